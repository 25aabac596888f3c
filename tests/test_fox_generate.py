"""generate() with the gated caches gives what a cache-free computation gives."""

import pytest
import torch

from kvg_export import DynamicCache, FoxConfig, FoxForCausalLM, StaticCache

PRO = dict(use_k_shift=True, use_v_shift=True, qk_norm=True, use_output_gate=True, use_output_norm=True, use_rope=True)
CONFIGS = {
    "fox": {},
    "pro": PRO,
    "gqa-pro": dict(PRO, num_kv_heads=2),
}
CACHES = ["dynamic", "static"]
PAD = 0


@pytest.fixture(scope="module", params=CONFIGS.values(), ids=CONFIGS.keys())
def model(request):
    torch.manual_seed(3)
    config = FoxConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_heads=4, intermediate_size=48,
        initializer_range=0.2, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, **request.param,
    )  # fmt: skip
    return FoxForCausalLM(config).eval()


def prompts(lengths, seed=0):
    """A left-padded batch of random prompts of the given lengths (no special ids inside)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, 96, (n,), generator=generator)
        mask[row, width - n :] = 1
    return ids, mask


def generate(model, ids, mask, cache, **kwargs):
    options = {"max_new_tokens": 8, "min_new_tokens": 8, "pad_token_id": PAD, "do_sample": False, **kwargs}
    if cache == "static":
        options["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **options)[:, ids.shape[1] :]


def greedy_without_cache(model, ids, steps):
    """Argmax decoding with one full forward pass per token: no cache involved."""
    with torch.no_grad():
        for _ in range(steps):
            logits = model(ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("cache", CACHES)
def test_greedy_generate_matches_cache_free_decoding(model, cache):
    ids, mask = prompts([6])
    want = greedy_without_cache(model, ids, 8)[:, 6:]
    assert torch.equal(generate(model, ids, mask, cache), want)


@pytest.mark.parametrize("cache", CACHES)
def test_each_row_of_a_left_padded_batch_generates_what_it_generates_alone(model, cache):
    lengths = [3, 7, 5]
    ids, mask = prompts(lengths, seed=1)
    batch = generate(model, ids, mask, cache)
    for row, n in enumerate(lengths):
        alone = greedy_without_cache(model, ids[row : row + 1, -n:], 8)[:, n:]
        assert torch.equal(batch[row : row + 1], alone), f"row {row}"


@pytest.mark.parametrize("cache", CACHES)
def test_seeded_sampling_is_the_same_with_and_without_a_cache(model, cache):
    ids, mask = prompts([4, 6], seed=2)
    sampled = []
    for use_cache, kind in ((True, cache), (False, "dynamic")):
        torch.manual_seed(7)
        sampled.append(generate(model, ids, mask, kind, do_sample=True, top_k=20, temperature=1.3, use_cache=use_cache))
    assert torch.equal(*sampled)


@pytest.mark.parametrize("cache", CACHES)
def test_beam_search_reorders_the_cache_like_recomputation(model, cache):
    ids, mask = prompts([5, 3], seed=3)
    with_cache = generate(model, ids, mask, cache, num_beams=3)
    without = generate(model, ids, mask, "dynamic", num_beams=3, use_cache=False)
    assert torch.equal(with_cache, without)


def test_generate_fills_the_cache_kind_it_was_asked_for(model):
    ids, mask = prompts([4])
    for kind, cls in (("dynamic", DynamicCache), ("static", StaticCache)):
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, pad_token_id=PAD, do_sample=False,
            return_dict_in_generate=True, **({"cache_implementation": "static"} if kind == "static" else {}),
        )  # fmt: skip
        assert isinstance(out.past_key_values, cls)
        assert out.past_key_values.get_seq_length() == 4 + 3 - 1  # the last token is sampled, not yet fed


def test_an_unknown_cache_implementation_is_refused(model):
    ids, mask = prompts([4])
    with pytest.raises(ValueError, match="not supported by FoX"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="quantized")
