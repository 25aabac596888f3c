"""kvg-export's PyTorch side: gated key/value/gate caches and the FoX model family.

The names below load on first use, so that a torch-free module of this package (folders, corpus, presets)
can be imported without torch: the exporter's own process stays light while its torch half runs in a process of its own.
Importing the package registers FoX with transformers' Auto classes (kvg_export.fox does it) as soon as
transformers is loaded: at once if it is already, else when it is first imported, since transformers imports
torch.
"""

import sys
from importlib import import_module
from importlib.abc import Loader, MetaPathFinder
from importlib.util import find_spec

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


def _register_fox() -> None:
    if "kvg_export.fox" not in sys.modules:  # else it is being imported, and registers as it ends
        import_module("kvg_export.fox")


class _RegisterAfter(Loader):
    """transformers' own loader, then FoX's registration."""

    def __init__(self, loader: Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__spec__.loader = module.__loader__ = self.loader  # transformers sees its own loader
        self.loader.exec_module(module)
        _register_fox()


class _AwaitTransformers(MetaPathFinder):
    """Finds nothing itself: when transformers is first imported, wraps its loader in _RegisterAfter, once."""

    def find_spec(self, name: str, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader)
        return spec


if "transformers" in sys.modules:
    _register_fox()
else:
    sys.meta_path.insert(0, _AwaitTransformers())
