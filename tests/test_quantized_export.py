"""Quantized exports: judged on held-out text against eager fp32, recorded in the manifest, served unchanged by
the runtime, speculative decoding included; one that misses its thresholds leaves nothing behind."""

import json
from dataclasses import fields, replace

import numpy as np
import onnx
import pytest
from scripted_drafts import Scripted

from exporters.checks.cache_check import check_cache
from exporters.pipeline import cli
from exporters.quantization.settings import Quantization
from runtime.artifact import SessionOptions
from runtime.cli import generate as generate_cli
from runtime.decode.generator import GenerationConfig, Generator

QUALITY_SEGMENTS = "8"  # of the test split: about 4k predicted tokens, enough to judge int4 against 90%


@pytest.fixture(scope="module")
def int4_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized") / "fox-py-int4"
    assert cli.main(["fox-py", "--out", str(out), "--quantize", "int4", "--quality-segments", QUALITY_SEGMENTS]) == 0
    return out


def test_the_export_is_judged_on_held_out_text_and_says_so(int4_artifact):
    report = json.loads((int4_artifact / "validation.json").read_text())
    assert report["parity"]["passed"] and report["cache_check"]["passed"]
    quality = report["quality"]
    assert quality["passed"] and quality["text"]["split"] == "test" and quality["segments"] == int(QUALITY_SEGMENTS)
    assert quality["thresholds"] == {"max_relative_perplexity_diff": 0.05, "min_top1_agreement": 0.9}
    assert abs(quality["relative_perplexity_diff"]) <= 0.05 and quality["top1_agreement"] >= 0.9
    assert quality["relative_perplexity_diff"] != 0 and quality["top1_agreement"] < 1  # the weights did change
    assert report["quantization"]["method"] == "rtn" and report["quantization"]["bits"] == 4


def test_the_manifest_records_the_quantization_as_the_graph_has_it(int4_artifact):
    manifest = json.loads((int4_artifact / "kvg_config.json").read_text())
    record = manifest["quantization"]
    settings = {f.name: record[f.name] for f in fields(Quantization)}
    assert Quantization(**{**settings, "keep_float": tuple(settings["keep_float"])}) == Quantization(4)
    graph = onnx.load(str(int4_artifact / "model.onnx")).graph
    nodes = {node.name: node for node in graph.node}
    for name in record["quantized_nodes"]:
        node = nodes[f"{name}_Q4"]
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert node.op_type == "MatMulNBits" and node.domain == "com.microsoft"
        assert (attributes["bits"], attributes["block_size"], attributes["accuracy_level"]) == (4, 32, 4)
    assert record["float_nodes"] == ["model.embeddings"] and nodes["model.embeddings"].op_type == "Gather"
    assert "lm_head" in record["quantized_nodes"]  # and the forget gate's projection, joined with q, k and v:
    assert "model.layers.0.attn.q_proj+model.layers.0.attn.k_proj+model.layers.0.attn.v_proj+" \
        "model.layers.0.attn.fgate_proj" in record["quantized_nodes"]  # fmt: skip
    assert manifest["validation"]["quality"]["top1_agreement"] >= 0.9


def test_the_runtime_serves_it_unchanged_and_names_the_quantization(int4_artifact, capsys):
    assert generate_cli.main([str(int4_artifact), "--prompt", "def parse_args(argv):", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    first = err.splitlines()[0]
    assert "int4 weights (rtn, block 32, accuracy level 4; in float32: embedding)" in first
    assert out.strip() and "8 tokens" in err


def test_the_cache_check_catches_a_runtime_that_reads_the_wrong_cache(int4_artifact, monkeypatch):
    assert check_cache(int4_artifact).passed
    generate = Generator.generate

    def drifting(self, *args, **kwargs):
        result = generate(self, *args, **kwargs)
        result.step_logits[5] = result.step_logits[5] + np.float32(0.01)
        return result

    monkeypatch.setattr(Generator, "generate", drifting)
    check = check_cache(int4_artifact)
    assert check.failure.startswith("step 5: the runtime's logits (cache bound in place) differ from session.run's")


def test_the_cache_check_catches_a_present_that_breaks_the_contract(int4_artifact, tmp_path):
    folder = tmp_path / "art"
    folder.mkdir()
    for path in int4_artifact.iterdir():
        (folder / path.name).symlink_to(path)
    manifest = json.loads((int4_artifact / "kvg_config.json").read_text())
    entry = next(e for e in manifest["outputs"] if e["name"] == "present.1.gate")
    entry["axes"][1] += 1  # one head more than the graph makes
    (folder / "kvg_config.json").unlink()
    (folder / "kvg_config.json").write_text(json.dumps(manifest))
    assert "present.1.gate is float32[2, 4, 8], the contract says float32[2, 5, 8]" in check_cache(folder).failure


def test_an_export_that_misses_its_thresholds_exits_non_zero_and_loses_nothing(tmp_path, capsys):
    good = tmp_path / "art"
    good.mkdir()
    (good / "model.onnx").write_text("the previous good artifact")
    # No quantized model scores exactly as eager fp32 does: a zero perplexity difference cannot be met.
    args = ["fox-py", "--out", str(good), "--force", "--quantize", "int4", "--block-size", "256",
            "--keep-float", "none", "--quality-segments", "2", "--max-perplexity-diff", "0"]  # fmt: skip
    assert cli.main(args) != 0
    err = capsys.readouterr().err
    assert "the int4 artifact misses its quality thresholds: perplexity" in err and "over 0.000%" in err
    assert "Nothing was written" in err
    assert (good / "model.onnx").read_text() == "the previous good artifact"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "64"], "--block-size applies to a quantized export: add --quantize int8|int4"),
        (["--quantize", "int8", "--quant-method", "hqq"], "hqq's int8 weights"),
        (["--quantize", "int4", "--keep-float", "fgate,norms"], "unknown role norms"),
        (["--quantize", "int4", "--provider", "cuda"], "a quantized export is judged on onnxruntime's CPU provider"),
    ],
)
def test_quantization_flags_that_cannot_work_are_refused(tmp_path, capsys, args, message):
    try:
        code = cli.main(["fox-py", "--out", str(tmp_path / "out"), *args])
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_speculative_decoding_on_it_gives_plain_greedy_tokens(int4_artifact):
    """Runs of a token and its drafts through the int4 weights (MatMulNBits over several rows, not one) choose the
    tokens one a step does, for drafts right and wrong."""
    generator = Generator.open(int4_artifact, SessionOptions(provider="cpu"))
    prompt = generator.model.encode(
        "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument("
    )
    config = GenerationConfig(48, 48)
    plain = generator.generate(prompt, config).tokens
    drafts = Scripted.of(prompt, plain, lambda row, position: position % 5 != 2, generator.model.artifact.vocab_size)
    spoken = generator.generate(prompt, replace(config, speculative=drafts))
    assert spoken.tokens == plain and 0 < spoken.drafts_accepted < spoken.drafts_proposed
