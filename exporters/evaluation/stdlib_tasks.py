"""The documents of the `kvg_stdlib` lm-evaluation-harness tasks (exporters/evaluation/lm_eval_tasks/), made at run time
from the held-out test split of the corpus (kvg_export/corpus.py), so they need no download.

Every draw comes from one string-seeded `random.Random` over the split's lines in path order: the same
interpreter gives the same documents on every machine (another Python version has other stdlib text, as
for kvg-eval). Lines and contexts are bounded in characters so that a document fits a small static cache
(fox-tiny's 96 slots in the tests, with room for the generated tokens) and nothing is ever truncated.
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetDict

from kvg_export.corpus import Document, read_split

SEED = "kvg_stdlib"
CONTEXT_LINES = 2  # lines before the one to predict
CONTEXT_CHARS = 72  # at most, the context lines with their newlines
LINE_CHARS = (16, 48)  # a predicted line's length without its indentation
LINES = 40  # documents of next_line and complete_line
CHOICES = 4  # the true next line and three others
PASSAGE_LINES = 8  # consecutive lines in a perplexity passage
PASSAGE_CHARS = 320
PASSAGES = 20


def _plain(line: str) -> bool:
    """ASCII without control characters or backslash escapes: text every byte-level tokenizer sees alike."""
    return line.isascii() and line.isprintable() and "\\" not in line


def _predictable(line: str) -> bool:
    """A code line worth predicting: neither blank, a comment nor too short or long, with a space to split
    it at (complete_line gives its first half)."""
    code = line.strip()
    return _plain(line) and not code.startswith("#") and LINE_CHARS[0] <= len(code) <= LINE_CHARS[1] and " " in code


def _sites(documents: list[Document]) -> list[tuple[str, str]]:
    """(context, line) for every predictable line whose CONTEXT_LINES plain lines before it fit CONTEXT_CHARS and
    are not all blank; the context ends with a newline."""
    sites = []
    for document in documents:
        lines = document.text.splitlines()
        for i in range(CONTEXT_LINES, len(lines)):
            context = "".join(f"{line}\n" for line in lines[i - CONTEXT_LINES : i])
            plain = all(map(_plain, lines[i - CONTEXT_LINES : i]))
            if _predictable(lines[i]) and plain and context.strip() and len(context) <= CONTEXT_CHARS:
                sites.append((context, lines[i]))
    return sites


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _drawn_lines() -> tuple[random.Random, list[tuple[str, str]], list[str]]:
    """The generator after drawing, the LINES sites drawn, and every predictable line of the split."""
    rng = random.Random(SEED)
    sites = _sites(read_split("test"))
    return rng, rng.sample(sites, LINES), sorted({line for _context, line in sites})


def next_line(**_metadata) -> DatasetDict:
    """Multiple choice: after `context`, the true next line (`gold` indexes it in `choices`) among three lines
    from elsewhere in the split, re-indented as the true one so that indentation alone does not tell."""
    rng, drawn, pool = _drawn_lines()
    rows = []
    for context, line in drawn:
        others = rng.sample([other for other in pool if other.strip() != line.strip()], CHOICES - 1)
        choices = [_indent(line) + other.strip() for other in others]
        gold = rng.randrange(CHOICES)
        choices.insert(gold, line)
        rows.append({"context": context, "choices": [f"{choice}\n" for choice in choices], "gold": gold})
    return DatasetDict({"test": Dataset.from_list(rows)})


def complete_line(**_metadata) -> DatasetDict:
    """Generation: after `context` and the first half of a line (up to the space nearest its middle), its
    rest (`target`, from that space on)."""
    _rng, drawn, _pool = _drawn_lines()
    rows = []
    for context, line in drawn:
        start = len(_indent(line))
        middle = start + (len(line) - start) // 2
        cut = min((i for i, char in enumerate(line) if char == " " and i > start), key=lambda i: abs(i - middle))
        rows.append({"context": context + line[:cut], "target": line[cut:]})
    return DatasetDict({"test": Dataset.from_list(rows)})


def passages(**_metadata) -> DatasetDict:
    """Perplexity: PASSAGES blocks of PASSAGE_LINES consecutive plain lines (blocks start at multiples of
    PASSAGE_LINES, so none overlap), each at most PASSAGE_CHARS long and not blank."""
    blocks = []
    for document in read_split("test"):
        lines = document.text.splitlines()
        for i in range(0, len(lines) - PASSAGE_LINES + 1, PASSAGE_LINES):
            text = "".join(f"{line}\n" for line in lines[i : i + PASSAGE_LINES])
            if all(map(_plain, lines[i : i + PASSAGE_LINES])) and text.strip() and len(text) <= PASSAGE_CHARS:
                blocks.append(text)
    return DatasetDict({"test": Dataset.from_list([{"text": t} for t in random.Random(SEED).sample(blocks, PASSAGES)])})
