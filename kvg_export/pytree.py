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
from kvg_export.cache_layers import SHIFT_FIELDS, TENSOR_FIELDS, DynamicLayer, StaticLayer


def _flatten(cache: GatedCache) -> tuple[list[list], tuple[str, ...]]:
    if any(layer.keys is None for layer in cache.layers):
        raise ValueError("a cache with uninitialized layers cannot be flattened; update or early-initialize it")
    shifts = {name for layer in cache.layers for name in SHIFT_FIELDS if getattr(layer, name) is not None}
    fields = tuple(name for name in TENSOR_FIELDS if name in shifts or name not in SHIFT_FIELDS)
    return [[getattr(layer, name) for layer in cache.layers] for name in fields], fields


def _flatten_with_keys(cache: GatedCache):
    columns, fields = _flatten(cache)
    return [(pytree.MappingKey(name), column) for name, column in zip(fields, columns, strict=True)], fields


def _layer_tuples(columns: list[list], fields: tuple[str, ...]) -> list[tuple]:
    """Per layer, (keys, values, gates, key_shift, value_shift) with None for fields not flattened."""
    named = [dict(zip(fields, tensors, strict=True)) for tensors in zip(*columns, strict=True)]
    return [tuple(layer.get(name) for name in TENSOR_FIELDS) for layer in named]


def _unflatten_dynamic(columns: list[list], fields: tuple[str, ...]) -> DynamicCache:
    return DynamicCache(_layer_tuples(columns, fields))


def _unflatten_static(columns: list[list], fields: tuple[str, ...]) -> StaticCache:
    return StaticCache.from_tensors(_layer_tuples(columns, fields))


def register_cache_pytrees() -> None:
    """Idempotent: importing `kvg_export.cache` calls it once.

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
