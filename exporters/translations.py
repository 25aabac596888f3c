"""Custom ONNX lowerings for the exporter: ops that torch.onnx would otherwise spell out node by node.

- `aten.softplus` becomes one ONNX Softplus.
- `kvg::decay_after` (kvg_export/fox/attention.py) becomes one CumSum that sums from the end.
- `kvg::group_query_attention` (kvg_export/fox/in_place_attention.py) becomes onnxruntime's
  com.microsoft GroupQueryAttention (`gqa`), or, for `onnx-attention`, two opset-24 TensorScatter nodes
  that write the new keys and values into the static buffers and one ONNX Attention over them. Either way
  the runtime binds each cache buffer as both past and present, and the op writes it in place.
"""

from __future__ import annotations

import torch
from onnx.defs import OpSchema, get_schema
from onnxscript import INT32
from onnxscript import opset18 as op
from onnxscript.values import Op, Opset

import kvg_export.fox.attention  # registers kvg::decay_after
import kvg_export.fox.in_place_attention  # noqa: F401  (registers kvg::group_query_attention)


def lower_softplus(x, beta: float = 1.0, threshold: float = 20.0):
    """aten.softplus as one ONNX Softplus. torch switches to the identity above `threshold` for its own
    formula's sake; onnxruntime's Softplus is exact over float32's whole range (measured against float64
    from -200 to 200), so the exporter's Greater and Where per call are left out."""
    if beta == 1.0:
        return op.Softplus(x)
    scale = op.CastLike(beta, x)
    return op.Div(op.Softplus(op.Mul(x, scale)), scale)


def lower_decay_after(log_gates):
    """kvg::decay_after as one CumSum that sums from the end and leaves each position's own term out."""
    return op.CumSum(log_gates, op.Constant(value_int=-1), exclusive=1, reverse=1)


def _group_query_attention_schema() -> OpSchema:
    """The part of onnxruntime's contrib schema this exporter uses (onnx itself knows no com.microsoft
    ops, and torch.onnx builds a node only from a schema): inputs in onnxruntime's order, up to
    attention_bias."""
    required, optional = OpSchema.FormalParameterOption.Single, OpSchema.FormalParameterOption.Optional
    inputs = [("query", "T"), ("key", "T"), ("value", "T"), ("past_key", "T"), ("past_value", "T"),
              ("seqlens_k", "M"), ("total_sequence_length", "M"), ("cos_cache", "T"), ("sin_cache", "T"),
              ("position_ids", "P"), ("attention_bias", "T")]  # fmt: skip
    return OpSchema(
        "GroupQueryAttention",
        "com.microsoft",
        1,
        inputs=[
            OpSchema.FormalParameter(name, kind, param_option=optional if index > 6 else required)
            for index, (name, kind) in enumerate(inputs)
        ],
        outputs=[OpSchema.FormalParameter(name, "T") for name in ("output", "present_key", "present_value")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
            ("M", ["tensor(int32)"], ""),
            ("P", ["tensor(int64)"], ""),
        ],
        attributes=[
            OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, ""),
            OpSchema.Attribute("kv_num_heads", OpSchema.AttrType.INT, ""),
        ],
    )


GROUP_QUERY_ATTENTION = Op(Opset("com.microsoft", 1), "GroupQueryAttention", _group_query_attention_schema())


def lower_group_query_attention(
    query, key, value, key_cache, value_cache, bias, allowed, cache_position, heads: int, kv_heads: int
):  # fmt: skip
    """Every row's last new key goes to the last cache position (`seqlens_k`); the window is the total
    length attended, and left padding is masked in the bias, which also carries FoX's gate sums. The
    lengths come from inputs every layer shares, so onnxruntime computes them once. GroupQueryAttention's
    default scale is FoX's."""

    total = op.Cast(op.Shape(allowed, start=3, end=4), to=INT32.dtype)  # one element, as onnxruntime accepts
    last = op.Slice(cache_position, op.Constant(value_ints=[-1]), op.Constant(value_ints=[1 << 62]))
    seqlens = op.Cast(op.Expand(last, op.Shape(allowed, start=0, end=1)), to=INT32.dtype)
    masked = op.Where(allowed, bias, op.Constant(value_float=float(torch.finfo(torch.float32).min)))
    return GROUP_QUERY_ATTENTION(
        query, key, value, key_cache, value_cache, seqlens, total, None, None, None, op.CastLike(masked, query),
        num_heads=heads, kv_num_heads=kv_heads,
    )  # fmt: skip


ONNX_24 = Opset("", 24)
TENSOR_SCATTER = Op(ONNX_24, "TensorScatter", get_schema("TensorScatter", 24))
ATTENTION = Op(ONNX_24, "Attention", get_schema("Attention", 24))


def lower_onnx_attention(
    query, key, value, key_cache, value_cache, bias, allowed, cache_position, heads: int, kv_heads: int
):  # fmt: skip
    """Each row's new keys and values go to the buffer from `cache_position[0]` on; Attention then reads
    the buffer's first `window` slots of every row (`nonpad_kv_seqlen`), so slots after the window are
    neither copied nor attended. The op's mask must span the whole buffer: the bias is padded with float32's
    minimum. The later slots of the window are masked here (Attention's own is_causal aligns the chunk to
    the window's start, not its end)."""
    minimum = op.Constant(value_float=float(torch.finfo(torch.float32).min))
    window = op.Shape(allowed, start=3, end=4)
    rows = op.Shape(allowed, start=0, end=1)
    start = op.Slice(cache_position, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]))

    def per_head(states, count: int):  # [batch, seq, count * head_dim] -> [batch, count, seq, head_dim]
        return op.Transpose(op.Reshape(states, op.Constant(value_ints=[0, 0, count, -1])), perm=[0, 2, 1, 3])

    present_key = TENSOR_SCATTER(key_cache, per_head(key, kv_heads), op.Expand(start, rows), axis=2)
    present_value = TENSOR_SCATTER(value_cache, per_head(value, kv_heads), op.Expand(start, rows), axis=2)
    slots = op.Range(op.Constant(value_int=0), op.Squeeze(window), op.Constant(value_int=1))
    earlier = op.LessOrEqual(slots, op.Unsqueeze(cache_position, op.Constant(value_ints=[-1])))  # [seq, window]
    masked = op.Where(op.And(allowed, earlier), bias, minimum)
    after = op.Sub(op.Shape(key_cache, start=2, end=3), window)
    pads = op.Concat(op.Constant(value_ints=[0, 0, 0, 0, 0, 0, 0]), after, axis=0)
    mask = op.CastLike(op.Pad(masked, pads, minimum), query)
    out = ATTENTION(
        per_head(query, heads), present_key, present_value, mask, None, None, op.Expand(window, rows)
    )[0]  # fmt: skip
    joined = op.Reshape(op.Transpose(out, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))
    return joined, present_key, present_value


def translations(attention: str) -> dict:
    """The custom lowerings for a graph that attends as `attention` (see exporters/export.py)."""
    in_place = lower_onnx_attention if attention == "onnx-attention" else lower_group_query_attention
    return {
        torch.ops.aten.softplus.default: lower_softplus,
        torch.ops.kvg.group_query_attention.default: in_place,
        torch.ops.kvg.decay_after.default: lower_decay_after,
    }
