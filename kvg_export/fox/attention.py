"""The forgetting attention, in one function.

    logit_ij = q_i . k_j / sqrt(d) + (c_i - c_j),  c = cumsum(log forget gate),  j <= i
    o_i      = softmax_j(logit_ij) @ v

Scores, gate sums and the softmax are float32 whatever the model dtype, so masks and extreme gates
stay finite in fp16 and bf16.
"""

from __future__ import annotations

import torch


def forgetting_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    log_gates: torch.Tensor,
    query_positions: torch.Tensor,
    allowed: torch.Tensor,
) -> torch.Tensor:
    """Attend from new queries to every cached position.

    query `[batch, heads, seq, head_dim]`; keys, values `[batch, kv_heads, kv_len, head_dim]`;
    log_gates `[batch, heads, kv_len]` float32; query_positions `[seq]`, each query's slot in the cache;
    allowed `[batch or 1, 1, seq, kv_len]`, true where a query may attend a key (a real token at or before
    the query's slot; see `modeling.attention_pattern`). Returns `[batch, heads, seq, head_dim]` in the
    values' dtype.
    """
    heads, kv_heads = query.shape[1], keys.shape[1]
    if heads != kv_heads:
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
    scale = query.shape[-1] ** -0.5
    scores = torch.matmul(query * scale, keys.transpose(-1, -2)).float()

    decay = torch.cumsum(log_gates.float(), dim=-1)  # [batch, heads, kv_len]
    scores = scores + (decay.index_select(-1, query_positions).unsqueeze(-1) - decay.unsqueeze(-2))
    scores = torch.where(allowed, scores, torch.finfo(torch.float32).min)
    weights = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(weights, values)
