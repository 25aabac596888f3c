"""What an artifact carries of its checkpoint's tokenizer: a `tokenizer.json` the runtime loads without transformers,
and the manifest's `text` rules around it (runtime/text/tokenizer.py), read from tokenizer_config.json before anything
is traced.

A checkpoint holds a fast tokenizer's `tokenizer.json`, or a slow GPT-2 tokenizer's `vocab.json` and `merges.txt`
(the released FoX checkpoints: the official `JSONGPT2Tokenizer`, which JSON-escapes text first), from which the same
byte-level BPE is built here. A `tokenizer_class` whose behaviour is not known here, or an option of it the runtime
does not reproduce, is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from runtime.text.tokenizer import JSON_ESCAPE, TextRules, TextTokenizer

CONFIG_NAME = "tokenizer_config.json"
FAST_FILE = "tokenizer.json"
SLOW_FILES = ("vocab.json", "merges.txt")
# tokenizer_class: how its text is escaped (runtime/text/tokenizer.py); its files are SLOW_FILES or FAST_FILE, the
# ones its kind reads first where a checkpoint holds both
KNOWN_CLASSES = {
    "PreTrainedTokenizerFast": None,
    "GPT2TokenizerFast": None,
    "GPT2Tokenizer": None,
    "JSONGPT2Tokenizer": JSON_ESCAPE,
}
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
SPECIAL_ROLES = ("bos", "eos", "unk", "pad")
ADDED_TOKEN_FIELDS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class TokenizerError(ValueError):
    """The checkpoint's tokenizer cannot be carried as it is; the message names what and the fix."""


@dataclass(frozen=True)
class CheckpointTokenizer:
    """The tokenizer files of a checkpoint folder and the rules its config sets around them."""

    folder: Path
    source: str  # FAST_FILE, or SLOW_FILES joined: what the BPE is read from
    rules: TextRules = field(default_factory=TextRules)
    special_ids: dict[str, int] = field(default_factory=dict)  # the ids of the bos, eos, unk and pad tokens it names
    added: tuple[dict, ...] = ()  # a slow tokenizer's added tokens (AddedToken's fields, and "id" where recorded)

    def bpe(self) -> Tokenizer:
        """The byte-level BPE as the runtime runs it (a slow GPT-2 tokenizer's built as transformers' GPT2Tokenizer
        tokenizes: its regex split, its merges, no prefix space, added tokens matched whole)."""
        if self.source == FAST_FILE:
            return Tokenizer.from_file(str(self.folder / FAST_FILE))
        vocab, merges = (str(self.folder / name) for name in SLOW_FILES)
        bpe = Tokenizer(models.BPE.from_file(vocab, merges))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        for fields in self.added:
            token = AddedToken(fields["content"], **{k: fields[k] for k in ADDED_TOKEN_FIELDS if k in fields})
            if fields.get("special"):
                bpe.add_special_tokens([token])
            else:
                bpe.add_tokens([token])
            if fields.get("id", bpe.token_to_id(token.content)) != bpe.token_to_id(token.content):
                raise TokenizerError(
                    f"{self.folder / CONFIG_NAME}: added token {token.content!r} has id {fields['id']}, but "
                    f"{SLOW_FILES[0]} gives it {bpe.token_to_id(token.content)}: the files do not belong together"
                )
        return bpe

    def text_tokenizer(self) -> TextTokenizer:
        return TextTokenizer(self.bpe(), self.rules)


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TokenizerError(f"{path} is not valid JSON ({error})") from None


def _special_tokens(folder: Path, config: dict) -> dict[str, str]:
    """The special tokens' texts by role, from tokenizer_config.json or else special_tokens_map.json."""
    named = {**_json(folder / SPECIAL_TOKENS_MAP), **config}
    found = {role: named.get(f"{role}_token") for role in SPECIAL_ROLES}
    return {role: token["content"] if isinstance(token, dict) else token for role, token in found.items() if token}


def read_tokenizer(folder: Path) -> CheckpointTokenizer | None:
    """The checkpoint's tokenizer, None when it has no tokenizer files; TokenizerError for one it cannot carry."""
    config_path = folder / CONFIG_NAME
    config = _json(config_path)
    has_fast = (folder / FAST_FILE).is_file()
    has_slow = all((folder / name).is_file() for name in SLOW_FILES)
    name = config.get("tokenizer_class")
    if name is None:
        if not (has_fast or has_slow):
            return None
        name = "PreTrainedTokenizerFast" if has_fast else "GPT2Tokenizer"
    if name not in KNOWN_CLASSES:
        raise TokenizerError(
            f"{config_path}: tokenizer_class {name!r} is not one this exporter can carry to the runtime (it knows "
            f"{', '.join(KNOWN_CLASSES)}); convert the tokenizer to a {FAST_FILE} and set tokenizer_class to "
            "PreTrainedTokenizerFast, or export without its tokenizer files and feed token ids"
        )
    if not (has_fast if name == "PreTrainedTokenizerFast" else has_fast or has_slow):
        wanted = FAST_FILE if name == "PreTrainedTokenizerFast" else f"{' and '.join(SLOW_FILES)} (or {FAST_FILE})"
        raise TokenizerError(f"{folder}: its tokenizer_class {name} needs {wanted}, which the folder lacks")
    slow = has_slow and not name.endswith("Fast")
    _refuse_unreproduced(config, config_path, slow)
    specials = _special_tokens(folder, config)
    added = [{**fields, "id": int(i)} for i, fields in config.get("added_tokens_decoder", {}).items()]
    added.sort(key=lambda fields: fields["id"])  # added in id order, as new ones take the next ids
    recorded = {fields["content"] for fields in added}
    added += [{"content": text, "special": True} for text in specials.values() if text not in recorded]
    source = " + ".join(SLOW_FILES) if slow else FAST_FILE
    bpe = CheckpointTokenizer(folder, source, added=tuple(added)).bpe()
    special_ids = {role: bpe.token_to_id(text) for role, text in specials.items() if bpe.token_to_id(text) is not None}
    bos = None
    if config.get("add_bos_token", False):
        if "bos" not in special_ids:
            raise TokenizerError(f"{config_path} sets add_bos_token but names no bos_token in the vocabulary")
        bos = special_ids["bos"]
    return CheckpointTokenizer(folder, source, TextRules(KNOWN_CLASSES[name], bos), special_ids, tuple(added))


def _refuse_unreproduced(config: dict, config_path: Path, slow: bool) -> None:
    """Options whose effect the runtime's decoding would not have: refused rather than silently dropped."""
    if config.get("clean_up_tokenization_spaces", False):
        raise TokenizerError(
            f"{config_path} sets clean_up_tokenization_spaces, which transformers applies to decoded text and the "
            "runtime does not: set it to false there (the released FoX checkpoints do) to export"
        )
    if slow and config.get("add_prefix_space", False):
        raise TokenizerError(
            f"{config_path} sets add_prefix_space for a slow GPT-2 tokenizer, which the runtime does not reproduce: "
            "set it to false there, or convert the tokenizer to a tokenizer.json"
        )
