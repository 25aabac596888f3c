"""kvg-export's PyTorch side: gated key/value/gate caches and the FoX model family."""

from kvg_export.cache import DynamicCache, GatedCache, StaticCache
from kvg_export.cache_layers import DynamicLayer, GatedLayer, StaticLayer
from kvg_export.fox import FoxConfig, FoxForCausalLM, FoxModel
from kvg_export.pytree import register_cache_pytrees

register_cache_pytrees()

__all__ = [
    "DynamicCache",
    "DynamicLayer",
    "FoxConfig",
    "FoxForCausalLM",
    "FoxModel",
    "GatedCache",
    "GatedLayer",
    "StaticCache",
    "StaticLayer",
]
