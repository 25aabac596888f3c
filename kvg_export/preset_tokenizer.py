"""Deterministic byte-level BPE tokenizers for the model presets, built from local text.

The model hub is unreachable from where this project builds and tests, so presets ship tokenizers made here:
BPE trained on the Python standard library's own source, which every machine with Python already has. The
random-weight presets use the top-level stdlib files; trained presets pass their training split's texts.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvg_export.folders import write_whole

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]  # ids 0, 1, 2
CORPUS_DIR = Path(os.path.dirname(os.__file__))
# Stop reading the stdlib once this many bytes are in: bounds build time whatever the Python version.
CORPUS_LIMIT_BYTES = 5_000_000


def _corpus() -> Iterator[str]:
    """Top-level stdlib `.py` files in name order, so every build sees the same text in the same order."""
    total = 0
    for path in sorted(CORPUS_DIR.glob("*.py"), key=lambda p: p.name):
        if total >= CORPUS_LIMIT_BYTES:
            return
        text = path.read_bytes().decode("utf-8", errors="replace")
        total += len(text.encode("utf-8"))
        yield text


def build_tokenizer(vocab_size: int, texts: Iterable[str] | None = None) -> Tokenizer:
    """Byte-level BPE with exactly `vocab_size` ids: 3 specials, the 256 byte symbols, then merges trained on
    `texts` (default: the top-level stdlib files, up to CORPUS_LIMIT_BYTES)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(SPECIAL_TOKENS) + len(alphabet):
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + len(alphabet)}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Offsets only: no bos/eos is added, so encodings are the plain text's tokens.
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(_corpus() if texts is None else texts, trainer=trainer)
    # A corpus too small for the merges asked for would silently give a smaller vocabulary.
    if sorted(tokenizer.get_vocab().values()) != list(range(vocab_size)):
        raise RuntimeError(f"training gave {tokenizer.get_vocab_size()} ids, not {vocab_size}")
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="where to write tokenizer.json")
    args = parser.parse_args(argv)
    write_whole(args.out, build_tokenizer(args.vocab_size).to_str().encode("utf-8"))


if __name__ == "__main__":
    main()
