"""The forgetting attention, in one place.

    logit_ij = q_i . k_j / sqrt(d) + (c_i - c_j),  c = cumsum(log forget gate),  j <= i
    o_i      = softmax_j(logit_ij) @ v

The gate term is an additive bias (`gate_bias`), so any attention kernel that takes one can run FoX:
the eager path below, or onnxruntime's GroupQueryAttention (see `in_place_attention.py`). Scores,
gate sums and the softmax are float32 whatever the model dtype, so masks and extreme gates stay finite
in fp16 and bf16.
"""

from __future__ import annotations

import torch


def gate_bias(log_gates: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """c_i - c_j, float32 `[batch, heads, seq, kv_len]`, from log_gates `[batch, heads, kv_len]` and
    query_positions `[seq]`, each query's slot in the cache."""
    decay = torch.cumsum(log_gates.float(), dim=-1)  # [batch, heads, kv_len]
    return decay.index_select(-1, query_positions).unsqueeze(-1) - decay.unsqueeze(-2)


def forgetting_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    log_gates: torch.Tensor,
    query_positions: torch.Tensor,
    allowed: torch.Tensor,
) -> torch.Tensor:
    """Attend from new queries to every cached position.

    query `[batch, heads, seq, head_dim]`; keys, values `[batch, kv_heads, kv_len, head_dim]`; log_gates
    and query_positions as in `gate_bias`; allowed `[batch or 1, 1, seq, kv_len]`, true where a query may
    attend a key (see `modeling.attention_pattern`). Returns `[batch, heads, seq, head_dim]` in the values'
    dtype.
    """
    heads, kv_heads = query.shape[1], keys.shape[1]
    if heads != kv_heads:
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
    scale = query.shape[-1] ** -0.5
    scores = torch.matmul(query * scale, keys.transpose(-1, -2)).float()
    scores = torch.where(allowed, scores + gate_bias(log_gates, query_positions), torch.finfo(torch.float32).min)
    weights = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(weights, values)
