"""exporters/checks/validate.py: an export is judged against eager PyTorch step by step, so a graph or run that differs
fails, with the step and the difference named, and a faithful one passes."""

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import CPU_FP32_ATTENTION

from exporters.checks import references, validate
from exporters.graph.onnx_export import export_program
from exporters.pipeline.export import export_artifact
from exporters.pipeline.options import ExportOptions
from kvg_export.presets import load_model
from runtime.artifact import session_options
from runtime.contract import cache_layout


class Changed:
    """An onnxruntime session some of whose outputs a test changes; the rest is the session's."""

    def __init__(self, session: ort.InferenceSession):
        self.session = session

    def __getattr__(self, name):
        return getattr(self.session, name)


class WrongWithLongerBuffers(Changed):
    """An onnxruntime session whose logits are off by 0.01 when the key buffers are longer than the mask."""

    def run(self, names, feed):
        outputs = self.session.run(names, feed)
        if feed["past_key_values.0.key"].shape[2] > feed["attention_mask"].shape[1]:
            outputs[0] = outputs[0] + 0.01
        return outputs


@pytest.mark.parametrize("attention", sorted({"gqa", CPU_FP32_ATTENTION}))
def test_an_in_place_dynamic_export_is_validated_with_buffers_longer_than_the_filled_positions(exported, attention):
    """The runtime runs a fused or gqa dynamic graph with longer cache buffers; validation must run it so too."""
    path = exported("fox-tiny", "dynamic", attention=attention)[0].path
    model = load_model("fox-tiny")
    layout = cache_layout(model.config, static=False)
    program, _ = export_program(model, layout, in_place_attention=attention if attention == "fused" else True)
    session = ort.InferenceSession(str(path / "model.onnx"), session_options(path), providers=["CPUExecutionProvider"])
    longer, exact = (references.record(model, layout, program, None, longer_buffers=flag) for flag in (True, False))
    assert validate.validate_onnx(longer, session).passed
    wrong = WrongWithLongerBuffers(session)
    assert validate.validate_onnx(exact, wrong).passed
    report = validate.validate_onnx(longer, wrong)
    assert report.failure.startswith("prefill: onnxruntime logits differ by 1.00e-02")


@pytest.fixture(scope="module")
def fox_py(exported):
    """The trained fox-py's dynamic artifact, a session on it, and eager's record of the validation's steps."""
    path = exported("fox-py", "dynamic")[0].path
    model = load_model("fox-py")
    layout = cache_layout(model.config, static=False)
    program, _ = export_program(model, layout, in_place_attention=True)
    session = ort.InferenceSession(str(path / "model.onnx"), session_options(path), providers=["CPUExecutionProvider"])
    recorded = references.record(model, layout, program, None, longer_buffers=True)
    return path, session, recorded


class PlantedError(Changed):
    """An onnxruntime session whose logits are 0.1% too large: the error of one weight (the final norm's) off
    by 0.1%."""

    def run(self, names, feed):
        outputs = self.session.run(names, feed)
        outputs[0] = outputs[0] * np.float32(1.001)
        return outputs


def test_the_scaled_fp32_tolerance_still_fails_a_planted_error(fox_py):
    """fp32 parity is judged on the logits' scale (the trained fox-py's reach 14), so it allows more absolute
    difference than 1e-4; an error of 0.1% in the logits must still fail it."""
    _, session, recorded = fox_py
    report = validate.validate_onnx(recorded, session)
    assert report.passed and max(step.onnx_logits for step in report.steps) < validate.TOLERANCES["float32"]
    planted = validate.validate_onnx(recorded, PlantedError(session))
    assert planted.failure.startswith("prefill: onnxruntime logits differ")


def test_an_artifact_whose_final_norm_weight_is_off_by_a_tenth_of_a_percent_fails_at_the_prefill(fox_py):
    """The error PlantedError stands for, made in the graph itself: its final norm's weight initializer scaled by
    1.001 (every logit 0.1% larger). The untouched graph passes (the test above); this one fails at the first step,
    naming it and the logits' difference, which is 0.1% of the logits' scale."""
    path, _, recorded = fox_py
    tampered = onnx.load(str(path / "model.onnx"))
    (weight,) = [tensor for tensor in tampered.graph.initializer if tensor.name.endswith(".model.norm.weight")]
    scaled = onnx.numpy_helper.to_array(weight) * np.float32(1.001)
    weight.CopyFrom(onnx.numpy_helper.from_array(scaled, weight.name))
    session = ort.InferenceSession(
        tampered.SerializeToString(), session_options(path), providers=["CPUExecutionProvider"]
    )
    report = validate.validate_onnx(recorded, session)
    assert not report.passed
    assert report.failure.startswith("prefill: onnxruntime logits differ by 1.0") and report.failure.endswith("> 1e-04")
    assert report.steps[0].onnx_logits == pytest.approx(1e-3, rel=0.05)  # 0.001 of each logit, over their scale


class LastShiftStateForEach(Changed):
    """An onnxruntime session whose per-token shift states of a run are all its last token's (what the present
    holds): the slip a graph exposing the wrong output of the operator would make."""

    def run(self, names, feed):
        outputs = self.session.run(names, feed)
        for index, name in enumerate(names):
            if name.startswith("shift_states."):
                outputs[index] = np.repeat(outputs[index][:, -1:], outputs[index].shape[1], axis=1)
        return outputs


@pytest.mark.skipif(CPU_FP32_ATTENTION != "fused", reason="the fused operator's library cannot be built here")
def test_each_tokens_shift_states_of_a_fused_fox_pro_graph_are_checked_against_eager(exported):
    """A fused FoX-Pro graph outputs every new token's shift state (for speculative runs); validation compares
    them with eager's state after each token, so a graph whose states are all the run's last token's fails at the
    prefill, the only step of several tokens, naming the output."""
    path = exported("fox-pro-tiny", "dynamic", attention="fused")[0].path
    model = load_model("fox-pro-tiny")
    layout = cache_layout(model.config, static=False, attention="fused")
    program, _ = export_program(model, layout, in_place_attention="fused")
    session = ort.InferenceSession(str(path / "model.onnx"), session_options(path), providers=["CPUExecutionProvider"])
    recorded = references.record(model, layout, program, None)
    report = validate.validate_onnx(recorded, session)
    assert report.passed
    assert recorded.steps[0].shift_states[0].shape[1] == validate.PROMPT_LENGTH
    changed = validate.validate_onnx(recorded, LastShiftStateForEach(session))
    assert re.match(r"prefill: shift_states\.\d+\.(key|value)_shift differs by", changed.failure)
    assert all(step.worst_present_diff < validate.TOLERANCES["float32"] for step in changed.steps[1:])


def _nodes(graph: onnx.GraphProto):
    """Every node of `graph` and of the branches inside it."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(attribute.g)


def test_a_pruned_export_is_validated_with_its_heads_staggered(tmp_path):
    """Once pruning staggers a layer's heads, a pruned graph runs other branches (exporters/graph/translations.py): a
    masked
    step, an unmasked step and a prompt's chunk. The validation runs each against eager, so an error planted in
    those branches alone (the folded attention's scale, 1% off) fails it at the first step with the heads staggered,
    while every step with the heads together still passes."""
    options = ExportOptions(
        "fox-gqa-tiny", tmp_path / "pruned", "dynamic", attention="gqa", log_pruning_tolerance=-10.0,
        separate_process=False,
    )  # fmt: skip
    result = export_artifact(options, log=lambda line: None)  # here: quicker; test_isolated.py runs it apart
    branches = ["masked 1", "masked 2", "masked 3", "unmasked 1", "chunk 1", "unmasked 2"]
    assert result.report.passed and [step.step for step in result.report.steps][1 + validate.DECODE_STEPS :] == branches
    model = load_model("fox-gqa-tiny")
    layout = cache_layout(model.config, static=False)
    program, _ = export_program(model, layout, in_place_attention=True, window_offsets=True)
    recorded = references.record(model, layout, program, None, longer_buffers=True)
    graph = onnx.load(str(result.path / "model.onnx"))
    folded = [node for node in _nodes(graph.graph) if node.op_type == "GroupQueryAttention"
              and next(a.i for a in node.attribute if a.name == "kv_num_heads") == 1]  # fmt: skip
    assert folded
    for node in folded:
        node.attribute.append(onnx.helper.make_attribute("scale", 1.01 / model.config.head_dim**0.5))
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    report = validate.validate_onnx(recorded, session)
    assert report.failure.startswith("masked 1: onnxruntime logits differ"), report.failure
    together = report.steps[: 1 + validate.DECODE_STEPS]
    assert max(step.onnx_logits for step in together) < validate.TOLERANCES["float32"]


def test_a_difference_is_the_largest_error_over_eagers_largest_magnitude_or_one():
    """The tolerances' measure, max |Δ| / max(1, max |eager|): relative where eager's values pass 1 in magnitude,
    absolute below; nothing to compare is no difference."""
    want = np.array([[-4.0, 2.0], [0.5, 0.0]], dtype=np.float32)
    assert validate.difference(want + np.array([[0.0, 0.5], [0.0, -0.25]], np.float32), want) == 0.5 / 4
    small = np.array([0.25, -0.5], dtype=np.float32)
    assert validate.difference(small + np.array([0.0, 0.125], np.float32), small) == 0.125
    assert validate.difference(np.zeros((2, 0)), np.zeros((2, 0))) == 0.0
    rng = np.random.default_rng(0)
    got, wanted = rng.normal(0, 3, (3, 50)).astype(np.float32), rng.normal(0, 3, (3, 50)).astype(np.float32)
    naive = max(abs(float(g) - float(w)) for g, w in zip(got.flat, wanted.flat, strict=True))
    naive /= max(1.0, max(abs(float(w)) for w in wanted.flat))
    assert validate.difference(got, wanted) == pytest.approx(naive, rel=1e-6)


def test_the_validation_prompt_left_pads_its_first_row_only_when_it_has_others():
    """Every export is validated on the same random prompt, whose first row is left-padded where a batch has
    others, so that padding is checked too."""
    ids, mask = validate.validation_prompt(vocab_size=50, batch=3, pad_id=7)
    assert ids.shape == mask.shape == (3, validate.PROMPT_LENGTH) and ids.dtype == mask.dtype == np.int64
    assert (ids[0, : validate.PADDING] == 7).all() and not mask[0, : validate.PADDING].any()
    assert mask[0, validate.PADDING :].all() and mask[1:].all() and ((ids >= 0) & (ids < 50)).all()
    again_ids, again_mask = validate.validation_prompt(vocab_size=50, batch=3, pad_id=7)
    assert np.array_equal(ids, again_ids) and np.array_equal(mask, again_mask)
    single_ids, single_mask = validate.validation_prompt(vocab_size=50, batch=1, pad_id=7)
    assert single_ids.shape == (1, validate.PROMPT_LENGTH) and single_mask.all()


def test_a_greedy_run_agrees_within_the_tolerance_and_in_half_precision_may_part_only_at_a_near_tie():
    """Eager's two best tokens at step 1 differ by 1e-4 on a scale of 2, within twice the tolerance on that scale
    of fp16 (0.04) and of fp32 (4e-4). A row may take the other one there in half precision alone (fp32 tells which
    is larger), and its later steps, which then follow other tokens, are not compared; a wider margin fails in fp16
    too, and logits more than the tolerance away fail at any step."""
    want_tokens = [[1, 0, 2]]
    want = [np.array([[0.0, 3.0, 1.0]], np.float32), np.array([[2.0, 0.0, 1.9999]], np.float32),
            np.array([[0.0, 1.0, 2.0]], np.float32)]  # fmt: skip
    assert validate.greedy_disagreement(want_tokens, want_tokens, want, want, "float32") is None
    parted, later = [[1, 2, 0]], [want[0], want[1], np.array([[9.0, 0.0, 0.0]], np.float32)]
    assert validate.greedy_disagreement(parted, want_tokens, later, want, "float16") is None
    flipped = validate.greedy_disagreement(parted, want_tokens, later, want, "float32")
    assert flipped == "row 0, step 1: token 2, eager's 0 (margin 1.00e-04)"
    wide = [want[0], np.array([[2.0, 0.0, 1.5]], np.float32), want[2]]
    assert validate.greedy_disagreement(parted, want_tokens, wide, wide, "float16").startswith("row 0, step 1: token 2")
    off = [want[0] + np.array([[6e-4, 0.0, 0.0]], np.float32), *want[1:]]  # 6e-4 on a scale of 3
    assert validate.greedy_disagreement(want_tokens, want_tokens, off, want, "float32") == (
        "row 0, step 0: logits differ by 2.00e-04 > 1e-04"
    )
    near = [want[0] + np.array([[1.5e-4, 0.0, 0.0]], np.float32), *want[1:]]  # 5e-5 of the scale
    assert validate.greedy_disagreement(want_tokens, want_tokens, near, want, "float32") is None
