"""FoX attention as one op over the gated cache: `kvg::fox_attention`, which the exporter lowers to the fused
onnxruntime operator `kvg.fox FoxAttention` (exporters/native/fox_attention.cc holds its contract).

It takes the new queries, keys, values and forget-gate logits with the layer's key, value and gate buffers and the
window's attention mask, writes the new entries into the buffers and attends each kv head's own window with the
decay summed inside, so the graph around it carries no log gates, no gate scatter, no gate sums, no bias and no
attention pattern; and FoX-Pro's token shift, QK-norm, output norm and output gate, so that a FoX-Pro layer's graph
is as short as a LLaMA's. Here it is written with plain PyTorch, head by head, the decay summed in float64 as the
operator sums it: the ExportedProgram is checked against eager FoX attention (kvg_export/fox/attention.py), an
independent computation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvg_export.fox.layers import rms_normalize, token_shift


@torch.library.custom_op("kvg::fox_attention", mutates_args=())
def fox_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gate_logits: torch.Tensor,
    gate_bias: torch.Tensor | None,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    past_gate: torch.Tensor,
    attention_mask: torch.Tensor,
    cache_position: torch.Tensor,
    window_starts: torch.Tensor | None,
    key_shift_logits: torch.Tensor | None,
    past_key_shift: torch.Tensor | None,
    value_shift_logits: torch.Tensor | None,
    past_value_shift: torch.Tensor | None,
    query_norm: torch.Tensor | None,
    key_norm: torch.Tensor | None,
    output_norm: torch.Tensor | None,
    output_gate_logits: torch.Tensor | None,
    heads: int,
    kv_heads: int,
    qk_norm_epsilon: float,
    output_norm_epsilon: float,
    output_gate_activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Its tensors are the fused operator's inputs, named and ordered as runtime/contract.py's OP_INPUTS, with the
    shapes and meanings exporters/native/fox_attention.cc's Input enum gives them (K kv heads, D head_dim, L past
    slots, W window slots; each FoX-Pro input None where the model has none). Returns the attention output
    `[batch, seq, heads*head_dim]`, the caches, `max(past, window - min(window_starts))` long, the past's slots kept
    and the rest zero but for the new entries, and the key's and value's shift states after the step (`[batch, 0]`
    without a shift)."""
    batch, seq, _ = query.shape
    head_dim, past, window = past_key.shape[-1], past_key.shape[2], attention_mask.shape[-1]
    begins = [0] * kv_heads if window_starts is None else window_starts.tolist()
    length = max(past, window - min(begins))
    group = heads // kv_heads
    real = attention_mask.expand(batch, window) != 0
    key, key_state = _shifted(key, key_shift_logits, past_key_shift, real[:, cache_position], kv_heads)
    value, value_state = _shifted(value, value_shift_logits, past_value_shift, real[:, cache_position], kv_heads)
    query = _normalized(query, query_norm, head_dim, qk_norm_epsilon)
    key = _normalized(key, key_norm, head_dim, qk_norm_epsilon)
    logits = gate_logits.float() + (0.0 if gate_bias is None else gate_bias.float())
    log_gates = torch.where(real[:, cache_position, None], -F.softplus(-logits), 0.0).transpose(1, 2)
    keys, values, gates = (_grown(cache, length) for cache in (past_key, past_value, past_gate))
    new_keys, new_values = (x.view(batch, seq, kv_heads, head_dim).transpose(1, 2) for x in (key, value))
    out = query.new_empty(batch, seq, heads, head_dim)
    queries = query.view(batch, seq, heads, head_dim)
    for head, begin in enumerate(begins):
        own = cache_position - begin  # the new tokens' own slots
        keys[:, head, own], values[:, head, own] = new_keys[:, head], new_values[:, head]
        query_heads = slice(head * group, (head + 1) * group)
        gates[:, query_heads, own] = log_gates[:, query_heads]
        width = window - begin
        out[:, :, query_heads] = _attend_head(
            queries[:, :, query_heads], keys[:, head, :width], values[:, head, :width], gates[:, query_heads, :width],
            real[:, begin:], own,
        ).to(out.dtype)  # fmt: skip
    out = _normalized(out.flatten(2), output_norm, head_dim, output_norm_epsilon)
    return _gated(out, output_gate_logits, output_gate_activation), keys, values, gates, key_state, value_state


def _gated(out: torch.Tensor, logits: torch.Tensor | None, activation: str) -> torch.Tensor:
    """The output times its gate's `activation` (sigmoid or silu) of `logits`, where the model has an output gate."""
    if logits is None:
        return out
    return (torch.sigmoid if activation == "sigmoid" else F.silu)(logits) * out


def _grown(cache: torch.Tensor, length: int) -> torch.Tensor:
    """A copy of `cache` `[batch, heads, past, ...]` `length` slots long: its slots kept up to there, zeros after."""
    grown = cache.new_zeros(*cache.shape[:2], length, *cache.shape[3:])
    kept = min(cache.shape[2], length)
    grown[:, :, :kept] = cache[:, :, :kept]
    return grown


def _attend_head(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gates: torch.Tensor, real: torch.Tensor,
    own: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """One kv head's attention: its query heads `[batch, seq, group, head_dim]` over its window's keys and values
    `[batch, width, head_dim]`, with its query heads' log gates `[batch, group, width]` (the decay summed in float64),
    the window's real slots `[batch, width]` and the new tokens' own slots `[seq]`; `[batch, seq, group, head_dim]`
    in float32."""
    width = keys.shape[1]
    sums = gates.double().cumsum(-1)  # [batch, group, width]
    decay = sums.index_select(-1, own).unsqueeze(-1) - sums.unsqueeze(-2)  # c_i - c_j [batch, group, seq, width]
    slots = torch.arange(width, device=queries.device)
    seeable = real[:, None, None, :] | (slots == own.unsqueeze(-1))  # [batch, 1, seq, width]
    visible = seeable & (slots <= own.unsqueeze(-1))
    scores = queries.transpose(1, 2).float() @ keys.float().mT.unsqueeze(1)
    scores = scores * keys.shape[-1] ** -0.5 + decay.float()
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return (weights @ values.float().unsqueeze(1)).transpose(1, 2)


def _shifted(raw, logits, state, keep, kv_heads) -> tuple[torch.Tensor, torch.Tensor]:
    """The token shift where it is asked for, and the state after it (`[batch, 0]` where it is not)."""
    if logits is None:
        return raw, raw.new_zeros(raw.shape[0], 0)
    return token_shift(raw, logits, state, keep, kv_heads)


def _normalized(x: torch.Tensor, weight: torch.Tensor | None, head_dim: int, eps: float) -> torch.Tensor:
    """Each head's channels of `[batch, seq, heads*head_dim]` through an RMS norm, where it has a weight."""
    if weight is None:
        return x
    return rms_normalize(x.unflatten(-1, (-1, head_dim)), weight.view(-1, head_dim), eps).flatten(2)


@fox_attention.register_fake
def _(query, key, value, gate_logits, gate_bias, past_key, past_value, past_gate, attention_mask, cache_position,
      window_starts, key_shift_logits, past_key_shift, value_shift_logits, past_value_shift, query_norm, key_norm,
      output_norm, output_gate_logits, heads, kv_heads, qk_norm_epsilon, output_norm_epsilon,
      output_gate_activation):  # fmt: skip
    batch, kv_heads_, past, head_dim = past_key.shape
    window = attention_mask.shape[-1]
    # A static buffer's length is a number no window exceeds; a dynamic past's is symbolic, and the window may be longer
    length = past if isinstance(past, int) else torch.sym_max(past, window)
    return (
        torch.empty_like(query),
        past_key.new_empty(batch, kv_heads_, length, head_dim),
        past_value.new_empty(batch, kv_heads_, length, head_dim),
        past_gate.new_empty(batch, past_gate.shape[1], length),
        key.new_empty(batch, 0 if key_shift_logits is None else key.shape[-1]),
        value.new_empty(batch, 0 if value_shift_logits is None else value.shape[-1]),
    )
