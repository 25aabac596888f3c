"""A residual add and the RMSNorm that reads its sum become one onnxruntime SkipSimplifiedLayerNormalization.

Every FoX block adds its attention and its MLP output to the residual stream and normalizes the sum for
the next projection. onnxruntime's optimizer makes each RMSNorm one SimplifiedLayerNormalization, but it
does not join the add before it, as onnxruntime-genai's builder does with the com.microsoft op that
takes both summands and returns the normalized sum and the sum itself. One node where there were two, at
each of a decode step's 2 x layers such sums. The node computes in float32 like `layers.rms_normalize`,
and export validation checks the result against eager PyTorch like any other graph.

A head's RMSNorm (`layers.HeadRMSNorm`: QK-norm and FoX-Pro's output norm, over each head's channels) is left
as six nodes by onnxruntime, whose fusion takes a one-dimensional weight only, and this one's is `[1, head_dim]`
(one weight for every head) or `[heads, head_dim]`. So the weight is made `[head_dim]` where every head shares
it, and otherwise the norm is scaled by ones and then by the weight: onnxruntime then makes it one
SimplifiedLayerNormalization (and a Mul). fox-pro-py: 42 fewer nodes in a decode step's graph of 339.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import RewriteRule, pattern, rewrite


def _residual_norm(cast: bool):
    """The sum, then `layers.rms_normalize` as torch.onnx writes it: x / sqrt(mean(x^2) + eps) * weight,
    `cast` into float32 and back around it when the model is fp16 or bf16."""

    def target(op, summand, other, exponent, epsilon, weight, compute_dtype, output_dtype):
        total = op.Add(summand, other)
        x = op.Cast(total, to=compute_dtype) if cast else total
        rms = op.Sqrt(op.Add(op.ReduceMean(op.Pow(x, exponent), [-1], keepdims=1, noop_with_empty_axes=0), epsilon))
        scale = pattern.OrValue([op.Cast(weight, to=compute_dtype), weight])
        normalized = op.Mul(op.Div(x, rms), scale)
        return (op.Cast(normalized, to=output_dtype) if cast else normalized), total

    return target


def _fits(context, summand, other, exponent, epsilon, weight, **_) -> bool:
    """Summands of one shape and dtype (a residual add, not a broadcast), squares, a scalar epsilon, and a
    constant 1-D weight as long as the normalized axis that the summands' dtype holds exactly (the op takes
    it in that dtype; torch.onnx has folded an fp16 model's weight into float32)."""
    if weight.const_value is None or summand.dtype != other.dtype or None in (summand.shape, other.shape):
        return False
    square = exponent.const_value is not None and float(exponent.const_value.numpy()) == 2.0
    scalar = epsilon.const_value is not None and epsilon.const_value.numpy().size == 1
    values = weight.const_value.numpy()
    return (
        square
        and scalar
        and summand.shape == other.shape
        and values.shape == (summand.shape[-1],)
        and (values.astype(summand.dtype.numpy()).astype(values.dtype) == values).all()
    )


def _skip_norm(op, summand, other, epsilon, weight, **_):
    if weight.dtype != summand.dtype:
        weight = op.initializer(ir.tensor(weight.const_value.numpy().astype(summand.dtype.numpy())),
                                name=f"{summand.name}.norm_weight")  # fmt: skip
    normalized, _mean, _inverse_std, total = op.SkipSimplifiedLayerNormalization(
        summand, other, weight, epsilon=float(epsilon.const_value.numpy()), _domain="com.microsoft", _outputs=4
    )
    return normalized, total


RESIDUAL_NORMS = [RewriteRule(_residual_norm(cast), _skip_norm, _fits, name=f"residual norm (cast {cast})")
                  for cast in (False, True)]  # fmt: skip


def fuse_residual_norms(model: ir.Model) -> int:
    """Rewrite every residual add with its RMSNorm in place; returns how many were joined."""
    before = sum(1 for node in model.graph if node.op_type == "SkipSimplifiedLayerNormalization")
    rewrite(model, RESIDUAL_NORMS)
    return sum(1 for node in model.graph if node.op_type == "SkipSimplifiedLayerNormalization") - before


def _head_norm(op, x, exponent, epsilon, weight, last=None):
    """`layers.rms_normalize` over the last axis, its weight broadcast over the heads (the pattern names the
    axis as a literal, a replacement as the Constant `last`)."""
    mean = op.ReduceMean(op.Pow(x, exponent), [-1] if last is None else last, keepdims=1, noop_with_empty_axes=0)
    return op.Mul(op.Div(x, op.Sqrt(op.Add(mean, epsilon))), weight)


def _per_head_weight(context, x, weight, **_) -> bool:
    """A constant weight of rank 2 up to the input's whose last axis is the normalized one (so the product keeps
    the input's shape, as it does with the weight made one row)."""
    if weight.const_value is None or x.shape is None:
        return False
    shape = weight.const_value.shape
    return 2 <= len(shape) <= len(x.shape) and shape[-1] == x.shape[-1] and isinstance(x.shape[-1], int)


def _fusable(op, x, exponent, epsilon, weight, **_):
    """The norm as onnxruntime fuses it: by a `[head_dim]` weight, the heads' own weights (if they differ) after."""
    values = weight.const_value.numpy()
    rows = values.reshape(-1, values.shape[-1])
    shared = bool((rows == rows[0]).all())
    flat = op.initializer(ir.tensor(rows[0] if shared else np.ones_like(rows[0])), name=f"{x.name}.head_norm_weight")
    normalized = _head_norm(op, x, exponent, epsilon, flat, op.Constant(value_ints=[-1]))
    return normalized if shared else op.Mul(normalized, weight)


HEAD_NORM = RewriteRule(_head_norm, _fusable, _per_head_weight, name="head norm")


def fusable_head_norms(model: ir.Model) -> int:
    """Rewrite every head's RMSNorm in place so that onnxruntime fuses it; returns how many."""
    count = HEAD_NORM.apply_to_model(model)
    RemoveUnusedNodesPass()(model)  # and the weights no longer read
    return count
