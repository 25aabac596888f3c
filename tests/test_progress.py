"""A long stage's progress: counted lines in a log (from the start, then every while), a bar on a terminal,
nothing for a stage that ends at once."""

import re
import time

from exporters.pipeline.stages import stage
from exporters.progress import Progress


def wait_for(lines: list[str], pattern: str) -> str:
    """The first line matching `pattern`, waiting for the progress thread to write it (at most 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = [line for line in lines if re.search(pattern, line)]
        if found:
            return found[0]
        time.sleep(0.01)
    raise AssertionError(f"no line matched {pattern!r}: {lines}")


def test_a_stage_that_ends_at_once_logs_its_stage_line_alone():
    lines = []
    assert stage(lines.append, "validate", lambda progress: progress.plan(3, "steps") or 7, str) == 7
    assert len(lines) == 1 and re.fullmatch(r"validate +\d+\.\d s  7", lines[0])


def test_a_long_stage_logs_how_much_work_it_has_then_how_much_is_done():
    lines = []
    with Progress(lines.append, "text", delay_s=0.2, every_s=0.05, terminal=False) as progress:
        progress.plan(4, "segments scored")
        assert re.fullmatch(r"text +\.\.\. \d+ s: 0/4 segments scored", wait_for(lines, "0/4"))
        progress.advance(3)
        assert re.search(r"3/4 segments scored \(75%\), about \d+ s left$", wait_for(lines, "3/4"))
    count = len(lines)
    time.sleep(0.2)
    assert len(lines) == count  # nothing after the stage ends


def test_work_without_a_count_says_what_it_does_and_that_it_is_running():
    lines = []
    with Progress(lines.append, "trace", delay_s=0.2, every_s=0.05, terminal=False) as progress:
        progress.expect("torch.export of 24 layers")
        assert re.fullmatch(r"trace +\.\.\. \d+ s: running, torch.export of 24 layers", wait_for(lines, "running"))


def test_on_a_terminal_the_work_is_a_bar_on_stderr_and_nothing_is_logged(capsys):
    lines = []
    with Progress(lines.append, "quantize", delay_s=0, terminal=True) as progress:
        progress.plan(8, "weights quantized")
    assert re.search(r"quantize: +0%.*0/8", capsys.readouterr().err) and lines == []
