"""The kvg_stdlib tasks' documents: cut from the held-out test split, the same in every process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exporters.evaluation.stdlib_tasks import (
    CHOICES,
    LINES,
    PASSAGE_LINES,
    PASSAGES,
    complete_line,
    next_line,
    passages,
)
from kvg_export.corpus import read_split

REPO = Path(__file__).resolve().parent.parent
SPLIT = "\n".join(document.text for document in read_split("test"))


def documents(make) -> list[dict]:
    return make()["test"].to_list()


@pytest.mark.parametrize("make", [next_line, complete_line, passages])
def test_the_documents_are_the_same_in_every_process(make):
    """A score is comparable across runs only if the documents are: a process with another hash seed (which orders
    sets and dicts of strings otherwise) draws the same ones, and there are as many as the task says."""
    script = (f"import json; from exporters.evaluation.stdlib_tasks import {make.__name__}; "
              f"print(json.dumps({make.__name__}()['test'].to_list()))")  # fmt: skip
    other = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"})  # fmt: skip
    drawn = documents(make)
    assert json.loads(other.stdout) == drawn
    assert len(drawn) == (PASSAGES if make is passages else LINES)


def test_the_true_next_line_follows_its_context_among_other_lines_indented_alike():
    drawn = documents(next_line)
    assert len(drawn) == LINES
    for document in drawn:
        choices, true = document["choices"], document["choices"][document["gold"]]
        assert document["context"] + true in SPLIT
        assert len({choice.strip() for choice in choices}) == CHOICES
        assert {choice[: len(choice) - len(choice.lstrip())] for choice in choices} == {
            true[: len(true) - len(true.lstrip())]
        }
    assert len({document["gold"] for document in drawn}) == CHOICES  # the true line is not always in one place


def test_a_completion_is_the_rest_of_a_line_from_a_space_on():
    for document in documents(complete_line):
        assert document["context"] + document["target"] + "\n" in SPLIT
        assert document["target"].startswith(" ") and "\n" not in document["target"]
        assert document["context"].rsplit("\n", 1)[-1].strip()  # the line's first half is given


def test_passages_are_distinct_runs_of_whole_lines():
    texts = [document["text"] for document in documents(passages)]
    assert len(set(texts)) == PASSAGES
    assert all(text in SPLIT and text.count("\n") == PASSAGE_LINES for text in texts)
