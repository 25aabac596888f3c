"""Files and folders that appear whole or not at all: built in a hidden staging folder beside the target, then renamed
into place, so a failed or interrupted writer never leaves a half-written artifact or checkpoint, and an
old folder is replaced only by a complete new one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def staging_folder(out: Path) -> Path:
    """A new empty hidden folder beside `out` (OSError when `out`'s parent cannot be written)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))


def publish(staging: Path, out: Path) -> None:
    """Rename the finished `staging` folder to `out`; an old `out` is moved aside first and removed after."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    try:
        staging.rename(out)
    except OSError:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def write_whole(path: Path, data: bytes) -> None:
    """Write `data` beside `path` and rename it into place, so a reader never sees half a file. A plain open
    (not mkstemp) keeps the usual umask permissions on the result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "xb") as f:
            f.write(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


@contextmanager
def written_whole(out: Path) -> Iterator[Path]:
    """`with written_whole(out) as staging:` fill `staging`; it becomes `out` only if the block completes."""
    staging = staging_folder(out)
    try:
        yield staging
        publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
