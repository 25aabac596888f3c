"""FLA-format FoX checkpoints (flash-linear-attention's `forgetting_transformer`) load and export as the official FoX.

Each test makes an official checkpoint with random weights, then writes it in FLA's format with this file's own
conversion, written from FLA's side: its config fields, its tensor names, its separate MLP gate and up projections.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from exporters.pipeline.export import export_artifact
from exporters.pipeline.options import ExportOptions
from kvg_export import FoxConfig, FoxForCausalLM
from kvg_export.presets import load_model
from runtime.artifact import SessionOptions
from runtime.decode.generator import GenerationConfig, Generator

OFFICIAL = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
    qk_norm=True, use_output_gate=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
IDS = [5, 17, 42, 8, 33, 61, 12, 9, 27, 50]
# The official names FLA spells differently; FLA's MLP gate and up projections are the halves of official gate_proj
FLA_NAMES = {"attn.fgate_proj.": "attn.f_proj.", "attn.ogate_proj.": "attn.g_proj."}


def official_model(tied: bool) -> FoxForCausalLM:
    """A small GQA FoX with QK-norm and an output gate, every parameter random (norm weights near 1)."""
    torch.manual_seed(0)
    model = FoxForCausalLM(FoxConfig(**OFFICIAL, tie_word_embeddings=tied))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn_like(parameter)
            parameter.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.4 * noise)
    return model.eval()


SIZES_AND_TOKENS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "num_kv_heads", "intermediate_size",
                    "pad_token_id", "bos_token_id", "eos_token_id")  # fmt: skip


def fla_config(official: dict) -> dict:
    """FLA's ForgettingTransformerConfig fields for the same model, as FLA's save_pretrained writes them."""
    return {
        "model_type": "forgetting_transformer",
        "architectures": ["ForgettingTransformerForCausalLM"],
        **{name: official[name] for name in SIZES_AND_TOKENS},
        "qkv_bias": False,
        "qk_norm": official["qk_norm"],
        "window_size": None,
        "use_output_gate": official["use_output_gate"],
        "hidden_ratio": 4,
        "hidden_act": "swish",
        "initializer_range": 0.02,
        "elementwise_affine": True,
        "norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": official["tie_word_embeddings"],
        "fuse_norm": True,
        "fuse_swiglu": True,
        "fuse_cross_entropy": True,
        "fuse_linear_cross_entropy": False,
        "use_l2warp": False,
        "attnres_block_size": None,
        "torch_dtype": "float32",
    }


def fla_state_dict(model: FoxForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under FLA's names; a tied lm_head is left out, as FLA's saves leave it."""
    inner = model.config.intermediate_size
    tensors = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if key.endswith(".mlp.gate_proj.weight"):
            layer = key.removesuffix("gate_proj.weight")
            tensors[layer + "gate_proj.weight"], tensors[layer + "up_proj.weight"] = tensor[:inner], tensor[inner:]
            continue
        for official, fla in FLA_NAMES.items():
            key = key.replace(official, fla)
        tensors[key] = tensor
    return {key: tensor.clone().contiguous() for key, tensor in tensors.items()}


def write_fla_checkpoint(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def write_checkpoints(tmp_path: Path, tied: bool) -> tuple[FoxForCausalLM, Path, Path]:
    """(the official model, its official folder, the same model as an FLA folder)."""
    model = official_model(tied)
    official = tmp_path / "official"
    model.save_pretrained(official, safe_serialization=True)
    fla = write_fla_checkpoint(tmp_path / "fla", fla_config(model.config.to_dict()), fla_state_dict(model))
    return model, official, fla


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def checkpoints(request, tmp_path) -> tuple[FoxForCausalLM, Path, Path]:
    return write_checkpoints(tmp_path, tied=request.param)


def fla_reference_logits(state: dict[str, torch.Tensor], config: dict, ids: list[int]) -> torch.Tensor:
    """Logits `[seq, vocab]` in float64, computed as FLA's FoX defines them, from its tensors and config alone.

    GroupNorm (RMS) over each head's block of the flat q and k projections, eps 1e-5; forget gate logsigmoid(f_proj);
    each kv head serves a group of consecutive query heads (einops `b t h d -> b t (h g) d`); sigmoid(g_proj) output
    gate; SwiGLU MLP down(silu(gate(x)) * up(x))."""
    w = {name: tensor.double() for name, tensor in state.items()}
    heads, kv_heads, eps = config["num_heads"], config["num_kv_heads"], config["norm_eps"]
    seq, head_dim = len(ids), config["hidden_size"] // heads

    def rms(x, weight, eps, groups=1):
        blocks = x.view(seq, groups, -1)
        return (blocks / blocks.pow(2).mean(-1, keepdim=True).add(eps).sqrt()).view(seq, -1) * weight

    h = w["model.embeddings.weight"][ids]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        x = rms(h, w[p + "attn_norm.weight"], eps)
        q = rms(x @ w[p + "attn.q_proj.weight"].T, w[p + "attn.q_norm.weight"], 1e-5, heads).view(seq, heads, -1)
        k = rms(x @ w[p + "attn.k_proj.weight"].T, w[p + "attn.k_norm.weight"], 1e-5, kv_heads)
        v = x @ w[p + "attn.v_proj.weight"].T
        k, v = (t.view(seq, kv_heads, 1, head_dim).expand(-1, -1, heads // kv_heads, -1).reshape(seq, heads, -1)
                for t in (k, v))  # fmt: skip
        log_f = F.logsigmoid(x @ w[p + "attn.f_proj.weight"].T + w[p + "attn.f_proj.bias"])  # [seq, heads]
        summed = log_f.cumsum(0).T  # [heads, seq]
        scores = torch.einsum("ihd,jhd->hij", q * head_dim**-0.5, k) + summed[:, :, None] - summed[:, None, :]
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hij,jhd->ihd", weights, v).reshape(seq, -1)
        h = h + (torch.sigmoid(x @ w[p + "attn.g_proj.weight"].T) * o) @ w[p + "attn.o_proj.weight"].T
        x = rms(h, w[p + "mlp_norm.weight"], eps)
        up = F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
        h = h + up @ w[p + "mlp.down_proj.weight"].T
    h = rms(h, w["model.norm.weight"], eps)
    return h @ w.get("lm_head.weight", w["model.embeddings.weight"]).T


def test_an_fla_checkpoint_loads_as_the_official_model_it_was_made_from(checkpoints):
    _, official, fla = checkpoints
    ids = torch.tensor([IDS])
    with torch.no_grad():
        assert torch.equal(load_model(fla)(ids).logits, load_model(official)(ids).logits)


def test_the_loaded_fla_checkpoint_computes_what_fla_defines(checkpoints):
    _, _, fla = checkpoints
    config = json.loads((fla / "config.json").read_text())
    want = fla_reference_logits(load_file(fla / "model.safetensors"), config, IDS)
    with torch.no_grad():
        got = load_model(fla)(torch.tensor([IDS])).logits[0].double()
    assert (got - want).abs().max() < 1e-5 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize(
    "option", [("qkv_bias", True), ("window_size", 512), ("attnres_block_size", 2), ("hidden_act", "powlu")],
    ids=lambda option: option[0],
)  # fmt: skip
def test_an_fla_option_the_official_fox_lacks_is_refused_by_name(tmp_path, option):
    name, value = option
    model = official_model(tied=False)
    config = fla_config(model.config.to_dict()) | {name: value}
    fla = write_fla_checkpoint(tmp_path / "fla", config, fla_state_dict(model))
    with pytest.raises(ValueError, match=rf"\b{name}={value!r}: \w"):
        load_model(fla)


def test_a_tensor_the_official_model_has_no_place_for_is_refused(tmp_path):
    model = official_model(tied=False)
    tensors = fla_state_dict(model) | {"model.layers.0.attn.q_proj.bias": torch.zeros(OFFICIAL["hidden_size"])}
    fla = write_fla_checkpoint(tmp_path / "fla", fla_config(model.config.to_dict()), tensors)
    with pytest.raises(RuntimeError, match=r"Unexpected key.*model\.layers\.0\.attn\.q_proj\.bias"):
        load_model(fla)


def test_the_config_mapping_imports_no_torch():
    """The exporter's own process, which never imports torch, maps an FLA config for the artifact's config.json."""
    probe = (
        "import sys\n"
        "from kvg_export.fla_format import official_config\n"
        "print(official_config({'model_type': 'forgetting_transformer'})['model_type'], 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["forgetting_transformer-project_fox", "False"]


def test_an_fla_checkpoint_exports_to_an_artifact_that_matches_the_official_eager_model(tmp_path):
    model, _, fla = write_checkpoints(tmp_path, tied=True)  # tied: the FLA file has no lm_head to export
    out = tmp_path / "artifact" / "fla"
    lines = []
    result = export_artifact(ExportOptions(str(fla), out, "dynamic", separate_process=False), log=lines.append)
    assert result.report.passed
    generator = Generator.open(out, SessionOptions(provider="cpu"))
    got = generator.generate([IDS], GenerationConfig(max_new_tokens=8, min_new_tokens=8)).tokens[0]
    with torch.no_grad():
        prompt = torch.tensor([IDS])
        want = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(IDS) :].tolist()
        eager = model(prompt).logits.numpy()
    assert got == want
    logits = generator.teacher_forced_logits(np.array([IDS]))
    assert np.abs(logits - eager).max() < 1e-4 * max(1.0, float(np.abs(eager).max()))
    # transformers reads the artifact as the official FoX it is: its config.json is the mapped one
    shaped = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "kv_heads", "mlp_size", "fgate_type",
              "qk_norm", "qk_norm_share_param_across_head", "use_output_gate", "ogate_act", "use_output_norm",
              "use_k_shift", "use_v_shift", "use_rope", "tie_word_embeddings")  # fmt: skip
    artifact_config = FoxConfig.from_pretrained(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "forgetting_transformer-project_fox"
    assert {name: getattr(artifact_config, name) for name in shaped} == {
        name: getattr(model.config, name) for name in shaped
    }
