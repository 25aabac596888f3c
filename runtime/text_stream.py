"""Generated tokens as text that is final: held back while it ends mid-character or may begin a stop string."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""  # the decoded tokens, up to the last whole character
        self.sent = 0  # how much of `text` has been handed out
        self.stopped = False  # a stop string was met: the text ends before it, and nothing more is added

    def push(self, token: int) -> str:
        """The text that `token` makes final."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        return "" if text.endswith("\ufffd") else self._advance(text, last=False)

    def flush(self) -> str:
        """What is still held back, once no token follows: a character left incomplete is decoded as the
        tokenizer decodes it whole (U+FFFD), as the full answer's text has it."""
        if self.stopped:
            return ""
        return self._advance(self.tokenizer.decode(self.tokens), last=True)

    def _advance(self, text: str, last: bool) -> str:
        self.text = text
        hits = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]  # sent text begins none
        if hits:
            self.stopped, self.text = True, text[: min(hits)]
            return self._release(len(self.text))
        held = 0 if last else max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        return self._release(len(text) - held)

    def _release(self, end: int) -> str:
        out = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out
