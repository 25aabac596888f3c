"""Log-probabilities from the server (`logprobs`, `echo`) against eager PyTorch's log-softmax of the same checkpoint."""

import httpx
import numpy as np
import pytest
import torch
from test_serve import CPU, MODEL, client, serving

from kvg_export.presets import load_model
from runtime.decode.generator import Generator

TOLERANCE = 1e-4  # fp32, as the issue sets it: eager and onnxruntime differ by about 1e-6 here
PROMPTS = [[5, 17, 33, 2, 40, 41, 9], [70, 3, 3, 12], [8, 100, 54, 61, 6, 23, 19, 44, 81, 7]]


@pytest.fixture(scope="module")
def server(exported):
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    with serving(generator) as (url, _engine):
        yield url, generator.model.tokenizer


@pytest.fixture(scope="module")
def eager():
    """Eager log-softmax `[positions, vocab]` of a token sequence, each position predicting the next."""
    model = load_model(MODEL)

    def log_softmax(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float()
        return torch.log_softmax(logits, -1).numpy()

    return log_softmax


def names(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([int(token)], skip_special_tokens=False) for token in ids]


def check_against_eager(logprobs: dict, tokens: list[int], first: int, top: int, eager, tokenizer) -> None:
    """Entries `first` on of `logprobs` score tokens[first:] as eager does (entry i predicted from position i - 1)."""
    expected = eager(tokens)
    for i in range(first, len(tokens)):
        row = expected[i - 1]
        assert logprobs["tokens"][i] == names(tokenizer, [tokens[i]])[0]
        assert abs(logprobs["token_logprobs"][i] - row[tokens[i]]) < TOLERANCE, (i, logprobs["token_logprobs"][i])
        likeliest = np.argsort(-row)[:top]
        listed = logprobs["top_logprobs"][i]
        wanted = set(names(tokenizer, likeliest)) | set(names(tokenizer, [tokens[i]]))
        assert set(listed) == wanted  # the top N, and the token itself if it is not among them
        for name in set(
            names(tokenizer, likeliest)
        ):  # of two tokens with one text (a piece of a character), the likelier
            best = max(row[t] for t in likeliest if names(tokenizer, [t])[0] == name)
            assert abs(listed[name] - best) < TOLERANCE


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echoed_prompts_are_scored_as_eager_scores_them(server, eager, max_tokens):
    url, tokenizer = server
    answer = client(url).completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=max_tokens, temperature=0, echo=True, logprobs=3
    )
    for prompt, choice in zip(PROMPTS, answer.choices, strict=True):
        logprobs = choice.logprobs.model_dump()
        generated = choice.model_extra["token_ids"]
        assert len(generated) == max_tokens
        tokens = prompt + generated
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert len(logprobs["tokens"]) == len(tokens)
        check_against_eager(logprobs, tokens, 1, 3, eager, tokenizer)
        assert choice.text == tokenizer.decode(prompt, skip_special_tokens=False) + tokenizer.decode(generated)
        texts = names(tokenizer, tokens)
        assert logprobs["text_offset"] == [sum(map(len, texts[:i])) for i in range(len(texts))]


def test_generated_tokens_are_scored_and_a_stream_scores_them_alike(server, eager):
    url, tokenizer = server
    request = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=5)
    whole = client(url).completions.create(**request).choices[0]
    generated = whole.model_extra["token_ids"]
    logprobs = whole.logprobs.model_dump()
    tokens = PROMPTS[2] + generated
    padded = {key: [None] * len(PROMPTS[2]) + values for key, values in logprobs.items()}
    check_against_eager(padded, tokens, len(PROMPTS[2]), 5, eager, tokenizer)
    assert logprobs["text_offset"][0] == 0  # offsets count in the text returned, which starts at the completion

    chunks = [chunk.choices[0] for chunk in client(url).completions.create(**request, stream=True)]
    streamed = {key: [value for chunk in chunks for value in chunk.logprobs.model_dump()[key]] for key in logprobs}
    assert streamed == logprobs
    assert "".join(chunk.text for chunk in chunks) == whole.text


def test_sampled_tokens_are_scored_under_the_distribution_they_were_drawn_from(server, eager):
    """Temperature 0.7 and top-k 4, as vLLM's processed log-probabilities: the softmax of logits / 0.7 over the
    4 likeliest tokens, the others removed (-inf, sent as -9999)."""
    url, tokenizer = server
    answer = (
        client(url)
        .completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0.7, seed=3, logprobs=6, extra_body={"top_k": 4}
        )
        .choices[0]
    )
    tokens = PROMPTS[0] + answer.model_extra["token_ids"]
    logits = eager(tokens)  # a log-softmax: logits up to a constant per row, which dividing by 0.7 keeps
    for i, position in enumerate(range(len(PROMPTS[0]) - 1, len(tokens) - 1)):
        scaled = logits[position] / 0.7
        kept = np.argsort(-scaled)[:4]
        expected = scaled[kept] - np.log(np.exp(scaled[kept] - scaled[kept].max()).sum()) - scaled[kept].max()
        wanted = {}
        for name, logprob in zip(names(tokenizer, kept), expected, strict=True):
            wanted.setdefault(name, logprob)  # of two tokens with one text (a piece of a character), the likelier
        listed = list(answer.logprobs.top_logprobs[i].items())
        assert [name for name, _ in listed[: len(wanted)]] == list(wanted)
        assert max(abs(logprob - wanted[name]) for name, logprob in listed[: len(wanted)]) < TOLERANCE
        assert {logprob for _, logprob in listed[len(wanted) :]} <= {-9999.0}  # removed by top-k
        assert tokens[position + 1] in kept


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [1, 2], "logprobs": 21}, "logprobs"),
        ({"prompt": [1, 2], "logprobs": -1}, "logprobs"),
        ({"prompt": [1, 2], "echo": "yes"}, "echo"),
        ({"prompt": [1, 2], "max_tokens": 0, "logprobs": 2}, "max_tokens"),  # nothing to score without echo
        ({"prompt": [1, 2], "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ],
)
def test_bad_log_probability_fields_are_400s_naming_the_field(server, body, param):
    url, _tokenizer = server
    answer = httpx.post(f"{url}/v1/completions", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
