"""Speculative decoding with a draft model: a model drafting for itself has every draft accepted and the tokens of
plain decoding, on every cache the Generator holds; a trained preset drafting for the other (same tokenizer) gives
plain decoding's tokens; sampled drafts keep the target's distribution (Sampler.verify against the exact one, by a
chi-square bound, alone and through the models); a draft of other token ids is refused, naming the difference."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import export_here
from scipy.stats import chi2
from test_speculative import CPU, KINDS, NEW, prompts

from exporters.pipeline.options import ExportOptions
from kvg_export.presets import load_model
from runtime.cli import generate as cli
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.model import Model
from runtime.decode.sampling import Sampler, SamplingConfig, filtered_logits
from runtime.errors import RequestError
from runtime.speculative.draft_model import DraftModel

PRESETS = Path(__file__).resolve().parents[1] / "models"
SIGNIFICANCE = 1e-4  # a right distribution fails one run in 10,000


@pytest.mark.parametrize("kind", KINDS, ids=["-".join(kind) for kind in KINDS])
def test_a_model_drafting_for_itself_has_every_guess_accepted(exported, kind):
    preset, cache, attention = kind
    folder = exported(preset, cache, attention=attention)[0].path
    target = Generator.open(folder, CPU, None)
    row = prompts(target.model.artifact.vocab_size)[:1]
    plain = target.generate(row, GenerationConfig(NEW, NEW))
    config = GenerationConfig(NEW, NEW, speculative=DraftModel(Model.open(folder, CPU, None), tokens=5))
    drafted = target.generate(row, config)
    assert drafted.tokens == plain.tokens
    assert drafted.drafts_proposed >= NEW // 2 and drafted.drafts_accepted == drafted.drafts_proposed


def test_fox_py_drafting_for_fox_pro_py_gives_its_greedy_tokens(exported, capsys):
    """Two trained presets of one tokenizer: the drafts are partly right, the text is the target's, and
    kvg-generate takes the draft's folder."""
    target, draft = (str(exported(preset, "dynamic")[0].path) for preset in ("fox-pro-py", "fox-py"))
    common = [target, "--prompt", "def parse_args(argv):\n", "--max-new-tokens", "40", "--provider", "cpu"]
    assert cli.main(common) == 0
    plain = capsys.readouterr().out
    assert cli.main([*common, "--speculative", draft]) == 0
    out, err = capsys.readouterr()
    assert out == plain
    accepted, proposed = (int(n) for n in err.split(" drafts accepted")[0].split(", ")[-1].split(" of "))
    assert 0 < accepted < proposed


def exact_pair_distribution(target: Generator, prompt: list[int], sampling: SamplingConfig) -> np.ndarray:
    """P(first two new tokens) `[vocab, vocab]` as plain sampling gives them: the filtered softmax of the prompt's
    logits, times that of the logits after each first token it can choose (teacher-forced from an empty cache)."""

    def probabilities(ids: list[int]) -> np.ndarray:
        logits = target.teacher_forced_logits(np.array([ids]))[:, -1]
        scores = filtered_logits(logits, sampling).astype(np.float64)[0]
        weights = np.exp(scores - scores.max())
        return weights / weights.sum()

    first = probabilities(prompt)
    pairs = np.zeros((first.size, first.size))
    for token in np.flatnonzero(first):
        pairs[token] = first[token] * probabilities([*prompt, int(token)])
    return pairs


def assert_drawn_from(counts: np.ndarray, probabilities: np.ndarray) -> None:
    """Pearson's chi-square over the categories of non-zero probability; none drawn outside them."""
    counts, probabilities = counts.ravel(), probabilities.ravel()
    possible = probabilities > 0
    assert counts[~possible].sum() == 0
    expected = counts.sum() * probabilities[possible]
    assert expected.min() >= 5, "too few draws for the chi-square approximation"
    statistic = ((counts[possible] - expected) ** 2 / expected).sum()
    assert statistic < chi2.ppf(1 - SIGNIFICANCE, possible.sum() - 1), statistic


def test_verify_keeps_the_targets_distribution_whatever_the_drafts():
    """Drafts drawn from q (far from p, and with mass where p has none) and judged by the rule: the tokens are
    distributed as p."""
    rng = np.random.default_rng(3)
    vocab, draws = 6, 40_000
    logits = rng.normal(size=(1, vocab)).astype(np.float32)
    logits[0, 4] = -np.inf  # a token the target never chooses
    q = rng.dirichlet(np.ones(vocab))
    sampler = Sampler(SamplingConfig(temperature=0.8, seed=5))
    p = sampler.distribution(logits)[0]
    drafts = rng.choice(vocab, size=draws, p=q)
    tokens = [int(sampler.verify(logits, np.array([d]), q[None])[0]) for d in drafts]
    kept = np.mean(np.array(tokens) == drafts)
    assert abs(kept - np.minimum(p, q).sum()) < 0.01  # the rule keeps a draft with total probability sum min(p, q)
    assert_drawn_from(np.bincount(tokens, minlength=vocab), p)


def test_sampled_drafts_from_another_model_keep_the_targets_distribution(exported, tmp_path):
    """fox-pro-tiny drafted for by itself with its logits fifty times as large (its final norm's weights), sampling
    from the top 3: q is sharper than p on the same tokens, so drafts are kept and replaced. The first two tokens of
    many seeded generations (the second verified from a draft) against the exact joint distribution."""
    target = Generator.open(exported("fox-pro-tiny", "dynamic")[0].path, CPU, None)
    model = load_model("fox-pro-tiny")
    with torch.no_grad():
        model.model.norm.weight.mul_(50.0)
    model.save_pretrained(tmp_path / "checkpoint")
    shutil.copy(PRESETS / "fox-pro-tiny" / "tokenizer.json", tmp_path / "checkpoint")  # the target's tokens
    options = ExportOptions(str(tmp_path / "checkpoint"), tmp_path / "sharper", "dynamic", log_pruning_tolerance=None)
    draft = DraftModel(Model.open(export_here(options), CPU, None), tokens=1)
    prompt, sampling = prompts(target.model.artifact.vocab_size)[0], SamplingConfig(temperature=1.0, top_k=3)
    counts = np.zeros((target.model.artifact.vocab_size,) * 2, dtype=np.int64)
    proposed = accepted = 0
    for seed in range(1200):
        config = GenerationConfig(3, 3, sampling=dataclasses.replace(sampling, seed=seed), speculative=draft)
        result = target.generate([prompt], config)
        counts[result.tokens[0][0], result.tokens[0][1]] += 1
        proposed, accepted = proposed + result.drafts_proposed, accepted + result.drafts_accepted
    assert proposed == 1200 and 0.2 * proposed < accepted < 0.95 * proposed  # kept and replaced, both often
    assert_drawn_from(counts, exact_pair_distribution(target, prompt, sampling))


def test_a_draft_of_other_token_ids_is_refused_naming_the_difference(exported, tmp_path, capsys):
    target = Generator.open(exported("fox-pro-py", "dynamic")[0].path, CPU)
    source = exported("fox-py", "dynamic")[0].path
    other = tmp_path / "other-tokenizer"
    shutil.copytree(source, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = GenerationConfig(8, speculative=DraftModel(Model.open(other, CPU)))
    with pytest.raises(RequestError, match=f"gives '{second}' id {vocab[second]}, the target's id {vocab[first]}"):
        target.generate("def f(x):", config)
    tiny = DraftModel(Model.open(exported("fox-tiny", "dynamic")[0].path, CPU))
    with pytest.raises(RequestError, match="its vocabulary has 512 ids, the target's 2048"):
        target.generate("def f(x):", GenerationConfig(8, speculative=tiny))
    itself = DraftModel(Model.open(source, CPU))
    with pytest.raises(RequestError, match="one prompt at a time"):
        target.generate(["def f(x):", "import os"], GenerationConfig(8, speculative=itself))
    common = [str(target.model.artifact.folder), "--prompt", "x = 1", "--provider", "cpu"]
    assert cli.main([*common, "--speculative", str(other)]) == 2
    assert "does not share the target's tokens" in capsys.readouterr().err
    assert cli.main([*common, "--speculative", str(tmp_path / "missing")]) == 2
    assert "ngram or a folder made by kvg-export" in capsys.readouterr().err
