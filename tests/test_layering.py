"""The dependency direction of DESIGN.md: the serving runtime never loads torch."""

import subprocess
import sys


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
