"""Custom ONNX lowerings for the exporter: ops that torch.onnx would otherwise spell out node by node.

- `aten.softplus` becomes one ONNX Softplus.
- `kvg::decay_after` (kvg_export/fox/attention.py) becomes one CumSum that sums from the end, along a
  leading axis.
- `kvg::group_query_attention` (kvg_export/fox/in_place_attention.py) becomes onnxruntime's
  com.microsoft GroupQueryAttention (`gqa`), or, for `onnx-attention`, two opset-24 TensorScatter nodes
  that write the new keys and values into the static buffers and one ONNX Attention over them. Either way
  the runtime binds each cache buffer as both past and present, and the op writes it in place.
- `kvg::fox_attention` (kvg_export/fox/fused_attention.py) becomes the fused operator `kvg.fox FoxAttention`
  (`fused`; exporters/native/fox_attention.cc), which writes keys, values and gates in place alike.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir
import onnxscript
import torch
from onnx.defs import OpSchema, get_schema
from onnxscript import BOOL, INT32
from onnxscript import opset18 as op
from onnxscript.values import Op, Opset

import kvg_export.fox.attention  # registers kvg::decay_after
import kvg_export.fox.fused_attention
import kvg_export.fox.in_place_attention  # noqa: F401  (registers kvg::group_query_attention)
from runtime.contract import OP_DOMAIN, OP_INPUTS, OP_INTEGER_INPUTS, OP_NAME, OP_OUTPUTS, OP_VERSION


def lower_softplus(x, beta: float = 1.0, threshold: float = 20.0):
    """aten.softplus as one ONNX Softplus. torch switches to the identity above `threshold` for its own
    formula's sake; onnxruntime's Softplus is exact over float32's whole range (measured against float64
    from -200 to 200), so the exporter's Greater and Where per call are left out."""
    if beta == 1.0:
        return op.Softplus(x)
    scale = op.CastLike(beta, x)
    return op.Div(op.Softplus(op.Mul(x, scale)), scale)


def lower_decay_after(log_gates):
    """kvg::decay_after as one CumSum that sums from the end and leaves each position's own term out.

    The keys' axis is moved to the front for it: onnxruntime's CumSum steps one element at a time along the
    last axis (3.3 ns an element, 124 µs for a decode step's `[1, 4, 9000]`) but a slice at a time along a
    leading one, so the two Transposes around it make the step's sum 2.5 times faster (49 µs, measured)."""
    rank = len(log_gates.shape)
    keys_first = op.Transpose(log_gates, perm=[rank - 1, *range(rank - 1)])
    summed = op.CumSum(keys_first, op.Constant(value_int=0), exclusive=1, reverse=1)
    return op.Transpose(summed, perm=[*range(1, rank), 0])


def _attention_schema(
    name: str, domain: str, version: int, inputs: list[tuple[str, str]], required: int, outputs: list[str],
    types: dict[str, list[str]], attributes: dict[str, OpSchema.AttrType] | None = None,
) -> OpSchema:  # fmt: skip
    """A schema for an attention op onnx itself does not know (torch.onnx builds a node only from a schema): its
    inputs in order, the first `required` of them required, and the heads and any other `attributes`."""
    option = OpSchema.FormalParameterOption
    return OpSchema(
        name,
        domain,
        version,
        inputs=[
            OpSchema.FormalParameter(input, kind, param_option=option.Single if index < required else option.Optional)
            for index, (input, kind) in enumerate(inputs)
        ],
        outputs=[OpSchema.FormalParameter(output, "T") for output in outputs],
        type_constraints=[(kind, allowed, "") for kind, allowed in types.items()],
        attributes=[
            OpSchema.Attribute(attribute, kind, "")
            for attribute, kind in {
                "num_heads": OpSchema.AttrType.INT, "kv_num_heads": OpSchema.AttrType.INT, **(attributes or {})
            }.items()
        ],
    )  # fmt: skip


# The part of onnxruntime's contrib schema this exporter uses: inputs in onnxruntime's order, up to attention_bias
GROUP_QUERY_ATTENTION = Op(
    Opset("com.microsoft", 1),
    "GroupQueryAttention",
    _attention_schema(
        "GroupQueryAttention", "com.microsoft", 1,
        [("query", "T"), ("key", "T"), ("value", "T"), ("past_key", "T"), ("past_value", "T"), ("seqlens_k", "M"),
         ("total_sequence_length", "M"), ("cos_cache", "T"), ("sin_cache", "T"), ("position_ids", "P"),
         ("attention_bias", "T")], 7, ["output", "present_key", "present_value"],
        {"T": ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "M": ["tensor(int32)"], "P": ["tensor(int64)"]},
    ),
)  # fmt: skip
FOX_ATTENTION = Op(
    Opset(OP_DOMAIN, OP_VERSION),
    OP_NAME,
    _attention_schema(
        OP_NAME, OP_DOMAIN, OP_VERSION,
        [(name, "P" if name in OP_INTEGER_INPUTS else "T") for name in OP_INPUTS],
        OP_INPUTS.index("window_starts"),  # those before it are given (or None) by every call
        list(OP_OUTPUTS[: OP_OUTPUTS.index("key_shift_states")]),  # the per-token states: passes/shift_states.py
        {"T": ["tensor(float)"], "P": ["tensor(int64)"]},
        {"qk_norm_epsilon": OpSchema.AttrType.FLOAT, "output_norm_epsilon": OpSchema.AttrType.FLOAT,
         "output_gate_activation": OpSchema.AttrType.STRING},
    ),
)  # fmt: skip


def lower_fox_attention(
    query, key, value, gate_logits, gate_bias, past_key, past_value, past_gate, attention_mask, cache_position,
    window_starts, key_shift_logits, past_key_shift, value_shift_logits, past_value_shift, query_norm, key_norm,
    output_norm, output_gate_logits, heads: int, kv_heads: int, qk_norm_epsilon: float, output_norm_epsilon: float,
    output_gate_activation: str,
):  # fmt: skip
    """kvg::fox_attention as the fused operator, its inputs (OP_INPUTS, the torch op's tensors) as they are."""
    return FOX_ATTENTION(
        query, key, value, gate_logits, gate_bias, past_key, past_value, past_gate, attention_mask, cache_position,
        window_starts, key_shift_logits, past_key_shift, value_shift_logits, past_value_shift, query_norm, key_norm,
        output_norm, output_gate_logits, num_heads=heads, kv_num_heads=kv_heads, qk_norm_epsilon=qk_norm_epsilon,
        output_norm_epsilon=output_norm_epsilon, output_gate_activation=output_gate_activation,
    )  # fmt: skip


MINIMUM = float(torch.finfo(torch.float32).min)


def lower_group_query_attention(
    query, key, value, key_cache, value_cache, bias, allowed, cache_position, starts, heads: int, kv_heads: int
):  # fmt: skip
    """Every row's last new key goes to the last cache position (`seqlens_k`); the window is the total
    length attended, and left padding is masked in the bias, which also carries FoX's gate sums. The
    lengths come from inputs every layer shares, so onnxruntime computes them once. GroupQueryAttention's
    default scale is FoX's. With `starts`, where the heads' rows are staggered the heads are folded into rows
    (see `Folding`) for a decode step, and a prompt's chunk runs head by head (see `_chunk_head_by_head`)."""
    # One element, as onnxruntime accepts; with `starts`, the longest head's window (the bias's width)
    total = op.Cast(op.Shape(allowed if starts is None else bias, start=3, end=4), to=INT32.dtype)
    last = op.Slice(cache_position, op.Constant(value_ints=[-1]), op.Constant(value_ints=[1 << 62]))

    def one_window(masked, shift=None):  # every head's rows start `shift` (None: no) slots into the window
        rows = op.Shape(query, start=0, end=1)
        seqlens = op.Cast(op.Expand(last if shift is None else op.Sub(last, shift), rows), to=INT32.dtype)
        return GROUP_QUERY_ATTENTION(
            query, key, value, key_cache, value_cache, seqlens, total, None, None, None, masked,
            num_heads=heads, kv_num_heads=kv_heads,
        )  # fmt: skip

    if starts is None:
        return one_window(op.CastLike(op.Where(allowed, bias, op.Constant(value_float=MINIMUM)), query))
    fold = Folding(query, allowed, starts, heads, kv_heads)
    unmasked = _unpadded_decode_step(fold, allowed)

    def staggered():
        lengths = op.Sub(last, starts)  # [kv_heads]: each head's slots before its last new one

        def one_token(masked):  # every head's row in one op
            out, present_key, present_value = GROUP_QUERY_ATTENTION(
                fold.token_states(query), fold.token_states(key), fold.token_states(value), fold.cache(key_cache),
                fold.cache(value_cache), op.Cast(fold.per_row(lengths), to=INT32.dtype), total, None, None, None,
                op.CastLike(masked, query), num_heads=heads // kv_heads, kv_num_heads=1,
            )  # fmt: skip
            return fold.token_output(out), present_key, present_value

        def unmasked_step():
            return one_token(fold.by_row(bias))

        def masked_step_or_chunk():
            def masked_step():
                return one_token(fold.masked(bias, fold.head_windows(allowed, bias)))

            def chunk():
                return _chunk_head_by_head(fold, query, key, value, key_cache, value_cache, bias, allowed,
                                           cache_position, lengths)  # fmt: skip

            return fold.either(fold.one_token, masked_step, chunk)

        return fold.either(unmasked, unmasked_step, masked_step_or_chunk)

    def together():
        return one_window(
            op.CastLike(op.Where(fold.shifted(allowed), bias, op.Constant(value_float=MINIMUM)), query), fold.earliest
        )

    return fold.either(fold.together, together, staggered)


def _unpadded_decode_step(fold: Folding, allowed):
    """Whether this is a decode step whose pattern allows every slot (no padding): such a step takes the bias as it
    is, since GroupQueryAttention reads each row's own slots alone, and no later one, and masking costs a pass over
    every head's longest window. Only a one-token step asks, so the pattern's last row answers: all of a chunk's
    would cost a pass over [seq, window]."""
    last_row = op.Slice(allowed, op.Constant(value_ints=[-1]), op.Constant(value_ints=[1 << 62]),
                        op.Constant(value_ints=[2]))  # fmt: skip
    everything = op.Cast(op.ReduceMin(op.Cast(last_row, to=INT32.dtype), keepdims=0), to=BOOL.dtype)
    return op.And(fold.one_token, everything)


def _chunk_head_by_head(fold, query, key, value, key_cache, value_cache, bias, allowed, cache_position, lengths):
    """A prompt's chunk where the heads' rows are staggered: GroupQueryAttention takes a chunk after a prompt's first
    for one batch row only, so it runs one op per kv head, over that head's slots alone (`lengths`: each head's
    slots before the chunk's last token), and a ScatterND writes the chunk's keys and values into the folded
    buffers in place."""
    filled = op.Sub(op.Slice(cache_position, op.Constant(value_ints=[0]), op.Constant(value_ints=[1])), fold.starts)
    queries, keys, values = fold.states(query), fold.states(key), fold.states(value)
    key_rows, value_rows = fold.cache(key_cache), fold.cache(value_cache)
    outs = []
    for head in range(fold.kv_heads):
        length = fold.head(lengths, head)
        out, _, _ = GROUP_QUERY_ATTENTION(
            fold.head(queries, head), fold.head(keys, head), fold.head(values, head),
            fold.first_slots(key_rows, head, filled), fold.first_slots(value_rows, head, filled),
            op.Cast(op.Expand(length, fold.batch), to=INT32.dtype),
            op.Cast(op.Add(length, op.Constant(value_ints=[1])), to=INT32.dtype), None, None, None,
            op.CastLike(fold.own_bias(bias, allowed, head), query), num_heads=fold.group, kv_num_heads=1,
        )  # fmt: skip
        outs.append(out)
    return op.Concat(*outs, axis=2), fold.write(key_rows, keys, filled), fold.write(value_rows, values, filled)


class Folding:
    """Heads folded into rows, where a layer's heads' rows start at different slots (forget-gate pruning): row
    b * kv_heads + h holds batch row b's kv head h (its query heads the row's heads), so that an attention op's
    per-row lengths are per head. A cache buffer `[batch, kv_heads, length, head_dim]` is the same memory as
    `[batch * kv_heads, 1, length, head_dim]`, and the op's folded present is the graph's output as it is (a
    Reshape back would copy the whole buffer: onnxruntime writes a graph output in place only where the op
    itself produces it). An If picks the form: folded where the heads' starts differ, else as one window."""

    def __init__(self, query, allowed, starts, heads: int, kv_heads: int):
        """`allowed`: the attention pattern `[batch, 1, seq, window]`, which every layer shares, so that onnxruntime
        computes the batch and the one-token condition from it once for all layers."""
        self.query, self.starts, self.kv_heads, self.group = query, starts, kv_heads, heads // kv_heads
        self.batch = op.Shape(allowed, start=0, end=1)  # outside the branches: the optimizer may merge both's
        self.earliest = op.ReduceMin(starts, keepdims=1)
        # Conditions, one element each as If takes: every head's rows start at one slot; one new token a row
        self.together = op.Equal(op.ReduceMax(starts, keepdims=1), self.earliest)
        self.one_token = op.Equal(op.Shape(allowed, start=2, end=3), op.Constant(value_ints=[1]))

    def either(self, condition, then: Callable[[], tuple], otherwise: Callable[[], tuple]) -> tuple:
        """An If on `condition`: `then()`'s outputs (attention output, present key and value) where it holds, else
        `otherwise()`'s, each built into its own branch. The exporter records ops into whichever recorder is the
        default, so each branch is recorded by a new one of the same kind."""
        recorder = onnxscript.evaluator.default()

        def typed(outputs) -> list:
            for output, rank in zip(outputs, (3, 4, 4), strict=True):
                output.dtype, output.shape = self.query.dtype, ir.Shape([None] * rank)
            return list(outputs)

        def branch(build: Callable[[], tuple]) -> ir.Graph:
            inner = type(recorder)(recorder.opset, {})
            with onnxscript.evaluator.default_as(inner):
                outputs = typed(build())
            return ir.Graph(inputs=[], outputs=outputs, nodes=inner.nodes, name=build.__name__)

        branches = {"then_branch": branch(then), "else_branch": branch(otherwise)}
        chosen = ir.node("If", [condition], branches, num_outputs=3)
        recorder.nodes.append(chosen)
        return tuple(typed(chosen.outputs))

    @property
    def row_count(self):
        return op.Mul(self.batch, op.Constant(value_ints=[self.kv_heads]))

    def states(self, states):
        """`[batch, seq, kv_heads * width]` -> `[rows, seq, width]`."""
        split = op.Reshape(states, op.Constant(value_ints=[0, 0, self.kv_heads, -1]))
        shape = op.Concat(self.row_count, op.Shape(states, start=1, end=2), op.Constant(value_ints=[-1]), axis=0)
        return op.Reshape(op.Transpose(split, perm=[0, 2, 1, 3]), shape)

    def token_states(self, states):
        """`[batch, 1, kv_heads * width]` -> `[rows, 1, width]`: with one token a row, the same memory, so one Reshape
        to a constant shape does what `states` does in five nodes (a decode step runs this per layer and tensor)."""
        return op.Reshape(states, op.Constant(value_ints=[-1, 1, _last_dim(states) // self.kv_heads]))

    def token_output(self, out):
        """`[rows, 1, width]` -> `[batch, 1, kv_heads * width]`, the inverse of `token_states`."""
        return op.Reshape(out, op.Constant(value_ints=[-1, 1, _last_dim(self.query)]))

    def output(self, out):
        """`[rows, seq, width]` -> `[batch, seq, kv_heads * width]`."""
        shape = op.Concat(
            self.batch, op.Constant(value_ints=[self.kv_heads]), op.Shape(self.query, start=1, end=2),
            op.Constant(value_ints=[-1]), axis=0,
        )  # fmt: skip
        return op.Reshape(op.Transpose(op.Reshape(out, shape), perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))

    def cache(self, cache):
        """`[batch, kv_heads, length, head_dim]` -> `[rows, 1, length, head_dim]`, the same memory."""
        return op.Reshape(cache, op.Constant(value_ints=[-1, 1, 0, 0]))  # a 0 keeps the input's size there

    def per_row(self, per_head):
        """`[kv_heads]` -> `[rows]`."""
        return op.Tile(per_head, self.batch)

    def head(self, rows, head: int):
        """The rows of kv head `head` (one per batch row) of `rows` `[rows, ...]`, or its element of `[kv_heads]`."""
        return op.Slice(rows, op.Constant(value_ints=[head]), op.Constant(value_ints=[1 << 62]),
                        op.Constant(value_ints=[0]), op.Constant(value_ints=[self.kv_heads]))  # fmt: skip

    def first_slots(self, rows, head: int, lengths, axis: int = 2):
        """Kv head `head`'s rows of `rows`, their first `lengths[head]` along `axis` (`lengths`: `[kv_heads]`)."""
        end = op.Concat(op.Constant(value_ints=[1 << 62]), self.head(lengths, head), axis=0)
        return op.Slice(rows, op.Constant(value_ints=[head, 0]), end, op.Constant(value_ints=[0, axis]),
                        op.Constant(value_ints=[self.kv_heads, 1]))  # fmt: skip

    def own_bias(self, bias, allowed, head: int):
        """Kv head `head`'s query heads' bias `[batch, group, seq, its window]` where the pattern `allowed` `[batch, 1,
        seq, window]` allows, else float32's minimum: the pattern from the head's start on, the bias (in the head's
        own slots) as wide."""
        pattern = op.Slice(allowed, self.head(self.starts, head), op.Constant(value_ints=[1 << 62]),
                           op.Constant(value_ints=[3]))  # fmt: skip
        end = op.Concat(op.Constant(value_ints=[(head + 1) * self.group]), op.Shape(pattern, start=3, end=4), axis=0)
        own = op.Slice(bias, op.Constant(value_ints=[head * self.group, 0]), end, op.Constant(value_ints=[1, 3]))
        return op.Where(pattern, own, op.Constant(value_float=MINIMUM))

    def write(self, cache, new, filled):
        """The folded `cache` `[rows, 1, length, head_dim]` with each row's `new` `[rows, seq, head_dim]` written after
        its `filled` slots (`filled`: per kv head): a ScatterND, which onnxruntime runs in place where the cache is
        bound as both its input and the output."""
        slots = op.Unsqueeze(op.Range(op.Constant(value_int=0), op.Squeeze(op.Shape(new, start=1, end=2)),
                                      op.Constant(value_int=1)), op.Constant(value_ints=[0]))  # fmt: skip
        slots = op.Add(op.Unsqueeze(self.per_row(filled), op.Constant(value_ints=[1])), slots)  # [rows, seq]
        rows = op.Range(op.Constant(value_int=0), op.Squeeze(self.row_count), op.Constant(value_int=1))
        rows = op.Expand(op.Unsqueeze(rows, op.Constant(value_ints=[1])), op.Shape(slots))
        first_head = op.ConstantOfShape(op.Shape(slots), value=ir.tensor(np.zeros(1, np.int64)))  # a row's only
        columns = [op.Unsqueeze(index, op.Constant(value_ints=[2])) for index in (rows, first_head, slots)]
        return op.ScatterND(cache, op.Concat(*columns, axis=2), new)

    def shifted(self, allowed):
        """The pattern `[batch, 1, seq, window]` from the slot where every head's rows start (all at one)."""
        return op.Slice(allowed, self.earliest, op.Constant(value_ints=[1 << 62]), op.Constant(value_ints=[3]))

    def head_windows(self, allowed, bias):
        """The pattern `[batch, 1, seq, window]` in each kv head's own slots, `[batch, kv_heads, 1, seq, width]`
        (`width`: the bias's, the longest head's window): slot s of head h is the window's slot s + starts[h],
        and a slot past the head's window is not allowed (as `kvg_export/fox/in_place_attention.head_windows`).
        A slice per head: a Gather of single elements costs about 30x as much."""
        width = op.Shape(bias, start=3, end=4)
        beyond = op.ConstantOfShape(op.Concat(op.Shape(allowed, start=0, end=3), width, axis=0),
                                    value=ir.tensor([False]))  # fmt: skip
        padded = op.Concat(allowed, beyond, axis=3)
        rows = []
        for head in range(self.kv_heads):
            begin = op.Slice(self.starts, op.Constant(value_ints=[head]), op.Constant(value_ints=[head + 1]))
            rows.append(op.Slice(padded, begin, op.Add(begin, width), op.Constant(value_ints=[3])))
        return op.Unsqueeze(op.Concat(*rows, axis=1), op.Constant(value_ints=[2]))

    def masked(self, bias, allowed):
        """The bias `[batch, heads, seq or 1, width]` where `allowed` `[batch, kv_heads, 1, seq, width]`, else
        float32's minimum, as `[rows, group, seq, width]`."""
        by_head = op.Concat(op.Constant(value_ints=[0, self.kv_heads, self.group, -1]), op.Shape(bias, start=3, end=4),
                            axis=0)  # fmt: skip
        masked = op.Where(allowed, op.Reshape(bias, by_head), op.Constant(value_float=MINIMUM))
        return op.Reshape(masked, op.Concat(self.row_count, op.Constant(value_ints=[self.group]),
                                            op.Shape(masked, start=3, end=5), axis=0))  # fmt: skip

    def by_row(self, bias):
        """The bias `[batch, heads, seq or 1, width]` as `[rows, group, seq or 1, width]`."""
        return op.Reshape(bias, op.Constant(value_ints=[-1, self.group, 0, 0]))  # a 0 keeps the input's size there

    def by_group(self, rows):
        """`[rows, seq, group * head_dim]` -> `[rows, group, seq, head_dim]`."""
        split = op.Reshape(rows, op.Constant(value_ints=[0, 0, self.group, -1]))
        return op.Transpose(split, perm=[0, 2, 1, 3])


ONNX_24 = Opset("", 24)
TENSOR_SCATTER = Op(ONNX_24, "TensorScatter", get_schema("TensorScatter", 24))
ATTENTION = Op(ONNX_24, "Attention", get_schema("Attention", 24))


def lower_onnx_attention(
    query, key, value, key_cache, value_cache, bias, allowed, cache_position, starts, heads: int, kv_heads: int
):  # fmt: skip
    """Each row's new keys and values go to the buffer from `cache_position[0]` on; Attention then reads
    the buffer's first `window` slots of every row (`nonpad_kv_seqlen`), so slots after the window are
    neither copied nor attended. The op's mask must span the whole buffer: the bias is padded with float32's
    minimum. The later slots of the window are masked here (Attention's own is_causal aligns the chunk to
    the window's start, not its end). With `starts`, the heads are folded into rows where they are staggered,
    as for GroupQueryAttention."""
    minimum = op.Constant(value_float=MINIMUM)
    window = op.Shape(allowed if starts is None else bias, start=3, end=4)  # with `starts`, the longest head's
    slots = op.Range(op.Constant(value_int=0), op.Squeeze(window), op.Constant(value_int=1))
    start = op.Slice(cache_position, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]))
    pads = op.Concat(op.Constant(value_ints=[0, 0, 0, 0, 0, 0, 0]), op.Sub(op.Shape(key_cache, start=2, end=3), window),
                     axis=0)  # fmt: skip

    def one_window(masked, shift=None):  # every head's rows start `shift` (None: no) slots into the window
        rows = op.Shape(query, start=0, end=1)
        written = op.Expand(start if shift is None else op.Sub(start, shift), rows)

        def per_head(states, count: int):  # [batch, seq, count * head_dim] -> [batch, count, seq, head_dim]
            return op.Transpose(op.Reshape(states, op.Constant(value_ints=[0, 0, count, -1])), perm=[0, 2, 1, 3])

        present_key = TENSOR_SCATTER(key_cache, per_head(key, kv_heads), written, axis=2)
        present_value = TENSOR_SCATTER(value_cache, per_head(value, kv_heads), written, axis=2)
        mask = op.CastLike(op.Pad(masked, pads, minimum), query)
        out = ATTENTION(per_head(query, heads), present_key, present_value, mask, None, None, op.Expand(window, rows))
        return _joined(out[0]), present_key, present_value

    if starts is None:
        earlier = op.LessOrEqual(slots, op.Unsqueeze(cache_position, op.Constant(value_ints=[-1])))  # [seq, window]
        return one_window(op.Where(op.And(allowed, earlier), bias, minimum))
    fold = Folding(query, allowed, starts, heads, kv_heads)

    def staggered():
        # [kv_heads, 1, seq, window]: no key after the query in each head's own slots
        own = op.Sub(op.Unsqueeze(cache_position, op.Constant(value_ints=[0])),
                     op.Unsqueeze(starts, op.Constant(value_ints=[-1])))  # fmt: skip
        earlier = op.LessOrEqual(slots, op.Unsqueeze(own, op.Constant(value_ints=[1, -1])))
        masked = fold.masked(bias, op.And(fold.head_windows(allowed, bias), earlier))
        one_head = op.Constant(value_ints=[1])
        written = fold.per_row(op.Sub(start, starts))
        present_key = TENSOR_SCATTER(fold.cache(key_cache), op.Unsqueeze(fold.states(key), one_head), written, axis=2)
        present_value = TENSOR_SCATTER(fold.cache(value_cache), op.Unsqueeze(fold.states(value), one_head), written,
                                       axis=2)  # fmt: skip
        last = op.Slice(cache_position, op.Constant(value_ints=[-1]), op.Constant(value_ints=[1 << 62]))
        mask = op.CastLike(op.Pad(masked, pads, minimum), query)
        lengths = fold.per_row(op.Add(op.Sub(last, starts), one_head))
        out = ATTENTION(fold.by_group(fold.states(query)), present_key, present_value, mask, None, None, lengths)
        return fold.output(_joined(out[0])), present_key, present_value

    def together():
        shifted = op.Sub(cache_position, fold.earliest)
        earlier = op.LessOrEqual(slots, op.Unsqueeze(shifted, op.Constant(value_ints=[-1])))  # [seq, window]
        return one_window(op.Where(op.And(fold.shifted(allowed), earlier), bias, minimum), fold.earliest)

    return fold.either(fold.together, together, staggered)


def _last_dim(value) -> int:
    """A traced value's last size, which the exported program fixes (the heads' widths)."""
    size = value.shape[-1]
    if not isinstance(size, int):
        raise TypeError(f"expected a fixed last dimension, got {value.shape}")
    return size


def _joined(out):
    """Attention's `[rows, heads, seq, head_dim]` as `[rows, seq, heads * head_dim]`."""
    return op.Reshape(op.Transpose(out, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))


def translations(attention: str) -> dict:
    """The custom lowerings for a graph that attends as `attention` (see exporters/pipeline/export.py)."""
    in_place = lower_onnx_attention if attention == "onnx-attention" else lower_group_query_attention
    return {
        torch.ops.aten.softplus.default: lower_softplus,
        torch.ops.kvg.group_query_attention.default: in_place,
        torch.ops.kvg.fox_attention.default: lower_fox_attention,
        torch.ops.kvg.decay_after.default: lower_decay_after,
    }
