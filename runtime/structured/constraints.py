"""Structured outputs: a request's text held to a JSON schema, a regular expression, a list of choices or a grammar,
token by token, by masking every token that could not continue it.

llguidance matches (onnxruntime-genai and vLLM use it too): a Rust parser that computes a step's mask over the
vocabulary from a token trie in well under a millisecond, compiles a schema or grammar lazily instead of building an
automaton over the whole vocabulary first, takes JSON Schema, regexes, Lark and GBNF, and needs no torch, which
runtime/ must not import (xgrammar's Python package requires torch).

A row's mask for its next token is computed on a worker thread from the moment its latest token is known, so it
overlaps the onnxruntime run that takes that token (llguidance releases the GIL while it computes). A row may end
only where its constraint is complete: the artifact's and the request's stop tokens are allowed exactly when
llguidance allows its end of sequence, so a row that runs out of tokens first ends with "length". What llguidance
matches over is the tokenizer's vocabulary, or for a JSON-escaping tokenizer one of its own
(runtime/structured/grammar_vocabulary.py), whose state each row keeps.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, lru_cache

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from runtime.errors import RequestError
from runtime.structured.grammar_vocabulary import EscapedVocabulary, PlainVocabulary
from runtime.text.tokenizer import TextTokenizer

# Compact JSON (no whitespace between tokens, "," and ":" as separators, as json.dumps(..., separators=(",", ":"))
# writes): whitespace a model may repeat until max_tokens runs out is never offered
JSON_OPTIONS = {"whitespace_flexible": False}
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
COMPILED_CACHE = 64  # constraints compiled per tokenizer and kept for the next request that names one again


class ConstraintError(RequestError):
    """A constraint llguidance cannot compile, or one a request cannot be held to; the message says why."""


@dataclass(frozen=True)
class Constraint:
    """What a request's text must be: `kind` and its `text` (a schema as JSON, a pattern, choices as a JSON list,
    a Lark or GBNF grammar). The class methods build one from Python values."""

    kind: str  # one of KINDS
    text: str = ""

    @classmethod
    def json_schema(cls, schema: dict | str) -> Constraint:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        if not options or not all(isinstance(option, str) for option in options):
            raise ConstraintError("a choice constraint takes a non-empty list of strings")
        return cls("choice", json.dumps(options))

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        return cls("grammar", text)

    def grammar_text(self) -> str:
        """llguidance's grammar for the constraint (not yet checked: see `Grammars.compile`)."""
        try:
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.text, overrides=JSON_OPTIONS)
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
            if self.kind in ("regex", "choice", "grammar"):
                return llguidance.grammar_from(self.kind, self.text)
        except ValueError as error:
            raise ConstraintError(f"{self.kind}: {error}") from None
        raise ConstraintError(f"unknown constraint kind {self.kind!r}; the kinds are {', '.join(KINDS)}")


@cache
def _workers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="kvg-mask")


class Grammars:
    """The constraints compiled for one artifact's tokenizer (its vocabulary and end tokens), each once."""

    def __init__(self, tokenizer: TextTokenizer, vocab: int, eos: tuple[int, ...]):
        if not eos:
            raise ConstraintError("structured outputs end a text with an end token; this artifact names no eos")
        escaped = tokenizer.escaped
        self.vocabulary = EscapedVocabulary(tokenizer, vocab) if escaped else PlainVocabulary(tokenizer, vocab, eos)
        self.compile = lru_cache(COMPILED_CACHE)(self._compile)

    def _compile(self, constraint: Constraint) -> Grammar:
        """The constraint ready to hold rows to; ConstraintError naming what llguidance refuses."""
        matcher = llguidance.LLMatcher(self.vocabulary.llguidance, constraint.grammar_text(), log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"{constraint.kind}: {matcher.get_error().strip()}")
        return Grammar(self.vocabulary, matcher)


@dataclass(frozen=True)
class Grammar:
    vocabulary: PlainVocabulary | EscapedVocabulary
    start_state: llguidance.LLMatcher  # never advanced: each row copies it

    def start(self, stops: frozenset[int]) -> Matching:
        """A row held to the grammar from its first token; `stops`: the ids that end the row."""
        return Matching(self.start_state.deep_copy(), self.vocabulary, stops)


class Matching:
    """One row's place in its grammar, and the mask of the tokens that may come next."""

    def __init__(self, matcher: llguidance.LLMatcher, vocabulary: PlainVocabulary | EscapedVocabulary,
                 stops: frozenset[int]):  # fmt: skip
        self.matcher, self.vocabulary = matcher, vocabulary
        self.state = 0  # the vocabulary's: for an escaping tokenizer, whether a backslash is pending
        self.stops, self.stop_ids = stops, np.array(sorted(stops), dtype=np.int64)
        self.bits = allocate_token_bitmask(1, vocabulary.llguidance.vocab_size)
        self._mask: Future = _workers().submit(self._fill)

    def _fill(self) -> np.ndarray:
        fill_next_token_bitmask(self.matcher, self.bits)
        every = np.unpackbits(self.bits.view(np.uint8), bitorder="little").view(bool)  # a new array each time
        allowed = self.vocabulary.allowed(every, self.state, self.matcher)
        allowed[self.stop_ids] = self.vocabulary.may_end(every, self.state)  # an end only where llguidance may end
        return allowed

    def allowed(self) -> np.ndarray:
        """The tokens that may come next `[vocab]` (bool)."""
        return self._mask.result()

    def push(self, token: int) -> None:
        """The row's next token; the mask after it starts computing at once."""
        if token in self.stops:
            return
        ids, self.state = self.vocabulary.ids(token, self.state)
        if ids and not self.matcher.consume_tokens(ids):
            raise ConstraintError(f"token {token} breaks the constraint: {self.matcher.get_error().strip()}")
        self._mask = _workers().submit(self._fill)

    def valid_prefix(self, tokens: list[int]) -> list[int]:
        """The longest start of `tokens` the grammar accepts from here (drafts beyond it cannot be chosen)."""
        self._mask.result()  # the matcher is the worker's until its mask is out
        ends, ids, state = [], [], self.state
        for token in tokens:
            read = self.vocabulary.ids(token, state)
            if read is None:
                break
            more, state = read
            ids += more
            ends.append(len(ids))
        valid = self.matcher.validate_tokens(ids) if ids else 0
        return tokens[: sum(end <= valid for end in ends)]
