"""Streamed text, piece by piece, is the whole answer's text cut before the first stop string."""

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from runtime.text_stream import TextStream

TOKENIZER = Tokenizer.from_file(str(Path(__file__).resolve().parent.parent / "models" / "fox-tiny" / "tokenizer.json"))
# byte tokens (some start or continue a multi-byte character) and merges, so pieces can end mid-character
TOKENS = st.lists(st.integers(3, TOKENIZER.get_vocab_size() - 1), max_size=40)


def streamed(tokens: list[int], stop: list[str]) -> tuple[list[str], bool]:
    stream = TextStream(TOKENIZER, stop)
    pieces = [stream.push(token) for token in tokens]
    return [*pieces, stream.flush()], stream.stopped


@settings(max_examples=200, deadline=None)
@given(TOKENS, st.data())
def test_pieces_join_to_the_text_cut_before_the_stop_string(tokens, data):
    whole = TOKENIZER.decode(tokens)
    if whole and data.draw(st.booleans()):  # often a stop string that does occur, from anywhere in the text
        start = data.draw(st.integers(0, len(whole) - 1))
        stop = whole[start : start + data.draw(st.integers(1, 3))]
    else:
        stop = data.draw(st.text(min_size=1, max_size=3))
    pieces, stopped = streamed(tokens, [stop])
    assert "".join(pieces) == (whole[: whole.find(stop)] if stop in whole else whole)
    assert stopped == (stop in whole)


@given(TOKENS)
def test_a_piece_never_ends_in_half_a_character_before_the_last(tokens):
    pieces, _stopped = streamed(tokens, [])
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])
