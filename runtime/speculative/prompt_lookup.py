"""Prompt lookup: draft the tokens that come next from what followed the text's last few tokens earlier in it.

What users decode (code, structured text, documents they quote from) repeats itself, so what followed an earlier
occurrence of the last few tokens often follows now. The drafts cost no model run; the decode loop verifies them
all in one (see `Generator._decode`). transformers' `prompt_lookup_num_tokens` and `max_matching_ngram_size` are
`tokens` and `ngram` here, and vLLM's `prompt_lookup_min` is `min_ngram`. Where transformers follows the earliest
occurrence of the final n-gram, a draft here follows all the occurrences whose tokens before them match the text's
longest, each next token the one most of them went on with (a tie to the latest), as SuffixDecoding chooses by
frequency, and it is as long as the match is: `tokens` after a match of `ngram` tokens, proportionally fewer after a
shorter one (each draft verified costs a quarter to a third of a run here, and one that follows two tokens is often
wrong at once). Chosen by replaying each trained preset's greedy continuation of eight third-party modules (jinja2,
requests, urllib3, fastapi, pydantic, tqdm, yaml, uvicorn) through candidate rules at the runs' measured costs,
then measured on `make bench`'s four other modules, 15 interleaved rounds in one process: plain speed times 1.79
(fox-py) and 1.67 (fox-pro-py), geometric means, where following the latest occurrence of a 2- to 3-gram made 1.66
and 1.59; a file's drafts 54-98% right (were 49-98%). Replayed, a match of one token drafted poorly (min_ngram 1
3-6% slower than 2, which 3 only matched). Replayed again (2026-12-07, prompts of 1024 and 256 tokens), drafts as
long as their match made the tuning modules 1.3-2.7% faster than drafts of `tokens` after any match (geometric
means by preset and prompt length), and the four bench modules 1.9-5.0%; cut by an oracle to the tokens that would
be right, the same drafts would have been 4-5% faster again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.errors import RequestError

LATEST = 16  # occurrences of the final min_ngram tokens a draft looks at (replayed: 8 to 64 drafted alike)


@dataclass(frozen=True)
class PromptLookup:
    """How to draft: up to `tokens` tokens a run, as most of the earlier occurrences matching the text's final
    `min_ngram` to `ngram` tokens longest went on."""

    tokens: int = 8
    ngram: int = 8
    min_ngram: int = 2
    max_rows = math.inf  # drafts cost no run, so every running row may draft (the engine's default)

    def __post_init__(self) -> None:
        """Refuse settings that draft nothing, as they are given."""
        if self.tokens < 1 or not 1 <= self.min_ngram <= self.ngram:
            raise RequestError(
                f"prompt lookup needs tokens (--draft-tokens) >= 1 and 1 <= min_ngram (--lookup-min-ngram) <= ngram "
                f"(--lookup-ngram), got {self.tokens}, {self.min_ngram} and {self.ngram}"
            )

    def check(self, target, prompts: list[list[int]], config) -> None:
        """Any target and request can be drafted for."""

    def start(self, prompt: list[int], config=None) -> LookupDrafter:
        """The drafter of one row, which has read `prompt` (the request's `config` is a draft model's concern)."""
        return LookupDrafter(self, prompt)


class LookupDrafter:
    """One row's text and where each run of `min_ngram` tokens occurred in it. A draft looks at the latest
    `LATEST` occurrences of the text's final `min_ngram` tokens, keeps those whose tokens before them also match the
    text's, up to `ngram` in all, longest, and goes on as most of them went on, token by token: its cost is bounded
    however long or repetitive the text. Occurrences are indexed when a draft is first asked for, so a row that never
    drafts (the engine's rows while several run) costs an append a token."""

    distributions = ()  # a draft is one token for certain: no q (see `Sampler.verify`)

    def __init__(self, settings: PromptLookup, prompt: list[int]):
        self.settings = settings
        self.text = list(prompt)
        self.indexed = 0  # the text's first tokens whose runs `ends` holds
        self.ends: dict[tuple[int, ...], list[int]] = {}  # min_ngram tokens -> the index after each occurrence

    def push(self, token: int) -> None:
        self.text.append(token)

    def _index(self) -> None:
        """Bring `ends` up to the text's end: the run that ended the text before each token is an earlier occurrence
        from then on."""
        low = self.settings.min_ngram
        for end in range(max(self.indexed, low), len(self.text)):
            self.ends.setdefault(tuple(self.text[end - low : end]), []).append(end)
        self.indexed = len(self.text)

    def _longest_matches(self) -> tuple[int, list[int]]:
        """How many final tokens match longest (up to `ngram`), and the index after each of the latest occurrences of
        the final min_ngram tokens that match that many, the latest first."""
        text, low, high = self.text, self.settings.min_ngram, self.settings.ngram
        last, best, found = len(text) - 1, low, []
        for end in reversed(self.ends.get(tuple(text[-low:]), [])[-LATEST:]):
            n = low
            while n < min(high, end) and text[end - 1 - n] == text[last - n]:
                n += 1
            if n > best:
                best, found = n, [end]
            elif n == best:
                found.append(end)
        return best, found

    def propose(self, most: int) -> list[int]:
        """Up to `most` drafts, and as many of `tokens` as the match is of `ngram` (rounded up): the token most of
        the longest matches went on with (a tie goes to the latest), then the next among those that went on with it,
        and so on; none when nothing matched."""
        self._index()
        settings, text, drafts = self.settings, self.text, []
        matched, followed = self._longest_matches()
        length = min(most, -(-settings.tokens * matched // settings.ngram))  # tokens * matched / ngram, rounded up
        while followed and len(drafts) < length:
            votes: dict[int, int] = {}
            for end in followed:
                votes[text[end]] = votes.get(text[end], 0) + 1
            token = max(votes, key=votes.__getitem__)  # max keeps the first of equals: the latest occurrence's
            drafts.append(token)
            followed = [end + 1 for end in followed if text[end] == token and end + 1 < len(text)]
        return drafts
