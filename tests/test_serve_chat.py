"""POST /v1/chat/completions: the messages rendered by the artifact's chat template, then answered as the
completions route answers that text."""

import json
import shutil

import httpx
import pytest
from test_serve import CPU, MODEL, client, serving

from runtime.decode.engine import Engine
from runtime.decode.generator import Generator

BOS = "<|bos|>"  # fox-tiny's tokenizer has it as a special token, id 1
TEMPLATE = (
    "{% if messages[-1].role != 'user' %}{{ raise_exception('the last message must be the user\\'s') }}{% endif %}"
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}, {"type": "text", "text": "    return"}]},
]
RENDERED = f"{BOS}<|system|>You write Python.\n<|user|>def add(a, b):\n    return\n<|assistant|>"  # written out by hand


@pytest.fixture(scope="module")
def server(exported, tmp_path_factory):
    """A server over a copy of the static fox-tiny artifact, given a tokenizer_config.json with TEMPLATE."""
    folder = tmp_path_factory.mktemp("chat") / "fox-tiny-chat"
    shutil.copytree(exported("fox-tiny", "static")[0].path, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "chat_template": TEMPLATE}))
    with serving(Generator.open(folder, CPU)) as running:
        yield running


def chat(url: str, **fields) -> dict:
    answer = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, **fields}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def completion(url: str, **fields) -> dict:
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": RENDERED, **fields}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_chat_answer_is_the_completion_of_the_template_rendered_prompt(server):
    url, _engine = server
    answer = chat(url, max_tokens=20, temperature=0)
    expected = completion(url, max_tokens=20, temperature=0)["choices"][0]
    choice = answer["choices"][0]
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    assert choice["message"] == {"role": "assistant", "content": expected["text"]}
    assert (choice["token_ids"], choice["finish_reason"]) == (expected["token_ids"], expected["finish_reason"])
    assert answer["usage"]["completion_tokens"] == len(expected["token_ids"])


def test_the_rendered_prompt_begins_with_the_templates_bos_as_its_special_token(server):
    url, engine = server
    prompt_tokens = chat(url, max_tokens=1)["usage"]["prompt_tokens"]
    ids = engine.model.tokenizer.encode(RENDERED, bos=False)
    assert prompt_tokens == len(ids) and ids[0] == 1


def test_max_completion_tokens_is_max_tokens_and_without_either_the_answer_may_fill_the_cache(server):
    url, engine = server
    tokens = chat(url, max_completion_tokens=7, temperature=0)["choices"][0]["token_ids"]
    assert tokens == completion(url, max_tokens=7, temperature=0)["choices"][0]["token_ids"]
    prompt = len(engine.model.tokenizer.encode(RENDERED, bos=False))
    unbounded = chat(url, temperature=0)["choices"][0]["token_ids"]
    rest = engine.cache.length - prompt + 1  # the last new token is never fed back
    assert unbounded == completion(url, max_tokens=rest, temperature=0)["choices"][0]["token_ids"]


def test_a_stream_opens_with_the_role_then_carries_the_whole_answer_then_usage_and_done(server):
    url, _engine = server
    whole = chat(url, max_tokens=24, temperature=0)
    body = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as raw:
        lines = [line.removeprefix("data: ") for line in raw.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [chunk["choices"][0] for chunk in chunks[1:-1]]
    assert "".join(piece["delta"].get("content", "") for piece in pieces) == whole["choices"][0]["message"]["content"]
    assert [piece["finish_reason"] for piece in pieces] == [None] * (len(pieces) - 1) + ["length"]
    assert pieces[-1]["token_ids"] == whole["choices"][0]["token_ids"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_the_openai_client_streams_the_same_text(server):
    url, _engine = server
    whole = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    stream = client(url).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text == whole.choices[0].message.content and whole.choices[0].message.role == "assistant"


def test_chat_logprobs_are_the_completions_ones_as_a_content_list(server):
    url, _engine = server
    answer = chat(url, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    legacy = completion(url, max_tokens=8, temperature=0, logprobs=3)["choices"][0]["logprobs"]
    content = answer["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == legacy["tokens"]
    assert [entry["logprob"] for entry in content] == legacy["token_logprobs"]
    for entry, top in zip(content, legacy["top_logprobs"], strict=True):
        listed = [alternative["logprob"] for alternative in entry["top_logprobs"]]
        assert len(listed) == 3 and listed == sorted(listed, reverse=True) and listed[0] == max(top.values())
        assert entry["bytes"] == list(entry["token"].encode())
    assert chat(url, max_tokens=2)["choices"][0]["logprobs"] is None


def test_an_artifact_without_a_chat_template_is_a_400_naming_it(exported):
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    with serving(generator) as (url, _engine):
        answer = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES}, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and "chat_template" in error["message"]
    assert "/v1/completions" in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": [{"role": "tool", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}, "messages"),  # over the cache
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages"),  # the template refuses it
    ],
)
def test_bad_chat_input_is_a_400_naming_the_field_and_queues_nothing(server, body, param, monkeypatch):
    url, engine = server
    queued, submit = [], Engine.submit
    monkeypatch.setattr(
        Engine, "submit", lambda self, prompt, *rest: queued.append(prompt) or submit(self, prompt, *rest)
    )
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert not queued and engine.queue_depth == 0 and engine.busy_rows == 0


def test_an_unknown_model_is_a_404(server):
    url, _engine = server
    answer = httpx.post(f"{url}/v1/chat/completions", json={"model": "gpt-4", "messages": MESSAGES}, timeout=60)
    assert answer.status_code == 404 and MODEL in answer.json()["error"]["message"]


def test_a_chat_answer_stops_at_the_tokenizer_configs_eos_token(server, exported, tmp_path):
    """As ChatML's <|im_end|> ends a turn without being the model's eos: here a token the greedy answer reaches."""
    url, engine = server
    tokens = chat(url, max_tokens=20, temperature=0)["choices"][0]["token_ids"]
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])  # its first appearance, not the first
    folder = tmp_path / "fox-tiny-chat-eos"
    shutil.copytree(exported("fox-tiny", "static")[0].path, folder)
    eos = engine.model.tokenizer.bpe.id_to_token(tokens[at])
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": eos, "chat_template": TEMPLATE})
    )
    with serving(Generator.open(folder, CPU)) as (ended_url, _engine):
        choice = chat(ended_url, max_tokens=20, temperature=0)["choices"][0]
        assert (choice["token_ids"], choice["finish_reason"]) == (tokens[: at + 1], "stop")
        assert completion(ended_url, max_tokens=20, temperature=0)["choices"][0]["token_ids"] == tokens  # chat only
