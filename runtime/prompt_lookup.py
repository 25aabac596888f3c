"""Prompt lookup: guess the tokens that come next by finding the text's latest n tokens earlier in it.

What users decode (code, structured text, documents they quote from) repeats itself, so the tokens that followed
an earlier occurrence of the last few are often the ones that follow now. The guesses cost no model run; the
decode loop verifies them all in one (see `Generator._decode`). transformers' `prompt_lookup_num_tokens` and
`max_matching_ngram_size` are `tokens` and `ngram` here, and vLLM's `prompt_lookup_min` is `min_ngram`; where
transformers takes the earliest occurrence, this takes the latest, the nearest repetition being the likeliest to go
on the same way. A match of one token guesses poorly: on the trained presets continuing held-out code, requiring
two (and looking up to three) decoded 1.39x and 1.15x plain speed (geometric means over four files), against 1.28x
and 1.05x with matches of one or two.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptLookup:
    """How to guess: up to `tokens` tokens a run, after the longest match of `min_ngram` to `ngram` final tokens."""

    tokens: int = 8
    ngram: int = 3
    min_ngram: int = 2

    def __post_init__(self) -> None:
        """Refuse settings that guess nothing, as they are given."""
        if self.tokens < 1 or not 1 <= self.min_ngram <= self.ngram:
            raise ValueError(
                f"prompt lookup needs tokens (--draft-tokens) >= 1 and 1 <= min_ngram (--lookup-min-ngram) <= ngram "
                f"(--lookup-ngram), got {self.tokens}, {self.min_ngram} and {self.ngram}"
            )

    def check(self, target, prompts: list[list[int]], config) -> None:
        """Any target and request can be guessed for."""

    def start(self, prompt: list[int], config=None) -> Lookup:
        """The guesser of one row, which has read `prompt` (the request's `config` is a draft model's concern)."""
        return Lookup(self, prompt)


class Lookup:
    """One row's text and, for each n-gram of `min_ngram` to `ngram` tokens, where its latest occurrence before the
    text's end was followed from: guessing and reading a token cost O(ngram), however long the text. The n-grams are
    indexed when a guess is first asked for, so a row that never guesses (the engine's rows while several run)
    costs an append a token."""

    distributions = ()  # a guess is one token for certain: no q (see `Sampler.verify`)

    def __init__(self, settings: PromptLookup, prompt: list[int]):
        self.settings = settings
        self.text = list(prompt)
        self.indexed = 0  # the text's first tokens whose n-grams `followed` holds
        self.followed: dict[tuple[int, ...], int] = {}  # n-gram -> the index after its latest earlier occurrence

    def push(self, token: int) -> None:
        self.text.append(token)

    def _index(self) -> None:
        """Bring `followed` up to the text's end: the n-grams that ended the text before each token are earlier
        occurrences from then on."""
        low, high = self.settings.min_ngram, self.settings.ngram
        for end in range(max(self.indexed, 1), len(self.text)):
            for n in range(low, min(high, end) + 1):
                self.followed[tuple(self.text[end - n : end])] = end
        self.indexed = len(self.text)

    def propose(self, most: int) -> list[int]:
        """Up to `most` (and `tokens`) guesses: what followed the latest earlier occurrence of the longest final
        n-gram (of at least `min_ngram`) that occurred before; none when none did."""
        self._index()
        for n in range(min(self.settings.ngram, len(self.text)), self.settings.min_ngram - 1, -1):
            start = self.followed.get(tuple(self.text[-n:]))
            if start is not None:
                return self.text[start : start + min(most, self.settings.tokens)]
        return []
