"""runtime/cache/device_cache.py: the Generator's cache. Its window mask keeps every token's RoPE position once pruning
has moved the window past dropped positions, and its buffers grow keeping what they hold; each against a
computation by hand (the running sum of the whole mask, numpy copies of the buffers)."""

import numpy as np
import pytest

from runtime.artifact import Artifact, SessionOptions
from runtime.cache.buffers import overwrite, to_host
from runtime.cache.device_cache import DeviceCache
from runtime.decode.prefill import chunking
from runtime.errors import RequestError


@pytest.fixture(scope="module")
def cache(exported):
    artifact = Artifact.open(exported("fox-tiny", "dynamic")[0].path, SessionOptions(provider="cpu"))
    return DeviceCache(artifact, 3)


def test_the_window_mask_keeps_each_positions_count_of_the_tokens_before_it(cache):
    """A token's RoPE position is the running sum of its row's mask; dropping the window's front must not change
    it, for a padded row, a row that stopped (zeros after), and as the window moves on twice."""
    cache.reset()
    full = np.ones((3, 20), dtype=np.int64)
    full[1, :4] = 0  # left padding
    full[2, 12:] = 0  # a row that stopped generating
    mask = full.copy()
    for offset, end in [(5, 14), (9, 20)]:
        cache.window.offset = offset  # as pruning leaves it: positions [0, offset) dropped from every head
        window = cache.window.mask(mask, end)
        assert window.shape == (3, end - offset)
        attended = full[:, offset:end] > 0
        np.testing.assert_array_equal(window > 0, attended)
        np.testing.assert_array_equal(np.where(attended, window.cumsum(1), 0),
                                      np.where(attended, full.cumsum(1)[:, offset:end], 0))  # fmt: skip


def test_growing_buffers_keep_what_they_hold_and_at_least_double(cache):
    cache.reset()
    cache.start(None, np.ones((cache.batch, 6), dtype=np.int64), 5)  # 5 prompt tokens, 1 new
    rng = np.random.default_rng(0)
    written = {}
    for name in cache.in_place:
        host = rng.normal(size=to_host(cache.held_in(name), cache.dtypes[name]).shape).astype(np.float32)
        overwrite(cache.held_in(name), host, cache.dtypes[name])
        written[name] = host
    cache.reserve(7)
    assert cache.length == 10  # 7 asked, but twice 5
    for name, host in written.items():
        grown = to_host(cache.held_in(name), cache.dtypes[name])
        assert grown.shape[2] == 10
        np.testing.assert_array_equal(grown[:, :, :5], host)
        assert not grown[:, :, 5:].any()
    assert cache.stale_bindings  # the buffers are new: the next step binds them again


@pytest.fixture(scope="module")
def gqa_static(exported):
    return Artifact.open(exported("fox-pro-tiny", "static", attention="gqa")[0].path, SessionOptions(provider="cpu"))


def test_a_gqa_batch_past_one_chunk_is_fed_row_by_row_and_must_fit_its_slots(gqa_static):
    """GroupQueryAttention takes a later chunk of a prompt for one row only: a batch whose prompts span several
    chunks goes row by row; one row, or a batch within one chunk, goes whole; a row-by-row prompt longer than the
    slots cannot be pruned on the way, and is refused naming the fix."""
    slots = gqa_static.manifest["cache"]["max_cache_len"]
    assert chunking(gqa_static, DeviceCache(gqa_static, 2), 20, 8) == (8, True)
    assert chunking(gqa_static, DeviceCache(gqa_static, 2), 8, 8) == (8, False)
    assert chunking(gqa_static, DeviceCache(gqa_static, 1), 20, 8) == (8, False)
    with pytest.raises(RequestError, match="send the prompts one by one"):
        chunking(gqa_static, DeviceCache(gqa_static, 2), slots + 1, 8)
