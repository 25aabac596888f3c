"""FoX checkpoints: official key names load unchanged, save/load round-trips, pickle needs consent."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from kvg_export import FoxConfig, FoxForCausalLM

SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_heads=2, intermediate_size=24)
OPTION_SETS = {
    "defaults": {},
    "pro": dict(
        use_k_shift=True, use_v_shift=True, qk_norm=True, use_output_gate=True, use_output_norm=True, use_rope=True
    ),
    "pro-shared-qk-norm": dict(
        use_k_shift=True, use_v_shift=True, qk_norm=True, qk_norm_share_param_across_head=True, use_output_gate=True
    ),
    "bias-only-gate": dict(fgate_type="bias_only", fgate_bias_init=True, decay_time_min=1.0, decay_time_max=32.0),
    "fixed-gate": dict(fgate_type="fixed", fgate_bias_init=True, decay_time_min=1.0, decay_time_max=32.0),
    "no-gate-tied": dict(fgate_type="none", tie_word_embeddings=True),
}


def official_state_dict_shapes(options: dict) -> dict[str, tuple[int, ...]]:
    """The key names and shapes the official implementation saves, written from its option list."""
    c = {**SMALL, **options}
    hidden, heads, vocab, inner = c["hidden_size"], c["num_heads"], c["vocab_size"], c["intermediate_size"]
    head_dim = hidden // heads
    keys = {"model.embeddings.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not c.get("tie_word_embeddings"):
        keys["lm_head.weight"] = (vocab, hidden)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        keys |= {
            p + "attn_norm.weight": (hidden,),
            p + "mlp_norm.weight": (hidden,),
            p + "attn.q_proj.weight": (hidden, hidden),
            p + "attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (2 * inner, hidden),
            p + "mlp.down_proj.weight": (hidden, inner),
        }
        for proj, shifted in (("k_proj", c.get("use_k_shift")), ("v_proj", c.get("use_v_shift"))):
            if shifted:
                keys |= {
                    p + f"attn.{proj}.linear.weight": (hidden, hidden),
                    p + f"attn.{proj}.shift_proj.weight": (heads, hidden),
                }
            else:
                keys[p + f"attn.{proj}.weight"] = (hidden, hidden)
        gate = c.get("fgate_type", "full")
        if gate == "full":
            keys |= {p + "attn.fgate_proj.weight": (heads, hidden), p + "attn.fgate_proj.bias": (heads,)}
        elif gate in ("bias_only", "fixed"):
            keys[p + "attn.fgate_bias"] = (heads,)
        if c.get("use_output_gate"):
            keys[p + "attn.ogate_proj.weight"] = (hidden, hidden)
        if c.get("use_output_norm"):
            keys[p + "attn.output_norm.weight"] = (hidden,)
        if c.get("qk_norm"):
            width = head_dim if c.get("qk_norm_share_param_across_head") else hidden
            keys |= {p + "attn.q_norm.weight": (width,), p + "attn.k_norm.weight": (width,)}
    return keys


def write_official_checkpoint(folder, options, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(shape, generator=generator) for k, shape in official_state_dict_shapes(options).items()}
    config = {"model_type": "forgetting_transformer-project_fox", **SMALL, **options}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return tensors


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_an_official_state_dict_loads_with_no_missing_or_unexpected_keys(tmp_path, options):
    tensors = write_official_checkpoint(tmp_path, options)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(model, FoxForCausalLM)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []
    state = model.state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor), name
    if options.get("tie_word_embeddings"):
        assert model.lm_head.weight.data_ptr() == model.model.embeddings.weight.data_ptr()


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_save_and_load_give_identical_logits(tmp_path, options):
    torch.manual_seed(1)
    model = FoxForCausalLM(FoxConfig(**SMALL, **options)).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 6))
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert AutoConfig.from_pretrained(tmp_path).to_diff_dict() == model.config.to_diff_dict()


def test_a_pickle_checkpoint_is_refused_unless_asked_for(tmp_path):
    torch.manual_seed(2)
    model = FoxForCausalLM(FoxConfig(**SMALL)).eval()
    model.save_pretrained(tmp_path, safe_serialization=False)
    assert (tmp_path / "pytorch_model.bin").is_file()
    with pytest.raises(OSError, match="allow_pickle=True"):
        FoxForCausalLM.from_pretrained(tmp_path)
    loaded = FoxForCausalLM.from_pretrained(tmp_path, allow_pickle=True).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (1, 5))
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_every_official_config_field_is_accepted_and_kept():
    fields = dict(
        vocab_size=50, hidden_size=24, hidden_ratio=3.5, intermediate_size=None, num_hidden_layers=1, num_heads=3,
        num_kv_heads=None, hidden_act="sigmoid", window_size=None, max_position_embeddings=None,
        initializer_range=0.01, elementwise_affine=True, norm_eps=1e-5, use_cache=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, attention_bias=False, fuse_norm=True,
        fuse_cross_entropy=True, rope_base=10000.0, use_rope=True, use_output_gate=True, ogate_act="silu",
        fgate_type="bias_only", fgate_bias_init=True, decay_time_min=2.0, decay_time_max=64.0,
        use_output_norm=True, qk_norm=True, qk_norm_share_param_across_head=True, use_k_shift=True,
        use_v_shift=True, log_pruning_tolerance=-10.0,
    )  # fmt: skip
    saved = FoxConfig(**fields).to_dict()
    assert {k: saved[k] for k in fields} == fields
    assert FoxConfig(**fields).mlp_size == 256  # int(24 * 3.5 * 2 / 3) = 56, rounded up to 256 as officially


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(fgate_type="sometimes"), "fgate_type"),
        (dict(fgate_type="fixed"), "fixed' needs fgate_bias_init"),
        (dict(fgate_bias_init=True), "decay_time_min"),
        (dict(decay_time_min=1.0), "only used with fgate_bias_init"),
        (dict(num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(ogate_act="tanh"), "ogate_act"),
    ],
)
def test_a_config_the_model_cannot_run_is_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        FoxConfig(**SMALL, **options)
