"""FoX's forget-gate terms in fewer nodes: two exact rewrites of what torch.onnx writes for them.

Each layer of a decode step computes its new log gates and the row of gate sums its attention adds to the
scores. Beside the matrix products these are tiny tensors (one float per head and position), so a step
pays for them per node, not per byte, and they are most of what a FoX graph runs beyond a LLaMA's.

- The log gate `-softplus(-(z + b)) * keep` (z the forget-gate projection, b its bias, keep the new
  tokens' padding mask) is written by torch.onnx as Add, Neg, Softplus, Neg and Mul. It becomes
  `softplus((-b) - z) * (-keep)`: Sub, Softplus and Mul, with -b a constant and -keep one node that
  every layer shares. Bit for bit the same: IEEE rounding is symmetric, so -(z + b) and (-b) - z round
  alike, and so do -(s * k) and s * (-k).
- The window's gate sums `Unsqueeze(CumSum(Slice(gates)))`, a `[batch, heads, 1, window]` row for the
  attention bias, become `CumSum(Gather(gates, [[0 .. window-1]]))`: the Gather's 2-D index adds the
  query axis as it copies the window out.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import (
    CommonSubexpressionEliminationPass,
    DeduplicateInitializersPass,
    RemoveUnusedNodesPass,
)
from onnxscript.rewriter import RewriteRule, rewrite


def _log_gate(op, logits, bias, keep):
    gates = op.Neg(op.Softplus(op.Neg(op.Transpose(op.Add(logits, bias), perm=[0, 2, 1]))))
    return op.Mul(gates, keep)


def _constant_bias(context, logits, bias, keep) -> bool:
    return bias.const_value is not None and logits.dtype == ir.DataType.FLOAT


def _lean_log_gate(op, logits, bias, keep):
    negated = op.initializer(ir.tensor(-bias.const_value.numpy()), name=f"{logits.name}.negated_bias")
    return op.Mul(op.Softplus(op.Transpose(op.Sub(negated, logits), perm=[0, 2, 1])), op.Neg(keep))


def _window_decay(op, gates, starts, ends, axes, steps, cumsum_axis, query_axis):
    window = op.Slice(gates, starts, ends, axes, steps)
    return op.Unsqueeze(op.CumSum(window, cumsum_axis, exclusive=1, reverse=1), query_axis)


def _ints(value: ir.Value) -> list[int] | None:
    return None if value.const_value is None else np.asarray(value.const_value.numpy()).reshape(-1).tolist()


def _slices_last_axis_from_zero(context, gates, starts, ends, axes, steps, cumsum_axis, query_axis) -> bool:
    """A `[batch, heads, buffer]` gate buffer cut to its first `ends` slots and summed along them, the
    query axis then inserted before them."""
    last = {2, -1}
    return (
        gates.shape is not None
        and len(gates.shape) == 3
        and _ints(starts) == [0]
        and _ints(steps) == [1]
        and len(_ints(axes) or []) == 1
        and _ints(axes)[0] in last
        and len(_ints(cumsum_axis) or []) == 1
        and _ints(cumsum_axis)[0] in last
        and _ints(query_axis) == [2]
    )


def _gathered_window_decay(op, gates, starts, ends, axes, steps, cumsum_axis, query_axis):
    def constant(role: str, value: int | list[int]):  # merged with the other layers' by `lean_gates`
        return op.initializer(ir.tensor(np.array(value, np.int64)), name=f"{gates.name}.{role}")

    slots = op.Range(constant("first_slot", 0), op.Squeeze(ends), constant("slot_step", 1))
    window = op.Gather(gates, op.Unsqueeze(slots, constant("query_axis", [0])), axis=2)
    return op.CumSum(window, constant("slot_axis", -1), exclusive=1, reverse=1)


LEAN_GATES = [
    RewriteRule(_log_gate, _lean_log_gate, _constant_bias, name="log gate"),
    RewriteRule(_window_decay, _gathered_window_decay, _slices_last_axis_from_zero, name="window decay"),
]


def lean_gates(model: ir.Model) -> int:
    """Rewrite every layer's gate terms in place; returns how many nodes that took out. The rewrites write
    each layer its own -keep and window index; equal constants and then identical nodes are merged, so every
    layer reads one."""
    before = len(model.graph)
    rewrite(model, LEAN_GATES)
    for each in (DeduplicateInitializersPass(), CommonSubexpressionEliminationPass(), RemoveUnusedNodesPass()):
        each(model)
    return before - len(model.graph)
