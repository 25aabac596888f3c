"""Streamed text, piece by piece, is the whole answer's text cut before the first stop string."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from runtime.text.text_stream import TextStream
from runtime.text.tokenizer import JSON_ESCAPE, TextRules, TextTokenizer

BYTE_LEVEL = Tokenizer.from_file(str(Path(__file__).resolve().parent.parent / "models" / "fox-tiny" / "tokenizer.json"))


def sentencepiece_like() -> Tokenizer:
    """A LLaMA-style tokenizer (the official FoX checkpoints' kind): byte-fallback tokens, '▁' for a space, and a
    decoder that drops the leading space of a text's first token, which a text decoded in pieces must not lose."""
    pieces = ["<unk>", *(f"<0x{byte:02X}>" for byte in range(256)), "▁", "a", "b", ".", "▁a", "ab", "▁ab"]
    merges = [("▁", "a"), ("a", "b"), ("▁a", "b")]
    tokenizer = Tokenizer(models.BPE({piece: i for i, piece in enumerate(pieces)}, merges, byte_fallback=True))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer


TOKENIZERS = {"byte-level": BYTE_LEVEL, "sentencepiece-like": sentencepiece_like()}


def token_lists(tokenizer: Tokenizer):
    """Byte tokens (some start or continue a multi-byte character) and merges, so pieces can end mid-character.
    A byte-fallback decoder turns every byte of an invalid sequence into U+FFFD, text given before included, so
    its bytes come as whole characters, each split over as many tokens as it has bytes."""
    if tokenizer is BYTE_LEVEL:
        return st.lists(st.integers(3, tokenizer.get_vocab_size() - 1), max_size=40)
    byte = {b: tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    character = st.characters(exclude_categories=["Cs"]).map(lambda c: [byte[b] for b in c.encode()])
    piece = st.sampled_from(["▁", "a", "b", ".", "▁a", "ab", "▁ab"]).map(lambda p: [tokenizer.token_to_id(p)])
    return st.lists(st.one_of(character, piece), max_size=20).map(lambda units: [t for unit in units for t in unit])


def streamed(tokenizer: Tokenizer, tokens: list[int], stop: list[str]) -> tuple[list[str], bool]:
    stream = TextStream(TextTokenizer(tokenizer), stop)
    pieces = [stream.push(token) for token in tokens]
    return [*pieces, stream.flush()], stream.stopped


@pytest.mark.parametrize("kind", TOKENIZERS)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_pieces_join_to_the_text_cut_before_the_stop_string(kind, data):
    tokenizer = TOKENIZERS[kind]
    tokens = data.draw(token_lists(tokenizer))
    whole = tokenizer.decode(tokens)
    if whole and data.draw(st.booleans()):  # often a stop string that does occur, from anywhere in the text
        start = data.draw(st.integers(0, len(whole) - 1))
        stop = whole[start : start + data.draw(st.integers(1, 3))]
    else:
        stop = data.draw(st.text(min_size=1, max_size=3))
    pieces, stopped = streamed(tokenizer, tokens, [stop])
    assert "".join(pieces) == (whole[: whole.find(stop)] if stop in whole else whole)
    assert stopped == (stop in whole)


@pytest.mark.parametrize("kind", TOKENIZERS)
@given(data=st.data())
def test_a_piece_never_ends_in_half_a_character_before_the_last(kind, data):
    tokenizer = TOKENIZERS[kind]
    pieces, _stopped = streamed(tokenizer, data.draw(token_lists(tokenizer)), [])
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])


def test_a_long_answer_costs_each_token_the_same():
    """Each push decodes a few tokens (from one released token back), not the whole answer (counted, not timed)."""
    decoded = []

    class Counting:
        def decode(self, tokens):
            decoded.append(len(tokens))
            return BYTE_LEVEL.decode(tokens)

    stream = TextStream(TextTokenizer(Counting()))
    for token in range(300, 2300):
        stream.push(token)
    assert max(decoded) <= 4


class Pieces:
    """A tokenizer whose token i decodes to the i-th of some pieces of text."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, tokens: list[int]) -> str:
        return "".join(self.pieces[token] for token in tokens)


@settings(max_examples=300, deadline=None)
@given(text=st.text(), cuts=st.lists(st.integers(1, 8), max_size=40))
def test_json_escaped_text_streams_in_whole_characters_however_its_escapes_are_split(text, cuts):
    """The released FoX checkpoints' text, escaped as json.dumps escapes it and cut anywhere: every piece extends the
    text so far towards the whole text (never half an escape, never half a surrogate pair)."""
    escaped, pieces = json.dumps(text)[1:-1], []
    for cut in cuts:
        if escaped:
            pieces.append(escaped[:cut])
            escaped = escaped[cut:]
    pieces += [escaped] if escaped else []
    stream = TextStream(TextTokenizer(Pieces(pieces), TextRules(escape=JSON_ESCAPE)))
    so_far = ""
    for piece in [*(stream.push(token) for token in range(len(pieces))), stream.flush()]:
        so_far += piece
        assert text.startswith(so_far)
    assert so_far == text
