"""The OpenAI-compatible server, over loopback, as clients use it: answers equal the Generator's alone."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from manual_clock import ManualClock, wait_until

from runtime.artifact import SessionOptions
from runtime.decode.engine import Engine
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.logprobs import TokenLogprob
from runtime.decode.requests import Failed, Finished, Token
from runtime.decode.sampling import SamplingConfig
from runtime.serving.answers import ApiError, Choice, Decoded, ServerState
from runtime.serving.server import create_app

CPU = SessionOptions(provider="cpu")
MODEL = "fox-tiny"


@pytest.fixture(scope="module")
def generator(exported):
    return Generator.open(exported("fox-tiny", "static")[0].path, CPU)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def serving(
    generator: Generator, max_batch: int = 8, max_queue: int = 64, timeout_s: float | None = None,
    engine_options: dict | None = None, **app_options,
):  # fmt: skip
    """A server on a loopback port of its own, in a thread; yields (base url, engine). `engine_options` go to the
    Engine, `app_options` to create_app."""
    engine = Engine(generator.model, max_batch, max_queue, timeout_s, **(engine_options or {}))
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, MODEL, **app_options), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def server(generator):
    with serving(generator) as running:
        yield running


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


GREEDY = SamplingConfig()


def streamed_text(url: str, route: str, body: dict) -> tuple[str, str]:
    """The text of a streamed answer's chunks joined, and its finish reason."""
    text, reason = "", None
    with httpx.stream("POST", f"{url}/v1/{route}", json={**body, "stream": True}, timeout=60) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
                reason = choice["finish_reason"] or reason
    return text, reason


def alone(generator: Generator, prompt: list[int], max_tokens: int, sampling=GREEDY, min_tokens: int = 0):
    """(tokens, text, finish reason) of the prompt run by itself through the Generator."""
    result = generator.generate([prompt], GenerationConfig(max_tokens, min_tokens, sampling=sampling))
    return result.tokens[0], generator.model.tokenizer.decode(result.tokens[0]), result.finish_reasons[0]


def encode(generator: Generator, text: str) -> list[int]:
    return generator.model.tokenizer.encode(text)


def test_completions_of_text_and_token_prompts_equal_each_prompt_alone(server, generator):
    url, _engine = server
    texts = ["def parse_args(argv):", "import numpy as np\n"]
    answer = client(url).completions.create(model=MODEL, prompt=texts, max_tokens=24, temperature=0)
    expected = [alone(generator, encode(generator, text), 24) for text in texts]
    assert [(c.index, c.model_extra["token_ids"], c.text, c.finish_reason) for c in answer.choices] == [
        (i, *want) for i, want in enumerate(expected)
    ]
    prompts = [encode(generator, text) for text in texts]
    completion = sum(len(tokens) for tokens, _text, _reason in expected)
    assert answer.usage.prompt_tokens == sum(map(len, prompts))
    assert answer.usage.completion_tokens == completion
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + completion
    assert answer.object == "text_completion" and answer.model == MODEL

    ids = client(url).completions.create(model=MODEL, prompt=prompts[1], max_tokens=24, temperature=0)
    assert ids.choices[0].model_extra["token_ids"] == expected[1][0]


def test_seeded_sampling_equals_the_same_sampling_alone(server, generator):
    url, _engine = server
    prompt = encode(generator, "class Parser:")
    answer = client(url).completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, temperature=0.8, top_p=0.9, seed=7, extra_body={"top_k": 20}
    )
    tokens, text, _reason = alone(generator, prompt, 30, SamplingConfig(0.8, 20, 0.9, seed=7))
    assert (answer.choices[0].model_extra["token_ids"], answer.choices[0].text) == (tokens, text)


def test_a_stream_is_the_same_text_in_pieces_then_usage_and_done(server, generator):
    url, _engine = server
    prompt = encode(generator, "for i in range(")
    tokens, text, reason = alone(generator, prompt, 40)
    chunks = list(
        client(url).completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert "".join(piece.text for piece in pieces) == text
    assert [piece.finish_reason for piece in pieces] == [None] * (len(pieces) - 1) + [reason]
    assert pieces[-1].model_extra["token_ids"] == tokens
    assert chunks[-1].usage.completion_tokens == len(tokens) and chunks[-1].usage.prompt_tokens == len(prompt)

    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 3, "stream": True}) as raw:
        lines = [line for line in raw.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"


def test_tokens_that_arrive_together_make_one_delta_unless_log_probabilities_are_asked():
    """A step that accepted drafts, or steps the event loop fell behind on, make one chunk (as vLLM sends what a step
    made); asked for log-probabilities, each token keeps a delta of its own. Text before a failure still goes out."""
    state = ServerState(SimpleNamespace(model=SimpleNamespace(tokenizer=None)), MODEL)

    def token(text: str, logprobs: int | None) -> Decoded:
        return Decoded(Token(ord(text), TokenLogprob(ord(text), -1.0) if logprobs else None), text)

    async def deltas(logprobs: int | None, bursts: list[str], end: Finished | Failed) -> list[tuple]:
        choice = Choice(0, state, time.perf_counter(), [], logprobs, False)
        seen, stream = [], choice.deltas()
        for burst in bursts:
            for text in burst:
                choice.events.put_nowait(token(text, logprobs))
            while choice.events.qsize():  # what arrived together is read before the next burst comes
                delta = await anext(stream)
                seen.append((delta.text, len(delta.scored), delta.finish_reason))
        choice.events.put_nowait(Decoded(end))
        try:
            seen += [(delta.text, len(delta.scored), delta.finish_reason) async for delta in stream]
        except ApiError as error:
            seen.append(str(error))
        return seen

    finished = Finished("length", 3, 4)
    assert asyncio.run(deltas(None, ["abc", "d"], finished)) == [("abc", 0, None), ("d", 0, None), ("", 0, "length")]
    assert asyncio.run(deltas(1, ["abc", "d"], finished)) == [
        ("a", 1, None), ("b", 1, None), ("c", 1, None), ("d", 1, None), ("", 0, "length"),
    ]  # fmt: skip
    assert asyncio.run(deltas(None, ["ab"], Failed("the engine stopped"))) == [("ab", 0, None), "the engine stopped"]


@pytest.mark.parametrize("stream", [False, True])
def test_text_ends_before_the_first_stop_string(server, generator, stream):
    url, _engine = server
    prompt = encode(generator, "while True:")
    _tokens, text, _reason = alone(generator, prompt, 60)
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a piece of what comes, possibly seen earlier too
    assert len(stop) == 3, f"too short an answer to cut: {text!r}"
    answer = client(url).completions.create(
        model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stop=[stop, "\x00never"], stream=stream
    )
    choices = [chunk.choices[0] for chunk in answer] if stream else answer.choices
    assert "".join(choice.text for choice in choices) == text[: text.find(stop)]
    assert choices[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"prompt": [1, 2], "max_tokens": 4', None),  # malformed JSON
        ({"prompt": [1, 2], "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": [1, 2], "temperature": [1]}, "temperature"),
        ({"prompt": [1, 2], "best_of_all": 3}, "best_of_all"),
        ({"prompt": [5] * 90, "max_tokens": 10}, "prompt"),  # 99 cache positions, over the 96 exported
        ({"prompt": "", "max_tokens": 4}, "prompt"),
        ({"prompt": [], "max_tokens": 4}, "prompt"),
        ({"prompt": [[1, 2], []], "max_tokens": 4}, "prompt"),
        ({"prompt": [1, 10**6], "max_tokens": 4}, "prompt"),
        ({"prompt": [1, -1], "max_tokens": 4}, "prompt"),
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 2], "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"prompt": [1, 2], "top_p": 0}, "top_p"),
        ({"prompt": [1, 2], "n": 2}, "n"),
    ],
)
def test_bad_input_is_a_400_with_an_openai_error_body(server, body, param, monkeypatch):
    url, engine = server
    queued, submit = [], Engine.submit

    def recorded(self, prompt, *rest):
        request = submit(self, prompt, *rest)
        queued.append(prompt)  # reached only when the engine took the prompt
        return request

    monkeypatch.setattr(Engine, "submit", recorded)
    content = body if isinstance(body, str) else json.dumps(body)
    answer = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert "max_new_tokens" not in error["message"]  # the API names it max_tokens
    assert not queued  # every prompt is checked before any is queued, so none is queued and then cancelled
    assert engine.queue_depth == 0 and engine.busy_rows == 0


def test_an_unknown_model_is_a_404_naming_the_served_one(server):
    url, _engine = server
    with pytest.raises(openai.NotFoundError, match=MODEL):
        client(url).completions.create(model="gpt-4", prompt=[1, 2], max_tokens=2)


@contextmanager
def held_steps(monkeypatch):
    """Decode steps wait until the returned event is set: a prefilled request holds its row meanwhile."""
    release, step = threading.Event(), Engine._step
    monkeypatch.setattr(Engine, "_step", lambda self: release.wait() and step(self))
    try:
        yield release
    finally:
        release.set()


def test_a_full_queue_is_a_429_with_retry_after_and_the_queued_request_still_runs(generator, monkeypatch):
    results, body = [], {"prompt": [7, 8], "max_tokens": 4, "temperature": 0}
    with held_steps(monkeypatch) as release, serving(generator, max_batch=1, max_queue=1) as (url, engine):
        first = {"prompt": [5, 6], "max_tokens": 8, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=first) as busy:
            lines = busy.iter_lines()
            # it holds the only row (its first event may wait for a step: a sampled first token may complete no
            # character, and then only the stream's 15 s ping came)
            wait_until(lambda: engine.busy_rows == 1, "the first request was not admitted")
            queued = threading.Thread(target=lambda: results.append(http.post("/v1/completions", json=body)))
            queued.start()
            wait_until(lambda: engine.queue_depth == 1, "the second request was not queued")
            refused = http.post("/v1/completions", json={"prompt": [9], "max_tokens": 4})
            assert refused.status_code == 429 and refused.headers["Retry-After"].isdigit()
            assert refused.json()["error"]["type"] == "rate_limit_error"
            release.set()
            assert [line for line in lines if line][-1] == "data: [DONE]"
            queued.join(60)
    assert results[0].json()["choices"][0]["token_ids"] == alone(generator, [7, 8], 4)[0]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_frees_its_row(generator, monkeypatch, stream):
    step, left = Engine._step, threading.Event()

    def held(engine: Engine) -> None:  # the request cannot finish before its client has gone and the server seen it
        def gone() -> bool:
            return left.is_set() or any(row is not None and row.request.cancelled for row in engine.running)

        wait_until(gone, "the server did not see its client leave")
        step(engine)

    monkeypatch.setattr(Engine, "_step", held)
    with serving(generator, max_batch=1) as (url, engine):
        body = {"prompt": [5, 6], "max_tokens": 80, "min_tokens": 80, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{url}/v1/completions", json=body):  # its head: the stream has begun
                # generating: it holds the only row (its first event may not come, as its first token may complete
                # no character and the next steps wait)
                wait_until(lambda: engine.busy_rows == 1, "the request was not admitted")
        else:
            with pytest.raises(httpx.ReadTimeout):  # no answer can come: its steps wait for it to leave
                httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
        wait_until(lambda: not engine.busy_rows, "the row was not freed when its client left")
        left.set()  # the next request's steps run at once
        metrics = httpx.get(f"{url}/metrics").text
        assert metric(metrics, "kvg_generated_tokens_total") < 80
        assert metric(metrics, 'kvg_requests_total{outcome="cancelled"}') == 1
        follow = client(url).completions.create(model=MODEL, prompt=[7, 8], max_tokens=5, temperature=0)
        assert follow.choices[0].model_extra["token_ids"] == alone(generator, [7, 8], 5)[0]


def test_a_request_past_the_timeout_ends_with_length(generator, monkeypatch):
    """On the engine's clock, which only its decode steps move (10 ms each): out of time after about 30 steps."""
    clock, step = ManualClock(), Engine._step
    monkeypatch.setattr(Engine, "_step", lambda self: clock.advance(0.01) or step(self))
    with serving(generator, max_batch=2, timeout_s=0.3, engine_options={"clock": clock}) as (url, _engine):
        answer = client(url).completions.create(
            model=MODEL, prompt=[5, 6], max_tokens=80, extra_body={"min_tokens": 80}
        )
    assert answer.choices[0].finish_reason == "length" and 1 <= answer.usage.completion_tokens < 80


def test_32_concurrent_streaming_clients_each_get_their_tokens_alone(generator):
    """32 clients over 8 rows, greedy and seeded sampling: rows are freed and retaken while others decode."""
    prompts = [encode(generator, f"def f{i}(x):\n    return x * {i}") for i in range(32)]
    lengths = [8 + (7 * i) % 40 for i in range(32)]
    samplings = [SamplingConfig(0.9, 30, 0.95, seed=i) if i % 2 else SamplingConfig() for i in range(32)]

    async def one(api: openai.AsyncOpenAI, i: int):
        sampling = samplings[i]
        stream = await api.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=lengths[i], temperature=sampling.temperature,
            top_p=sampling.top_p, seed=sampling.seed, extra_body={"top_k": sampling.top_k}, stream=True,
        )  # fmt: skip
        choices = [chunk.choices[0] async for chunk in stream]
        return choices[-1].model_extra["token_ids"], "".join(choice.text for choice in choices)

    async def everyone():
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        async with api:
            return await asyncio.gather(*(one(api, i) for i in range(32)))

    with serving(generator, max_batch=8) as (url, _engine):
        got = asyncio.run(everyone())
        metrics = httpx.get(f"{url}/metrics").text
    expected = [alone(generator, prompts[i], lengths[i], samplings[i])[:2] for i in range(32)]
    assert [tuple(answer) for answer in got] == expected
    assert metric(metrics, 'kvg_requests_total{outcome="completed"}') == 32
    assert metric(metrics, "kvg_generated_tokens_total") == sum(len(tokens) for tokens, _text in expected)
    assert metric(metrics, "kvg_time_to_first_token_seconds_count") == 32


def metric(text: str, name: str) -> float:
    """A sample's value from Prometheus text."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, f"{name} not in the metrics"
    return values[0]


def test_health_models_and_metrics_describe_the_server(server):
    url, engine = server
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    models = client(url).models.list()
    assert [model.id for model in models.data] == [MODEL]
    metrics = httpx.get(f"{url}/metrics").text
    assert metric(metrics, "kvg_queue_depth") == engine.queue_depth
    assert metric(metrics, "kvg_batch_occupancy") == engine.busy_rows / 8
    for name in ("kvg_time_per_output_token_seconds_bucket", "kvg_prompt_tokens_total", "kvg_requests_total"):
        assert name in metrics


def run_cli(*args: str, **kwargs) -> subprocess.Popen:
    command = [sys.executable, "-m", "runtime.cli.serve", *args]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": "."}, **kwargs)


def test_kvg_serve_serves_a_static_artifact_and_refuses_what_it_cannot(exported, generator):
    dynamic = exported("fox-tiny", "dynamic")[0].path
    refused = run_cli(str(dynamic))
    assert refused.wait(60) == 2 and "re-export with --cache static" in refused.stderr.read()
    missing = run_cli(str(dynamic.parent / "nowhere"))
    assert missing.wait(60) == 2 and "kvg-serve: error:" in missing.stderr.read()

    with free_socket() as sock:
        port = sock.getsockname()[1]  # free now; the server binds it below
    process = run_cli(
        str(generator.model.artifact.folder), "--port", str(port), "--max-batch", "2", "--provider", "cpu"
    )
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "kvg-serve did not come up"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        name = client(url).models.list().data[0].id
        answer = client(url).completions.create(model=name, prompt=[5, 6, 7], max_tokens=6, temperature=0)
        assert answer.choices[0].model_extra["token_ids"] == alone(generator, [5, 6, 7], 6)[0]
    finally:
        process.terminate()
        process.wait(30)


def test_a_request_the_closing_engine_refuses_is_a_503_not_the_clients_fault(generator):
    """Once the engine has closed (a shutdown under way), a request is the server's to refuse: 503, a server error,
    where a request the engine finds wrong is a 400 naming its field."""
    with serving(generator) as (url, engine):
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 10**6], "max_tokens": 4}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        engine.close()
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}, timeout=60)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["type"] == "server_error" and "shutting down" in error["message"]
