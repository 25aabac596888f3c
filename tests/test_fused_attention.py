"""The fused FoX attention operator (exporters/native/fox_attention.cc) alone, in onnxruntime, against a naive
float64 computation of the formula: windows per kv head, GQA, left padding, prompt chunks and decode steps, a
long window split across threads, and in-place writes into a buffer bound as past and present."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from exporters.native_library import NativeUnavailable, build
from runtime.custom_ops import DOMAIN, OP_NAME, OP_VERSION

NAMES = ["query", "key", "value", "gate_logits", "gate_bias", "past_key", "past_value", "past_gate", "attention_mask",
         "cache_position", "window_starts"]  # fmt: skip
OUTPUTS = ["output", "present_key", "present_value", "present_gate"]


@pytest.fixture(scope="module")
def library():
    try:
        return build()
    except NativeUnavailable as error:
        pytest.skip(f"the fused attention library cannot be built here: {error}")


def _session(library, heads: int, kv_heads: int, names: list[str] = NAMES) -> ort.InferenceSession:
    floats = {"query": 3, "key": 3, "value": 3, "gate_logits": 3, "gate_bias": 1, "past_key": 4, "past_value": 4,
              "past_gate": 3}  # fmt: skip
    types = {**{n: (TensorProto.FLOAT, r) for n, r in floats.items()}, "attention_mask": (TensorProto.INT64, 2),
             "cache_position": (TensorProto.INT64, 1), "window_starts": (TensorProto.INT64, 1)}  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, types[n][0], [None] * types[n][1]) for n in names if n]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in OUTPUTS]
    node = helper.make_node(OP_NAME, names, OUTPUTS, domain=DOMAIN, num_heads=heads, kv_num_heads=kv_heads)
    model = helper.make_model(
        helper.make_graph([node], "fused", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, OP_VERSION)], ir_version=10,
    )  # fmt: skip
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def naive(feeds: dict, heads: int, kv_heads: int) -> list[np.ndarray]:
    """The op's contract, element by element in float64."""
    q, k, v = (feeds[n].astype(np.float64) for n in ("query", "key", "value"))
    past_key, past_value, past_gate = (feeds[n].astype(np.float64) for n in ("past_key", "past_value", "past_gate"))
    mask, positions = feeds["attention_mask"], feeds["cache_position"]
    starts = feeds.get("window_starts", np.zeros(kv_heads, dtype=np.int64))
    batch, seq, _ = q.shape
    dim, past, window, group = past_key.shape[3], past_key.shape[2], mask.shape[1], heads // kv_heads
    mask = np.broadcast_to(mask, (batch, window))
    logits = feeds["gate_logits"].astype(np.float64) + feeds.get("gate_bias", np.zeros(heads))  # [batch, seq, heads]
    real = mask[:, positions] > 0  # [batch, seq]: the new tokens that are not padding
    g = np.where(
        real[:, None, :], -np.logaddexp(0, -logits).transpose(0, 2, 1), 0.0
    )  # -softplus(-y) [batch, heads, seq]
    length = max(past, window - starts.min())
    keys, values = np.zeros((batch, kv_heads, length, dim)), np.zeros((batch, kv_heads, length, dim))
    gates = np.zeros((batch, heads, length))
    kept = min(past, length)
    keys[:, :, :kept], values[:, :, :kept], gates[:, :, :kept] = (
        past_key[:, :, :kept], past_value[:, :, :kept], past_gate[:, :, :kept])  # fmt: skip
    for h in range(kv_heads):
        slots = positions - starts[h]
        keys[:, h, slots] = k.reshape(batch, seq, kv_heads, dim)[:, :, h]
        values[:, h, slots] = v.reshape(batch, seq, kv_heads, dim)[:, :, h]
        gates[:, h * group : (h + 1) * group][:, :, slots] = g[:, h * group : (h + 1) * group]
    out = np.zeros((batch, seq, heads, dim))
    queries = q.reshape(batch, seq, heads, dim)
    for b in range(batch):
        for h in range(heads):
            start = starts[h // group]
            for i in range(seq):
                own = positions[i] - start
                slots = [s for s in range(min(own, window - start - 1) + 1) if mask[b, s + start] or s == own]
                decay = np.array([gates[b, h, s + 1 : own + 1].sum() for s in slots])
                logits = keys[b, h // group, slots] @ queries[b, i, h] / np.sqrt(dim) + decay
                weights = np.exp(logits - logits.max())
                out[b, i, h] = weights @ values[b, h // group, slots] / weights.sum()
    return [out.reshape(batch, seq, heads * dim), keys, values, gates]


def _feeds(rng, batch, seq, heads, kv_heads, dim, past, window, starts, padding, position=None) -> dict:
    """Random inputs: the new tokens end the window (or start at `position`), rows left-padded by `padding`: a
    number of slots, or a (begin, end) span of slots the row holds none of (a gap: other rows' slots)."""
    first = window - seq if position is None else position
    mask = np.ones((batch, window), dtype=np.int64)
    for row, pad in enumerate(padding):
        mask[row, slice(*pad) if isinstance(pad, tuple) else slice(0, pad)] = 0
    gate_scale = rng.uniform(0.01, 4.0, size=(1, heads, 1))
    return {
        "query": rng.standard_normal((batch, seq, heads * dim), dtype=np.float32),
        "key": rng.standard_normal((batch, seq, kv_heads * dim), dtype=np.float32),
        "value": rng.standard_normal((batch, seq, kv_heads * dim), dtype=np.float32),
        "gate_logits": rng.normal(2.0, 3.0, size=(batch, seq, heads)).astype(np.float32),
        "gate_bias": rng.uniform(-1.0, 4.0, size=heads).astype(np.float32),
        "past_key": rng.standard_normal((batch, kv_heads, past, dim), dtype=np.float32),
        "past_value": rng.standard_normal((batch, kv_heads, past, dim), dtype=np.float32),
        "past_gate": -(rng.random((batch, heads, past)) * gate_scale).astype(np.float32),
        "attention_mask": mask,
        "cache_position": np.arange(first, first + seq, dtype=np.int64),
        "window_starts": np.asarray(starts, dtype=np.int64),
    }


CASES = {
    # name: batch, seq, heads, kv_heads, dim, past, window, starts, padding
    "prompt": (2, 37, 4, 4, 16, 0, 37, [0, 0, 0, 0], [0, 5]),
    "chunk after a past, gqa": (2, 40, 6, 2, 8, 50, 90, [0, 0], [3, 0]),
    "decode, heads apart": (3, 1, 4, 2, 16, 64, 61, [0, 7], [0, 2, 9]),
    "chunk, heads apart": (1, 70, 2, 2, 32, 100, 100, [12, 3], [0]),
    "long window split across threads": (1, 1, 2, 1, 16, 5000, 4800, [40], [0]),
    "two-token step, long window": (2, 2, 2, 2, 8, 3000, 3000, [0, 100], [10, 0]),
    "a row whose window starts late": (2, 1, 2, 2, 8, 4500, 4500, [0, 30], [4400, 0]),
    "a gap in a row's window": (2, 2, 2, 1, 8, 600, 600, [5], [(70, 530), 0]),
    "a padding query in a chunk": (1, 12, 2, 2, 8, 4, 12, [0, 0], [(6, 9)]),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_matches_the_formula(library, case):
    batch, seq, heads, kv_heads, dim, past, window, starts, padding = CASES[case]
    rng = np.random.default_rng(len(case))
    feeds = _feeds(rng, batch, seq, heads, kv_heads, dim, past, window, starts, padding)
    got = _session(library, heads, kv_heads).run(None, feeds)
    for name, actual, expected in zip(OUTPUTS, got, naive(feeds, heads, kv_heads), strict=True):
        assert actual.shape == expected.shape, name
        np.testing.assert_allclose(actual, expected, rtol=0, atol=2e-5, err_msg=name)


def test_writes_in_place_where_past_and_present_are_one_buffer(library):
    """The runtime binds one buffer as past and present: the op writes the new entries into it and nothing else."""
    heads, kv_heads = 2, 2
    feeds = _feeds(np.random.default_rng(1), 1, 1, heads, kv_heads, 8, 32, 20, [0, 4], [0])
    expected = naive(feeds, heads, kv_heads)
    session = _session(library, heads, kv_heads)
    binding = session.io_binding()
    shared = {}
    for name in NAMES:
        value = ort.OrtValue.ortvalue_from_numpy(feeds[name])
        binding.bind_ortvalue_input(name, value)
        if name.startswith("past_"):
            shared[name.replace("past_", "present_")] = value
    binding.bind_output("output")
    for name, value in shared.items():
        binding.bind_ortvalue_output(name, value)
    session.run_with_iobinding(binding)
    np.testing.assert_allclose(binding.get_outputs()[0].numpy(), expected[0], rtol=0, atol=2e-5)
    for index, name in enumerate(OUTPUTS[1:], start=1):  # keys and values copied exactly; gates computed in float32
        exact = name != "present_gate"
        np.testing.assert_allclose(
            shared[name].numpy(), expected[index], rtol=0 if exact else 1e-6, atol=0, err_msg=name
        )


def test_without_gate_bias_or_window_starts_they_are_zero(library):
    heads = 2
    feeds = _feeds(np.random.default_rng(2), 2, 3, heads, heads, 8, 10, 10, [0, 0], [0, 4])
    del feeds["gate_bias"], feeds["window_starts"]
    names = [name if name in feeds else "" for name in NAMES]
    got = _session(library, heads, heads, names).run(None, feeds)
    for name, actual, expected in zip(OUTPUTS, got, naive(feeds, heads, heads), strict=True):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=2e-5, err_msg=name)


def test_an_infinite_gate_bias_is_no_forget_gate(library):
    """FoX without forget gates (fgate_type none) attends with the gates' sums at zero."""
    heads = 2
    feeds = _feeds(np.random.default_rng(5), 1, 4, heads, heads, 8, 6, 10, [0, 0], [0])
    feeds["gate_bias"] = np.full(heads, np.inf, dtype=np.float32)
    got = _session(library, heads, heads).run(None, feeds)
    assert (got[3][:, :, 6:10] == 0).all()
    for name, actual, expected in zip(OUTPUTS, got, naive(feeds, heads, heads), strict=True):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=2e-5, err_msg=name)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cache_position": np.array([5, 7], dtype=np.int64)}, "consecutive"),
        ({"window_starts": np.array([0, 30], dtype=np.int64)}, "inside the window"),
        ({"gate_logits": np.zeros((1, 2, 3), dtype=np.float32)}, "shapes do not agree"),
    ],
)
def test_refuses_inputs_that_break_the_contract(library, change, message):
    feeds = _feeds(np.random.default_rng(3), 1, 2, 2, 2, 8, 12, 12, [0, 0], [0]) | change
    with pytest.raises(Exception, match=message):
        _session(library, 2, 2).run(None, feeds)
