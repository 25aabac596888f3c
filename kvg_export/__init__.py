"""kvg-export's PyTorch side: gated key/value/gate caches and the FoX model family.

The names below load on first use, so that a torch-free module of this package (folders, corpus, presets)
can be imported without torch: the exporter's own process stays light while its torch half runs apart.
"""

from importlib import import_module

_HOMES = {
    "DynamicCache": "kvg_export.cache",
    "GatedCache": "kvg_export.cache",
    "StaticCache": "kvg_export.cache",
    "DynamicLayer": "kvg_export.cache_layers",
    "GatedLayer": "kvg_export.cache_layers",
    "StaticLayer": "kvg_export.cache_layers",
    "FoxConfig": "kvg_export.fox",
    "FoxForCausalLM": "kvg_export.fox",
    "FoxModel": "kvg_export.fox",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'kvg_export' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
