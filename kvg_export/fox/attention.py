"""The forgetting attention, in one place.

    logit_ij = q_i . k_j / sqrt(d) + (c_i - c_j),  c = cumsum(log forget gate),  j <= i
    o_i      = softmax_j(logit_ij) @ v

The gate term is an additive bias (`gate_bias`), so any attention kernel that takes one can run FoX:
the eager path below, or onnxruntime's GroupQueryAttention (see `in_place_attention.py`). Scores,
gate sums and the softmax are float32 whatever the model dtype, so masks and extreme gates stay finite
in fp16 and bf16.

Softmax ignores a term that is the same for every key of a query, so c_i - c_j may be replaced by
c_last - c_j, the sum of the gates after key j (`decay_after`): one row for every query of a step,
which the exporter lowers to one CumSum node where c_i - c_j takes five. The in-place attention does so
in float32; in fp16 and bf16, where the bias reaches the kernel in the model's dtype, the term c_last - c_i
of an early query in a long prompt would be rounded into its every score (or overflow), so there the
row is shifted back to c_i - c_j, which is 0 at the query's own key.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("kvg::decay_after", mutates_args=())
def decay_after(log_gates: torch.Tensor) -> torch.Tensor:
    """sum_{l>j} log_gates[..., l] for every j, float32 in and out: onnxruntime's CumSum with `exclusive`
    and `reverse`, which the exporter lowers it to, summing from the end as here."""
    after = log_gates[..., 1:].flip(-1).cumsum(-1).flip(-1)
    return F.pad(after, (0, 1))  # a new, contiguous tensor whatever the input's strides, as the fake says


@decay_after.register_fake
def _(log_gates):
    return log_gates.new_empty(log_gates.shape)


def _decay_after_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    """Gate l is in the sums of the positions before it: its gradient is theirs summed, forwards."""
    return F.pad(grad[..., :-1].cumsum(-1), (1, 0))


decay_after.register_autograd(_decay_after_backward)  # training attends through gate_bias


def gate_bias(log_gates: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """c_i - c_j, float32 `[batch, heads, seq, kv_len]`, from log_gates `[batch, heads, kv_len]` and
    query_positions `[seq]`, each query's slot in the cache.

    Taken as r_j - r_i with r the gates summed after each slot up to the last (`decay_after`), not as a
    difference of sums from the first slot: those reach the thousands at long positions, where float32
    keeps about 1e-4, while r is small near the queries, where the weights are (with a cache, a long
    prompt is attended in chunks, so r_i spans one chunk at most: see `modeling.PREFILL_CHUNK`)."""
    after = decay_after(log_gates.float())  # [batch, heads, kv_len]
    return after.unsqueeze(-2) - after.index_select(-1, query_positions).unsqueeze(-1)


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
