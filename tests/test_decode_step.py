"""runtime/decode/step.py: the step the Generator and the engine share, over either cache, its two bindings
alternating and rebound when the row count changes, against plain `session.run` with the cache fed back by hand
(the contract's own definition of a step): the same session on the same inputs, so the same numbers, exactly."""

import numpy as np
import pytest

from runtime import contract
from runtime.artifact import Artifact, SessionOptions
from runtime.cache.buffers import HOST_TYPES, to_host
from runtime.cache.device_cache import DeviceCache
from runtime.cache.row_cache import RowCache
from runtime.decode.step import DecodeStep, fitted

PRESET = "fox-pro-tiny"  # token-shift states: the tensors that trade buffers between the two bindings
ROWS = [1, 2, 2, 3, 3, 2, 2]  # rows [0, n) stepped at each clock: requests join the engine's rows and leave


def empty_pasts(artifact: Artifact, batch: int) -> dict[str, np.ndarray]:
    """Each past input zeroed, as the manifest shapes it: a dynamic cache 0 positions long."""
    pasts = {}
    for entry in artifact.manifest["inputs"]:
        if entry["name"].startswith(contract.PAST_PREFIX):
            shape = [batch if a == contract.BATCH_AXIS else 0 if a == contract.PAST_AXIS else a for a in entry["axes"]]
            pasts[entry["name"]] = np.zeros(shape, dtype=HOST_TYPES[entry["dtype"]])
    return pasts


def reference_step(artifact: Artifact, pasts: dict, ids: np.ndarray, mask: np.ndarray, slot: int) -> np.ndarray:
    """session.run on rows [0, len(ids)) of `pasts`, its presents written back over them; the last logits."""
    rows = len(ids)
    feeds = {
        contract.INPUT_IDS: ids,
        contract.ATTENTION_MASK: mask,
        **{name: past[:rows] for name, past in pasts.items()},
    }
    if artifact.static:
        feeds[contract.CACHE_POSITION] = np.array([slot], dtype=np.int64)
    logits, *presents = artifact.session.run([contract.LOGITS, *artifact.present_names()], feeds)
    for name, present in zip(artifact.present_names(), presents, strict=True):
        past = contract.past_of(name)
        if artifact.static:
            pasts[past][:rows] = present
        else:  # a dynamic cache grows by the step: every row is stepped
            pasts[past] = present
    return logits[:, -1]


@pytest.fixture(scope="module")
def artifacts(exported):
    cpu = SessionOptions(provider="cpu")
    return {cache: Artifact.open(exported(PRESET, cache)[0].path, cpu) for cache in ("static", "dynamic")}


def test_a_row_cache_step_over_rows_that_come_and_go_equals_session_run(artifacts):
    artifact = artifacts["static"]
    cache = RowCache(artifact, max(ROWS))
    step = DecodeStep(artifact, cache, artifact.session.run_with_iobinding)
    pasts, rng = empty_pasts(artifact, max(ROWS)), np.random.default_rng(0)
    for clock, rows in enumerate(ROWS):
        for row in range(max(ROWS)):  # a request in each stepped row, its window from slot 0 (never placed)
            if row < rows:
                cache.join(row, None)
            else:
                cache.end_row(row)
        ids = rng.integers(0, artifact.vocab_size, (rows, 1))
        mask = np.ones((rows, clock + 1), dtype=np.int64)
        want = reference_step(artifact, pasts, ids, mask, clock)
        np.testing.assert_array_equal(step(fitted(cache, ids))[:, -1], want)
    for row in range(max(ROWS)):  # what the steps left in each row: the slots, and a running row's shift states
        slots, states = cache.read_block(row, 0, cache.length, 0, 1)
        for name, host in {**slots, **(states if row < ROWS[-1] else {})}.items():
            np.testing.assert_array_equal(host, pasts[name][row], err_msg=name)


def test_a_device_cache_step_over_a_growing_batch_equals_session_run(artifacts):
    artifact, batch = artifacts["dynamic"], 2
    cache = DeviceCache(artifact, batch)
    mask = np.ones((batch, len(ROWS)), dtype=np.int64)
    cache.start(None, mask.copy(), 4)  # a 4-token prompt's room, shorter than the steps: the buffers double on the way
    step = DecodeStep(artifact, cache, artifact.session.run_with_iobinding)
    pasts, rng = empty_pasts(artifact, batch), np.random.default_rng(1)
    for filled in range(len(ROWS)):
        ids = rng.integers(0, artifact.vocab_size, (batch, 1))
        want = reference_step(artifact, pasts, ids, mask[:, : filled + 1], filled)
        np.testing.assert_array_equal(step(fitted(cache, ids))[:, -1], want)
    for name, reference in pasts.items():
        kept = to_host(cache.held_in(name), artifact.input_spec(name)["dtype"])
        kept = kept[:, :, : reference.shape[2]] if name in cache.in_place else kept  # the buffers' filled slots
        np.testing.assert_array_equal(kept, reference, err_msg=name)
