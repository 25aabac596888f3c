"""Exportable forms of a FoX model: flat, named cache tensors in; logits and the updated cache out.

`torch.export` traces these rather than the transformers model, so that each cache tensor is one
graph input and one graph output and the ONNX names follow the contract in `contract.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from kvg_export import DynamicCache, FoxForCausalLM, StaticCache
from runtime.contract import CACHE_FIELDS, CacheLayout


class ExportableFox(nn.Module):
    """One forward step over a dynamic cache (`past` may be empty) or a static one (written at cache_position).

    `in_place_attention` attends through the op the exporter lowers to onnxruntime's GroupQueryAttention;
    see `kvg_export/fox/in_place_attention.py`. A dynamic graph then places the new tokens at the end of
    the mask, not of `past`, so a runtime may pass cache buffers longer than the filled positions.
    """

    def __init__(self, model: FoxForCausalLM, layout: CacheLayout, in_place_attention: bool | str = False):
        super().__init__()
        self.model, self.layout, self.in_place_attention = model, layout, in_place_attention

    def _layer_tuples(self, past: tuple[torch.Tensor, ...]) -> list[tuple]:
        width = len(self.layout.fields)
        layers = []
        for i in range(self.layout.num_layers):
            named = dict(zip(self.layout.fields, past[i * width : (i + 1) * width], strict=True))
            layers.append(tuple(named.get(f) for f in CACHE_FIELDS))
        return layers

    def forward(self, input_ids, attention_mask, *rest, window_offsets=None):
        """input_ids `[batch, seq]`, attention_mask `[batch, past+seq]` (static: `[batch, window]`, the filled
        slots and the new ones), then cache_position `[seq]` for a static graph, then the past tensors in
        `layout.past_names()` order; with in-place attention, `window_offsets` (see FoxModel.forward).
        """
        cache_position, past = (rest[0], rest[1:]) if self.layout.static else (None, rest)
        if self.in_place_attention and not self.layout.static:
            total = attention_mask.shape[1]
            cache_position = torch.arange(total - input_ids.shape[1], total, device=input_ids.device)
        layers = self._layer_tuples(past)
        cache = StaticCache.from_tensors(layers) if self.layout.static else DynamicCache(layers)
        out = self.model(input_ids, attention_mask, cache, cache_position=cache_position, use_cache=True,
                         in_place_attention=self.in_place_attention, window_offsets=window_offsets)  # fmt: skip
        present = []
        for layer in cache.layers:
            by_field = dict(
                zip(
                    CACHE_FIELDS,
                    (layer.keys, layer.values, layer.gates, layer.key_shift, layer.value_shift),
                    strict=True,
                )
            )
            present.extend(by_field[f] for f in self.layout.fields)
        return (out.logits.float(), *present)
