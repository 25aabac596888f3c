"""Continuous batching: requests that join and leave a running batch get the tokens they get alone."""

import itertools
import random
import threading

import numpy as np
import pytest
from manual_clock import ManualClock, wait_until

from runtime.artifact import SessionOptions
from runtime.cache.row_cache import RowCache
from runtime.decode import prompt_fill
from runtime.decode.engine import Engine
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.model import Model
from runtime.decode.prefill import bind_chunk
from runtime.decode.requests import Failed, Finished, Token
from runtime.decode.sampling import SamplingConfig
from runtime.errors import ArtifactError, QueueFull, RequestError

CPU = SessionOptions(provider="cpu")


def workload(count: int, seed: int) -> list[tuple[list[int], GenerationConfig]]:
    """Prompts of 1 to 24 tokens and 1 to 48 new tokens, half greedy and half seeded sampling with every
    filter, some with min_new_tokens, some prefilled in chunks of 5: together they outgrow the 96-slot cache."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        new = rng.randint(1, 48)
        sampling = SamplingConfig(0.8, 20, 0.9, 1.2, seed=index) if index % 2 else SamplingConfig()
        config = GenerationConfig(new, rng.choice([0, new]), sampling=sampling, prefill_chunk=rng.choice([5, 256]))
        requests.append(([rng.randint(3, 500) for _ in range(rng.randint(1, 24))], config))
    return requests


class Collector:
    """Events per request, from the engine's thread; `wait` blocks until every request has ended."""

    def __init__(self, count: int):
        self.tokens = {i: [] for i in range(count)}
        self.ends: dict[int, object] = {}
        self._ended = threading.Semaphore(0)

    def emit(self, index: int):
        def on_event(event):
            if isinstance(event, Token):
                self.tokens[index].append(event.token)
            else:
                self.ends[index] = event
                self._ended.release()

        return on_event

    def wait(self, count: int) -> None:
        for _ in range(count):
            assert self._ended.acquire(timeout=120), "a request never ended"


class Arrivals:
    """Submits each request when an earlier one has emitted a given number of tokens (or ended), from the
    engine's own thread: requests join a running batch at clocks that are the same on every run."""

    def __init__(self, engine: Engine, requests, triggers: dict[int, tuple[int, int]]):
        self.engine, self.requests, self.got = engine, requests, Collector(len(requests))
        self.pending = {after: [] for after in range(len(requests))}
        for index, (after, tokens) in triggers.items():
            self.pending[after].append((tokens, index))
        self.seen = dict.fromkeys(range(len(requests)), 0)

    def submit(self, index: int) -> None:
        prompt, config = self.requests[index]
        self.engine.submit(prompt, config, self._on_event(index))

    def _on_event(self, index: int):
        record = self.got.emit(index)

        def on_event(event):
            self.seen[index] += isinstance(event, Token)
            ended = not isinstance(event, Token)
            due = [(tokens, later) for tokens, later in self.pending[index] if ended or self.seen[index] >= tokens]
            for item in due:
                self.pending[index].remove(item)
                self.submit(item[1])
            record(event)

        return on_event


def served(engine: Engine, requests, triggers: dict[int, tuple[int, int]]) -> list[list[int]]:
    """Each request's tokens, the requests arriving as `triggers` say (see Arrivals); every one must finish."""
    arrivals = Arrivals(engine, requests, triggers)
    arrivals.submit(0)
    arrivals.got.wait(len(requests))
    engine.close()
    assert {type(end) for end in arrivals.got.ends.values()} == {Finished}
    return [arrivals.got.tokens[i] for i in range(len(requests))]


def watch_compactions(monkeypatch) -> list[int]:
    """The clock at each time the rows are moved to the front, from now on."""
    compactions, compact = [], RowCache._compact
    monkeypatch.setattr(RowCache, "_compact", lambda self: compactions.append(self.clock) or compact(self))
    return compactions


def schedule(count: int, seed: int) -> tuple[list, dict[int, tuple[int, int]]]:
    """Four requests that force every way a row's slots move (given three rows), then `count` random ones
    arriving while earlier ones run. Request 1's 20-token prompt joins at clock 5, so running request 0 is
    moved later to end at clock 20. Request 2 joins request 1 at clock 40 and ends at 87; request 3 joins at
    70, once request 1 (from slot 0) has ended, and needs slots to 109, past the 96-slot cache, so the rows
    are compacted."""
    forced = [([7, 8], 48), (list(range(30, 50)), 48), ([9, 10, 11, 12, 13], 48), ([14, 15, 16, 17, 18], 40)]
    requests = [(prompt, GenerationConfig(new, new)) for prompt, new in forced] + workload(count, seed)
    triggers = {1: (0, 4), 2: (1, 20), 3: (2, 30)}
    rng = random.Random(seed)
    for index in range(len(forced), len(requests)):
        after = rng.randrange(max(3, index - 6), index)
        triggers[index] = (after, rng.randint(1, requests[after][1].max_new_tokens))
    return requests, triggers


@pytest.mark.parametrize(("preset", "attention", "rows"), [("fox-pro-tiny", "gqa", 8), ("fox-pro-tiny", "standard", 3),
                                                            ("fox-tiny", "onnx-attention", 16)])  # fmt: skip
def test_requests_joining_a_running_batch_get_the_tokens_they_get_alone(exported, monkeypatch, preset, attention, rows):
    """Every way a row's slots move (later, for a prompt longer than the clock; to the front, once the clock
    reaches the end of the cache) happens, as the test checks, and each request still gets its tokens alone."""
    generator = Generator.open(exported(preset, "static", attention=attention)[0].path, CPU)
    requests, triggers = schedule(56, seed=rows)
    alone = [generator.generate([prompt], config).tokens[0] for prompt, config in requests]
    moves, move = [], RowCache.move
    monkeypatch.setattr(RowCache, "move", lambda self, *args: moves.append(args) or move(self, *args))
    compactions = watch_compactions(monkeypatch)
    assert served(Engine(generator.model, rows, max_queue=len(requests)), requests, triggers) == alone
    assert compactions, "no compaction happened"
    assert any(to > begin for _rows, begin, _end, to in moves), "no row was moved later"


def test_a_row_is_freed_once_its_request_ends_and_taken_by_the_next(exported):
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    engine, got = Engine(generator.model, 2), Collector(3)
    block, blocked = threading.Event(), threading.Event()

    def slow_consumer(event):  # holds the engine's loop on its first token until released
        blocked.set()
        block.wait()
        got.emit(0)(event)

    long = engine.submit([5, 6, 7], GenerationConfig(max_new_tokens=40, min_new_tokens=40), slow_consumer)
    blocked.wait()
    engine.submit([8, 9], GenerationConfig(max_new_tokens=2, min_new_tokens=2), got.emit(1))
    engine.submit([10], GenerationConfig(max_new_tokens=2, min_new_tokens=2), got.emit(2))
    assert engine.queue_depth == 2
    block.set()
    long.cancel()
    got.wait(2)
    assert sorted(got.ends) == [1, 2] and len(got.tokens[0]) < 40
    wait_until(lambda: engine.busy_rows == 0, "the rows were not freed")
    engine.close()


@pytest.mark.parametrize("preset", ["fox-tiny", "fox-pro-tiny"])  # fox-pro-tiny: shift states between chunks
def test_a_long_prompt_is_prefilled_a_chunk_between_two_decode_steps(exported, monkeypatch, preset):
    """While a 42-token prompt is prefilled in chunks of 8 (the budget), the running requests get a token
    between every two chunks; everyone's tokens are still those they get alone."""
    generator = Generator.open(exported(preset, "static")[0].path, CPU)
    engine, got, order = Engine(generator.model, 4, prefill_budget=8), Collector(3), []
    fill = Engine._fill
    monkeypatch.setattr(
        Engine,
        "_fill",
        lambda self: order.append("chunk" if self.filling.request.prompt == long_prompt else "") or fill(self),
    )
    long_prompt = [3 + (7 * i) % 400 for i in range(42)]
    config = GenerationConfig(max_new_tokens=30, min_new_tokens=30)

    def running(index):
        record = got.emit(index)

        def on_event(event):
            if isinstance(event, Token) and len(got.tokens[index]) == 4 and index == 0:
                engine.submit(long_prompt, config, got.emit(2))  # arrives while both run
            order.append(index if isinstance(event, Token) else "end")
            record(event)

        return on_event

    engine.submit([5, 6, 7], config, running(0))
    engine.submit([8, 9], config, running(1))
    got.wait(3)
    engine.close()
    chunks = [i for i, item in enumerate(order) if item == "chunk"]
    assert len(chunks) == 6  # ceil(42 / 8)
    for before, after in itertools.pairwise(chunks):
        assert sorted(order[before + 1 : after]) == [0, 1]  # one decode step: a token for each running request
    for index, prompt in enumerate([[5, 6, 7], [8, 9], long_prompt]):
        assert got.tokens[index] == generator.generate([prompt], config).tokens[0]


def test_a_full_queue_is_refused_and_the_queued_requests_still_run(exported):
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    engine, got = Engine(generator.model, 1, max_queue=1), Collector(2)
    release, blocked = threading.Event(), threading.Event()

    def stalled(event):
        blocked.set()
        release.wait()
        got.emit(0)(event)

    config = GenerationConfig(max_new_tokens=3, min_new_tokens=3)
    engine.submit([5, 6], config, stalled)
    blocked.wait()
    engine.submit([7, 8], config, got.emit(1))
    with pytest.raises(QueueFull, match="1 rows are busy"):
        engine.submit([9], config, lambda event: None)
    release.set()
    got.wait(2)
    engine.close()
    assert got.tokens[1] == generator.generate([[7, 8]], config).tokens[0]


def test_a_failing_request_or_consumer_leaves_the_others_running(exported, monkeypatch):
    """A consumer that raises cancels its own request; a prefill onnxruntime refuses fails its own request."""
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    engine, got = Engine(generator.model, 4), Collector(3)
    poisoned = 13

    def refuse_poisoned(binding, artifact, ids, *rest):
        if poisoned in ids:
            raise RuntimeError("onnxruntime refused the input")
        return bind_chunk(binding, artifact, ids, *rest)

    monkeypatch.setattr(prompt_fill, "bind_chunk", refuse_poisoned)
    config = GenerationConfig(max_new_tokens=20, min_new_tokens=20)

    def broken(event):
        raise ConnectionError("the client went away")

    engine.submit([5, 6, 7], config, broken)
    engine.submit([poisoned, 6], config, got.emit(0))
    engine.submit([8, 9], config, got.emit(1))
    engine.submit([10, 11, 12], config, got.emit(2))
    got.wait(3)
    engine.close()
    assert isinstance(got.ends[0], Failed) and "refused the input" in got.ends[0].message
    assert got.tokens[1] == generator.generate([[8, 9]], config).tokens[0]
    assert got.tokens[2] == generator.generate([[10, 11, 12]], config).tokens[0]


def test_a_request_past_its_deadline_ends_with_length(exported, monkeypatch):
    """On the engine's clock, which only its decode steps move: the request is admitted at once (never past its
    deadline while it waits) and runs out of time after about 20 steps, however loaded the machine."""
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    clock, step = ManualClock(), Engine._step
    monkeypatch.setattr(Engine, "_step", lambda self: clock.advance(0.01) or step(self))  # a slow model: 10 ms a step
    engine, got = Engine(generator.model, 2, timeout_s=0.2, clock=clock), Collector(1)
    engine.submit([5, 6], GenerationConfig(max_new_tokens=80, min_new_tokens=80), got.emit(0))
    got.wait(1)
    engine.close()
    assert got.ends[0] == Finished("length", 2, len(got.tokens[0])) and 1 <= len(got.tokens[0]) < 80


def test_what_cannot_be_served_is_refused_with_the_fix(exported):
    with pytest.raises(ArtifactError, match="re-export with --cache static"):
        Engine(Model.open(exported("fox-tiny", "dynamic")[0].path, CPU), 2)
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    limit = generator.model.artifact.manifest["cache"]["max_batch"]
    with pytest.raises(RequestError, match="re-export with a larger --max-batch"):
        Engine(generator.model, limit + 1)
    engine = Engine(generator.model, 1)
    for prompt, config in (([], GenerationConfig()), ([10**9], GenerationConfig()), ([5], GenerationConfig(500))):
        with pytest.raises(RequestError):
            engine.submit(prompt, config, lambda event: None)
    engine.close()
    assert np.isfinite(engine.cache.held_in(generator.model.artifact.past_names()[0]).numpy()).all()
