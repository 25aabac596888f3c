"""`kvg-export`: every preset exports in both cache kinds, validated; bad input fails cleanly."""

import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import CPU_FP32_ATTENTION, STATIC_LENGTH

from exporters import weights_file
from exporters.checks import validate
from exporters.pipeline.cli import main
from exporters.pipeline.export import export_artifact
from exporters.pipeline.options import ExportError, ExportOptions, check_options
from kvg_export.presets import load_model
from runtime.artifact import session_options
from runtime.contract import MANIFEST_NAME

CASES = [
    (p, c, "fp32") for p in ("fox-tiny", "fox-pro-tiny", "fox-gqa-tiny", "fox-small") for c in ("dynamic", "static")
]
CASES.append(("fox-gqa-tiny", "dynamic", "fp16"))


@pytest.fixture(params=CASES, ids=lambda c: "-".join(c))
def artifact(request, exported):
    preset, cache, dtype = request.param
    return (preset, cache, dtype, *exported(preset, cache, dtype))


def test_the_export_passes_its_validation_and_says_so(artifact):
    _, _, _, result, lines = artifact
    assert result.report.passed and len(result.report.steps) == 1 + validate.DECODE_STEPS
    stages = [line.split()[0] for line in lines if line.split()[1:2] != ["..."]]  # not a long stage's progress
    assert stages[:6] == ["load", "trace", "eager", "lower", "check", "validate"]
    saved = json.loads((result.path / "validation.json").read_text())
    assert saved["passed"] and len(saved["steps"]) == 17


def test_the_artifact_holds_graph_manifest_and_model_files(artifact):
    _, cache, dtype, result, _ = artifact
    names = {p.name for p in result.path.iterdir()}
    assert {"model.onnx", MANIFEST_NAME, "config.json", "generation_config.json", "tokenizer.json"} <= names
    manifest = json.loads((result.path / MANIFEST_NAME).read_text())
    assert manifest["cache"]["kind"] == cache and manifest["dtype"] == {"fp32": "float32", "fp16": "float16"}[dtype]
    assert manifest["cache"]["max_cache_len"] == (STATIC_LENGTH if cache == "static" else None)
    assert manifest["validation"]["passed"] and manifest["special_tokens"]["eos"] == [2]
    assert manifest["attention"] == (CPU_FP32_ATTENTION if dtype == "fp32" else "gqa")
    assert not [p for p in result.path.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_onnxruntime_on_the_artifact_matches_eager_prefill(artifact):
    """An independent check of the artifact: one prefill through a fresh session against eager logits."""
    preset, cache, dtype, result, _ = artifact
    model = load_model(preset, dtype={"fp32": torch.float32, "fp16": torch.float16}[dtype])
    manifest = json.loads((result.path / MANIFEST_NAME).read_text())
    session = ort.InferenceSession(str(result.path / "model.onnx"), session_options(result.path),
                                   providers=["CPUExecutionProvider"])  # fmt: skip
    ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    feed = {"input_ids": ids.numpy(), "attention_mask": np.ones((1, 6), dtype=np.int64)}
    if cache == "static":
        feed["attention_mask"] = np.pad(feed["attention_mask"], ((0, 0), (0, STATIC_LENGTH - 6)))
        feed["cache_position"] = np.arange(6)
    for entry in manifest["inputs"]:
        if entry["name"].startswith("past_key_values"):
            shape = [1 if a == "batch" else 0 if a == "past" else a for a in entry["axes"]]
            feed[entry["name"]] = np.zeros(shape, dtype={"float32": np.float32, "float16": np.float16}[entry["dtype"]])
    logits = session.run(["logits"], feed)[0]
    with torch.no_grad():
        want = model(ids).logits.float().numpy()
    assert np.abs(logits - want).max() < validate.TOLERANCES[manifest["dtype"]]


def test_a_failed_validation_leaves_no_artifact_and_keeps_the_old_one(tmp_path, monkeypatch):
    good = tmp_path / "art"
    good.mkdir()
    (good / "model.onnx").write_text("the previous good artifact")
    monkeypatch.setitem(validate.TOLERANCES, "float32", -1.0)  # any difference at all now fails
    here = {"separate_process": False}  # quicker; test_isolated.py runs the stages apart
    with pytest.raises(ExportError, match=r"validation failed: prefill: .* differ"):
        export_artifact(ExportOptions("fox-tiny", good, force=True, **here), log=lambda _: None)
    assert (good / "model.onnx").read_text() == "the previous good artifact"
    with pytest.raises(ExportError, match="validation failed"):
        export_artifact(ExportOptions("fox-tiny", tmp_path / "new", **here), log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fox-huge"], r"unknown model 'fox-huge'.*fox-tiny"),
        (["fox-tiny", "--max-cache-len", "70000"], r"dynamic cache must be 1\.\.65,536"),
        (["fox-tiny", "--cache", "static", "--max-cache-len", "8"], "must be at least 25"),
        (["fox-tiny", "--dtype", "bf16"], "bf16 graphs cannot be validated on onnxruntime's CPU provider"),
        (["fox-tiny", "--opset", "12"], "--opset 12 is not supported"),
        (["fox-tiny", "--max-batch", "0"], "--max-batch must be at least 1"),
        (["fox-tiny", "--attention", "gqa", "--provider", "cuda"], "--attention gqa has no fp32 kernel on CUDA"),
        (["fox-tiny", "--attention", "onnx-attention"], "use it with --cache static"),
        (["fox-tiny", "--cache", "static", "--attention", "onnx-attention", "--opset", "20"], "needs opset 24"),
    ],
)
def test_bad_input_is_refused_with_a_message_and_nothing_written(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    assert main([*args, "--out", str(out)]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("dtype", "provider", "cache", "attention"),
    [
        ("fp32", "cpu", "dynamic", CPU_FP32_ATTENTION), ("fp32", "cpu", "static", CPU_FP32_ATTENTION),
        ("fp16", "cpu", "dynamic", "gqa"), ("fp16", "cuda", "static", "gqa"), ("bf16", "cuda", "dynamic", "gqa"),
        ("fp32", "cuda", "static", "onnx-attention"), ("fp32", "cuda", "dynamic", "standard"),
    ],
)  # fmt: skip
def test_auto_attention_follows_the_dtype_and_the_provider(tmp_path, dtype, provider, cache, attention):
    """The fused operator for fp32 on the CPU where its library builds; GroupQueryAttention where onnxruntime
    has a kernel for the dtype (CPU: fp16, and fp32 without the library; CUDA: fp16, bf16); fp32 for CUDA writes
    a static buffer with TensorScatter, at the opset that has it."""
    options = ExportOptions("fox-tiny", tmp_path / "art", cache, dtype, provider=provider)
    chosen = check_options(options)
    assert (chosen.attention, chosen.opset) == (attention, 24 if attention == "onnx-attention" else 20)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA, so the export can run here")
def test_a_bf16_export_for_cuda_where_there_is_none_is_refused(tmp_path, capsys):
    assert main(["fox-tiny", "--dtype", "bf16", "--provider", "cuda", "--out", str(tmp_path / "art")]) == 2
    assert "CUDA is not available to onnxruntime here" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_existing_artifact_is_not_replaced_without_force(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["fox-tiny", "--out", str(tmp_path)]) == 2
    assert "already exists and is not empty; pass --force" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_an_unwritable_output_path_is_refused(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["fox-tiny", "--out", str(blocker / "artifact")]) == 2
    assert "cannot write to" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_an_older_opset_passes_the_same_validation(tmp_path):
    options = ExportOptions("fox-pro-tiny", tmp_path / "art", opset=18, separate_process=False)  # quicker here
    result = export_artifact(options, log=lambda _: None)
    assert result.report.passed
    assert json.loads((result.path / MANIFEST_NAME).read_text())["opset"] == 18
    assert [p.name for p in result.path.iterdir() if p.name.startswith("model.onnx.")]  # the weights file


def test_fp16_exports_at_opset_23(tmp_path):
    """The opset-23 trap (fp16 RMSNorm fused into an invalid RMSNormalization) matched the rsqrt form;
    RMSNorm now lowers with a division, and the fp16 graph passes the checker and the validation."""
    assert main(["fox-tiny", "--dtype", "fp16", "--opset", "23", "--out", str(tmp_path / "art")]) == 0


def test_a_graph_that_fails_the_checker_is_refused_cleanly(tmp_path, capsys, monkeypatch):
    def reject(*args, **kwargs):
        raise onnx.checker.ValidationError("a broken node")

    monkeypatch.setattr(onnx.checker, "check_model", reject)
    assert main(["fox-tiny", "--out", str(tmp_path / "art")]) == 2
    assert "fails onnx.checker at opset 20: a broken node" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_weights_are_memory_mapped_by_a_session(exported):
    """Every artifact keeps its weights in model.onnx.data, each large tensor at an offset onnxruntime can map:
    a session maps the file (its memory maps name it) rather than reading it into buffers of its own."""
    path = exported("fox-small", "dynamic")[0].path
    graph = onnx.load(str(path / "model.onnx"), load_external_data=False).graph
    places = [{entry.key: entry.value for entry in tensor.external_data} for tensor in graph.initializer]
    large = [place for place in places if int(place.get("length", 0)) > 1 << 20]
    assert large and all(place["location"] == "model.onnx.data" for place in large)
    assert all(int(place["offset"]) % weights_file.ALIGNMENT == 0 for place in large)
    session = ort.InferenceSession(str(path / "model.onnx"), session_options(path), providers=["CPUExecutionProvider"])
    with open("/proc/self/maps") as maps:
        assert any(line.rstrip().endswith(str(path / "model.onnx.data")) for line in maps)
    del session
