"""kvg-serve's limits and key, as vLLM's server has them: the /v1 routes need the API key when one is set,
and a body over the size limit is a 413 before it is parsed, while the server keeps answering."""

import asyncio
import json
import socket
import threading

import httpx
import openai
import pytest
from manual_clock import HANG_S
from starlette.testclient import TestClient
from test_serve import CPU, MODEL, client, serving

from runtime.cli import serve as serve_cli
from runtime.decode.generator import Generator
from runtime.errors import RequestError
from runtime.serving.drain import DrainingServer
from runtime.serving.http_guard import body_limit
from runtime.serving.server import ServeOptions

KEY = "sk-kvg-test"
SMALL = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def generator(exported):
    return Generator.open(exported("fox-tiny", "static")[0].path, CPU)


@pytest.fixture(scope="module")
def guarded(generator):
    """A server with a key and the default body limit."""
    with serving(generator, api_key=KEY) as running:
        yield running


def chunks(body: bytes, size: int = 1 << 16):
    """The body as httpx sends a generator: chunked, with no Content-Length."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


@pytest.mark.parametrize("headers", [{}, bearer("sk-other"), {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}])
@pytest.mark.parametrize("route", ["GET /v1/models", "POST /v1/completions"])
def test_a_v1_route_without_the_key_is_a_401_with_an_openai_error_body(guarded, headers, route):
    url, _engine = guarded
    method, path = route.split()
    answer = httpx.request(method, f"{url}{path}", json=SMALL, headers=headers)
    assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None and error["code"] is None
    assert ("needs an API key" if not headers else "not this server's") in error["message"]


def test_with_the_key_the_openai_client_and_raw_requests_are_served(guarded):
    url, _engine = guarded
    keyed = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    answer = keyed.completions.create(model=MODEL, **SMALL)
    assert [model.id for model in keyed.models.list().data] == [MODEL]
    raw = httpx.post(f"{url}/v1/completions", json=SMALL, headers=bearer(KEY))
    assert raw.status_code == 200
    assert raw.json()["choices"][0]["token_ids"] == answer.choices[0].model_extra["token_ids"]
    with pytest.raises(openai.AuthenticationError):
        client(url).completions.create(model=MODEL, **SMALL)  # test_serve's client sends another key


def test_health_and_metrics_stay_open_without_the_key(guarded):
    url, _engine = guarded
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert "kvg_requests" in httpx.get(f"{url}/metrics").text


@pytest.mark.parametrize("chunked", [False, True])
def test_a_20_mb_body_is_a_413_before_it_is_all_sent_while_health_answers(guarded, chunked):
    url, engine = guarded
    body = b" " * 20_000_000
    probes, done = [], threading.Event()

    def probe() -> None:
        while True:  # at least once, however late this thread starts
            probes.append(httpx.get(f"{url}/health", timeout=HANG_S).status_code)
            if done.is_set():
                return

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        answer = httpx.post(f"{url}/v1/completions", content=chunks(body) if chunked else body, headers=bearer(KEY),
                            timeout=HANG_S)  # fmt: skip
    finally:
        done.set()
        prober.join(HANG_S)
    assert answer.status_code == 413, answer.status_code
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert probes and all(status == 200 for status in probes), probes
    # The same request held with a tenth of its body sent (twice the limit): /health answers meanwhile, and the 413
    # comes without the rest
    sent = body[: 2 * body_limit(engine.cache.length, engine.cache.rows)]
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    head = f"POST /v1/completions HTTP/1.1\r\nHost: kvg\r\nAuthorization: Bearer {KEY}\r\n{framing}\r\n\r\n"
    with socket.create_connection((answer.url.host, answer.url.port), timeout=HANG_S) as sock:
        sock.sendall(head.encode() + (f"{len(sent):x}\r\n".encode() + sent + b"\r\n" if chunked else sent))
        assert httpx.get(f"{url}/health", timeout=HANG_S).status_code == 200
        assert sock.recv(1 << 16).startswith(b"HTTP/1.1 413 ")


def test_a_declared_length_over_the_limit_is_a_413_before_any_of_the_body_is_sent(guarded):
    url = httpx.URL(guarded[0])
    head = f"POST /v1/completions HTTP/1.1\r\nHost: kvg\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 20000000\r\n"
    with socket.create_connection((url.host, url.port), timeout=1) as sock:
        sock.sendall(f"{head}\r\n".encode())
        assert sock.recv(1 << 16).startswith(b"HTTP/1.1 413 ")


def test_the_default_limit_passes_a_batch_of_prompts_as_long_as_the_cache(guarded):
    url, engine = guarded
    prompts = [[999_999] * engine.cache.length] * engine.cache.rows  # ids as long as a million-token vocabulary's
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": prompts}, headers=bearer(KEY))
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"  # read and judged, not refused


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_at_the_limit_is_parsed_and_one_byte_more_is_a_413(generator, chunked):
    limit = 4096
    with serving(generator, max_body_bytes=limit) as (url, _engine):
        expected = httpx.post(f"{url}/v1/completions", json=SMALL).json()["choices"][0]["token_ids"]
        padded = json.dumps(SMALL).encode().ljust(limit)  # JSON allows the trailing spaces
        for body, status in [(padded, 200), (padded + b" ", 413)]:
            answer = httpx.post(f"{url}/v1/completions", content=chunks(body, 1000) if chunked else body)
            assert answer.status_code == status, answer.text
        assert httpx.post(f"{url}/v1/completions", content=padded).json()["choices"][0]["token_ids"] == expected


@pytest.mark.parametrize("environment", [None, "sk-from-env"])
def test_kvg_serve_takes_the_key_from_its_flag_else_from_kvg_api_key(generator, monkeypatch, environment):
    served = []
    monkeypatch.setattr(DrainingServer, "run", lambda server, **_: served.append(server.config.app))
    if environment is None:
        monkeypatch.delenv("KVG_API_KEY", raising=False)
    else:
        monkeypatch.setenv("KVG_API_KEY", environment)
    folder = str(generator.model.artifact.folder)
    for flags, key in [((), environment), (("--api-key", "sk-from-flag"), "sk-from-flag")]:
        assert serve_cli.main([folder, "--provider", "cpu", "--max-body-bytes", "4096", *flags]) == 0
        with TestClient(served.pop()) as http:
            assert http.get("/v1/models").status_code == (200 if key is None else 401)
            keyed = {} if key is None else bearer(key)
            assert http.get("/v1/models", headers=keyed).status_code == 200
            assert http.post("/v1/completions", content=b" " * 4097, headers=keyed).status_code == 413


def test_serve_options_keep_the_key_out_of_their_repr(generator):
    assert KEY not in repr(ServeOptions(str(generator.model.artifact.folder), api_key=KEY))


def test_an_empty_key_or_a_limit_below_one_byte_is_refused(generator):
    folder = str(generator.model.artifact.folder)
    for options in [ServeOptions(folder, api_key=""), ServeOptions(folder, max_body_bytes=0)]:
        with pytest.raises(RequestError, match="--api-key must not be empty and --max-body-bytes must be >= 1"):
            options.check()


class LoopWatched:
    """A tokenizer that notes the name of each of its methods called on a thread that runs an event loop."""

    def __init__(self, tokenizer):
        self.tokenizer, self.on_loop = tokenizer, []

    def __getattr__(self, name: str):
        attribute = getattr(self.tokenizer, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                self.on_loop.append(name)
            except RuntimeError:  # no loop runs here: an engine or worker thread
                pass
            return attribute(*args, **kwargs)

        return call


def test_no_tokenizing_or_detokenizing_runs_on_the_event_loop(exported):
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    watched = generator.model.tokenizer = LoopWatched(generator.model.tokenizer)
    body = {"prompt": ["def main():\n", "import os"], "max_tokens": 12, "temperature": 0, "logprobs": 2,
            "echo": True, "stop": ["zzz"]}  # fmt: skip
    with serving(generator) as (url, _engine):
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert whole.status_code == 200 and all(choice["logprobs"]["tokens"] for choice in whole.json()["choices"])
    assert events[-1] == "data: [DONE]" and len(events) > 2 * 12
    assert watched.on_loop == []


def refusals(url: str) -> dict[str, float]:
    """kvg_requests_total by outcome, for the guard's statuses, from /metrics."""
    counted = {"http_401": 0.0, "http_413": 0.0}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        for outcome in counted:
            if line.startswith(f'kvg_requests_total{{outcome="{outcome}"}}'):
                counted[outcome] = float(line.split()[-1])
    return counted


def test_the_guards_refusals_are_counted_in_the_request_metrics(guarded):
    url, _engine = guarded
    before = refusals(url)
    assert httpx.post(f"{url}/v1/completions", json=SMALL).status_code == 401
    assert httpx.post(f"{url}/v1/completions", content=b" " * 20_000_000, headers=bearer(KEY)).status_code == 413
    after = refusals(url)
    assert {outcome: after[outcome] - before[outcome] for outcome in after} == {"http_401": 1.0, "http_413": 1.0}
