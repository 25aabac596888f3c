"""The dependency direction: the serving runtime never loads torch (docs/layout.md)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import contract

ROOT = Path(__file__).resolve().parent.parent


def test_importing_every_runtime_module_loads_no_torch():
    probe = (
        "import importlib, pkgutil, sys, runtime\n"
        "names = [module.name for module in pkgutil.walk_packages(runtime.__path__, 'runtime.')]\n"
        "assert {'runtime.decode.generator', 'runtime.decode.engine', 'runtime.serving.server',\n"
        "        'runtime.serving.ray_app'} <= set(names), names\n"
        "for name in names: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _modules(folder: str) -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted((ROOT / folder).rglob("*.py"))}


def _imported(tree: ast.Module) -> list[str]:
    return [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names] + [
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    ]


def test_runtime_modules_import_neither_the_exporter_nor_the_model():
    imported = {
        (path.name, name)
        for path, tree in _modules("runtime").items()
        for name in _imported(tree)
        if name.split(".")[0] in ("exporters", "kvg_export", "torch", "transformers")
    }
    assert imported == set()


# The rooms of each package, each above those before it: a module imports modules of its own room and of the rooms
# before it only ("" holds the modules every room stands on: for runtime/ the contract, the errors and the artifact)
ROOMS = {
    "runtime": ("", "text", "structured", "cache", "decode", "speculative", "serving", "cli"),
    "exporters": ("", "graph", "checks", "quantization", "native", "evaluation", "pipeline", "optimum_register"),
}


def _room(module: str, rooms: tuple[str, ...]) -> str:
    """The room of a dotted module name, or of what a module imports: "" for the package's top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in rooms else ""


@pytest.mark.parametrize("package", sorted(ROOMS))
def test_rooms_import_only_the_rooms_below_them(package):
    rooms, upward = ROOMS[package], []
    for path, tree in _modules(package).items():
        parts = path.relative_to(ROOT).with_suffix("").parts
        assert len(parts) <= 2 or parts[1] in rooms, f"{path.relative_to(ROOT)} is in no room of ROOMS[{package!r}]"
        own = _room(".".join(parts), rooms)
        for name in _imported(tree):
            if name.split(".")[0] == package and rooms.index(_room(name, rooms)) > rooms.index(own):
                upward.append(f"{path.relative_to(ROOT)} ({own or 'top'}) imports {name}")
    assert upward == []


def test_the_contracts_names_are_spelled_only_in_the_contract_module():
    """Graph input and output names are read from runtime/contract.py (or the manifest), never written out."""
    names = {contract.INPUT_IDS, contract.ATTENTION_MASK, contract.CACHE_POSITION, contract.LOGITS,
             contract.LOGITS_TO_KEEP, contract.WINDOW_OFFSETS}  # fmt: skip
    spelled = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}"
        for folder in ("runtime", "exporters")
        for path, tree in _modules(folder).items()
        if path.name != "contract.py"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and (node.value in names or node.value.startswith((contract.PAST_PREFIX, contract.PRESENT_PREFIX)))
    ]
    assert spelled == []
