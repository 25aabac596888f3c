"""Shared test set-up: CUDA-marked tests skip without a GPU; exported artifacts are made once per run."""

import os
import pickle
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from exporters.native.library import available
from exporters.pipeline.export import export_artifact
from exporters.pipeline.options import ExportOptions, check_options

STATIC_LENGTH = 96  # room for a 16-token prompt and 64 new tokens, and for the export's own validation
# What `auto` picks for fp32 on the CPU: the fused operator where its library builds here, else GroupQueryAttention
CPU_FP32_ATTENTION = "fused" if available() else "gqa"


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)  # one worker per core: more threads a worker only contend for the cores


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def export_here(options: ExportOptions) -> Path:
    """The artifact `options` make, exported in this process: quicker than in a process of its own, which
    tests/test_isolated.py covers."""
    options.separate_process = False
    return export_artifact(options, log=lambda line: None).path


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """exported(preset, cache, dtype="fp32", attention="auto", provider="cpu", length=None, max_batch=None) ->
    (ExportResult, progress lines), each exported (and validated on `provider`) once per run: `make test` runs the
    tests in several pytest-xdist workers, and the first worker to need an artifact exports it, under a file lock,
    for all. A static cache is STATIC_LENGTH slots long unless `length` says otherwise."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's folder, above each worker's own
    made = {}

    def export(preset: str, cache: str, dtype: str = "fp32", attention: str = "auto", provider: str = "cpu",
               length: int | None = None, max_batch: int | None = None):  # fmt: skip
        sized = (length, max_batch) != (None, None)
        length = length or (STATIC_LENGTH if cache == "static" else None)
        batch = {"max_batch": max_batch} if max_batch else {}
        unmade = tmp_path_factory.getbasetemp() / "unmade"
        options = ExportOptions(preset, unmade, cache, dtype, length, provider=provider, attention=attention, **batch)
        attention = check_options(options).attention
        key = (preset, cache, dtype, attention, provider)  # "auto" as what it resolves to: one export for both
        key += (f"{length}x{max_batch}",) if sized else ()
        if key not in made:
            name = "-".join(key)
            record, out = shared / "artifacts" / f"{name}.pickle", shared / "artifacts" / name / name
            out.parent.mkdir(parents=True, exist_ok=True)  # a folder of its own: nothing else may be beside it
            with FileLock(shared / "artifacts" / f"{name}.lock"):
                if not record.exists():
                    lines = []
                    options = ExportOptions(
                        preset,
                        out,
                        cache,
                        dtype,
                        length,
                        provider=provider,
                        attention=attention,
                        separate_process=False,
                        **batch,
                    )  # quicker; test_isolated.py runs it in a process of its own
                    result = export_artifact(options, log=lines.append)
                    record.write_bytes(pickle.dumps((result, lines)))
                made[key] = pickle.loads(record.read_bytes())
        return made[key]

    return export
