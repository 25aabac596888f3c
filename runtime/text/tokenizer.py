"""An artifact's tokenizer: its byte-level BPE (`tokenizer.json`, run by the tokenizers library) and the rules the
manifest's `text` sets around it, so that text reaches the model as the model was trained on it.

The released FoX checkpoints were trained on LongCrawl64, whose text was JSON-escaped before GPT-2's BPE (the
official `JSONGPT2Tokenizer`): a newline goes in as the two characters `\\` `n`, a quote as `\\"`, a non-ASCII
character as `\\u` and four hex digits; and their official usage puts `<|endoftext|>` first. So for such an
artifact a text is escaped, then tokenized, with the BOS id first, and tokens are decoded, then unescaped, exactly
as that class does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from runtime.errors import ArtifactError

JSON_ESCAPE = "json"  # the manifest's text.escape for the official JSONGPT2Tokenizer's escaping
_ESCAPE = re.compile(r"\\(?:u[0-9A-Fa-f]{0,4}|.)?", re.DOTALL)  # one escape, or its start at a text's end
_UNFINISHED = re.compile(r"\\(u[0-9A-Fa-f]{0,3})?")  # an escape whose last characters are still to come
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9A-Fa-f]{2}")  # its low half, the next escape, makes one character


def json_escape(text: str) -> str:
    """The text as LongCrawl64 held it: JSON string content, every non-ASCII character as an escape."""
    return json.dumps(text)[1:-1]


def json_unescape(text: str) -> str:
    """JSON string content back to text; where it is not valid JSON, the official tokenizer's best effort (Python's
    unicode_escape, dropping what it cannot read), which this must match."""
    try:
        return json.loads(f'"{text}"')
    except json.JSONDecodeError:
        return text.encode().decode("unicode_escape", "ignore")


def escaped_end(text: str) -> int:
    """Where `text`, JSON string content as it is generated, stops being final: before an escape whose last
    characters may still come (`\\`, `\\u00`), and before a high surrogate whose low half may (`\\ud83d`).
    Valid content unescaped piece by piece, each piece ending there, unescapes as it does whole."""
    escapes, end = list(_ESCAPE.finditer(text))[-2:], len(text)
    if escapes and escapes[-1].end() == end and _UNFINISHED.fullmatch(escapes[-1].group()):
        end = escapes.pop().start()
    if escapes and escapes[-1].end() == end and _HIGH_SURROGATE.fullmatch(escapes[-1].group()):
        end = escapes[-1].start()
    return end


@dataclass(frozen=True)
class TextRules:
    """The manifest's `text`: how a text is escaped before tokenization and unescaped after (None: as it is), and
    the token id put before every text (None: none)."""

    escape: str | None = None
    bos: int | None = None

    @classmethod
    def of(cls, manifest: dict) -> TextRules:
        return cls(**manifest.get("text") or {})


class TextTokenizer:
    """Text to token ids and back, under the artifact's TextRules."""

    def __init__(self, bpe: Tokenizer, rules: TextRules = TextRules()):
        if rules.escape not in (None, JSON_ESCAPE):
            raise ArtifactError(f"unknown text escape {rules.escape!r}; this runtime knows {JSON_ESCAPE!r}")
        self.bpe, self.rules = bpe, rules
        self.escaped = rules.escape == JSON_ESCAPE

    @classmethod
    def open(cls, folder: Path, manifest: dict) -> TextTokenizer | None:
        """The artifact's tokenizer, None when it has none."""
        name = manifest["files"].get("tokenizer")
        return cls(Tokenizer.from_file(str(folder / name)), TextRules.of(manifest)) if name else None

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """A text's token ids; `bos`: the rules' BOS first (a chat template writes its own)."""
        return self.encode_batch([text], bos)[0]

    def encode_batch(self, texts: list[str], bos: bool = True) -> list[list[int]]:
        texts = [self.escape(text) for text in texts]
        first = [self.rules.bos] if bos and self.rules.bos is not None else []
        return [first + encoding.ids for encoding in self.bpe.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.unescape(self.bpe.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text, decoded alone (a token that splits an escape gives what the official decode of
        that token gives)."""
        return [self.unescape(text) for text in self.bpe.decode_batch([[t] for t in ids], skip_special_tokens=False)]

    def escape(self, text: str) -> str:
        """A text as the BPE takes it."""
        return json_escape(text) if self.escaped else text

    def unescape(self, text: str) -> str:
        """Decoded text as the user reads it."""
        return json_unescape(text) if self.escaped else text

    def final_end(self, text: str) -> int:
        """How much of decoded, still escaped text is final whatever follows (see `escaped_end`)."""
        return escaped_end(text) if self.escaped else len(text)

    def token_to_id(self, token: str) -> int | None:
        return self.bpe.token_to_id(token)
