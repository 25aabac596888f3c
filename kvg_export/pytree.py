"""pytree registration of the caches, so `torch.export` can take and return them and save/load round-trips.

A cache flattens to one list per tensor field (`keys`, `values`, `gates`, then the shift states when
any layer holds them) with one tensor per layer. The context is the tuple of those field names: plain
JSON, so an exported program's input and output specs serialize. A static cache's length and batch
are read back from its buffers.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from kvg_export.cache import DynamicCache, GatedCache, StaticCache
from kvg_export.cache_layers import SHIFT_FIELDS, TENSOR_FIELDS, DynamicLayer, GatedLayer, StaticLayer


def _flatten(cache: GatedCache) -> tuple[list[list], tuple[str, ...]]:
    if any(layer.keys is None for layer in cache.layers):
        raise ValueError("a cache with uninitialized layers cannot be flattened; update or early-initialize it")
    held = {name for layer in cache.layers for name in SHIFT_FIELDS if getattr(layer, name) is not None}
    fields = tuple(name for name in TENSOR_FIELDS if name in held or name not in SHIFT_FIELDS)
    return [[getattr(layer, name) for layer in cache.layers] for name in fields], fields


def _flatten_with_keys(cache: GatedCache):
    columns, fields = _flatten(cache)
    return [(pytree.MappingKey(name), column) for name, column in zip(fields, columns, strict=True)], fields


def _fill(layer: GatedLayer, fields: tuple[str, ...], columns: list[list], index: int) -> GatedLayer:
    for name, column in zip(fields, columns, strict=True):
        setattr(layer, name, column[index])
    layer.device = layer.keys.device
    return layer


def _unflatten_dynamic(columns: list[list], fields: tuple[str, ...]) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [_fill(DynamicLayer(), fields, columns, i) for i in range(len(columns[0]))]
    return cache


def _unflatten_static(columns: list[list], fields: tuple[str, ...]) -> StaticCache:
    keys = columns[0]
    cache = StaticCache(num_layers=0, max_cache_len=1)
    cache.layers = [
        _fill(StaticLayer(keys[i].shape[2], keys[i].shape[0]), fields, columns, i) for i in range(len(keys))
    ]
    return cache


def register_cache_pytrees() -> None:
    """Idempotent: importing `kvg_export` calls it once.

    The cache classes are also allowed for `torch.load(weights_only=True)`: a saved exported program
    pickles its example inputs, caches included, and loading must not fall back to full unpickling.
    """
    torch.serialization.add_safe_globals([DynamicCache, StaticCache, DynamicLayer, StaticLayer])
    for cls, unflatten in ((DynamicCache, _unflatten_dynamic), (StaticCache, _unflatten_static)):
        if cls in pytree.SUPPORTED_NODES:
            continue
        pytree.register_pytree_node(
            cls,
            _flatten,
            unflatten,
            serialized_type_name=f"kvg_export.{cls.__name__}",
            flatten_with_keys_fn=_flatten_with_keys,
            to_dumpable_context=list,
            from_dumpable_context=tuple,
        )
