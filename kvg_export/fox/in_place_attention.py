"""Attention that writes the new keys and values into the cache buffer itself and attends over its window, as one op.

`kvg::group_query_attention` has the semantics of onnxruntime's GroupQueryAttention, and the exporter
lowers it to that node. Its present is as long as the longer of the past and the window, so one graph
serves both caches:
- a static buffer of `max_cache_len` keeps its length, and the runtime binds it as past and present, so
  the node appends in place and reads only the filled window, where the standard graph scatters and
  then copies the window out (fox-small at 2000 filled positions: 17.1 ms a step against 32.1 ms);
- a dynamic past exactly as long as the filled positions grows by the new ones (the contract's
  `past + seq`), while the runtime may instead pass a longer buffer and bind it as present too, so a
  dynamic step appends in place rather than copying every cached key and value into a new present.
Here it is written with PyTorch's own scaled_dot_product_attention, so that the ExportedProgram is
checked against the eager FoX attention by an independent computation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("kvg::group_query_attention", mutates_args=())
def group_query_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    bias: torch.Tensor,
    allowed: torch.Tensor,
    cache_position: torch.Tensor,
    starts: torch.Tensor | None,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query `[batch, seq, heads*head_dim]`; key, value `[batch, seq, kv_heads*head_dim]`; key_cache,
    value_cache `[batch, kv_heads, past, head_dim]`; bias `[batch, heads, seq or 1, window]` float32, added to
    the scaled scores where `allowed` `[batch, 1, seq, window]` is true and the key's slot is not after the
    query's (the other scores become float32's minimum; every query must be allowed some key);
    cache_position `[seq]`, the consecutive slots inside the window that the new keys and values go to.
    Like GroupQueryAttention, the op masks the later slots itself, so `allowed` need not.

    `starts` `[kv_heads]` (or None: all 0): kv head h's rows of the caches begin `starts[h]` slots into the
    window (forget-gate pruning dropped the slots before), so its new keys and values go to slots
    `cache_position - starts[h]` of its rows, and `bias` is in each head's own slots, its width the longest
    head's window (`allowed` stays the window's). A row holding one head's slots is what the exporter hands
    onnxruntime where the heads are staggered (heads folded into rows, each with its own length), so that no
    head reads another's longer window.

    Returns the attention output `[batch, seq, heads*head_dim]` and the updated caches, `max(past,
    window)` long, whose slots after each head's window are zero, as onnxruntime leaves them when past and
    present are separate buffers (the runtime binds one buffer to both, and no slot after the window is
    read).
    """
    batch, seq, _ = query.shape
    window, head_dim = bias.shape[-1], key_cache.shape[-1]
    if starts is not None:
        allowed = head_windows(allowed, starts, window)
    begins = torch.zeros(kv_heads, dtype=torch.long) if starts is None else starts.cpu()
    slots = cache_position.cpu().unsqueeze(0) - begins.unsqueeze(-1)  # [kv_heads, seq]: each head's own slots
    caches = []
    for cache, new in ((key_cache, key), (value_cache, value)):
        grown = cache.new_zeros(batch, kv_heads, max(cache.shape[2], window), head_dim)
        new = new.view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        for head, first in enumerate(slots[:, 0].tolist()):
            grown[:, head, :first] = cache[:, head, :first]
            grown[:, head, first : first + seq] = new[:, head]
        caches.append(grown)
    queries = query.view(batch, seq, heads, head_dim).transpose(1, 2)
    earlier = torch.arange(window) <= slots.unsqueeze(-1)  # [kv_heads, seq, window]
    visible = (allowed & earlier.to(allowed.device)).repeat_interleave(heads // kv_heads, dim=1)
    mask = torch.where(visible, bias, torch.finfo(torch.float32).min).to(query.dtype)
    out = F.scaled_dot_product_attention(
        queries, caches[0][:, :, :window], caches[1][:, :, :window], attn_mask=mask, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(batch, seq, heads * head_dim), caches[0], caches[1]


@group_query_attention.register_fake
def _(query, key, value, key_cache, value_cache, bias, allowed, cache_position, starts, heads, kv_heads):
    batch, kv_heads_, past, head_dim = key_cache.shape
    # A static buffer's length is a number no window exceeds (attention_pattern refuses a longer mask); a
    # dynamic past's is symbolic, and the window may be longer
    length = past if isinstance(past, int) else torch.sym_max(past, bias.shape[-1])
    return (
        torch.empty_like(query),
        key_cache.new_empty(batch, kv_heads_, length, head_dim),
        value_cache.new_empty(batch, kv_heads_, length, head_dim),
    )


def own_slots(starts: torch.Tensor, window: int, width: int) -> torch.Tensor:
    """`[len(starts), width]`: which of its buffer's first `width` slots hold a head's window, the head's rows
    beginning `starts[h]` slots into a `window` of slots."""
    return torch.arange(width, device=starts.device) < (window - starts).unsqueeze(-1)


def head_windows(allowed: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    """The attention pattern `[batch, 1, seq, window]` in each kv head's own slots, `[batch, kv_heads, seq,
    width]`: slot s of head h is window slot s + starts[h], and a slot past the head's window is not allowed."""
    window = allowed.shape[-1]
    columns = torch.arange(width, device=allowed.device) + starts.unsqueeze(-1)  # [kv_heads, width]
    picked = allowed[:, 0].index_select(-1, columns.clamp(max=window - 1).flatten())
    picked = picked.unflatten(-1, columns.shape).transpose(1, 2)
    return picked & own_slots(starts, window, width).unsqueeze(1)
