"""The stdlib corpus: a deterministic split by file, test folders left out, and its streams and segments."""

from types import SimpleNamespace

import numpy as np
import pytest

from kvg_export.corpus import (
    SPLITS,
    Document,
    corpus_files,
    read_split,
    segments,
    split_digest,
    split_of,
    stdlib_root,
    token_stream,
)


@pytest.fixture
def tree(tmp_path):
    """A small stdlib-like tree: top-level modules, a package, and folders the corpus must skip."""
    for relative in ["a.py", "b.py", "pkg/__init__.py", "pkg/mod.py", "pkg/data.txt",
                     "test/test_a.py", "pkg/tests/t.py", "idlelib/idle_test/x.py", "site-packages/dep/d.py",
                     "__pycache__/a.cpython-311.py"]:  # fmt: skip
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {relative}\n")
    return tmp_path


def test_only_py_files_outside_test_and_package_folders_are_in_the_corpus(tree):
    assert corpus_files(tree) == ["a.py", "b.py", "pkg/__init__.py", "pkg/mod.py"]


def test_a_files_split_depends_on_its_relative_path_alone(tree, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("other") / "lib"
    elsewhere.mkdir()
    for relative in corpus_files(tree):
        (elsewhere / relative).parent.mkdir(parents=True, exist_ok=True)
        (elsewhere / relative).write_text("different text, same path\n")
    for split in SPLITS:
        here, there = read_split(split, tree), read_split(split, elsewhere)
        assert [d.path for d in here] == [d.path for d in there]


def test_the_stdlib_splits_are_disjoint_cover_every_file_and_are_about_90_5_5():
    files = corpus_files(stdlib_root())
    by_split = {name: [f for f in files if split_of(f) == name] for name in SPLITS}
    assert sorted(f for group in by_split.values() for f in group) == files
    shares = {name: len(group) / len(files) for name, group in by_split.items()}
    assert shares["train"] == pytest.approx(0.90, abs=0.05)
    assert shares["validation"] == pytest.approx(0.05, abs=0.03)
    assert shares["test"] == pytest.approx(0.05, abs=0.03)
    assert not any("/test/" in f or f.startswith("test/") for f in files)


def test_the_split_is_the_same_every_time():
    assert [split_of(f"m{i}.py") for i in range(200)] == [split_of(f"m{i}.py") for i in range(200)]
    first, second = read_split("validation"), read_split("validation")
    assert split_digest(first) == split_digest(second) and first


def test_the_digest_changes_with_a_files_text():
    docs = [Document("a.py", "x = 1\n"), Document("b.py", "y = 2\n")]
    assert split_digest(docs) != split_digest([docs[0], Document("b.py", "y = 3\n")])


def test_an_unknown_split_is_refused():
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        read_split("dev")


class CharacterCodes:
    """A stand-in tokenizer: one id per character, its code point."""

    def encode_batch(self, texts, add_special_tokens):
        return [SimpleNamespace(ids=[ord(c) for c in t]) for t in texts]


def test_documents_are_joined_with_an_end_of_text_token():
    docs = [Document("a", "ab"), Document("b", "c")]
    stream = token_stream(CharacterCodes(), docs, eos_id=2)
    assert stream.tolist() == [97, 98, 2, 99, 2]


def test_longest_first_puts_the_documents_with_most_tokens_first_and_keeps_ties_in_order():
    docs = [Document("a", "ab"), Document("b", "cde"), Document("c", "fg")]
    stream = token_stream(CharacterCodes(), docs, eos_id=2, longest_first=True)
    assert stream.tolist() == [99, 100, 101, 2, 97, 98, 2, 102, 103, 2]


def test_segments_tile_the_stream_and_keep_no_one_token_tail():
    stream = np.arange(11)
    assert [s.tolist() for s in segments(stream, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert [len(s) for s in segments(np.arange(9), 4)] == [4, 4]
    with pytest.raises(ValueError):
        segments(stream, 1)
