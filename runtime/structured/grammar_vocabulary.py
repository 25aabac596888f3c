"""The vocabulary llguidance matches a constraint over: the artifact's tokens as the bytes of the text they write.

For most tokenizers that is the tokenizer itself. The released FoX checkpoints' tokenizer writes text JSON-escaped
(a newline as the two characters `\\` `n`, a quote as `\\"`), and GPT-2's split puts an escape's backslash and its
letter in different tokens (`\\` then `nThe`), so what a token writes depends on whether the token before it left a
backslash pending. For it llguidance gets a vocabulary of its own: every token read in each of the two states (ids
`state * V + token`), and, for a token that leaves a backslash pending, one id for each escape the next token may
complete, which says whether the token may be chosen at all (a pending backslash that no escape could complete
would leave the row nothing to choose). A `\\u` escape, which GPT-2's split always cuts across tokens, is not
followed: under a constraint such a model writes ASCII (JSON's own `\\u` escapes remain, as six ASCII characters).
"""

from __future__ import annotations

import numpy as np
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from runtime.text.tokenizer import TextTokenizer

ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
ESCAPE_TEXTS = frozenset(ESCAPES.values())  # what a backslash and its letter write
CLEAR, PENDING = 0, 1  # no escape begun, a backslash waiting for its letter
END = b"<|end|>"  # the one end-of-text id llguidance is told of


class PlainVocabulary:
    """A tokenizer whose tokens are the text's own bytes: llguidance reads its tokenizer.json."""

    def __init__(self, tokenizer: TextTokenizer, vocab: int, eos: tuple[int, ...]):
        self.size, self.eos = vocab, np.array(eos, dtype=np.int64)
        self.llguidance = LLTokenizer(tokenizer.bpe.to_str(), n_vocab=vocab, eos_token=list(eos))

    def allowed(self, every: np.ndarray, _state: int, _matcher: LLMatcher) -> np.ndarray:
        return every[: self.size]  # `every` is the mask's own: a view may be written

    def may_end(self, every: np.ndarray, _state: int) -> bool:
        return bool(every[self.eos].any())

    def ids(self, token: int, state: int) -> tuple[list[int], int] | None:
        return [token], state


def read(text: str, state: int) -> tuple[str, int] | None:
    """What a token's escaped `text` writes when read in `state`, and the state after it; None where escaped text
    cannot hold it there (a raw quote, a character outside printable ASCII, an unknown escape, or `\\u`)."""
    if not text:
        return None
    text = "\\" + text if state == PENDING else text
    written, index = [], 0
    while index < len(text):
        char = text[index]
        if char == "\\":
            if index + 1 == len(text):
                return "".join(written), PENDING
            if text[index + 1] not in ESCAPES:
                return None
            written.append(ESCAPES[text[index + 1]])
            index += 2
        elif char == '"' or not " " <= char <= "~":
            return None
        else:
            written.append(char)
            index += 1
    return "".join(written), CLEAR


class _Tokens:
    """The duck-typed tokenizer llguidance's TokenizerWrapper reads: bytes per id (the last 256 one byte each) and
    an encoder, which spells text byte by byte (llguidance tokenizes a grammar's literals; rows consume by id)."""

    def __init__(self, tokens: list[bytes], end: int):
        self.bytes_from = len(tokens)
        self.tokens = tokens + [bytes([byte]) for byte in range(256)]
        self.eos_token_id, self.bos_token_id, self.special_token_ids = end, None, [end]

    def __call__(self, text: bytes) -> list[int]:
        return [self.bytes_from + byte for byte in text]


class EscapedVocabulary:
    """A JSON-escaping tokenizer's tokens, each read in both states (see the module's docstring)."""

    def __init__(self, tokenizer: TextTokenizer, vocab: int):
        special = {i for i, added in tokenizer.bpe.get_added_tokens_decoder().items() if added.special}
        texts = tokenizer.bpe.decode_batch([[t] for t in range(vocab)], skip_special_tokens=False)
        self.size = vocab
        self.readings = [[None if t in special else read(text, state) for t, text in enumerate(texts)]
                         for state in (CLEAR, PENDING)]  # fmt: skip
        tokens = [b""] * (2 * vocab)  # b"": an id llguidance never allows
        # Per state, the tokens by what they write: those that end clear, and those that leave a backslash pending
        self.writing: list[tuple[dict[bytes, list[int]], dict[bytes, list[int]]]] = []
        for state, readings in enumerate(self.readings):
            ends = ({}, {})
            for token, reading in enumerate(readings):
                if reading is not None:
                    written = reading[0].encode()
                    tokens[state * vocab + token] = written
                    ends[reading[1]].setdefault(written, []).append(token)
            self.writing.append(ends)
        self.completions = []  # per state: the pending tokens, and the ids of each with each escape's text after it
        for state in (CLEAR, PENDING):
            pending = [(written, token) for written, group in self.writing[state][PENDING].items() for token in group]
            first = len(tokens)
            tokens += [written + escaped.encode() for written, _ in pending for escaped in ESCAPES.values()]
            ids = np.arange(first, len(tokens)).reshape(len(pending), len(ESCAPES))
            self.completions.append((np.array([token for _, token in pending], dtype=np.int64), ids))
        self.end = len(tokens)
        tokens.append(END)
        wrapped = _Tokens(tokens, self.end)
        self.llguidance = LLTokenizer(TokenizerWrapper(wrapped), n_vocab=len(wrapped.tokens))

    def allowed(self, every: np.ndarray, state: int, matcher: LLMatcher) -> np.ndarray:
        """The model's tokens that may come next in `state`, from llguidance's mask over this vocabulary's ids and
        the bytes the grammar forces next: where no token writes past them, llguidance's mask holds only the first
        token of their tokenization (this vocabulary spells them byte by byte), so every token that writes a start
        of them is added."""
        allowed = every[state * self.size : (state + 1) * self.size]  # `every` is the mask's own: written in place
        tokens, ids = self.completions[state]
        allowed[tokens] = every[ids].any(axis=1)
        forced = matcher.compute_ff_bytes()
        clear, pending = self.writing[state]
        for length in range(1, len(forced) + 1):
            allowed[clear.get(forced[:length], [])] = True
        for length, byte in enumerate(forced):  # a backslash left pending where the forced text has an escape next
            if chr(byte) in ESCAPE_TEXTS:
                allowed[pending.get(forced[:length], [])] = True
        return allowed

    def may_end(self, every: np.ndarray, state: int) -> bool:
        return state == CLEAR and bool(every[self.end])

    def ids(self, token: int, state: int) -> tuple[list[int], int] | None:
        """The ids llguidance consumes for `token` read in `state` (none where it writes nothing yet), and the state
        after it; None where the token cannot come in that state."""
        reading = self.readings[state][token]
        if reading is None:
            return None
        return ([state * self.size + token] if reading[0] else []), reading[1]
