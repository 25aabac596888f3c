"""The caches are torch.export inputs and outputs: dynamic batch and past (0 included), save/load too."""

import io

import pytest
import torch
from torch.export import Dim

from kvg_export import DynamicCache, StaticCache

KV_HEADS, HEADS, HEAD_DIM, LAYERS = 2, 4, 8, 2


class AppendToEveryLayer(torch.nn.Module):
    """Writes scaled new entries into every layer and returns the cache and a reduction of what it holds."""

    def forward(self, keys, values, gates, cache, cache_position=None):
        kwargs = None if cache_position is None else {"cache_position": cache_position}
        total = keys.new_zeros(())
        for layer_idx in range(len(cache)):
            all_keys, all_values, all_gates = cache.update(keys * (layer_idx + 1), values, gates, layer_idx, kwargs)
            total = total + all_keys.sum() + all_values.sum() + all_gates.sum()
        return cache, total


def new_entries(batch, seq, seed):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, KV_HEADS, seq, HEAD_DIM, generator=generator),
        torch.randn(batch, KV_HEADS, seq, HEAD_DIM, generator=generator),
        torch.randn(batch, HEADS, seq, generator=generator),
    )


def dynamic_cache(batch, past, seed):
    return DynamicCache(new_entries(batch, past, seed + layer) for layer in range(LAYERS))


def save_and_load(program):
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def assert_same_caches(got, want):
    assert type(got) is type(want) and len(got) == len(want)
    for got_layer, want_layer in zip(got, want, strict=True):
        for g, w in zip(got_layer, want_layer, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.fixture(scope="module")
def dynamic_program():
    batch, past, seq = Dim("batch", min=1, max=64), Dim("past", min=0, max=4096), Dim("seq", min=1, max=512)
    per_layer = [{0: batch, 2: past}] * LAYERS
    dynamic_shapes = ({0: batch, 2: seq}, {0: batch, 2: seq}, {0: batch, 2: seq}, [per_layer] * 3)
    example = (*new_entries(2, 3, seed=0), dynamic_cache(2, 4, seed=1))
    return torch.export.export(AppendToEveryLayer(), example, dynamic_shapes=dynamic_shapes, strict=False)


def test_exported_dynamic_cache_program_names_every_cache_tensor(dynamic_program):
    names = dynamic_program.graph_signature.user_inputs
    for field in ("keys", "values", "gates"):
        assert all(f"cache_{field}_{i}" in names for i in range(LAYERS))


@pytest.mark.parametrize(("batch", "past", "seq"), [(1, 0, 1), (2, 0, 5), (3, 7, 1), (5, 33, 4)])
def test_exported_dynamic_cache_program_matches_eager_at_any_size(dynamic_program, batch, past, seq):
    entries = new_entries(batch, seq, seed=batch + past + seq)
    want_cache, want_total = AppendToEveryLayer()(*entries, dynamic_cache(batch, past, seed=9))
    got_cache, got_total = dynamic_program.module()(*entries, dynamic_cache(batch, past, seed=9))
    assert got_cache.get_seq_length() == past + seq
    assert_same_caches(got_cache, want_cache)
    torch.testing.assert_close(got_total, want_total)


def test_saved_and_loaded_dynamic_cache_program_still_matches_eager(dynamic_program):
    loaded = save_and_load(dynamic_program)
    for batch, past in ((1, 0), (4, 6)):
        entries = new_entries(batch, 2, seed=3)
        want, _ = AppendToEveryLayer()(*entries, dynamic_cache(batch, past, seed=4))
        got, _ = loaded.module()(*entries, dynamic_cache(batch, past, seed=4))
        assert_same_caches(got, want)


def early_static_cache(batch, max_cache_len):
    cache = StaticCache(num_layers=LAYERS, max_cache_len=max_cache_len)
    cache.early_initialization(batch, KV_HEADS, HEADS, HEAD_DIM, torch.float32, "cpu")
    return cache


def test_exported_static_cache_program_writes_at_cache_position_and_round_trips():
    batch, seq = Dim("batch", min=1, max=16), Dim("seq", min=1, max=32)
    per_layer = [{0: batch}] * LAYERS
    dynamic_shapes = ({0: batch, 2: seq}, {0: batch, 2: seq}, {0: batch, 2: seq}, [per_layer] * 3, {0: seq})
    example = (*new_entries(2, 3, seed=0), early_static_cache(2, 16), torch.arange(3))
    program = torch.export.export(AppendToEveryLayer(), example, dynamic_shapes=dynamic_shapes, strict=False)
    for module in (program.module(), save_and_load(program).module()):
        for batch_size, start, length in ((1, 0, 4), (3, 5, 2)):
            entries = new_entries(batch_size, length, seed=start)
            position = torch.arange(start, start + length)
            want, _ = AppendToEveryLayer()(*entries, early_static_cache(batch_size, 16), position)
            got, _ = module(*entries, early_static_cache(batch_size, 16), position)
            assert_same_caches(got, want)
            assert got[0][0][:, :, start : start + length].abs().sum() > 0
