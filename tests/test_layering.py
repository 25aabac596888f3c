"""The dependency direction: the serving runtime never loads torch (docs/layout.md)."""

import ast
import subprocess
import sys
from pathlib import Path

from runtime import contract

ROOT = Path(__file__).resolve().parent.parent


def test_importing_every_runtime_module_loads_no_torch():
    probe = (
        "import importlib, pkgutil, sys, runtime\n"
        "names = [module.name for module in pkgutil.iter_modules(runtime.__path__)]\n"
        "assert {'generator', 'engine', 'server', 'ray_app'} <= set(names), names\n"
        "for name in names: importlib.import_module('runtime.' + name)\n"
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
