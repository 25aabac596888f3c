"""The cache's contract beyond plain storage: addresses, lengths, shift states, shapes and bad input."""

import pytest
import torch

from kvg_export import DynamicCache, StaticCache

BATCH, KV_HEADS, HEADS, HEAD_DIM = 2, 2, 4, 3


def states(length, batch=BATCH, dtype=torch.float32, fill=None):
    """(keys, values, gates) for `length` new positions; gates are float32 whatever `dtype` is."""
    make = (lambda *shape: torch.full(shape, fill)) if fill is not None else torch.randn
    return (
        make(batch, KV_HEADS, length, HEAD_DIM).to(dtype),
        make(batch, KV_HEADS, length, HEAD_DIM).to(dtype),
        make(batch, HEADS, length),
    )


def at(start, length):
    return {"cache_position": torch.arange(start, start + length)}


def test_static_buffers_keep_their_addresses_and_are_marked_static():
    cache = StaticCache(num_layers=1, max_cache_len=8)
    cache.early_initialization(BATCH, KV_HEADS, HEADS, HEAD_DIM, torch.float32, "cpu", shift=("key_shift",))
    layer = cache.layers[0]
    buffers = [layer.keys, layer.values, layer.gates, layer.key_shift]
    for tensor in buffers:
        assert getattr(tensor, "_dynamo_static_input_type", None) is not None
    cache.update(*states(3), 0, at(0, 3))
    cache.update_shift(0, key_shift=torch.randn(BATCH, KV_HEADS * HEAD_DIM))
    cache.update(*states(1), 0, at(3, 1))
    assert [t.data_ptr() for t in buffers] == [
        t.data_ptr() for t in (layer.keys, layer.values, layer.gates, layer.key_shift)
    ]


def test_early_initialization_allocates_gates_per_query_head_in_float32():
    cache = StaticCache(num_layers=2, max_cache_len=5)
    cache.early_initialization(3, KV_HEADS, HEADS, HEAD_DIM, torch.float16, "cpu", shift=("key_shift", "value_shift"))
    for keys, values, gates in cache:
        assert keys.shape == values.shape == (3, KV_HEADS, 5, HEAD_DIM) and keys.dtype == torch.float16
        assert gates.shape == (3, HEADS, 5) and gates.dtype == torch.float32
    assert cache.layers[1].value_shift.shape == (3, KV_HEADS * HEAD_DIM)
    assert cache.max_batch_size == 3 and cache.max_cache_len == 5 and cache.is_compileable


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gates_stay_float32_beside_half_precision_keys(dtype):
    for cache, kwargs in ((DynamicCache(), None), (StaticCache(1, 4), at(0, 2))):
        keys, values, gates = cache.update(*states(2, dtype=dtype), 0, kwargs)
        assert keys.dtype == values.dtype == dtype and gates.dtype == torch.float32


def test_static_length_counts_written_positions_even_when_keys_are_zero():
    cache = StaticCache(num_layers=1, max_cache_len=10)
    cache.update(*states(4, fill=0.0), 0, at(0, 4))
    assert cache.get_seq_length() == 4
    cache.update(*states(1, fill=0.0), 0, at(4, 1))
    assert cache.get_seq_length() == 5
    cache.reset()
    assert cache.get_seq_length() == 0


def test_reorder_of_a_cache_that_holds_nothing_is_a_no_op():
    beam_idx = torch.tensor([1, 0])
    for cache in (DynamicCache(), StaticCache(num_layers=2, max_cache_len=4)):
        cache.reorder_cache(beam_idx)
    lazy = DynamicCache()
    lazy._layer(1)  # layers exist but hold no tensors yet
    lazy.reorder_cache(beam_idx)
    assert lazy.get_seq_length() == 0


def test_mask_sizes_and_shapes_of_each_kind():
    dynamic, static = DynamicCache(), StaticCache(1, 16)
    assert dynamic.get_mask_sizes(torch.arange(3)) == (3, 0)
    dynamic.update(*states(5), 0)
    static.update(*states(5), 0, at(0, 5))
    assert dynamic.get_mask_sizes(torch.arange(5, 7)) == (7, 0)
    assert static.get_mask_sizes(torch.arange(5, 7)) == (16, 0)
    assert (dynamic.get_max_cache_shape(), static.get_max_cache_shape()) == (-1, 16)
    assert (dynamic.is_compileable, static.is_compileable) == (False, True)
    assert dynamic.is_sliding == static.is_sliding == [False]


def test_layers_are_indexed_and_iterated_as_key_value_gate_triples():
    cache = DynamicCache()
    written = [states(2) for _ in range(3)]
    for layer_idx, triple in enumerate(written):
        cache.update(*triple, layer_idx)
    assert len(cache) == 3
    for got, want in zip(cache, written, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(torch.equal(g, w) for g, w in zip(cache[2], written[2], strict=True))
    with pytest.raises(IndexError, match="3 layers"):
        cache[3]


def test_legacy_form_round_trips_and_construction_does_not_copy():
    triples = [states(3) for _ in range(2)]
    shifted = [(*states(3), torch.randn(BATCH, 6), torch.randn(BATCH, 6))]
    for legacy in (triples, shifted):
        cache = DynamicCache.from_legacy_cache(legacy)
        assert cache.layers[0].keys.data_ptr() == legacy[0][0].data_ptr()
        back = cache.to_legacy_cache()
        assert len(back) == len(legacy)
        for got, want in zip(back, legacy, strict=True):
            assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_update_shift_returns_the_previous_projection(kind):
    cache = DynamicCache() if kind == "dynamic" else StaticCache(1, 8)
    first, second = torch.randn(BATCH, 6), torch.randn(BATCH, 6)
    assert cache.update_shift(0, key_shift=first) == (None, None)
    previous_key, previous_value = cache.update_shift(0, key_shift=second)
    assert torch.equal(previous_key, first) and previous_value is None
    assert torch.equal(cache.shift_states(0)[0], second)


def test_reorder_applies_to_shift_states():
    for cache in (DynamicCache(), StaticCache(1, 8)):
        cache.update(*states(2, batch=3), 0, at(0, 2))
        shift = torch.randn(3, 6)
        cache.update_shift(0, value_shift=shift)
        cache.reorder_cache(torch.tensor([2, 2, 0]))
        assert torch.equal(cache.shift_states(0)[1], shift[[2, 2, 0]])


def test_crop_refuses_to_drop_a_shift_state_it_cannot_rebuild():
    for cache in (DynamicCache(), StaticCache(1, 8)):
        cache.update(*states(4), 0, at(0, 4))
        cache.update_shift(0, key_shift=torch.randn(BATCH, 6))
        with pytest.raises(ValueError, match="shift states"):
            cache.crop(2)
        cache.crop(6)  # nothing to cut: fine


def test_crop_among_runs_since_a_checkpoint_goes_back_to_it_and_leaves_their_tokens_to_feed_again():
    """A run leaves the shift states after its last token: a crop among the runs fed since a checkpoint goes back to
    the checkpoint's length and states, and the caller sees the length it asked for; before the checkpoint, it
    refuses."""
    tokens = torch.arange(BATCH * 5).view(BATCH, 5)
    for cache in (DynamicCache(), StaticCache(1, 8)):
        cache.update(*states(2), 0, at(0, 2))
        kept = torch.randn(BATCH, 6)
        cache.update_shift(0, key_shift=kept)
        cache.checkpoint()
        for begin, end in ((0, 3), (3, 5)):
            cache.feed(tokens[:, begin:end])
            cache.update(*states(end - begin), 0, at(2 + begin, end - begin))
            cache.update_shift(0, key_shift=torch.randn(BATCH, 6))
        cache.crop(6)
        assert (cache.get_seq_length(), cache.layers[0].get_seq_length()) == (6, 2)
        assert torch.equal(cache.shift_states(0)[0], kept)
        cache.crop(4)  # no run since: fewer tokens to feed again
        assert torch.equal(cache.take_again(), tokens[:, :2]) and cache.get_seq_length() == 2
        cache.feed(tokens[:, :1])  # the first run since the crop keeps the states anew
        cache.update(*states(1), 0, at(2, 1))
        with pytest.raises(ValueError, match="earlier ones are kept only at 2"):
            cache.crop(1)


def test_offloading_on_cpu_gives_the_same_cache():
    plain, offloaded = DynamicCache(), DynamicCache(offloading=True)
    for step in range(3):
        for layer_idx in range(3):
            new = states(2 if step == 0 else 1)
            a = plain.update(*new, layer_idx)
            b = offloaded.update(*new, layer_idx)
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.cuda
def test_offloading_on_cuda_keeps_idle_layers_in_host_memory():
    cache, plain = DynamicCache(offloading=True), DynamicCache()
    for step in range(2):
        for layer_idx in range(3):
            new = tuple(t.cuda() for t in states(2 if step == 0 else 1))
            got = cache.update(*new, layer_idx)
            want = plain.update(*new, layer_idx)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            assert got[0].device.type == "cuda"
    torch.cuda.synchronize()
    assert cache.layers[1].keys.device.type == "cpu"


def test_writing_past_max_cache_len_names_the_sizes():
    cache = StaticCache(num_layers=1, max_cache_len=4)
    cache.update(*states(3), 0, at(0, 3))
    with pytest.raises(ValueError, match=r"positions 3\.\.4 .* max_cache_len 4"):
        cache.update(*states(2), 0, at(3, 2))


def test_static_update_without_cache_position_is_refused():
    with pytest.raises(ValueError, match="cache_position"):
        StaticCache(1, 4).update(*states(1), 0)


@pytest.mark.parametrize(
    ("gates", "message"),
    [
        (torch.randn(BATCH, HEADS, 5), r"gate_states must be \[batch=2, heads, seq=2\]"),
        (torch.randn(BATCH + 1, HEADS, 2), r"gate_states must be \[batch=2, heads, seq=2\]"),
        (torch.randn(BATCH, 3, 2), r"gate heads \(3\) must be a multiple of kv_heads \(2\)"),
        (torch.randn(BATCH, HEADS, 2, dtype=torch.float64), "must be float32"),
    ],
)
def test_a_gate_tensor_of_the_wrong_shape_or_dtype_is_refused(gates, message):
    keys, values, _ = states(2)
    for cache, kwargs in ((DynamicCache(), None), (StaticCache(1, 8), at(0, 2))):
        with pytest.raises(ValueError, match=message):
            cache.update(keys, values, gates, 0, kwargs)


def test_layers_with_different_batch_sizes_are_refused():
    for cache, kwargs in ((DynamicCache(), None), (StaticCache(2, 8), at(0, 2))):
        cache.update(*states(2, batch=2), 0, kwargs)
        with pytest.raises(ValueError, match="layer 1 is updated with batch 3 but layer 0 holds batch 2"):
            cache.update(*states(2, batch=3), 1, kwargs)


def test_a_later_update_must_match_the_held_batch_and_heads():
    cache = DynamicCache()
    cache.update(*states(2), 0)
    with pytest.raises(ValueError, match=r"holds \[batch, kv_heads, heads, head_dim\] = \[2, 2, 4, 3\]"):
        cache.update(*states(1, batch=1), 0)


def test_a_batch_over_the_static_limit_is_refused():
    with pytest.raises(ValueError, match="batch 3 exceeds this static cache's max_batch_size 2"):
        StaticCache(1, 8, max_batch_size=2).update(*states(1, batch=3), 0, at(0, 1))


def test_static_batch_changing_operations_are_refused_with_a_reason():
    cache = StaticCache(1, 8)
    cache.update(*states(1), 0, at(0, 1))
    with pytest.raises(ValueError, match="fixed batch"):
        cache.batch_repeat_interleave(2)
    with pytest.raises(ValueError, match="fixed batch"):
        cache.batch_select_indices(torch.tensor([0]))
