"""An export that cannot succeed fails before the model is loaded or traced, with the fix."""

import json
import re
import shutil
import subprocess
import sys
import time
from collections import namedtuple

import pytest
from safetensors.torch import load_file

from exporters.pipeline import export, preflight
from exporters.pipeline.export import export_artifact
from exporters.pipeline.options import ExportError, ExportOptions, QualityOptions
from exporters.quantization.settings import Quantization
from kvg_export.presets import resolve_checkpoint


@pytest.fixture
def never_loaded(monkeypatch):
    """Fail the test if the export gets as far as starting its torch half (load, trace, lower)."""
    run_isolated = export.run_isolated

    def refuse_the_torch_half(target, *args, **kwargs):
        if target == "exporters.pipeline.lowering:lower":
            raise AssertionError("the model was loaded before the export was refused")
        return run_isolated(target, *args, **kwargs)

    monkeypatch.setattr(export, "run_isolated", refuse_the_torch_half)


@pytest.fixture
def untokenized(tmp_path):
    """fox-tiny's checkpoint without its tokenizer.json."""
    folder = tmp_path / "fox-tiny-no-tokenizer"
    shutil.copytree(resolve_checkpoint("fox-tiny"), folder)
    (folder / "tokenizer.json").unlink()
    return folder


def test_a_quantized_export_of_a_folder_without_a_tokenizer_exits_2_before_tracing(untokenized, tmp_path):
    started = time.monotonic()
    command = [sys.executable, "-m", "exporters.pipeline.cli", str(untokenized), "--out", str(tmp_path / "out"),
               "--quantize", "int4"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "has no tokenizer files" in done.stderr and "trace" not in done.stdout
    assert not (tmp_path / "out").exists()
    assert time.monotonic() - started < 60  # the interpreter and its imports; a traced export takes longer


def test_the_tokenizer_and_quality_text_are_checked_before_the_model_is_loaded(untokenized, tmp_path, never_loaded):
    options = ExportOptions(str(untokenized), tmp_path / "out", quantization=Quantization(4))
    with pytest.raises(ExportError, match=r"has no tokenizer files"):
        export_artifact(options)
    text = ExportOptions("fox-tiny", tmp_path / "out", quantization=Quantization(4),
                         quality=QualityOptions(text_paths=[tmp_path / "missing.txt"]))  # fmt: skip
    with pytest.raises(ExportError, match=r"missing\.txt does not exist"):
        export_artifact(text)


def test_an_export_that_would_not_fit_on_the_disk_is_refused_naming_the_space(tmp_path, monkeypatch, never_loaded):
    weights = sum(t.numel() for t in load_file(resolve_checkpoint("fox-tiny") / "model.safetensors").values())
    Usage = namedtuple("Usage", "total used free")
    free = []
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda folder: free.append(folder) or Usage(0, 0, 4 * weights))
    with pytest.raises(ExportError, match=r"needs about .* GiB .* free"):  # fp32: 4 bytes a weight and the rest
        export_artifact(ExportOptions("fox-tiny", tmp_path / "new" / "out"))
    assert free == [tmp_path]  # the first folder that exists on the way to --out
    assert preflight.parameters(resolve_checkpoint("fox-tiny")) == weights


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"tokenizer_class": "LlamaTokenizer"}, "tokenizer_class 'LlamaTokenizer' is not one"),
        ({"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True},
         "sets clean_up_tokenization_spaces"),
    ],
)  # fmt: skip
def test_a_tokenizer_the_runtime_would_not_reproduce_is_refused_by_name_before_the_model_is_loaded(
    tmp_path, never_loaded, settings, named
):
    folder = tmp_path / "fox-tiny-tokenizer"
    shutil.copytree(resolve_checkpoint("fox-tiny"), folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(ExportError, match=re.escape(named)):
        export_artifact(ExportOptions(str(folder), tmp_path / "out"))
    assert not (tmp_path / "out").exists()
