"""A residual add and the RMSNorm that reads its sum become one onnxruntime SkipSimplifiedLayerNormalization.

Every FoX block adds its attention and its MLP output to the residual stream and normalizes the sum for
the next projection. onnxruntime's optimizer makes each RMSNorm one SimplifiedLayerNormalization, but it
does not join the add before it, as onnxruntime-genai's builder does with the com.microsoft op that
takes both summands and returns the normalized sum and the sum itself. One node where there were two, at
each of a decode step's 2 x layers such sums. The node computes in float32 like `layers.rms_normalize`,
and export validation checks the result against eager PyTorch like any other graph.
"""

from __future__ import annotations

import onnx_ir as ir
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
