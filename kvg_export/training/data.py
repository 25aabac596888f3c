"""What a training run reads: the corpus's splits as token streams under a BPE tokenizer trained on the
training split, random training segments by step, the fixed evaluation segments, and the unigram baseline."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from kvg_export.corpus import SPLITS, describe, read_split, segments, token_stream
from kvg_export.preset_tokenizer import SPECIAL_TOKENS, build_tokenizer

EOS_ID = SPECIAL_TOKENS.index("<|eos|>")  # ends every document in a stream


@dataclass
class TrainingData:
    tokenizer: Tokenizer
    streams: dict[str, np.ndarray]  # split name -> token ids, documents joined, each followed by eos
    corpus: dict  # corpus.describe() of the splits

    @classmethod
    def prepare(cls, vocab_size: int, root: Path | None = None) -> TrainingData:
        """Read the splits and train the tokenizer on the training split (deterministic, a few seconds)."""
        documents = {name: read_split(name, root) for name in SPLITS}
        empty = [name for name, docs in documents.items() if not docs]
        if empty:
            raise ValueError(f"the corpus at {root or 'the stdlib'} has no files in split(s) {', '.join(empty)}")
        tokenizer = build_tokenizer(vocab_size, (d.text for d in documents["train"]))
        streams = {name: token_stream(tokenizer, docs, EOS_ID) for name, docs in documents.items()}
        return cls(tokenizer, streams, describe(documents))

    @property
    def tokenizer_sha256(self) -> str:
        return hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """Step `step`'s segments `[batch_size, seq_len]` at random offsets of the training stream; the same
        for the same (seed, step), so a resumed run sees what an uninterrupted one would."""
        stream = self.streams["train"]
        if len(stream) <= seq_len:
            raise ValueError(f"the training split has {len(stream)} tokens, fewer than one segment of {seq_len}")
        offsets = np.random.default_rng([seed, step]).integers(0, len(stream) - seq_len + 1, size=batch_size)
        return torch.from_numpy(np.stack([stream[o : o + seq_len] for o in offsets]))

    def evaluation_segments(self, split: str, seq_len: int, limit: int | None = None) -> list[np.ndarray]:
        return segments(self.streams[split], seq_len)[:limit]

    def unigram_loss(self, split: str, seq_len: int) -> float:
        """Mean -log p(token) in nats of the tokens a model predicts in the split's evaluation segments (all but
        each segment's first), with p the training split's add-one smoothed token frequencies."""
        counts = np.bincount(self.streams["train"], minlength=self.tokenizer.get_vocab_size()) + 1.0
        log_p = np.log(counts / counts.sum())
        targets = np.concatenate([s[1:] for s in self.evaluation_segments(split, seq_len)])
        return float(-log_p[targets].mean())
