"""exporters.pipeline.isolated: a function run in a spawned process answers, logs and fails as if it ran here; the
exporter's
own process never imports torch, whose half of the export runs in a process of its own."""

import importlib.util
import os
import signal
import subprocess
import sys

import pytest

from exporters.pipeline.isolated import IsolatedError, run_isolated


def doubled(value, log):
    log(f"doubling {value}")
    log("done")
    return {"value": value * 2, "pid": os.getpid()}


def refused(log):
    raise ValueError("the value is out of range")


def killed(log):
    log("about to be killed")
    os.kill(os.getpid(), signal.SIGKILL)


def installed(name, log):
    return importlib.util.find_spec(name) is not None


def test_a_package_named_absent_is_not_installed_for_the_function_while_others_are():
    assert run_isolated("test_isolated:installed", "wave", log=print, absent=("tomllib",)) is True
    assert run_isolated("test_isolated:installed", "wave", log=print, absent=("wave",)) is False


def test_the_result_and_the_log_lines_come_back_from_another_process():
    lines = []
    result = run_isolated("test_isolated:doubled", 21, log=lines.append)
    assert result["value"] == 42 and result["pid"] != os.getpid()
    assert lines == ["doubling 21", "done"]


def test_an_error_is_raised_here_with_its_type_message_and_the_other_process_traceback():
    with pytest.raises(ValueError, match="the value is out of range") as raised:
        run_isolated("test_isolated:refused", log=print)
    assert any("in refused" in note for note in raised.value.__notes__)


def test_a_process_killed_before_it_answers_is_an_error_naming_the_signal():
    lines = []
    with pytest.raises(IsolatedError, match=r"SIGKILL.*out-of-memory"):
        run_isolated("test_isolated:killed", log=lines.append)
    assert lines == ["about to be killed"]


def test_the_exporting_process_never_imports_torch(tmp_path):
    """Its torch half runs in a process of its own, so the memory torch and the model take is returned before
    onnxruntime's."""
    script = (
        "import sys\n"
        "from exporters.pipeline.cli import main\n"
        f"code = main(['fox-tiny', '--out', {str(tmp_path / 'out')!r}])\n"
        "assert 'torch' not in sys.modules, 'the exporting process imported torch'\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "greedy tokens agree" in done.stdout and (tmp_path / "out" / "model.onnx").is_file()
