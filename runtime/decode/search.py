"""A request's search: how each next token is chosen and when a row ends (onnxruntime-genai's Search is the model).

The Generator runs one Search over its batch and the engine one per request, so sampling, the repetition
penalties' histories, the stop tokens banned before min_new_tokens and the end test are written once. Rows advance
together: every running row takes one token a step, and a row that has ended is given padding. With speculation,
the search also keeps each row's drafter, proposes the tokens a run verifies, and judges them as it chooses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from runtime.decode.beam_search import BeamSearch
from runtime.decode.sampling import Sampler, SamplingConfig
from runtime.structured.constraints import Constraint, Grammar


class Drafter(Protocol):
    """One row's drafts (runtime/speculative/prompt_lookup.py's LookupDrafter, runtime/speculative/draft_model.py's
    ModelDrafter)."""

    distributions: Sequence[np.ndarray]  # the latest drafts' q where drawn from one (see `Sampler.verify`)

    def push(self, token: int) -> None: ...  # the row's next token, as chosen

    def propose(self, most: int) -> list[int]: ...  # up to `most` drafts of the tokens after those pushed


class Proposer(Protocol):
    """How a request's tokens are drafted (PromptLookup, DraftModel)."""

    tokens: int  # the most drafts a run verifies
    max_rows: float  # the most running rows beside which its drafts pay (the engine's default speculative_max_rows)

    def check(self, target, prompts: list[list[int]], config: GenerationConfig) -> None: ...  # raises if it cannot

    def start(self, prompt: list[int], config: GenerationConfig) -> Drafter: ...


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    min_new_tokens: int = 0
    stop_tokens: tuple[int, ...] = ()  # besides the model's eos ids
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prefill_chunk: int = 256  # prompts are prefilled in chunks of at most this many tokens (see prefill.chunk_size)
    speculative: Proposer | None = None  # how to draft the tokens a run verifies at once (None: one a run)
    constraint: Constraint | None = None  # what the text must be (runtime/structured/constraints.py; None: anything)
    num_return_sequences: int = 1  # answers a prompt, each its own row forked from the prompt's one prefill
    beams: BeamSearch | None = None  # beam search (runtime/decode/beam_search.py) in place of choosing token by token


class Search:
    def __init__(
        self, config: GenerationConfig, prompts: list[list[int]], eos: Iterable[int], pad: int,
        grammar: Grammar | None = None,
    ):  # fmt: skip
        """`grammar`: config.constraint compiled for the artifact's tokenizer (None where there is none)."""
        self.config, self.pad = config, pad
        self.sampler = Sampler(config.sampling)
        self.stop_ids = frozenset(eos) | frozenset(config.stop_tokens)
        self._stops = np.array(sorted(self.stop_ids), dtype=np.int64)
        penalised = config.sampling.repetition_penalty != 1.0
        self.context = [np.array(p, dtype=np.int64) for p in prompts] if penalised else None  # the penalty's
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.generated = self.tokens if config.sampling.counts_generated else None  # the penalties' history
        self.reasons: list[str | None] = [None] * len(prompts)  # "stop" or "length" once a row has ended
        self.ended = np.zeros(len(prompts), dtype=bool)
        self.finished = 0  # how many rows have ended: a count each step tests more cheaply than `ended`
        self.steps = 0  # tokens chosen so far, per running row
        self.taken: list[tuple[int, int, bool]] = []  # what the latest `record` took: (row, token, last)
        speculative = config.speculative
        self.drafters = None if speculative is None else [speculative.start(prompt, config) for prompt in prompts]
        self.matchings = None if grammar is None else [grammar.start(self.stop_ids) for _ in prompts]
        self.no_drafts = np.zeros((len(prompts), 0), dtype=np.int64)
        self.latest, self.drawn_from = self.no_drafts, ()  # the latest drafts, and the q of each where drawn
        self.proposed = self.accepted = 0  # drafts verified, and those the search then chose
        # The most drafts the next run verifies: where few are chosen, a long run costs more than the tokens it
        # yields, so the count adapts as transformers' assisted decoding's does (`adapted_budget`)
        self.budget = 0 if speculative is None else speculative.tokens

    @property
    def banned(self) -> np.ndarray | None:
        """The ids this step may not choose: the stop tokens while fewer than min_new_tokens are out."""
        return self._stops if self.steps < self.config.min_new_tokens and self._stops.size else None

    @property
    def done(self) -> bool:
        return self.finished == len(self.reasons)

    def choose(self, logits: np.ndarray, index: int = 0) -> np.ndarray:
        """Each row's next token `[rows]` from its logits `[rows, vocab]` at position `index` of a run (where the draft
        at `index` was drawn from a distribution, by `Sampler.verify`'s rule); padding for a row that has ended."""
        if self.matchings is not None:
            logits = self._constrained(logits)
        if index < len(self.drawn_from):
            drafts = self.latest[:, index]
            drawn_from = self.drawn_from[index][None]
            chosen = self.sampler.verify(logits, drafts, drawn_from, self.context, self.banned, self.generated)
        else:
            chosen = self.sampler.choose(logits, self.context, self.banned, self.generated)
        return np.where(self.ended, self.pad, chosen) if self.finished else chosen

    def _constrained(self, logits: np.ndarray) -> np.ndarray:
        """The logits with every token the row's constraint refuses next at -inf."""
        allowed = np.stack([matching.allowed() for matching in self.matchings])
        allowed[self.ended] = True  # a row that has ended is given padding whatever its logits
        return np.where(allowed, logits, np.float32(-np.inf))  # 6x faster than assigning through a boolean index

    def record(self, chosen: np.ndarray) -> list[tuple[int, int, bool]]:
        """Take each running row's `chosen` token; returns (row, token, last) for each, `last` when the row ends
        with it (a stop token once min_new_tokens are out, or max_new_tokens)."""
        self.steps += 1
        taken = []
        for row, token in enumerate(chosen.tolist()):
            if self.reasons[row] is not None:
                continue
            self.tokens[row].append(token)
            if self.drafters is not None:
                self.drafters[row].push(token)
            if self.matchings is not None:
                self.matchings[row].push(token)
            if self.context is not None:
                self.context[row] = np.append(self.context[row], token)
            if token in self.stop_ids and self.steps >= self.config.min_new_tokens:
                self.end(row, "stop")
            elif self.steps == self.config.max_new_tokens:
                self.end(row, "length")
            taken.append((row, token, self.reasons[row] is not None))
        self.taken = taken
        return taken

    def drafts(self, room: int | None = None) -> np.ndarray:
        """The tokens to verify after each row's latest `[rows, d]`: as many as every running row's drafter has, within
        the budget, the room max_new_tokens leaves to choose, and `room` (None: any); padding for a row that has
        ended."""
        most = min(self.budget, self.config.max_new_tokens - self.steps - 1)  # d drafts choose up to d + 1 tokens
        most = most if room is None else min(most, room)
        if self.drafters is None or most < 1:
            self.latest, self.drawn_from = self.no_drafts, ()
            return self.no_drafts
        proposed = [
            None if ended else drafter.propose(most) for drafter, ended in zip(self.drafters, self.ended, strict=True)
        ]
        if self.matchings is not None:  # a draft the constraint refuses is never chosen: not worth verifying
            proposed = [
                row if row is None else matching.valid_prefix(row)
                for row, matching in zip(proposed, self.matchings, strict=True)
            ]
        count = min(len(row) for row in proposed if row is not None)
        drafts = np.full((len(proposed), count), self.pad, dtype=np.int64)
        for index, row in enumerate(proposed):
            if row is not None:
                drafts[index] = row[:count]
        self.proposed += count
        # A draft model drafts for one row (DraftModel.check); a drawn draft carries its q
        self.latest, self.drawn_from = drafts, self.drafters[0].distributions[:count] if len(proposed) == 1 else ()
        return drafts

    def accepts(self, chosen: np.ndarray, drafts: np.ndarray, index: int) -> bool:
        """Whether the tokens just `chosen` are the drafts at `index` in every row that took one, and a row still runs:
        then the logits after those drafts hold. So speculation chooses the very tokens that one token a run would
        (a sampled choice too: a draft is kept with the probability the target gives it, the rule for a draft that
        is one token for certain)."""
        if index >= drafts.shape[1]:
            if index:  # the run's drafts were all chosen
                self.budget = adapted_budget(self.budget, self.config.speculative.tokens, whole=True)
            self.latest, self.drawn_from = self.no_drafts, ()  # judged: the next choice verifies none of them
            return False
        column = drafts[:, index].tolist()  # compared as Python ints: a row or a few, where numpy's calls cost most
        if any(column[row] != token for row, token, _ in self.taken):
            self.budget = adapted_budget(self.budget, self.config.speculative.tokens, whole=False)
            self.latest, self.drawn_from = self.no_drafts, ()
            return False
        self.accepted += 1
        return not self.done

    def end(self, row: int, reason: str) -> None:
        self.ended[row], self.reasons[row] = True, reason
        self.finished += 1


def adapted_budget(budget: int, most: int, whole: bool) -> int:
    """The drafts the next run verifies after one that verified `budget`: two more (up to `most`) when all were
    chosen (`whole`), else one fewer (at least 1)."""
    return min(budget + 2, most) if whole else max(budget - 1, 1)
