"""lm-evaluation-harness scores kvg-serve as it scores eager PyTorch: on the kvg_stdlib tasks, its
`local-completions` model over the served static artifact and its `hf` model over the checkpoint agree
document by document.

fox-py is trained, so its completions differ from one document to the next (fox-tiny's random weights end
every completion at once, at a newline). The artifact computes in float32 as eager PyTorch does, in another order:
each log-likelihood may differ by float32 rounding (at most 9e-7 relative measured; 1e-5 allowed), while
what is decided by them (accuracy, greedy text) must be equal.
"""

import json

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from exporters.evaluation.lm_eval_cli import eager_model, evaluate, serve_flags, server_model, tokenizer_folder
from kvg_export.presets import MODELS_DIR
from runtime.artifact import read_manifest
from runtime.serving.serve_process import kvg_serve

MODEL = "fox-py"
TASKS = ["kvg_stdlib"]
LIMIT = 16  # documents per task: both models in well under a minute on 2 cores
ROWS = 8
CLOSE = {"rel": 1e-5, "abs": 1e-5}


@pytest.fixture(scope="module")
def scored(exported, tmp_path_factory):
    """(server's, hf's) lm_eval results, samples included."""
    artifact = exported(MODEL, "static")[0].path
    tokenizer = tokenizer_folder(artifact, tmp_path_factory.mktemp("tokenizer"))
    max_length = read_manifest(artifact)["cache"]["max_cache_len"]
    with kvg_serve(artifact, serve_flags(ROWS, "cpu", threads=1)) as (_, url):
        server = evaluate(server_model(url, tokenizer, max_length, ROWS), TASKS, LIMIT, bootstrap_iters=0)
    return server, evaluate(eager_model(MODEL, tokenizer, max_length, ROWS), TASKS, LIMIT, bootstrap_iters=0)


def responses(result: dict, task: str) -> list:
    """Each document's responses, in document order: a completion's text, a passage's log-likelihood, or per
    choice (log-likelihood, whether each of its tokens is the greedy one)."""
    ordered = sorted(result["samples"][task], key=lambda sample: sample["doc_id"])
    return [[response[0] for response in sample["resps"]] for sample in ordered]


def metric(result: dict, task: str, name: str) -> float:
    return result["results"][task][f"{name},none"]


def test_the_next_line_choices_score_the_same(scored):
    server, hf = (responses(result, "kvg_stdlib_next_line") for result in scored)
    assert len(server) == LIMIT
    assert [[ll for ll, _greedy in choices] for choices in server] == [
        [pytest.approx(ll, **CLOSE) for ll, _greedy in choices] for choices in hf
    ]
    assert [[greedy for _ll, greedy in choices] for choices in server] == [
        [greedy for _ll, greedy in choices] for choices in hf
    ]
    for name in ("acc", "acc_norm"):
        assert metric(scored[0], "kvg_stdlib_next_line", name) == metric(scored[1], "kvg_stdlib_next_line", name)


def test_greedy_line_completions_are_the_same_text(scored):
    server, hf = (responses(result, "kvg_stdlib_complete_line") for result in scored)
    assert server == hf
    assert len({text for (text,) in server}) > 1  # not one degenerate answer for all
    assert metric(scored[0], "kvg_stdlib_complete_line", "exact_match") == (
        metric(scored[1], "kvg_stdlib_complete_line", "exact_match")
    )


def test_the_passages_perplexities_agree(scored):
    server, hf = (responses(result, "kvg_stdlib_perplexity") for result in scored)
    assert server == [[pytest.approx(ll, **CLOSE)] for (ll,) in hf]
    for name in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        want = metric(scored[1], "kvg_stdlib_perplexity", name)
        assert metric(scored[0], "kvg_stdlib_perplexity", name) == pytest.approx(want, rel=CLOSE["rel"])


def test_the_tokenizer_folder_loads_with_auto_tokenizer_as_the_preset_tokenizer(tmp_path):
    preset = MODELS_DIR / MODEL
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(preset, tmp_path))
    text = "def parse(argv):\n    return argv[1:]  # ü\n"
    assert tokenizer(text)["input_ids"] == Tokenizer.from_file(str(preset / "tokenizer.json")).encode(text).ids
    config = json.loads((preset / "config.json").read_text())
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        config["bos_token_id"],
        config["eos_token_id"],
        config["pad_token_id"],
    )
    assert tokenizer_folder(tmp_path, tmp_path / "unused") == tmp_path  # it has a tokenizer_config.json now
