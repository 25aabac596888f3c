"""Speculative decoding in the Generator: a run verifies a token and the drafts after it, and the tokens chosen are
plain decoding's, token for token, with its logits at each, on every cache the Generator holds (in place, fed
back, with FoX-Pro's shift states) and for drafts always right, always wrong or mixed, rows ending among them;
prompt lookup proposes what a naive search of the text finds; kvg-generate says how many drafts it kept."""

import numpy as np
import pytest
from scripted_drafts import DRAFTS, Scripted
from test_chunked_prefill import assert_float32_close

from runtime.artifact import SessionOptions
from runtime.cli import generate as cli
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.sampling import SamplingConfig
from runtime.errors import RequestError
from runtime.speculative.prompt_lookup import LATEST, PromptLookup

CPU = SessionOptions(provider="cpu")
NEW = 40
# (preset, cache, attention): keys, values and gates held in place (static; fused and gqa dynamic) or fed back
# (standard dynamic), and FoX-Pro's shift states swapped between two buffers or fed back
KINDS = [
    ("fox-pro-tiny", "static", "auto"),
    ("fox-pro-tiny", "dynamic", "auto"),
    ("fox-pro-tiny", "dynamic", "standard"),
    ("fox-tiny", "dynamic", "standard"),
    ("fox-tiny", "dynamic", "gqa"),
    ("fox-gqa-tiny", "dynamic", "auto"),
]
RIGHT = {
    "always right": lambda row, position: True,
    "always wrong": lambda row, position: False,
    "mixed": lambda row, position: (3 * position + row) % 5 < 3,
}


def prompts(vocab: int) -> list[list[int]]:
    """Two rows of different lengths: the shorter is left-padded."""
    rng = np.random.default_rng(7)
    return [rng.integers(3, vocab, 13).tolist(), rng.integers(3, vocab, 9).tolist()]


@pytest.mark.parametrize("kind", KINDS, ids=["-".join(kind) for kind in KINDS])
@pytest.mark.parametrize("right", RIGHT, ids=list(RIGHT))
def test_drafts_verified_in_one_run_choose_plain_decodings_tokens(exported, kind, right):
    """Row 0 stops at a token it meets early (a stop token), so it ends inside a run of drafts that row 1 goes on
    with (GroupQueryAttention runs several tokens for one row only: a gqa artifact decodes row 1 alone); the logits
    each token was chosen from are plain decoding's too."""
    preset, cache, attention = kind
    generator = Generator.open(exported(preset, cache, attention=attention)[0].path, CPU, None)
    rows = (
        prompts(generator.model.artifact.vocab_size)[1:]
        if attention == "gqa"
        else prompts(generator.model.artifact.vocab_size)
    )
    unstopped = generator.generate(rows, GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW)).tokens
    stop = unstopped[0][NEW // 3]
    config = GenerationConfig(max_new_tokens=NEW, stop_tokens=(stop,))
    plain = generator.generate(rows, config, keep_logits=True)
    assert len(plain.tokens[0]) < NEW and (len(rows) == 1 or len(plain.tokens[1]) == NEW)  # row 1 did not stop
    drafts = Scripted.of(rows, plain.tokens, RIGHT[right], generator.model.artifact.vocab_size)
    spoken = generator.generate(rows, GenerationConfig(NEW, stop_tokens=(stop,), speculative=drafts), keep_logits=True)
    assert spoken.tokens == plain.tokens and spoken.finish_reasons == plain.finish_reasons
    assert len(spoken.step_logits) == len(plain.step_logits)
    for got, want in zip(spoken.step_logits, plain.step_logits, strict=True):
        assert_float32_close(got[-1], want[-1])  # the last row runs throughout; row 0's logits after it stopped do not
    assert spoken.drafts_proposed > 0
    if right == "always right":  # but those after the stop of a run's last running row, which no one judges
        assert spoken.drafts_proposed - DRAFTS < spoken.drafts_accepted <= spoken.drafts_proposed
    elif right == "always wrong":
        assert spoken.drafts_accepted == 0
    else:
        assert 0 < spoken.drafts_accepted < spoken.drafts_proposed


def test_sampled_drafts_choose_the_tokens_a_seeded_plain_run_samples(exported):
    """A draft that is one token for certain is kept when the sample is that token, with the probability the target
    gives it, and the sample is the token chosen otherwise: so each token chosen takes one draw, as in plain
    decoding, and a seeded run repeats plain decoding's tokens."""
    generator = Generator.open(exported("fox-pro-tiny", "dynamic")[0].path, CPU, None)
    rows = prompts(generator.model.artifact.vocab_size)
    sampling = SamplingConfig(temperature=1.0, top_k=50, seed=11)
    plain = generator.generate(rows, GenerationConfig(NEW, NEW, sampling=sampling))
    drafts = Scripted.of(rows, plain.tokens, RIGHT["mixed"], generator.model.artifact.vocab_size)
    spoken = generator.generate(rows, GenerationConfig(NEW, NEW, sampling=sampling, speculative=drafts))
    assert spoken.tokens == plain.tokens and 0 < spoken.drafts_accepted < spoken.drafts_proposed


def naive_drafts(text: list[int], most: int, tokens: int, ngram: int, min_ngram: int) -> list[int]:
    """Of the latest LATEST earlier occurrences of the text's final min_ngram tokens, those that match the text's
    final tokens longest (n <= ngram); then, draft by draft, the token that most of those agreeing with the drafts
    so far went on with, a tie to the one whose occurrence is latest: up to `most`, and while the drafts are a
    smaller share of `tokens` than the match is of `ngram`."""
    shortest = [end for end in range(min_ngram, len(text)) if text[end - min_ngram : end] == text[-min_ngram:]]
    shortest = shortest[-LATEST:]
    for n in range(ngram, min_ngram - 1, -1):
        followed = [end for end in shortest if end >= n and text[end - n : end] == text[-n:]]
        if followed:
            break
    drafts = []
    while len(drafts) < most and len(drafts) / tokens < n / ngram:
        agreeing = [end for end in followed if end + len(drafts) < len(text) and text[end:][: len(drafts)] == drafts]
        if not agreeing:
            return drafts
        went_on = [text[end + len(drafts)] for end in agreeing]
        votes = max(went_on.count(token) for token in went_on)
        drafts.append(next(token for token in reversed(went_on) if went_on.count(token) == votes))
    return drafts


@pytest.mark.parametrize(("min_ngram", "ngram"), [(1, 1), (1, 2), (2, 3), (3, 3), (2, 5), (2, 8)])
def test_prompt_lookup_proposes_what_most_of_the_longest_matches_went_on_with(min_ngram, ngram):
    rng = np.random.default_rng(ngram)
    text = rng.integers(0, 4, 400).tolist()  # a small vocabulary: n-grams of every length recur, short ones past LATEST
    lookup = PromptLookup(tokens=6, ngram=ngram, min_ngram=min_ngram).start(text[:1])
    proposed = []
    for length in range(2, len(text) + 1):
        lookup.push(text[length - 1])
        if length % 5 in (1, 2):  # tokens read while no draft is asked for, indexed at the next draft
            continue
        most = 1 + length % 7  # sometimes fewer than `tokens`
        assert lookup.propose(most) == naive_drafts(text[:length], most, 6, ngram, min_ngram), length
        proposed.append(len(lookup.propose(most)))
    assert min(proposed) < max(proposed) <= 6
    assert max(proposed) == 6 or ngram > 5  # in 400 tokens of 4 ids, 8-grams rarely recur: drafts stay shorter


def test_a_guess_is_as_long_as_the_match_it_follows():
    """Up to eight drafts after matches of up to eight tokens: two after a match of two, eight after one of eight."""
    settings = PromptLookup(tokens=8, ngram=8, min_ngram=2)
    earlier = list(range(100, 120))
    two = settings.start([*earlier, *earlier[:2]]).propose(8)  # the earlier two tokens had none before them
    eight = settings.start([*earlier, *earlier[:8]]).propose(8)
    assert two == earlier[2:4] and eight == earlier[8:16]


def test_prompt_lookup_finds_repeated_text_and_kvg_generate_says_how_many_drafts_it_kept(exported, capsys):
    """fox-py continuing code it has seen in the prompt: the same text as without speculation."""
    artifact = str(exported("fox-py", "dynamic")[0].path)
    prompt = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"
    common = [artifact, "--prompt", prompt, "--max-new-tokens", "24", "--provider", "cpu"]
    assert cli.main(common) == 0
    plain = capsys.readouterr().out
    assert cli.main([*common, "--speculative", "ngram", "--draft-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out == plain
    accepted, proposed = (int(n) for n in err.split(" drafts accepted")[0].split(", ")[-1].split(" of "))
    assert 0 < accepted <= proposed


def test_bad_speculation_settings_are_refused_naming_them(exported, capsys):
    artifact = str(exported("fox-tiny", "dynamic")[0].path)
    assert cli.main([artifact, "--ids", "5,6,7", "--speculative", "ngram", "--draft-tokens", "0"]) == 2
    assert "--draft-tokens" in capsys.readouterr().err
    gqa = Generator.open(exported("fox-tiny", "dynamic", attention="gqa")[0].path, CPU)
    with pytest.raises(RequestError, match="GroupQueryAttention takes for one row only"):
        gqa.generate([[5, 6], [7, 8]], GenerationConfig(speculative=PromptLookup()))
