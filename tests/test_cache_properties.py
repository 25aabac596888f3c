"""Property tests: dynamic and static caches hold what plain tensor operations say they should."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvg_export import DynamicCache, StaticCache

settings.register_profile("kvg", max_examples=40, deadline=None)
settings.load_profile("kvg")


@st.composite
def update_plans(draw):
    """A model shape and a sequence of chunk lengths to feed every layer."""
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 3))
    head_dim = draw(st.integers(1, 4))
    layers = draw(st.integers(1, 3))
    chunks = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    spare = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**16))
    return batch, kv_heads, heads, head_dim, layers, chunks, spare, seed


def random_chunks(plan):
    """Per layer, per chunk: (keys, values, gates) with distinct random content."""
    batch, kv_heads, heads, head_dim, layers, chunks, _, seed = plan
    generator = torch.Generator().manual_seed(seed)
    return [
        [
            (
                torch.randn(batch, kv_heads, n, head_dim, generator=generator),
                torch.randn(batch, kv_heads, n, head_dim, generator=generator),
                torch.randn(batch, heads, n, generator=generator),
            )
            for n in chunks
        ]
        for _ in range(layers)
    ]


def fill(cache, data):
    position = 0
    for chunk_idx in range(len(data[0])):
        length = data[0][chunk_idx][0].shape[2]
        cache_position = torch.arange(position, position + length)
        for layer_idx, layer_chunks in enumerate(data):
            cache.update(*layer_chunks[chunk_idx], layer_idx, {"cache_position": cache_position})
        position += length
    return cache


def expected(data):
    """The whole sequence per layer, concatenated independently of any cache code."""
    return [
        (
            torch.cat([c[0] for c in chunks], dim=2),
            torch.cat([c[1] for c in chunks], dim=2),
            torch.cat([c[2] for c in chunks], dim=2),
        )
        for chunks in data
    ]


def caches_for(plan):
    data = random_chunks(plan)
    total = sum(plan[5])
    dynamic = fill(DynamicCache(), data)
    static = fill(StaticCache(num_layers=plan[4], max_cache_len=total + plan[6]), data)
    return data, total, dynamic, static


def static_prefix(static, layer_idx, length):
    keys, values, gates = static[layer_idx]
    return keys[:, :, :length], values[:, :, :length], gates[:, :, :length]


def assert_layers_equal(actual, wanted):
    for a, w in zip(actual, wanted, strict=True):
        torch.testing.assert_close(a, w, rtol=0, atol=0)


@given(update_plans())
def test_static_and_dynamic_caches_hold_the_same_entries(plan):
    data, total, dynamic, static = caches_for(plan)
    for layer_idx, wanted in enumerate(expected(data)):
        assert_layers_equal(dynamic[layer_idx], wanted)
        assert_layers_equal(static_prefix(static, layer_idx, total), wanted)
        keys, values, gates = static[layer_idx]
        assert not keys[:, :, total:].any() and not values[:, :, total:].any() and not gates[:, :, total:].any()
    assert dynamic.get_seq_length() == static.get_seq_length() == total


@given(update_plans(), st.integers(-6, 16))
def test_crop_keeps_what_slicing_keeps(plan, max_length):
    data, total, dynamic, static = caches_for(plan)
    dynamic.crop(max_length)
    static.crop(max_length)
    keep = min(total, max_length if max_length >= 0 else max(total + max_length, 0))
    for layer_idx, (keys, values, gates) in enumerate(expected(data)):
        wanted = (keys[:, :, :keep], values[:, :, :keep], gates[:, :, :keep])
        assert_layers_equal(dynamic[layer_idx], wanted)
        assert_layers_equal(static_prefix(static, layer_idx, keep), wanted)
        assert not static[layer_idx][0][:, :, keep:].any()
    assert dynamic.get_seq_length() == static.get_seq_length() == keep


@given(update_plans(), st.randoms(use_true_random=False))
def test_reorder_matches_index_select_on_every_tensor(plan, rng):
    data, total, dynamic, static = caches_for(plan)
    beam_idx = torch.tensor([rng.randrange(plan[0]) for _ in range(plan[0])])
    static_addresses = [t.data_ptr() for t in static[0]]
    dynamic.reorder_cache(beam_idx)
    static.reorder_cache(beam_idx)
    for layer_idx, layer in enumerate(expected(data)):
        wanted = tuple(t.index_select(0, beam_idx) for t in layer)
        assert_layers_equal(dynamic[layer_idx], wanted)
        assert_layers_equal(static_prefix(static, layer_idx, total), wanted)
    assert [t.data_ptr() for t in static[0]] == static_addresses


@given(update_plans(), st.integers(1, 3))
def test_repeat_interleave_matches_the_tensor_operation(plan, repeats):
    data, _, dynamic, _ = caches_for(plan)
    dynamic.batch_repeat_interleave(repeats)
    for layer_idx, layer in enumerate(expected(data)):
        assert_layers_equal(dynamic[layer_idx], tuple(t.repeat_interleave(repeats, dim=0) for t in layer))


@given(update_plans(), st.data())
def test_select_indices_matches_indexing(plan, draw):
    data, _, dynamic, _ = caches_for(plan)
    indices = torch.tensor(draw.draw(st.lists(st.integers(0, plan[0] - 1), min_size=1, max_size=4)))
    dynamic.batch_select_indices(indices)
    for layer_idx, layer in enumerate(expected(data)):
        assert_layers_equal(dynamic[layer_idx], tuple(t[indices] for t in layer))
