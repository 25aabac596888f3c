"""The bound behind forget-gate pruning (ACP: "Adaptive Computation Pruning for the Forgetting Transformer").

A query at t weighs key j by exp(s_tj + d_tj) / sum_i exp(s_ti + d_ti), with s the scaled score and d_tj =
c_t - c_j <= 0 the decay. If every |s| <= U, the query's own key (d = 0) puts at least exp(-U) in the sum, so a
key with d_tj < threshold = log_pruning_tolerance - 2U - log L weighs under exp(log_pruning_tolerance) / L,
and at most L such keys weigh under exp(log_pruning_tolerance) together. The decay only falls as t grows,
so such a key stays negligible for every later query: it can be dropped from the cache for good.

U must hold for every future query, so it comes from the weights, per head (`score_bounds`):
- with QK-norm, a head's q is its unit-RMS direction times the norm weight, so |q| <= sqrt(head_dim) max|w_q|,
  likewise k, and U = sqrt(head_dim) max|w_q| max|w_k|;
- without it, q = W_q diag(g) x / rms(x) with g the attention norm's weight and |x / rms(x)| <= sqrt(hidden),
  so |q| <= sqrt(hidden) sigma_max(W_q diag(g)) (the largest singular value), likewise k, whose token shift
  mixes two such projections with weights summing to 1 and so stays within the same bound.
RoPE turns q and k without changing their lengths. Both bounds hold for any input, not only seen ones.
"""

from __future__ import annotations

import math

import torch

from kvg_export.fox.layers import ShiftLinear


def _qk_norm_bounds(attention) -> torch.Tensor:
    """Per head: the largest |q| and |k| a QK-normed head can take, `[2, heads]`."""
    dim = attention.head_dim
    q = attention.q_norm.weight.detach().float().abs().view(-1, dim).amax(-1).expand(attention.heads)
    k = attention.k_norm.weight.detach().float().abs().view(-1, dim).amax(-1).expand(attention.kv_heads)
    return torch.stack([q, k.repeat_interleave(attention.heads // attention.kv_heads)]) * math.sqrt(dim)


def _projection_bound(weight: torch.Tensor, norm_weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Per head: sqrt(hidden) times the largest singular value of its rows of `weight` after the norm."""
    scaled = weight.detach().double() * norm_weight.detach().double()  # W diag(g)
    per_head = scaled.view(heads, -1, scaled.shape[-1])
    return torch.linalg.matrix_norm(per_head, ord=2) * math.sqrt(scaled.shape[-1])


def _projection_bounds(block) -> torch.Tensor:
    attention, norm = block.attn, block.attn_norm.weight
    key_proj = attention.k_proj.linear if isinstance(attention.k_proj, ShiftLinear) else attention.k_proj
    q = _projection_bound(attention.q_proj.weight, norm, attention.heads)
    k = _projection_bound(key_proj.weight, norm, attention.kv_heads)
    return torch.stack([q, k.repeat_interleave(attention.heads // attention.kv_heads)])


def score_bounds(model) -> list[list[float]]:
    """U per layer and head: no scaled score q.k / sqrt(head_dim) of that head exceeds it in magnitude."""
    bounds = []
    for block in model.model.layers:
        attention = block.attn
        q, k = _qk_norm_bounds(attention) if model.config.qk_norm else _projection_bounds(block)
        bounds.append((q.double() * k.double() / math.sqrt(attention.head_dim)).tolist())
    return bounds


def bound_kind(config) -> str:
    """How `score_bounds` bounds the scores, for the manifest."""
    return "qk-norm weights" if config.qk_norm else "projection norms"
