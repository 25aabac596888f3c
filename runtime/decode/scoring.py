"""Teacher-forced scoring, torch-free: how well a model's logits predict a text's next tokens.

A text is cut into segments; each segment is fed whole from an empty cache, and the logits at each of its
positions but the last are scored against the token that follows: its negative log-likelihood (nats)
and the token ranked first. Perplexity is exp(mean negative log-likelihood). Eager PyTorch and an
exported artifact go through the same segments and the same arithmetic, so their figures compare
position by position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from runtime.decode.sampling import softmax

LOGITS_BUDGET_BYTES = 64 << 20  # the most float32 logits one batch of segments may produce: 512 tokens of 32k
POSITIONS_PER_BLOCK = 64  # next_token_scores' float64 work: 16 MB an array (softmax makes a few) at a 32k vocabulary


def next_token_scores(logits: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """-log softmax(logits[..., t, :])[ids[..., t + 1]] (float64) and argmax(logits[..., t, :]) for every
    position t that `ids` has a next token for. logits `[..., seq, vocab]`; ids `[..., seq]` (the last position
    predicts nothing) or `[..., seq + 1]` (a block of a segment's positions, its ids running one past it);
    results `[..., len(ids) - 1]`. Worked POSITIONS_PER_BLOCK positions at a time: a segment's logits in
    float64 would take 8 bytes per vocabulary entry and position, twice over (131 MB each for 512 positions of
    a 32k vocabulary)."""
    logits, ids = np.asarray(logits), np.asarray(ids)
    positions = ids.shape[-1] - 1
    nll = np.empty((*logits.shape[:-2], positions), dtype=np.float64)
    top1 = np.empty(nll.shape, dtype=np.int64)
    for begin in range(0, positions, POSITIONS_PER_BLOCK):
        end = min(begin + POSITIONS_PER_BLOCK, positions)
        scores = logits[..., begin:end, :]
        logprobs = softmax(scores, np.float64, log=True)
        nll[..., begin:end] = -np.take_along_axis(logprobs, ids[..., begin + 1 : end + 1, None], axis=-1)[..., 0]
        top1[..., begin:end] = scores.argmax(axis=-1)
    return nll, top1


@dataclass
class Scores:
    nll: np.ndarray  # per predicted token, float64 nats, in segment order
    top1: np.ndarray  # the token each position ranks first
    targets: np.ndarray  # the token that actually follows
    positions: np.ndarray  # each predicted token's position in its segment: the context it had (1 to seq - 1)

    @property
    def mean_nll(self) -> float:
        return float(self.nll.mean())

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.mean_nll))

    @property
    def accuracy(self) -> float:
        """How often the top-ranked token is the one that follows."""
        return float((self.top1 == self.targets).mean())


def score_segments(
    logits_of: Callable[[np.ndarray], np.ndarray | Iterable[np.ndarray]],
    segments: list[np.ndarray],
    max_batch: int,
    vocab_size: int,
    on_scored: Callable[[int], None] = lambda segments: None,
) -> Scores:
    """Score `segments` (1-D token id arrays of at least 2 tokens) through `logits_of`, which maps ids
    `[batch, seq]` to logits `[batch, seq, vocab]`, whole or as consecutive blocks of positions (an iterable of
    `[batch, block, vocab]`, so that a segment's logits need not be held at once); consecutive segments of one
    length share a batch, after which `on_scored` is told how many segments it held."""
    if not segments:
        raise ValueError("no segments to score")
    batch_limit = max(1, min(max_batch, LOGITS_BUDGET_BYTES // (4 * vocab_size * max(map(len, segments)))))
    nll, top1, targets, positions = [], [], [], []
    begin = 0
    while begin < len(segments):
        end = begin + 1
        while end < len(segments) and end - begin < batch_limit and len(segments[end]) == len(segments[begin]):
            end += 1
        ids = np.stack(segments[begin:end]).astype(np.int64)
        logits = logits_of(ids)
        blocks, first = [logits] if isinstance(logits, np.ndarray) else logits, 0
        batch_nll, batch_top1 = [], []
        for block in blocks:
            block_nll, block_top1 = next_token_scores(block, ids[:, first : first + block.shape[1] + 1])
            batch_nll.append(block_nll)
            batch_top1.append(block_top1)
            first += block.shape[1]
        nll.append(np.concatenate(batch_nll, axis=1).ravel())
        top1.append(np.concatenate(batch_top1, axis=1).ravel())
        targets.append(ids[:, 1:].ravel())
        positions.append(np.tile(np.arange(1, ids.shape[1]), len(ids)))
        on_scored(end - begin)
        begin = end
    return Scores(*(np.concatenate(parts) for parts in (nll, top1, targets, positions)))
