"""What `--speculative` names, for kvg-generate and kvg-serve alike: prompt lookup ("ngram") or a draft artifact."""

from __future__ import annotations

import argparse

from runtime.artifact import SessionOptions, is_artifact
from runtime.errors import RequestError
from runtime.speculative.draft_model import DraftModel
from runtime.speculative.prompt_lookup import PromptLookup


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative", metavar="ngram|DRAFT_ARTIFACT",
        help="draft the next tokens and verify them in one run: the same tokens (the same distribution when "
        "sampling), sooner where the drafts are right. ngram: by prompt lookup (the latest n tokens found earlier "
        "in the text); a folder: with that smaller artifact of the same tokenizer (a draft model, each prompt "
        "drafted for alone)",
    )  # fmt: skip
    parser.add_argument(
        "--draft-tokens", type=int,
        help=f"most drafts a run verifies (default {PromptLookup.tokens} for ngram, after a match of --lookup-ngram "
        f"tokens, a shorter match its share; {DraftModel.tokens} for a draft)",
    )  # fmt: skip
    parser.add_argument("--lookup-ngram", type=int, default=PromptLookup.ngram, help="longest n-gram looked up")
    parser.add_argument(
        "--lookup-min-ngram", type=int, default=PromptLookup.min_ngram, help="shortest n-gram a draft may follow"
    )


def check_choice(choice: str) -> None:
    """Refuse a --speculative that is neither, before anything is loaded."""
    if choice != "ngram" and not is_artifact(choice):
        raise RequestError(f"--speculative takes ngram or a folder made by kvg-export; {choice!r} is neither")


def proposer(
    choice: str | None, tokens: int | None, ngrams: tuple[int, int], options: SessionOptions
) -> PromptLookup | DraftModel | None:  # fmt: skip
    """The drafter --speculative `choice` names (None: none), verifying up to `tokens` (None: its default) a
    run; prompt lookup matches `ngrams` (the longest n-gram, the shortest) final tokens; a draft artifact runs on
    the target's `options`."""
    if choice is None:
        return None
    check_choice(choice)
    if choice == "ngram":
        return PromptLookup(PromptLookup.tokens if tokens is None else tokens, *ngrams)
    return DraftModel.open(choice, options, DraftModel.tokens if tokens is None else tokens)
