"""The locally built preset tokenizers: exact vocabulary layout, lossless round trips, reproducible files."""

import functools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, pre_tokenizers

from kvg_export.corpus import read_split
from kvg_export.preset_tokenizer import SPECIAL_TOKENS, build_tokenizer

MODELS = Path(__file__).resolve().parent.parent / "models"
# Random-weight presets' tokenizers come from the top-level stdlib files; trained presets' from their training split.
TRAINED = {p.parent.name for p in MODELS.glob("*/preset.json") if "training" in json.loads(p.read_text())}
SHIPPED = sorted(p for p in MODELS.glob("*/tokenizer.json") if p.parent.name not in TRAINED)


@functools.cache
def built(vocab_size: int) -> Tokenizer:
    return build_tokenizer(vocab_size)


@pytest.mark.parametrize("vocab_size", [259, 512])
def test_vocab_is_exact_with_specials_first(vocab_size):
    tok = built(vocab_size)
    vocab = tok.get_vocab()
    assert sorted(vocab.values()) == list(range(vocab_size))
    assert [tok.id_to_token(i) for i in range(3)] == SPECIAL_TOKENS
    assert {tok.id_to_token(i) for i in range(3, 259)} == set(pre_tokenizers.ByteLevel.alphabet())


def test_too_small_vocab_is_refused():
    with pytest.raises(ValueError):
        build_tokenizer(258)


def test_no_bos_is_added_and_specials_are_skipped_on_decode():
    tok = built(512)
    assert tok.encode("hi").ids == tok.encode("hi", add_special_tokens=False).ids
    ids = tok.encode("<|bos|>hi<|eos|><|pad|>").ids
    assert ids[0] == 1 and ids[-2:] == [2, 0]
    assert tok.decode(ids) == "hi"


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "  leading and trailing  ",
        "tab\tnew\nline\r\n",
        "héllo wörld ñ",
        "日本語のテキスト",
        "🦊🎉👩‍👩‍👧 ok",
        "\x00\x01\x7f\x80\xff",
        "ĠĊ already byte-level looking",
        "def f(x):\n    return x ** 2\n",
    ],
)
def test_round_trip_examples(text):
    tok = built(512)
    assert tok.decode(tok.encode(text).ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(text):
    tok = built(512)
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_build_is_deterministic():
    # Against a second, separate build; the shipped-file test below also compares across processes.
    assert build_tokenizer(512).to_str() == built(512).to_str()


@pytest.mark.parametrize("path", SHIPPED, ids=[p.parent.name for p in SHIPPED])
def test_shipped_file_is_reproducible(path):
    shipped = json.loads(path.read_text(encoding="utf-8"))
    vocab_size = len(shipped["model"]["vocab"])
    # The corpus is this Python's stdlib, so a different Python version can legitimately train other merges.
    assert shipped == json.loads(built(vocab_size).to_str()), (
        f"{path} differs from build_tokenizer({vocab_size}); regenerate with "
        f"`python -m kvg_export.preset_tokenizer --vocab-size {vocab_size} --out {path}` (same Python as before)"
    )
    config = path.with_name("config.json")
    if config.exists():
        cfg = json.loads(config.read_text(encoding="utf-8"))
        assert cfg["vocab_size"] == vocab_size
        assert (cfg["pad_token_id"], cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1, 2)


@functools.cache
def built_on_training_split(vocab_size: int) -> Tokenizer:
    return build_tokenizer(vocab_size, (d.text for d in read_split("train")))


@pytest.mark.parametrize("preset", sorted(TRAINED))
def test_a_trained_presets_tokenizer_is_bpe_trained_on_the_training_split(preset):
    shipped = json.loads((MODELS / preset / "tokenizer.json").read_text(encoding="utf-8"))
    vocab_size = json.loads((MODELS / preset / "config.json").read_text())["vocab_size"]
    assert shipped == json.loads(built_on_training_split(vocab_size).to_str()), (
        f"{preset}'s tokenizer differs from one trained on this Python's stdlib training split; "
        f"retrain with `make train PRESET={preset}` (same Python as before)"
    )
