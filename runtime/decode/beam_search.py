"""Beam search, as transformers' `generate(num_beams=...)` runs it (its vectorised search of 4.5x), in numpy.

Each prompt keeps `num_beams` running rows. A step scores every row's every next token by the row's summed
log-probability, keeps the best `max(2, 1 + eos ids) x num_beams` continuations, takes the best that did not end as the
next running rows (a row whose beam another takes is replaced by a copy of that beam's row: `rows`), and offers
those of the best `num_beams` that ended to the finished hypotheses, scored by their sum over length ** length_penalty.
The search ends where no running beam can beat the finished ones (`early_stopping`: True, as soon as each prompt has
`num_beams` finished; False, by transformers' heuristic; "never", the canonical bound), or at max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.decode.sampling import softmax
from runtime.errors import RequestError

EXCLUDED = np.float32(-1.0e9)  # transformers' score for a continuation that may not be taken


@dataclass(frozen=True)
class BeamSearch:
    num_beams: int
    length_penalty: float = 1.0  # a finished hypothesis scores its summed log-probability / length ** this
    early_stopping: bool | str = False  # True, False or "never", as transformers takes it

    def check(self, answers: int) -> None:
        if self.num_beams < 1:
            raise RequestError(f"num_beams must be >= 1, got {self.num_beams}")
        if self.early_stopping not in (True, False, "never"):
            raise RequestError(f'early_stopping must be true, false or "never", got {self.early_stopping!r}')
        if answers > self.num_beams:
            raise RequestError(f"{answers} answers a prompt need at least as many beams, got {self.num_beams}")


def _top(scores: np.ndarray, count: int) -> np.ndarray:
    """The indices of each row's `count` best scores, best first (the lower index first among equals)."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :count]


def _take(values: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """`values[b, indices[b, i]]`, over any trailing axes."""
    return np.take_along_axis(values, indices.reshape(*indices.shape, *[1] * (values.ndim - 2)), axis=1)


class Beams:
    def __init__(self, search: BeamSearch, prompts: int, eos: frozenset[int], new_tokens: int, min_new_tokens: int):
        self.search, self.eos, self.new_tokens, self.min_new_tokens = search, eos, new_tokens, min_new_tokens
        beams = search.num_beams
        self.kept = max(2, 1 + len(eos)) * beams  # the continuations a step keeps
        self.running = np.zeros((prompts, beams, new_tokens), dtype=np.int64)
        self.running_scores = np.zeros((prompts, beams), dtype=np.float32)
        self.running_scores[:, 1:] = EXCLUDED  # the beams start as one: the first step takes the first's best
        self.finished = np.zeros((prompts, beams, new_tokens), dtype=np.int64)
        self.finished_lengths = np.zeros((prompts, beams), dtype=np.int64)
        self.finished_scores = np.full((prompts, beams), EXCLUDED, dtype=np.float32)
        self.is_finished = np.zeros((prompts, beams), dtype=bool)
        self.improvable = np.ones((prompts, 1), dtype=bool)  # whether a running beam may still beat a finished one
        self.steps = 0
        self.over = False
        self.tokens: list[list[int]] = []  # the answers, once `answer` has chosen them (see there)
        self.reasons: list[str] = []
        self.proposed = self.accepted = 0  # no drafts: a GenerationResult's fields, as a Search has them

    def step(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Take the step's logits `[prompts x beams, vocab]` (each prompt's beams in turn); returns which row each row
        continues `[prompts x beams]` and the token it takes `[prompts x beams]`; `over` once the search has ended."""
        prompts, beams = self.running_scores.shape
        log_probs = softmax(logits, np.float32, log=True)
        if self.steps < self.min_new_tokens:
            log_probs[:, sorted(self.eos)] = -np.inf
        vocab = log_probs.shape[-1]
        scores = (log_probs.reshape(prompts, beams, vocab) + self.running_scores[:, :, None]).reshape(prompts, -1)
        best = _top(scores, self.kept)
        best_scores, source, tokens = _take(scores, best), best // vocab, best % vocab
        sequences = _take(self.running, source)
        sequences[:, :, self.steps] = tokens
        ended = np.isin(tokens, list(self.eos)) | (self.steps + 1 >= self.new_tokens)

        running_scores = best_scores + ended * EXCLUDED  # an ended continuation runs no further
        order = _top(running_scores, beams)
        self.running, self.running_scores = _take(sequences, order), _take(running_scores, order)
        rows = (np.arange(prompts)[:, None] * beams + _take(source, order)).reshape(-1)

        self._offer(sequences, best_scores, ended)
        self.steps += 1
        self._bound()
        self.over = not (self.improvable.any() and not (self.is_finished.all() and self.search.early_stopping is True)
                         and not ended.all())  # fmt: skip
        return rows, self.running[:, :, self.steps - 1].reshape(-1)

    def _offer(self, sequences: np.ndarray, scores: np.ndarray, ended: np.ndarray) -> None:
        """Of the step's continuations, those among the best `num_beams` that ended join the finished hypotheses
        where they score better, with their length's penalty; none while no running beam could beat them."""
        beams, length = self.finished_scores.shape[1], self.steps + 1
        penalised = scores / np.float32(length**self.search.length_penalty)
        full = self.is_finished.all(axis=1, keepdims=True) & (self.search.early_stopping is True)
        offered = ended & (np.arange(self.kept) < beams)
        penalised = penalised + (full | ~self.improvable | ~offered) * EXCLUDED
        merged_scores = np.concatenate([self.finished_scores, penalised], axis=1)
        chosen = _top(merged_scores, beams)
        self.finished = _take(np.concatenate([self.finished, sequences], axis=1), chosen)
        lengths = np.concatenate([self.finished_lengths, np.full_like(scores, length, dtype=np.int64)], axis=1)
        self.finished_lengths = _take(lengths, chosen)
        self.finished_scores = _take(merged_scores, chosen)
        self.is_finished = _take(np.concatenate([self.is_finished, offered], axis=1), chosen)

    def _bound(self) -> None:
        """Whether each prompt's best running beam may still beat its worst finished one, by `early_stopping`'s rule."""
        penalty = self.search.length_penalty
        never = self.search.early_stopping == "never" and penalty > 0
        length = self.new_tokens if never else self.steps
        best_running = self.running_scores[:, :1] / np.float32(length**penalty)
        worst = np.where(self.is_finished, self.finished_scores.min(axis=1, keepdims=True), EXCLUDED)
        self.improvable &= (best_running > worst).any(axis=-1, keepdims=True)

    def answer(self, answers: int) -> None:
        """Once `over`: each prompt's `answers` best finished hypotheses, best first, prompt after prompt, in `tokens`,
        and in `reasons` "stop" for each that ends with an eos id, else "length"."""
        self.tokens = [
            self.finished[prompt, rank, : self.finished_lengths[prompt, rank]].tolist()
            for prompt in range(len(self.finished))
            for rank in range(answers)
        ]
        self.reasons = ["stop" if tokens and tokens[-1] in self.eos else "length" for tokens in self.tokens]
