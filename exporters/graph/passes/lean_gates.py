"""FoX's forget-gate terms in fewer and cheaper nodes: two exact rewrites of what torch.onnx writes for them.

Each layer of a decode step computes its new log gates and the row of gate sums its attention adds to the
scores. Beside the matrix products these are tiny tensors (one float per head and position), so what they
cost is each kernel's fixed work, which differs by kernel more than node counts suggest (bench/op_costs.py;
at fox-small's decode shapes a broadcast Where took 4.7 µs above a trivial node, an Add 2.7, a CumSum 7.0,
and a Gather of the window 16.3 against 3.1 for the Slice and Unsqueeze it could replace, so that rewrite
is not made).

- The log gate `-softplus(-(z + b)) * keep` (z the forget-gate projection, b its bias, keep the new
  tokens' padding mask) is written by torch.onnx as Add, Neg, Softplus, Neg and Mul. It becomes
  `softplus((-b) - z) * (-keep)`: Sub, Softplus and Mul, with -b a constant and -keep one node that
  every layer shares. Bit for bit the same: IEEE rounding is symmetric, so -(z + b) and (-b) - z round
  alike, and so do -(s * k) and s * (-k).
- The masked bias `Where(allowed, bias, lowest)` becomes `bias + Where(allowed, 0, lowest)`, the mask
  computed once for every layer: an Add a layer where there was a Where. Bit for bit the same: bias + 0 is
  bias, and bias + lowest rounds to lowest for any bias a gate sum or a score reaches.
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


def _masked_bias(op, allowed, bias, lowest):
    return op.Where(allowed, bias, lowest)


def _masks_with_float32_min(context, allowed, bias, lowest) -> bool:
    """float32 scores and biases masked with float32's lowest value, which swallows any bias a gate sum or a
    score reaches (x + lowest rounds to lowest for |x| < 2^103)."""
    value = lowest.const_value
    return (
        bias.dtype == ir.DataType.FLOAT
        and bias.const_value is None  # not the mask this rewrite writes
        and value is not None
        and value.numpy().size == 1
        and float(value.numpy().reshape(())) == float(np.finfo(np.float32).min)
    )


def _added_mask(op, allowed, bias, lowest):
    zero = op.initializer(ir.tensor(np.zeros((), np.float32)), name=f"{bias.name}.allowed")
    return op.Add(bias, op.Where(allowed, zero, lowest))


LEAN_GATES = [
    RewriteRule(_log_gate, _lean_log_gate, _constant_bias, name="log gate"),
    RewriteRule(_masked_bias, _added_mask, _masks_with_float32_min, name="masked bias"),
]


def lean_gates(model: ir.Model) -> int:
    """Rewrite every layer's gate terms in place; returns how many nodes that took out. The rewrites write
    each layer its own -keep and additive mask; equal constants and then identical nodes are merged, so every
    layer reads one of each."""
    before = len(model.graph)
    rewrite(model, LEAN_GATES)
    for each in (DeduplicateInitializersPass(), CommonSubexpressionEliminationPass(), RemoveUnusedNodesPass()):
        each(model)
    return before - len(model.graph)
