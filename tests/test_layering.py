"""The dependency direction of DESIGN.md: the serving runtime never loads torch."""

import subprocess
import sys


def test_importing_the_runtime_loads_no_torch():
    probe = "import sys, runtime; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
