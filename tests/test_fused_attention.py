"""The fused FoX attention operator (exporters/native/fox_attention.cc) alone, in onnxruntime, against a naive
float64 computation of the formula: windows per kv head, GQA, left padding, prompt chunks and decode steps, a
long window split across threads, in-place writes into a buffer bound as past and present, and FoX-Pro's token
shift, QK-norm, output norm and output gate."""

from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from exporters.native.library import SOURCE, NativeUnavailable, build, library_version, manifest_entry
from runtime.contract import (
    OP_DOMAIN,
    OP_INPUTS,
    OP_INTEGER_INPUTS,
    OP_NAME,
    OP_OUTPUTS,
    OP_PACKED_INPUTS,
    OP_PRO_INPUTS,
    OP_VERSION,
)

NAMES = [name for name in OP_INPUTS if name not in OP_PRO_INPUTS]
PRO_NAMES = list(OP_PRO_INPUTS)
OUTPUTS = [name for name in OP_OUTPUTS if "shift" not in name]
SHIFT_OUTPUTS = [name for name in OP_OUTPUTS if "shift" in name]


@pytest.fixture(scope="module")
def library():
    try:
        return build()
    except NativeUnavailable as error:
        pytest.skip(f"the fused attention library cannot be built here: {error}")


def _session(
    library, heads: int, kv_heads: int, names: list[str] = NAMES, outputs: list[str] = OUTPUTS,
    version: int = OP_VERSION, **attributes
) -> ort.InferenceSession:  # fmt: skip
    ranks = {"query": 3, "key": 3, "value": 3, "gate_logits": 3, "gate_bias": 1, "past_key": 4, "past_value": 4,
             "past_gate": 3, "attention_mask": 2, "cache_position": 1, "window_starts": 1, "key_shift_logits": 3,
             "past_key_shift": 2, "value_shift_logits": 3, "past_value_shift": 2, "query_norm": 1, "key_norm": 1,
             "output_norm": 1, "output_gate_logits": 3}  # fmt: skip
    kinds = {n: TensorProto.INT64 if n in OP_INTEGER_INPUTS else TensorProto.FLOAT for n in OP_INPUTS}
    inputs = [helper.make_tensor_value_info(n, kinds[n], [None] * ranks[n]) for n in names if n]
    node = helper.make_node(
        OP_NAME, names, outputs, domain=OP_DOMAIN, num_heads=heads, kv_num_heads=kv_heads, **attributes
    )  # fmt: skip
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs]
    model = helper.make_model(
        helper.make_graph([node], "fused", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(OP_DOMAIN, version)], ir_version=10,
    )  # fmt: skip
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def _shifted(raw: np.ndarray, logits: np.ndarray, state: np.ndarray, real: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A token shift: a r_{t-1} + (1 - a) r_t per kv head, r zero at padding and `state` before the first token; and
    r, each token's state after it."""
    r = raw * real[..., None]
    before = np.concatenate([state[:, None].astype(np.float64), r[:, :-1]], axis=1)
    weight = np.repeat(_sigmoid(logits), raw.shape[-1] // logits.shape[-1], axis=-1)
    return weight * before + (1 - weight) * r, r


def _rms(x: np.ndarray, weight: np.ndarray, dim: int, eps: float) -> np.ndarray:
    """Each head's channels of `[..., heads * dim]` over their RMS, times the weight (one head's, or every head's)."""
    heads = x.reshape(*x.shape[:-1], -1, dim)
    scaled = heads / np.sqrt((heads**2).mean(-1, keepdims=True) + eps) * weight.astype(np.float64).reshape(-1, dim)
    return scaled.reshape(x.shape)


def naive(feeds: dict, heads: int, kv_heads: int, silu: bool = False) -> list[np.ndarray]:
    """The op's contract, element by element in float64 (QK-norm's epsilon 1e-5, the output norm's 1e-6)."""
    q, k, v = (feeds[n].astype(np.float64) for n in ("query", "key", "value"))
    past_key, past_value, past_gate = (feeds[n].astype(np.float64) for n in ("past_key", "past_value", "past_gate"))
    mask, positions = feeds["attention_mask"], feeds["cache_position"]
    starts = feeds.get("window_starts", np.zeros(kv_heads, dtype=np.int64))
    batch, seq, _ = q.shape
    dim, past, window, group = past_key.shape[3], past_key.shape[2], mask.shape[1], heads // kv_heads
    mask = np.broadcast_to(mask, (batch, window))
    logits = feeds["gate_logits"].astype(np.float64) + feeds.get("gate_bias", np.zeros(heads))  # [batch, seq, heads]
    real = mask[:, positions] > 0  # [batch, seq]: the new tokens that are not padding
    states = []  # each shift's every token's state (the last's is the present state)
    if "key_shift_logits" in feeds:
        k, state = _shifted(k, feeds["key_shift_logits"], feeds["past_key_shift"], real)
        states.append(state)
    if "value_shift_logits" in feeds:
        v, state = _shifted(v, feeds["value_shift_logits"], feeds["past_value_shift"], real)
        states.append(state)
    if "query_norm" in feeds:
        q = _rms(q, feeds["query_norm"], dim, 1e-5)
    if "key_norm" in feeds:
        k = _rms(k, feeds["key_norm"], dim, 1e-5)
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
    out = out.reshape(batch, seq, heads * dim)
    if "output_norm" in feeds:
        out = _rms(out, feeds["output_norm"], dim, 1e-6)
    if "output_gate_logits" in feeds:
        z = feeds["output_gate_logits"].astype(np.float64)
        out = out * (z * _sigmoid(z) if silu else _sigmoid(z))
    return [out, keys, values, gates, *(state[:, -1] for state in states), *states]


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
    "decode, heads staggered": (3, 1, 4, 2, 16, 64, 61, [0, 7], [0, 2, 9]),
    "chunk, heads staggered": (1, 70, 2, 2, 32, 100, 100, [12, 3], [0]),
    "long window split across threads": (1, 1, 2, 1, 16, 5000, 4800, [40], [0]),
    "two-token step, long window": (2, 2, 2, 2, 8, 3000, 3000, [0, 100], [10, 0]),
    "a row whose window starts late": (2, 1, 2, 2, 8, 4500, 4500, [0, 30], [4400, 0]),
    "a gap in a row's window": (2, 2, 2, 1, 8, 600, 600, [5], [(70, 530), 0]),
    "a padding query in a chunk": (1, 12, 2, 2, 8, 4, 12, [0, 0], [(6, 9)]),
    "decode, head_dim 64 (compiled for it)": (2, 1, 2, 2, 64, 300, 300, [0, 9], [5, 0]),
    # a token and its drafts: each query reads its keys alone (no register tiles), a padding one among them
    "a token and three drafts, head_dim 64": (2, 4, 2, 2, 64, 200, 204, [0, 3], [(201, 202), 0]),
    "a token and two drafts, gqa": (1, 3, 4, 2, 16, 90, 93, [0, 0], [0]),
    "a token and eight drafts, head_dim 64": (2, 9, 2, 2, 64, 300, 309, [0, 5], [(302, 303), 0]),
    "a token and five drafts, gqa": (1, 6, 4, 2, 16, 500, 506, [0, 0], [0]),
    "a token and four drafts, head_dim 12": (1, 5, 2, 1, 12, 140, 145, [0], [3]),
    "a token and six drafts, head_dim 24": (2, 7, 2, 2, 24, 250, 257, [0, 4], [0, (252, 253)]),
    "decode, head_dim 128, gqa (compiled for it)": (1, 1, 4, 2, 128, 150, 150, [0, 0], [0]),
    # most keys' weights round to 0 under the faster-decaying heads' gates: blocks the kernel skips
    "chunk over a window its gates forgot": (2, 70, 4, 2, 16, 1500, 1570, [0, 0], [0, 200]),
    "decode over a window its gates forgot": (1, 1, 4, 4, 64, 1800, 1801, [0, 0, 0, 0], [0]),
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


def _pro_feeds(rng, batch, seq, heads, kv_heads, dim, shared: bool) -> dict:
    """FoX-Pro's inputs: shift logits and past states, norm weights (one head's, or every head's), gate logits."""
    width = kv_heads * dim
    weight = {name: rng.uniform(0.5, 1.5, size=dim if shared else count * dim).astype(np.float32)
              for name, count in (("query_norm", heads), ("key_norm", kv_heads), ("output_norm", heads))}  # fmt: skip
    return weight | {
        "key_shift_logits": rng.normal(0.0, 2.0, size=(batch, seq, kv_heads)).astype(np.float32),
        "past_key_shift": rng.standard_normal((batch, width), dtype=np.float32),
        "value_shift_logits": rng.normal(0.0, 2.0, size=(batch, seq, kv_heads)).astype(np.float32),
        "past_value_shift": rng.standard_normal((batch, width), dtype=np.float32),
        "output_gate_logits": rng.normal(0.0, 2.0, size=(batch, seq, heads * dim)).astype(np.float32),
    }


PRO_CASES = {
    # name: batch, seq, heads, kv_heads, dim, past, window, starts, padding, shared norms, output gate activation
    "prompt chunk, gqa, padding, per-head norms": (2, 21, 4, 2, 16, 30, 51, [0, 0], [0, 25], False, "sigmoid"),
    "decode, heads staggered, shared norms": (3, 1, 4, 2, 16, 64, 61, [0, 7], [0, 2, 9], True, "silu"),
    "a padding query in a chunk": (1, 12, 2, 2, 8, 4, 12, [0, 0], [(6, 9)], True, "sigmoid"),
}


@pytest.mark.parametrize("case", PRO_CASES, ids=list(PRO_CASES))
def test_fox_pro_work_matches_the_formula(library, case):
    """The token shift (state carried in and out), QK-norm, output norm and gate, done inside the op."""
    batch, seq, heads, kv_heads, dim, past, window, starts, padding, shared, activation = PRO_CASES[case]
    rng = np.random.default_rng(len(case))
    feeds = _feeds(rng, batch, seq, heads, kv_heads, dim, past, window, starts, padding)
    feeds |= _pro_feeds(rng, batch, seq, heads, kv_heads, dim, shared)
    outputs = OUTPUTS + SHIFT_OUTPUTS
    session = _session(library, heads, kv_heads, NAMES + PRO_NAMES, outputs, output_gate_activation=activation)
    expected = naive(feeds, heads, kv_heads, silu=activation == "silu")
    for name, actual, wanted in zip(outputs, session.run(None, feeds), expected, strict=True):
        assert actual.shape == wanted.shape, name
        np.testing.assert_allclose(actual, wanted, rtol=0, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("left_out", [["key_shift_logits", "past_key_shift"], ["query_norm", "output_gate_logits"]])
def test_fox_pro_inputs_each_optional(library, left_out):
    """Each piece of FoX-Pro's work is done only where its inputs are given; a shift's absent state output is empty."""
    heads = kv_heads = 2
    rng = np.random.default_rng(7)
    feeds = _feeds(rng, 2, 5, heads, kv_heads, 8, 6, 11, [0, 0], [0, 3]) | _pro_feeds(rng, 2, 5, 2, 2, 8, False)
    for name in left_out:
        del feeds[name]
    names = NAMES + [name if name in feeds else "" for name in PRO_NAMES]
    got = _session(library, heads, kv_heads, names, OUTPUTS + SHIFT_OUTPUTS).run(None, feeds)
    expected = naive(feeds, heads, kv_heads)
    if "key_shift_logits" not in feeds:
        assert got[4].shape == (2, 0) and got[6].shape == (2, 5, 0)
        got = got[:4] + got[5:6] + got[7:]
    for actual, wanted in zip(got, expected, strict=True):
        np.testing.assert_allclose(actual, wanted, rtol=0, atol=2e-5)


def test_refuses_a_shift_without_its_state(library):
    feeds = _feeds(np.random.default_rng(8), 1, 2, 2, 2, 8, 12, 12, [0, 0], [0])
    feeds["key_shift_logits"] = np.zeros((1, 2, 2), dtype=np.float32)
    names = [*NAMES, "key_shift_logits"]
    with pytest.raises(Exception, match="logits and its past state together"):
        _session(library, 2, 2, names, OUTPUTS + SHIFT_OUTPUTS).run(None, feeds)


PACKED = list(OP_PACKED_INPUTS)


@pytest.mark.parametrize("pro", [False, True], ids=["fox", "fox-pro"])
def test_reads_its_inputs_from_the_joined_projection(library, pro):
    """packed_offsets: input 0 is the layer's joined projection (its parts in any order, among other columns), and
    the op reads each part from its columns as it would from its own input."""
    heads, kv_heads, dim = 4, 2, 8
    rng = np.random.default_rng(9)
    feeds = _feeds(rng, 2, 6, heads, kv_heads, dim, 10, 16, [0, 0], [0, 4])
    if pro:
        feeds |= _pro_feeds(rng, 2, 6, heads, kv_heads, dim, False)
    parts = [name for name in PACKED if name in feeds]
    order = [parts[i] for i in rng.permutation(len(parts))]
    columns, offsets, width = [], {}, 0
    for name in order:
        columns += [rng.standard_normal((2, 6, 3), dtype=np.float32), feeds[name]]  # 3 columns of something else
        offsets[name] = width + 3
        width += 3 + feeds[name].shape[-1]
    packed = {"query": np.concatenate(columns, axis=-1)} | {n: v for n, v in feeds.items() if n not in PACKED}
    names = [name if name in packed and name not in PACKED[1:] else "" for name in NAMES + PRO_NAMES]
    outputs = OUTPUTS + (SHIFT_OUTPUTS if pro else [])
    session = _session(library, heads, kv_heads, names, outputs,
                       packed_offsets=[offsets.get(name, -1) for name in PACKED])  # fmt: skip
    expected = naive(feeds, heads, kv_heads)
    for name, actual, wanted in zip(outputs, session.run(None, packed), expected, strict=True):
        np.testing.assert_allclose(actual, wanted, rtol=0, atol=2e-5, err_msg=name)


def _snake(enumerator: str) -> str:
    """kPastKeyShift -> past_key_shift"""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", enumerator.strip().removeprefix("k")).lower()


def _enum(name: str) -> list[str]:
    """The enumerators of the C++ op's enum `name`, in snake case, less the last (their count)."""
    body = re.search(rf"enum {name}\b[^{{]*\{{(.*?)\}};", SOURCE.read_text(), re.DOTALL).group(1)
    return [_snake(item) for item in re.sub(r"//[^\n]*", "", body).split(",") if item.strip()][:-1]


def test_the_native_op_names_the_contracts_inputs_and_outputs_in_its_order():
    """The C++ op reads its inputs and writes its outputs by the names runtime/contract.py lists, in that order, and
    packed_offsets places the inputs the contract says."""
    assert _enum("Input") == list(OP_INPUTS)
    assert _enum("Output") == list(OP_OUTPUTS)
    packed = re.search(r"kPacked\[\] = \{(.*?)\};", SOURCE.read_text(), re.DOTALL).group(1)
    assert [_snake(item) for item in packed.split(",")] == list(OP_PACKED_INPUTS)


def test_the_library_implements_the_contracts_op_version(library):
    """The version the library declares to onnxruntime (the op's since-version) is the contract's, and the
    manifest's entry records it: a graph of an older version finds no kernel."""
    assert library_version(library) == OP_VERSION
    assert manifest_entry(library)["version"] == OP_VERSION
    with pytest.raises(Exception, match="not a registered function/op"):
        _session(library, 2, 2, version=OP_VERSION - 1)
