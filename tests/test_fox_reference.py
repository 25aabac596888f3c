"""FoxForCausalLM (float32) against the independent float64 reference in `fox_reference.py`.

Every option set is checked at prefill, at every decode step of a dynamic and of a static cache, and on a
left-padded batch, so each branch of the model (gates, shifts, norms, RoPE, GQA, caching, padding) is compared
with the specification's math rather than with another run of the same code.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from fox_reference import fox_reference_logits

from kvg_export import DynamicCache, FoxConfig, FoxForCausalLM, StaticCache
from kvg_export.fox.attention import decay_after
from kvg_export.fox.modeling import attention_pattern

SIZES = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_heads": 4,
    "intermediate_size": 48,
    "initializer_range": 0.2,
    # Far from the q/k norms' fixed 1e-5 and large enough against mean(x^2) ~ 1 that an eps taken from the
    # wrong place, or added outside the square root, moves the logits well past the tolerance.
    "norm_eps": 1e-2,
}
PRO = {
    "use_k_shift": True,
    "use_v_shift": True,
    "qk_norm": True,
    "use_output_gate": True,
    "use_output_norm": True,
    "use_rope": True,
    "rope_base": 10.0,
}
OPTIONS = {
    "base": {},
    "fgate_bias_only": {"fgate_type": "bias_only"},
    "fgate_fixed": {"fgate_type": "fixed", "fgate_bias_init": True, "decay_time_min": 2.0, "decay_time_max": 64.0},
    "fgate_none": {"fgate_type": "none"},
    "ogate_sigmoid": {"use_output_gate": True, "ogate_act": "sigmoid"},
    "ogate_silu": {"use_output_gate": True, "ogate_act": "silu"},
    "output_norm": {"use_output_norm": True},
    "output_norm_and_gate": {"use_output_norm": True, "use_output_gate": True},
    "qk_norm_per_head": {"qk_norm": True},
    "qk_norm_shared": {"qk_norm": True, "qk_norm_share_param_across_head": True},
    "k_shift": {"use_k_shift": True},
    "v_shift": {"use_v_shift": True},
    # A small base turns the angles by whole radians per step, so a wrong layout or a wrong relative position
    # (e.g. decode steps placed off the prefill's count, or pads counted in one call but not the next) shows at
    # once. Shifting every position of a row by the same offset cancels in q . k and is invisible by design.
    "rope": {"use_rope": True, "rope_base": 10.0},
    "mlp_sigmoid": {"hidden_act": "sigmoid"},
    "tied_embeddings": {"tie_word_embeddings": True},
    "gqa": {"num_kv_heads": 2},
    "gqa_pro": {"num_kv_heads": 2, **PRO},
    "pro": PRO,
}

SEQ, PREFILL, PAD = 12, 7, 3  # 7-token prefill then 5 decode steps; row 0 of the padded batch has 3 pads

# Tolerance, relative to the largest |logit| of the row compared (logits here are ~3..5 in size). The model runs
# in float32 (unit roundoff 6e-8) through 2 layers of 32-wide matmuls, norms, softmaxes and gates; the reference
# is float64. Measured worst error over every comparison in this file: 1.5e-6 of max|logit| (6.7e-6 absolute at
# max|logit| 4.5; ogate_silu decode); over four other weight/token seeds the worst was 2.2e-6. The bound is 10x
# the measured worst, i.e. 4.5e-5..7.5e-5 absolute. A genuine bug (an eps from the wrong place, swapped MLP
# halves, a missing shift, an off-by-one gate sum) moves logits by 1e-3..1, far above it.
RTOL = 1.5e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tensors are tiny: a second intra-op thread only adds wake-up latency, so run on one and restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite logits"
    error = (actual.double() - expected).abs().max().item()
    bound = RTOL * max(expected.abs().max().item(), 1.0)
    assert error <= bound, f"{what}: max |model - reference| = {error:.3g} > {bound:.3g}"


def perturb(model: FoxForCausalLM, seed: int) -> None:
    """Move every weight off its init so that no option can hide behind ones, zeros or symmetric values."""
    gen = torch.Generator().manual_seed(seed)

    def noise(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen, dtype=t.dtype)

    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is the embedding, listed once
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * noise(param))
            elif name.endswith(("fgate_proj.bias", "fgate_bias")):
                param.copy_(1.0 + 1.5 * noise(param))  # forget gates from ~0.1 to ~1
            else:
                param.add_(0.05 * noise(param))
        for name, buffer in model.named_buffers():
            if name.endswith("fgate_bias"):  # the "fixed" gate: decay-time init, perturbed
                buffer.add_(0.3 * noise(buffer))


@functools.cache
def build(option: str) -> FoxForCausalLM:
    torch.manual_seed(0)
    model = FoxForCausalLM(FoxConfig(**SIZES, **OPTIONS[option])).eval()
    perturb(model, seed=1)
    return model


def token_ids(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (rows, SEQ), generator=torch.Generator().manual_seed(seed))


_references: dict = {}


def reference(model: FoxForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    """Reference logits `[T, vocab]` for one unpadded row, memoised per model and tokens."""
    key = (id(model), tuple(tokens.tolist()))
    if key not in _references:
        _references[key] = fox_reference_logits(model.state_dict(), model.config, tokens.tolist())
    return _references[key]


def make_cache(kind: str, model: FoxForCausalLM, batch: int = 1):
    """A dynamic or static cache for `kind`; "-in-place" kinds are attended through the op the exporter lowers
    to onnxruntime's GroupQueryAttention, which writes keys and values into the buffers itself (a static
    one's allocated first, as for export)."""
    if kind.startswith("dynamic"):
        return DynamicCache()
    config = model.config
    cache = StaticCache(config.num_hidden_layers, max_cache_len=SEQ + 4)
    if kind.startswith("static-in-place"):
        cache.early_initialization(batch, config.kv_heads, config.num_heads, config.head_dim, torch.float32, "cpu")
    return cache


@torch.no_grad()
def prefill_then_decode(model, ids, mask, cache, whole_buffer: bool = False, in_place: bool = False) -> torch.Tensor:
    """Logits `[B, SEQ, vocab]`: the first PREFILL tokens in one call, then one call per token.

    Each call's mask stops after its new tokens (a static cache attends over that window), or with
    `whole_buffer` is zero-extended to the static cache's length, so the whole buffer is attended.
    `in_place` attends through `kvg::group_query_attention`.
    """

    def mask_until(stop: int) -> torch.Tensor | None:
        if mask is None:
            return None
        return F.pad(mask[:, :stop], (0, cache.max_cache_len - stop)) if whole_buffer else mask[:, :stop]

    step = functools.partial(model, past_key_values=cache, use_cache=True, in_place_attention=in_place)
    out = step(ids[:, :PREFILL], attention_mask=mask_until(PREFILL))
    assert out.past_key_values is cache
    logits = [out.logits]
    for t in range(PREFILL, SEQ):
        out = step(ids[:, t : t + 1], attention_mask=mask_until(t + 1))
        assert out.past_key_values is cache
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


def padded_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of SEQ columns; row 0 starts with PAD padding positions holding random (ignored) ids."""
    ids = token_ids(seed, rows=2)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :PAD] = 0
    return ids, mask


option_param = pytest.mark.parametrize("option", list(OPTIONS))


@option_param
def test_prefill(option):
    model = build(option)
    ids = token_ids(2)
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    assert_matches(logits[0], reference(model, ids[0]), f"{option} prefill")


def test_tied_embeddings_share_storage():
    model = build("tied_embeddings")
    assert model.lm_head.weight.data_ptr() == model.model.embeddings.weight.data_ptr()
    assert torch.equal(model.state_dict()["lm_head.weight"], model.state_dict()["model.embeddings.weight"])


@option_param
@pytest.mark.parametrize("cache_kind", ["dynamic", "dynamic-in-place", "static", "static-in-place"])
def test_decode(option, cache_kind):
    model = build(option)
    ids = token_ids(2)
    in_place = cache_kind.endswith("in-place")
    logits = prefill_then_decode(model, ids, None, make_cache(cache_kind, model), in_place=in_place)
    expected = reference(model, ids[0])
    assert_matches(logits[0, :PREFILL], expected[:PREFILL], f"{option} {cache_kind} prefill")
    for t in range(PREFILL, SEQ):
        assert_matches(logits[0, t], expected[t], f"{option} {cache_kind} decode step at position {t}")


@option_param
@pytest.mark.parametrize(
    "cache_kind",
    ["dynamic", "dynamic-in-place", "static", "static-whole-buffer", "static-in-place", "static-in-place-whole-buffer"],
)
def test_left_padded_batch(option, cache_kind):
    model = build(option)
    ids, mask = padded_batch(3)
    whole_buffer, in_place = cache_kind.endswith("whole-buffer"), "in-place" in cache_kind
    logits = prefill_then_decode(model, ids, mask, make_cache(cache_kind, model, batch=2), whole_buffer, in_place)
    for row, start in ((0, PAD), (1, 0)):
        expected = reference(model, ids[row, start:])
        for t in range(start, SEQ):
            stage = "prefill" if t < PREFILL else "decode"
            what = f"{option} {cache_kind} row {row} {stage} position {t}"
            assert_matches(logits[row, t], expected[t - start], what)


EXTREMES = [
    pytest.param("base", "model.layers.{}.attn.fgate_proj.bias", -200.0, id="full-neg200"),
    pytest.param("base", "model.layers.{}.attn.fgate_proj.bias", 200.0, id="full-pos200"),
    pytest.param("fgate_bias_only", "model.layers.{}.attn.fgate_bias", -200.0, id="bias_only-neg200"),
    pytest.param("fgate_bias_only", "model.layers.{}.attn.fgate_bias", 200.0, id="bias_only-pos200"),
]


@functools.cache
def build_extreme(option: str, key: str, value: float) -> FoxForCausalLM:
    torch.manual_seed(0)
    model = FoxForCausalLM(FoxConfig(**SIZES, **OPTIONS[option])).eval()
    perturb(model, seed=1)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in range(model.config.num_hidden_layers):
            params[key.format(n)].fill_(value)
    return model


@pytest.mark.parametrize(("option", "key", "value"), EXTREMES)
def test_extreme_gates(option, key, value):
    """Forget gates saturated at f ~ exp(-200) (attend to self only) or f ~ 1 - exp(-200) (no decay)."""
    model = build_extreme(option, key, value)
    ids = token_ids(2)
    expected = reference(model, ids[0])
    assert torch.isfinite(expected).all()
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    assert_matches(logits[0], expected, f"{option} bias {value} prefill")
    for kind in ("dynamic", "static", "dynamic-in-place", "static-in-place"):
        cache = make_cache(kind, model)
        logits = prefill_then_decode(model, ids, None, cache, in_place=kind.endswith("in-place"))
        assert_matches(logits[0], expected, f"{option} bias {value} {kind} prefill+decode")
    ids, mask = padded_batch(3)
    logits = prefill_then_decode(model, ids, mask, DynamicCache())
    assert_matches(logits[0, PAD:], reference(model, ids[0, PAD:]), f"{option} bias {value} padded row 0")
    assert_matches(logits[1], reference(model, ids[1]), f"{option} bias {value} padded row 1")


def test_a_static_mask_that_stops_before_the_new_tokens_is_refused():
    model = build("base")
    ids = token_ids(2)[:, :PREFILL]
    cache = make_cache("static", model)
    with pytest.raises(ValueError, match="must cover every filled slot and the new tokens"):
        model(ids, attention_mask=torch.ones(1, PREFILL - 1, dtype=torch.long), past_key_values=cache)


def test_in_place_attention_refuses_positions_that_are_not_consecutive():
    model = build("base")
    cache = make_cache("static-in-place", model)
    with pytest.raises(ValueError, match="consecutive cache positions"):
        model(
            token_ids(2)[:, :2], attention_mask=torch.ones(1, 4, dtype=torch.long), past_key_values=cache,
            cache_position=torch.tensor([0, 3]), in_place_attention=True,
        )  # fmt: skip


def test_a_padding_query_attends_its_own_slot_and_nothing_else():
    """Every query is allowed at least one key, so no attention kernel meets a row with every key masked."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = torch.arange(5)
    _, _, allowed = attention_pattern(mask, positions, kv_length=5, batch=2, windowed=True)
    for row in range(2):
        for query in range(5):
            real = [key for key in range(5) if mask[row, key] and key <= query]
            want = real if mask[row, query] else [query]
            assert allowed[row, 0, query].nonzero().flatten().tolist() == want


def test_decay_after_sums_the_gates_after_each_position():
    """decay_after[j] = sum of log_gates[l] for l > j (0 at the last position), against float64 sums."""
    log_gates = -torch.rand(2, 3, 17) * 5
    naive = torch.stack([log_gates.double()[..., j + 1 :].sum(-1) for j in range(17)], dim=-1)
    torch.testing.assert_close(decay_after(log_gates).double(), naive, rtol=0, atol=17 * 5 * 2e-7)


def test_decay_after_backpropagates_as_its_sums_do():
    """Training attends through gate_bias, so decay_after's gradient must be that of the sums it stands for."""
    log_gates = (-torch.rand(2, 3, 9, dtype=torch.float64)).requires_grad_()
    weights = torch.randn(2, 3, 9, dtype=torch.float64)
    (decay_after(log_gates) * weights).sum().backward()
    naive = log_gates.detach().clone().requires_grad_()
    sums = torch.stack([naive[..., j + 1 :].sum(-1) for j in range(9)], dim=-1)
    (sums * weights).sum().backward()
    torch.testing.assert_close(log_gates.grad, naive.grad)


def test_decay_after_tells_the_compiler_the_layout_it_returns():
    """`make train` compiles the loss, and the compiled code checks each custom op's output against what its fake
    said: on gates read transposed out of the model's [batch, positions, heads] (as training's are), a fake that
    followed the input's strides while the op returned contiguous sums stopped training at its first step."""
    log_gates = (-torch.rand(2, 9, 3)).transpose(1, 2)  # [batch, heads, positions], positions innermost in memory
    torch.library.opcheck(decay_after, (log_gates,), test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
