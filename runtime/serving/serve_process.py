"""kvg-serve in a process of its own on a free loopback port, for the tools that drive it as a client would
(kvg-lm-eval, the serving benchmarks)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT_S = 120
ROOT = Path(__file__).resolve().parent.parent  # where `python -m runtime.cli.serve` finds the package


@contextmanager
def kvg_serve(artifact: str | Path, flags: list[str]) -> Iterator[tuple[subprocess.Popen, str]]:
    """Serve `artifact` with kvg-serve's `flags` until the block ends; yields the process and its base URL once
    /health answers, and raises RuntimeError if it exits or stays silent first."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "runtime.cli.serve", str(artifact), "--port", str(port), *flags]
    process = subprocess.Popen(command, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            if process.poll() is not None:
                raise RuntimeError(f"kvg-serve exited with status {process.returncode} before it served")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvg-serve did not answer /health within {START_TIMEOUT_S} s")
            time.sleep(0.1)
        yield process, url
    finally:
        process.terminate()
        process.wait(30)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False
