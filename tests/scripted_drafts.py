"""A drafter for speculative decoding tests: it knows the tokens plain decoding chose, and drafts each right or
wrong as a test says, so a test decides what is accepted where (runtime/speculative/prompt_lookup.py's is what
users run)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

DRAFTS = 5  # the most a run verifies: enough to cross pruning's cadence and a static cache's end in a few runs


@dataclass(frozen=True)
class Scripted:
    """Drafts for each row from `truth` (the tokens plain decoding chose after its prompt); the draft of a row's
    position p is the truth where `right(row, p)`, else another token."""

    prompts: tuple[tuple[int, ...], ...]
    truth: tuple[tuple[int, ...], ...]
    right: Callable[[int, int], bool]
    vocab: int
    tokens: int = DRAFTS  # the most a run verifies, as PromptLookup.tokens
    max_rows: float = math.inf  # as PromptLookup.max_rows

    @classmethod
    def of(cls, prompts: list[list[int]], truth: list[list[int]], right: Callable[[int, int], bool], vocab: int):
        return cls(tuple(map(tuple, prompts)), tuple(map(tuple, truth)), right, vocab)

    def check(self, target, prompts, config) -> None:
        pass

    def start(self, prompt: list[int], config) -> Script:
        return Script(self, self.prompts.index(tuple(prompt)))


class Script:
    distributions = ()  # each draft is one token for certain

    def __init__(self, scripted: Scripted, row: int):
        self.scripted, self.row, self.chosen = scripted, row, 0

    def push(self, token: int) -> None:
        self.chosen += 1

    def propose(self, most: int) -> list[int]:
        truth, right = self.scripted.truth[self.row], self.scripted.right
        positions = range(self.chosen, min(self.chosen + min(most, self.scripted.tokens), len(truth)))
        return [truth[p] if right(self.row, p) else (truth[p] + 1) % self.scripted.vocab for p in positions]
