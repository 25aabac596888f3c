"""flash-linear-attention's FoX checkpoint format (`model_type: "forgetting_transformer"`) mapped onto the official one.

FLA's FoX is the official "LLaMA-style" FoX: no RoPE, a full forget gate, no key/value shift, no output norm, a
sigmoid output gate and per-head QK-norm. Its tensors keep the official names but for three: the forget gate
`f_proj`, the output gate `g_proj`, and the MLP, whose gate and up projections are separate where the official
model fuses them in one `gate_proj` (gate rows first). Both repeat each kv head for a group of consecutive query
heads. The config part needs no torch (the exporter's own process never imports it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FLA_MODEL_TYPE = "forgetting_transformer"
OFFICIAL_MODEL_TYPE = "forgetting_transformer-project_fox"

# FLA config fields the official config has under the same name and meaning, with FLA's defaults
CARRIED = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_heads": 32,
    "num_kv_heads": None,
    "hidden_ratio": 4,
    "intermediate_size": None,
    "hidden_act": "swish",
    "initializer_range": 0.02,
    "norm_eps": 1e-6,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "use_output_gate": False,
    "qk_norm": False,
}

# Official fields set to what FLA's FoX always is, whatever else the FLA config holds
FIXED = {
    "model_type": OFFICIAL_MODEL_TYPE,
    "fgate_type": "full",
    "fgate_bias_init": False,
    "decay_time_min": None,
    "decay_time_max": None,
    "ogate_act": "sigmoid",
    "qk_norm_share_param_across_head": False,  # FLA's q/k norms are GroupNorms: weights [hidden] and [kv_dim]
    "use_rope": False,
    "max_position_embeddings": None,  # FLA has no position encoding, so no limit
    "use_k_shift": False,
    "use_v_shift": False,
    "use_output_norm": False,
    "window_size": None,
    "attention_bias": False,
}

# FLA fields left out: training-only switches, one FLA stores and never reads, and FLA's own class names
IGNORED = (
    "fuse_norm",
    "fuse_swiglu",
    "fuse_cross_entropy",
    "fuse_linear_cross_entropy",
    "use_l2warp",
    "elementwise_affine",
    "architectures",
    "auto_map",
)

# FLA options with no counterpart in the official FoX: (is the value one the official FoX cannot run, why)
REFUSED = {
    "qkv_bias": (lambda value: bool(value), "the official FoX has no q/k/v projection biases"),
    "window_size": (
        lambda value: value is not None,
        "FLA trims its decode cache to the last window_size tokens, which the FoX model here does not",
    ),
    "attnres_block_size": (
        lambda value: value is not None,
        "AttnRes residual mixing (attn_res_proj, mlp_res_proj, res_proj) has no counterpart in the official FoX",
    ),
    "hidden_act": (
        lambda value: value not in (None, "swish"),
        "the official FoX MLP is SwiGLU ('swish'); FLA's other activations have no counterpart",
    ),
}

# State-dict keys: FLA's name -> the official name (by suffix, in every layer)
RENAMED = {
    "attn.f_proj.weight": "attn.fgate_proj.weight",
    "attn.f_proj.bias": "attn.fgate_proj.bias",
    "attn.g_proj.weight": "attn.ogate_proj.weight",
}
# FLA's separate MLP projections [intermediate, hidden] each, stacked in this order into the official fused one
FUSED_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
OFFICIAL_MLP = "mlp.gate_proj.weight"  # [2 * intermediate, hidden]


def is_fla(config: dict) -> bool:
    """Whether a config.json dict is in FLA's FoX format."""
    return config.get("model_type") == FLA_MODEL_TYPE


def official_config(fla: dict) -> dict:
    """The official-format config dict for FLA config dict `fla`; ValueError naming every option it cannot map.

    Fields the table above does not name are kept as they are (FLA keeps unknown fields as plain attributes and
    never reads them, and so does FoxConfig)."""
    refused = [
        f"{name}={fla[name]!r}: {why}" for name, (cannot, why) in REFUSED.items() if name in fla and cannot(fla[name])
    ]
    if refused:
        raise ValueError("this FLA FoX checkpoint cannot be mapped onto the official FoX: " + "; ".join(refused))
    kept = {name: value for name, value in fla.items() if name not in (*IGNORED, *REFUSED, *CARRIED)}
    carried = {name: fla.get(name, default) for name, default in CARRIED.items()}
    return kept | carried | FIXED


def official_state_dict(fla_state: dict[str, torch.Tensor], fla: dict) -> dict[str, torch.Tensor]:
    """The official state dict for FLA tensors `fla_state` of a model with FLA config dict `fla`.

    Keys the tables do not name keep their names (most are the same in both formats). With tied embeddings the
    output embedding is the input one, as transformers ties them on load (FLA's saves leave `lm_head` out)."""
    import torch

    state = {}
    for key, tensor in fla_state.items():
        prefix, suffix = _split(key, (*RENAMED, *FUSED_MLP))
        if suffix == FUSED_MLP[0]:
            parts = [prefix + part for part in FUSED_MLP]
            if parts[1] not in fla_state:
                raise ValueError(f"the FLA checkpoint has {key} but not {parts[1]}, its other half")
            state[prefix + OFFICIAL_MLP] = torch.cat([fla_state[part] for part in parts])
        elif suffix != FUSED_MLP[1]:  # the up projection went into the fused one with its gate
            state[prefix + RENAMED.get(suffix, suffix)] = tensor
    if fla.get("tie_word_embeddings", CARRIED["tie_word_embeddings"]):
        state["lm_head.weight"] = state["model.embeddings.weight"]
    return state


def _split(key: str, suffixes: tuple[str, ...]) -> tuple[str, str]:
    """(prefix, suffix) for the first of `suffixes` that `key` ends with, else ("", key)."""
    for suffix in suffixes:
        if key.endswith("." + suffix):
            return key[: -len(suffix)], suffix
    return "", key
