"""Generated tokens as text that is final: held back while it ends mid-character or may begin a stop string.

Each token is decoded with a prefix that starts one released token back, as vLLM's incremental detokenizer does,
so a token costs the same however long the answer has grown (decoding every token each time cost a 16k-token
answer seconds). The prefix's first token is one whose text was already final, so a decoder that treats a
text's first token differently (a leading space dropped) treats the two decodings from it alike; should the longer
one not begin with the shorter, the whole answer is decoded instead. Where the tokenizer's text is escaped (the
released FoX checkpoints'), the decoded text is unescaped up to its last complete escape: never half of one.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.text.tokenizer import TextTokenizer


class TextStream:
    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.tokens: list[int] = []
        self.prefix = 0  # the token the decoding starts at (vLLM's prefix_offset)
        self.read = 0  # tokens whose text is final (the prefix's first is among them, once any is)
        self.decoded = 0  # characters of final text so far, as decoded (before unescaping)
        self.escaped = ""  # final decoded text not unescaped yet: it ends in an escape that may go on
        self.pending = ""  # final text not handed out yet: it may begin a stop string
        self.stopped = False  # a stop string was met: the text ends before it, and nothing more is added

    def push(self, token: int, last: bool = False) -> str:
        """The text that `token` makes final; `last`: no token follows it, so all that is held back too."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        text = self._advance(last=False)
        return text + self.flush() if last else text

    def flush(self) -> str:
        """What is still held back, once no token follows: a character left incomplete is decoded as the
        tokenizer decodes it whole (U+FFFD), as the full answer's text has it."""
        if self.stopped:
            return ""
        return self._advance(last=True)

    def _advance(self, last: bool) -> str:
        decode = self.tokenizer.bpe.decode
        text = decode(self.tokens[self.prefix :])
        if text.endswith("\ufffd") and not last:
            return ""
        before = decode(self.tokens[self.prefix : self.read])
        # Where the decoder changed text it had already given, the whole answer's text is what counts
        new = text[len(before) :] if text.startswith(before) else decode(self.tokens)[self.decoded :]
        self.prefix, self.read, self.decoded = self.read, len(self.tokens), self.decoded + len(new)
        escaped = self.escaped + new
        end = len(escaped) if last else self.tokenizer.final_end(escaped)
        self.escaped = escaped[end:]
        return self._release(self.pending + self.tokenizer.unescape(escaped[:end]), last)

    def _release(self, text: str, last: bool) -> str:
        """`text` up to a stop string (then nothing more), or but for an end that may begin one."""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return text[: min(hits)]
        tail = 0 if last else max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self.pending = text[len(text) - tail :]
        return text[: len(text) - tail]
