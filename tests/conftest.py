"""Shared test set-up: CUDA-marked tests skip without a GPU; exported artifacts are made once per session."""

import pytest
import torch

from exporters.export import ExportOptions, check_options, export_artifact

STATIC_LENGTH = 96  # room for a 16-token prompt and 64 new tokens, and for the export's own validation


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """exported(preset, cache, dtype="fp32", attention="auto", provider="cpu") -> (ExportResult, progress
    lines), each exported (and validated on `provider`) once."""
    made = {}

    def export(preset: str, cache: str, dtype: str = "fp32", attention: str = "auto", provider: str = "cpu"):
        length = STATIC_LENGTH if cache == "static" else None
        unmade = tmp_path_factory.getbasetemp() / "unmade"
        options = ExportOptions(preset, unmade, cache, dtype, length, provider=provider, attention=attention)
        attention = check_options(options).attention
        key = (preset, cache, dtype, attention, provider)  # "auto" as what it resolves to: one export for both
        if key not in made:
            out = tmp_path_factory.mktemp("artifacts") / "-".join(key)
            lines = []
            options = ExportOptions(preset, out, cache, dtype, length, provider=provider, attention=attention)
            result = export_artifact(options, log=lines.append)
            made[key] = (result, lines)
        return made[key]

    return export
