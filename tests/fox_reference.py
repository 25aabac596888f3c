"""A naive, independent float64 reference of the Forgetting Transformer (FoX) forward pass.

Written from the FoX specification, not from `kvg_export`: it reads only a model's `state_dict()` and its
config's plain fields, and recomputes everything in float64 with explicit loops over query and key positions
for the attention. It runs ONE unpadded row of tokens and returns the logits at every position.

    s_ij = q_i . k_j / sqrt(d) + sum_{l=j+1..i} log f_l,   j <= i,   o_i = sum_j softmax_j(s_ij) v_j
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

QK_NORM_EPS = 1e-5  # the q/k norms use eps 1e-5, never config.norm_eps


def log_sigmoid(z: float) -> float:
    """log(sigmoid(z)) without overflow or cancellation for any finite z."""
    if z >= 0:
        return -math.log1p(math.exp(-z))
    return z - math.log1p(math.exp(z))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * sigmoid(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim."""
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def per_head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise each head of x `[T, heads, d]`; weight `[d]` (shared) or `[heads * d]` (head h: h*d:(h+1)*d)."""
    heads, d = x.shape[1], x.shape[2]
    out = torch.empty_like(x)
    for h in range(heads):
        w = weight if weight.numel() == d else weight[h * d : (h + 1) * d]
        out[:, h, :] = rms_norm(x[:, h, :], w, eps)
    return out


def rope(u: torch.Tensor, base: float) -> torch.Tensor:
    """Half-rotation rotary embedding of u `[T, heads, d]`; token t sits at position t."""
    seq, _, d = u.shape
    half = d // 2
    out = torch.empty_like(u)
    for t in range(seq):
        for m in range(half):
            angle = t * (1.0 / base ** (2.0 * m / d))
            cos, sin = math.cos(angle), math.sin(angle)
            u1, u2 = u[t, :, m], u[t, :, half + m]
            out[t, :, m] = u1 * cos - u2 * sin
            out[t, :, half + m] = u1 * sin + u2 * cos
    return out


def project_kv(x: torch.Tensor, weights: Mapping[str, torch.Tensor], prefix: str, shifted: bool, kv_heads: int):
    """k or v `[T, kv_heads, d]`; with a shift, mix each token's projection with the previous token's (0 before t=0)."""
    if not shifted:
        out = x @ weights[prefix + ".weight"].T
        return out.view(x.shape[0], kv_heads, -1)
    raw = (x @ weights[prefix + ".linear.weight"].T).view(x.shape[0], kv_heads, -1)
    alpha = sigmoid(x @ weights[prefix + ".shift_proj.weight"].T)  # [T, kv_heads], weight on the previous token
    out = torch.empty_like(raw)
    for t in range(x.shape[0]):
        previous = raw[t - 1] if t > 0 else torch.zeros_like(raw[t])
        for h in range(kv_heads):
            out[t, h] = alpha[t, h] * previous[h] + (1.0 - alpha[t, h]) * raw[t, h]
    return out


def log_forget_gates(x: torch.Tensor, weights: Mapping[str, torch.Tensor], fgate_type: str, heads: int) -> list:
    """log f as a python list `[T][heads]` of floats."""
    seq = x.shape[0]
    if fgate_type == "none":
        return [[0.0] * heads for _ in range(seq)]
    if fgate_type == "full":
        logits = x @ weights["attn.fgate_proj.weight"].T + weights["attn.fgate_proj.bias"]
        return [[log_sigmoid(float(logits[t, h])) for h in range(heads)] for t in range(seq)]
    if fgate_type in ("bias_only", "fixed"):
        bias = weights["attn.fgate_bias"]
        return [[log_sigmoid(float(bias[h])) for h in range(heads)] for _ in range(seq)]
    raise ValueError(f"unknown fgate_type {fgate_type!r}")


def attention(x: torch.Tensor, weights: Mapping[str, torch.Tensor], config) -> torch.Tensor:
    seq, hidden = x.shape
    heads = config.num_heads
    kv_heads = config.num_kv_heads or heads
    d = hidden // heads
    group = heads // kv_heads

    q = (x @ weights["attn.q_proj.weight"].T).view(seq, heads, d)
    k = project_kv(x, weights, "attn.k_proj", config.use_k_shift, kv_heads)
    v = project_kv(x, weights, "attn.v_proj", config.use_v_shift, kv_heads)
    if config.qk_norm:
        q = per_head_rms_norm(q, weights["attn.q_norm.weight"], QK_NORM_EPS)
        k = per_head_rms_norm(k, weights["attn.k_norm.weight"], QK_NORM_EPS)
    if config.use_rope:
        q, k = rope(q, config.rope_base), rope(k, config.rope_base)
    lf = log_forget_gates(x, weights, config.fgate_type, heads)

    o = torch.zeros(seq, heads, d, dtype=torch.float64)
    for h in range(heads):
        g = h // group
        for i in range(seq):
            scores = []
            for j in range(i + 1):
                decay = 0.0
                for m in range(j + 1, i + 1):
                    decay += lf[m][h]
                scores.append(float(torch.dot(q[i, h], k[j, g])) / math.sqrt(d) + decay)
            top = max(scores)
            exps = [math.exp(s - top) for s in scores]
            total = sum(exps)
            for j in range(i + 1):
                o[i, h] += (exps[j] / total) * v[j, g]

    if config.use_output_norm:
        o = per_head_rms_norm(o, weights["attn.output_norm.weight"], config.norm_eps)
    o = o.reshape(seq, heads * d)
    if config.use_output_gate:
        gate = x @ weights["attn.ogate_proj.weight"].T
        o = (sigmoid(gate) if config.ogate_act == "sigmoid" else silu(gate)) * o
    return o @ weights["attn.o_proj.weight"].T


def mlp(x: torch.Tensor, weights: Mapping[str, torch.Tensor], hidden_act: str) -> torch.Tensor:
    y = x @ weights["mlp.gate_proj.weight"].T
    width = y.shape[-1] // 2
    gate, up = y[:, :width], y[:, width:]
    act = silu(gate) if hidden_act == "swish" else sigmoid(gate)
    return (act * up) @ weights["mlp.down_proj.weight"].T


def fox_reference_logits(state_dict: Mapping[str, torch.Tensor], config, input_ids: Sequence[int]) -> torch.Tensor:
    """Logits `[T, vocab]` in float64 for one unpadded row of token ids."""
    sd = {name: tensor.detach().to(torch.float64).cpu() for name, tensor in state_dict.items()}
    ids = [int(t) for t in input_ids]
    h = sd["model.embeddings.weight"][ids]
    for n in range(config.num_hidden_layers):
        prefix = f"model.layers.{n}."
        weights = {name[len(prefix) :]: t for name, t in sd.items() if name.startswith(prefix)}
        h = h + attention(rms_norm(h, weights["attn_norm.weight"], config.norm_eps), weights, config)
        h = h + mlp(rms_norm(h, weights["mlp_norm.weight"], config.norm_eps), weights, config.hidden_act)
    h = rms_norm(h, sd["model.norm.weight"], config.norm_eps)
    head = sd.get("lm_head.weight", sd["model.embeddings.weight"])
    return h @ head.T
