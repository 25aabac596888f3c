"""The text every machine has: the running interpreter's standard library, split by file into train,
validation and test.

Each `.py` file under the stdlib directory (test folders and installed packages excluded) falls in a
split by a hash of its relative path, so the split is the same on every machine and a file keeps its
split across Python versions; the files' contents do differ between versions, which `describe`
records (the interpreter version and a digest per split) beside every model trained or evaluated on it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

SPLITS = {"train": range(0, 90), "validation": range(90, 95), "test": range(95, 100)}  # percent buckets
EXCLUDED_FOLDERS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
    """The split a file belongs to: its path's sha256, as a number, modulo 100, against SPLITS' buckets."""
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 100
    return next(name for name, buckets in SPLITS.items() if bucket in buckets)


def corpus_files(root: Path) -> list[str]:
    """Relative POSIX paths of the corpus's `.py` files under `root`, sorted."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [s for s in subfolders if s not in EXCLUDED_FOLDERS]
        found += [Path(folder, f).relative_to(root).as_posix() for f in files if f.endswith(".py")]
    return sorted(found)


@dataclass(frozen=True)
class Document:
    path: str  # relative to the corpus root
    text: str


def read_split(split: str, root: Path | None = None) -> list[Document]:
    """The split's documents in path order. Undecodable bytes become U+FFFD, as the tokenizer sees them."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    root = root or stdlib_root()
    paths = [p for p in corpus_files(root) if split_of(p) == split]
    return [Document(p, (root / p).read_bytes().decode("utf-8", errors="replace")) for p in paths]


def split_digest(documents: list[Document]) -> str:
    """sha256 over every document's path and text, in order: equal digests mean equal text sets."""
    digest = hashlib.sha256()
    for document in documents:
        digest.update(document.path.encode() + b"\0" + hashlib.sha256(document.text.encode()).digest())
    return digest.hexdigest()


def describe(splits: dict[str, list[Document]]) -> dict:
    """What a model was trained or evaluated on, to record beside it."""
    return {
        "source": "python-stdlib",
        "python": platform.python_version(),
        "splits": {
            name: {
                "files": len(documents),
                "bytes": sum(len(d.text.encode()) for d in documents),
                "sha256": split_digest(documents),
            }
            for name, documents in splits.items()
        },
    }


def token_stream(
    tokenizer: Tokenizer, documents: list[Document], eos_id: int | None, longest_first: bool = False
) -> np.ndarray:
    """The documents' token ids (no special tokens added) joined into one stream, each followed by `eos_id`
    if there is one (int64). `longest_first` puts the documents with the most tokens first (ties in the given
    order), so that the first long segments cut from the stream hold one document each, not several."""
    ids = [e.ids for e in tokenizer.encode_batch([d.text for d in documents], add_special_tokens=False)]
    if longest_first:
        ids.sort(key=len, reverse=True)  # a stable sort: ties keep their order
    end = [] if eos_id is None else [eos_id]
    pieces = [np.asarray([*row, *end], dtype=np.int64) for row in ids]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def segments(stream: np.ndarray, length: int, first: int | None = None) -> list[np.ndarray]:
    """Consecutive, non-overlapping slices of `length` tokens (the last may be shorter; none shorter than 2,
    since a segment predicts its tokens after the first). `first`: a token each segment starts with, followed by
    `length` - 1 of the stream's (a tokenizer that puts its BOS before every text)."""
    if length < 2:
        raise ValueError(f"a segment needs at least 2 tokens, got {length}")
    if first is None:
        return [stream[i : i + length] for i in range(0, len(stream), length) if len(stream) - i >= 2]
    head = np.asarray([first], dtype=stream.dtype)
    return [np.concatenate([head, stream[i : i + length - 1]]) for i in range(0, len(stream), length - 1)]
