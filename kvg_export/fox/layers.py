"""FoX's building blocks besides attention: norms, token shift, rotary embedding, gated MLP.

Each computes in float32 where the official Triton kernels do and returns the input dtype.
Parameter names match the official checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QK_NORM_EPS = 1e-5  # the official q/k norms use their class default, not config.norm_eps


def rms_normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in float32, returned in x's dtype.

    Written with a division, not rsqrt: onnxruntime fuses Pow-ReduceMean-Add-Sqrt-Div-Mul into one
    SimplifiedLayerNormalization, but not the Reciprocal that rsqrt lowers to.
    """
    x32 = x.float()
    scaled = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (scaled * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_normalize(x, self.weight, self.eps)


class HeadRMSNorm(nn.Module):
    """RMSNorm of each head's channels of `[..., heads, head_dim]`.

    The weight is `[heads * head_dim]` (a group norm, as the official output norm and unshared
    QK-norm store it) or `[head_dim]` when shared across heads.
    """

    def __init__(self, heads: int, head_dim: int, eps: float, shared: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim if shared else heads * head_dim))
        self.head_dim, self.eps = head_dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_normalize(x, self.weight.view(-1, self.head_dim), self.eps)


def token_shift(
    raw: torch.Tensor, logits: torch.Tensor, previous: torch.Tensor | None, keep: torch.Tensor | None, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """out_t = a_t * raw_{t-1} + (1 - a_t) * raw_t per head, with a = sigmoid(logits) `[batch, seq, heads]`.

    `previous` `[batch, width]` is raw of the token before this chunk (zeros at the start); `keep` `[batch, seq]`
    zeroes raw at padding, so a left-padded row starts as if unpadded. Returns the mixed `[batch, seq, width]` and raw
    of the chunk's last token, the next chunk's `previous`.
    """
    if keep is not None:
        raw = raw * keep.unsqueeze(-1).to(raw.dtype)
    if previous is None:
        previous = raw.new_zeros(raw.shape[0], raw.shape[2])
    before = torch.cat([previous.unsqueeze(1).to(raw.dtype), raw], dim=1)[:, :-1]
    batch, seq, width = raw.shape
    weight = torch.sigmoid(logits.float()).unsqueeze(-1)  # [batch, seq, heads, 1]
    mixed = weight * before.float().view(batch, seq, heads, -1)
    mixed = mixed + (1 - weight) * raw.float().view(batch, seq, heads, -1)
    return mixed.view(batch, seq, width).to(raw.dtype), raw[:, -1]


class ShiftLinear(nn.Module):
    """A projection mixed with the previous token's projection by a per-head, per-token sigmoid weight:
    `token_shift` of raw = linear(x) with logits shift_proj(x)."""

    def __init__(self, in_features: int, out_features: int, heads: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.shift_proj = nn.Linear(in_features, heads, bias=False)
        self.heads = heads

    def forward(
        self, x: torch.Tensor, previous: torch.Tensor | None, keep: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return token_shift(self.linear(x), self.shift_proj(x), previous, keep, self.heads)


def rotate(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding in the half-rotation (GPT-NeoX) layout.

    x `[batch, seq, heads, head_dim]`, positions `[batch, seq]`.
    """
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim))
    angles = positions.float().unsqueeze(-1) * inv_freq  # [batch, seq, head_dim / 2]
    cos, sin = angles.cos().unsqueeze(2).to(x.dtype), angles.sin().unsqueeze(2).to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class GatedMLP(nn.Module):
    """down(act(gate) * up), with gate and up fused in one projection, gate first (official layout)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = F.silu if hidden_act == "swish" else torch.sigmoid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
