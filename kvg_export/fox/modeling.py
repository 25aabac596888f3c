"""The FoX decoder for transformers: official module and parameter names, gated caches, pure PyTorch.

Beyond the official implementation: GQA (`num_kv_heads`), left-padded batches in prefill and decode
(padding is masked from attention and zeroed before the token shift), chunked prefill that reads the
cached shift state, and no Triton.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from kvg_export.cache import DynamicCache, GatedCache, StaticCache
from kvg_export.cache_layers import SHIFT_FIELDS, gate_slots, is_tracing
from kvg_export.fox.attention import decay_after, forgetting_attention
from kvg_export.fox.configuration import FoxConfig
from kvg_export.fox.fused_attention import fox_attention
from kvg_export.fox.in_place_attention import group_query_attention
from kvg_export.fox.layers import QK_NORM_EPS, GatedMLP, HeadRMSNorm, RMSNorm, ShiftLinear, rotate
from runtime.contract import operator_shifts

SHIFT_FIELD = {"k_proj": "key_shift", "v_proj": "value_shift"}  # the cache's state of each projection's token shift
# With a cache, a longer input runs through the layers in chunks of this many tokens, as the runtime prefills
PREFILL_CHUNK = 256


def decay_time_bias(heads: int, decay_time_min: float, decay_time_max: float) -> torch.Tensor:
    """Forget-gate biases b_h with sigmoid(b_h) = exp(-1/T_h), decay times T_h log-spaced in [min, max]."""
    times = torch.exp(torch.linspace(math.log(decay_time_min), math.log(decay_time_max), heads, dtype=torch.float64))
    return (-torch.log(torch.expm1(1.0 / times))).float()


class ForgettingAttention(nn.Module):
    def __init__(self, config: FoxConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        hidden, heads, kv_heads, head_dim = config.hidden_size, config.num_heads, config.kv_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = self._kv_projection(config.use_k_shift)
        self.v_proj = self._kv_projection(config.use_v_shift)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        if config.fgate_type == "full":
            self.fgate_proj = nn.Linear(hidden, heads, bias=True)
        elif config.fgate_type == "bias_only":
            self.fgate_bias = nn.Parameter(torch.zeros(heads))
        elif config.fgate_type == "fixed":
            self.register_buffer("fgate_bias", torch.zeros(heads))
        if config.use_output_gate:
            self.ogate_proj = nn.Linear(hidden, heads * head_dim, bias=False)
            self.ogate_act = torch.sigmoid if config.ogate_act == "sigmoid" else F.silu
        if config.use_output_norm:
            self.output_norm = HeadRMSNorm(heads, head_dim, config.norm_eps)
        if config.qk_norm:
            shared = config.qk_norm_share_param_across_head
            self.q_norm = HeadRMSNorm(heads, head_dim, QK_NORM_EPS, shared)
            self.k_norm = HeadRMSNorm(kv_heads, head_dim, QK_NORM_EPS, shared)

    def _kv_projection(self, shifted: bool) -> nn.Module:
        width = self.kv_heads * self.head_dim
        if shifted:
            return ShiftLinear(self.config.hidden_size, width, self.kv_heads)
        return nn.Linear(self.config.hidden_size, width, bias=False)

    def reset_forget_gate_bias(self) -> None:
        """Decay-time init of the forget-gate bias when the config asks for it, else zero."""
        bias = self.fgate_proj.bias if self.config.fgate_type == "full" else getattr(self, "fgate_bias", None)
        if bias is None:
            return
        with torch.no_grad():
            if self.config.fgate_bias_init:
                bias.copy_(decay_time_bias(self.heads, self.config.decay_time_min, self.config.decay_time_max))
            else:
                bias.zero_()

    def log_forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """log f per head and token `[batch, heads, seq]`, float32.

        -softplus(-z) lowers to ONNX Softplus and stays exact where Log(Sigmoid(z)) underflows.
        """
        kind = self.config.fgate_type
        if kind == "none":
            return x.new_zeros(x.shape[0], self.heads, x.shape[1], dtype=torch.float32)
        logits = self.fgate_proj(x).float().transpose(1, 2) if kind == "full" else self.fgate_bias.float()[:, None]
        return (-F.softplus(-logits)).expand(x.shape[0], self.heads, x.shape[1])

    def _project(self, name: str, x: torch.Tensor, keep: torch.Tensor | None, cache: GatedCache | None):
        """k or v projection; with a token shift, reads and stores the cached previous projection."""
        projection = getattr(self, name)
        if not isinstance(projection, ShiftLinear):
            return projection(x)
        mixed, last = projection(x, self._shift_state(name, cache), keep)
        if cache is not None:
            cache.update_shift(self.layer_idx, **{SHIFT_FIELD[name]: last})
        return mixed

    def _shift_state(self, name: str, cache: GatedCache | None) -> torch.Tensor | None:
        """The cached state of k or v projection's token shift: its last token's projection (None before the first)."""
        return None if cache is None else cache.shift_states(self.layer_idx)[SHIFT_FIELDS.index(SHIFT_FIELD[name])]

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache_position: torch.Tensor,
        keep: torch.Tensor | None,
        allowed: torch.Tensor,
        cache: GatedCache | None,
        in_place: bool | str = False,
        window_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x `[batch, seq, hidden]`; positions `[batch, seq]` (RoPE); keep `[batch, seq]` real tokens;
        allowed `[batch or 1, 1, seq, window]` the attention pattern; `in_place` (True, or "fused"), `window_offsets`:
        see `_attend_in_place`."""
        batch, seq, _ = x.shape
        starts = None if window_offsets is None else window_offsets[self.layer_idx]
        if in_place == "fused":  # `allowed` is then the window's attention mask, from which the op builds the pattern
            return self.o_proj(self._attend_fused(x, positions, cache_position, keep, allowed, cache, starts))
        query = self.q_proj(x)  # [batch, seq, heads * head_dim]; keys and values likewise with kv_heads
        keys = self._project("k_proj", x, keep, cache)
        values = self._project("v_proj", x, keep, cache)
        if self.config.qk_norm or self.config.use_rope:
            query, keys = self._per_head(query, keys, positions)
        if in_place:
            log_gates = self._masked_log_gates(x, keep)
            out = self._attend_in_place(query, keys, values, log_gates, cache_position, allowed, cache, starts)
        else:
            log_gates = self._masked_log_gates(x, keep)
            out = self._attend(query, keys, values, log_gates, cache_position, allowed, cache)
        if self.config.use_output_norm:
            out = self.output_norm(out.view(batch, seq, self.heads, self.head_dim)).flatten(2)
        if self.config.use_output_gate:
            out = self.ogate_act(self.ogate_proj(x)) * out
        return self.o_proj(out)

    def _masked_log_gates(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """The log forget gates, 0 at padding (`keep` false), so that no decay passes through it."""
        log_gates = self.log_forget_gate(x)
        return log_gates if keep is None else log_gates * keep[:, None, :].float()

    def _gate_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forget gate's pre-activation `[batch, seq, heads]` and a bias `[heads]` to add to it (None: 0; +inf: no
        forget gate, whose log gate -softplus(-inf) is 0), as the fused op takes them. The projection keeps its bias
        (through its module, whose name the graph's MatMul then bears, as quantization's choices read it)."""
        kind = self.config.fgate_type
        if kind == "full":
            return self.fgate_proj(x).float(), None
        zeros = x.new_zeros(*x.shape[:2], self.heads, dtype=torch.float32)
        if kind == "none":
            return zeros, torch.full((self.heads,), float("inf"), device=x.device)
        return zeros, self.fgate_bias.float()

    def _attend_fused(self, x, positions, cache_position, keep, attention_mask, cache, starts) -> torch.Tensor:
        """A step as one `kvg::fox_attention` op, which the exporter lowers to the fused FoX operator: it computes the
        log forget gates from their logits, writes them, the keys and the values into the cache buffers itself, and
        attends each kv head's own window (`starts` as in `_attend_in_place`) with the pattern it builds from the
        window's `attention_mask` `[batch or 1, window]`; and it does FoX-Pro's token shift (its states read from and
        stored in the cache), QK-norm, output norm and output gate. With RoPE, which turns queries and keys between
        QK-norm and attention, the shift and QK-norm stay outside. Returns the `[batch, seq, heads * head_dim]` input
        of o_proj."""
        if cache is None:
            raise ValueError("fused attention needs a cache to write to")
        _check_consecutive(cache_position)
        query = self.q_proj(x)
        # Each shift's logits and state before the step where the op does it (runtime/contract.py's operator_shifts,
        # which also names the graph's each-token state outputs: none with RoPE), else done here; QK-norm weights
        inside, norms = operator_shifts(self.config), (None, None)
        (keys, *key_shift), (values, *value_shift) = (
            self._shift_inputs(name, x, cache) if field in inside else (self._project(name, x, keep, cache), None, None)
            for name, field in SHIFT_FIELD.items()
        )
        if self.config.use_rope:
            query, keys = self._per_head(query, keys, positions)
        elif self.config.qk_norm:
            norms = (self.q_norm.weight, self.k_norm.weight)
        after = (
            self.output_norm.weight if self.config.use_output_norm else None,
            self.ogate_proj(x) if self.config.use_output_gate else None,
        )
        per_head = [t.unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2) for t in (keys, values)]
        gate_logits, gate_bias = self._gate_logits(x)
        new_gates = gate_logits.transpose(1, 2)  # for the cache's checks of the new entries' shapes
        buffers = cache.buffers(*per_head, new_gates, self.layer_idx, {"cache_position": cache_position})
        out, *buffers, key_state, value_state = fox_attention(
            query, keys, values, gate_logits, gate_bias, *buffers, attention_mask, cache_position, starts, *key_shift,
            *value_shift, *norms, *after, self.heads, self.kv_heads, QK_NORM_EPS, self.config.norm_eps,
            "sigmoid" if self.config.ogate_act == "sigmoid" else "silu",
        )  # fmt: skip
        cache.set_keys_values(self.layer_idx, *buffers)
        shifts = zip(SHIFT_FIELDS, (key_shift, value_shift), (key_state, value_state), strict=True)
        cache.update_shift(self.layer_idx, **{field: state for field, (logit, _), state in shifts if logit is not None})
        return out

    def _shift_inputs(self, name: str, x: torch.Tensor, cache: GatedCache):
        """k or v projection as the fused op takes it: the projection, and with a token shift its logits and the
        cached state before this step (zeros before the first)."""
        projection = getattr(self, name)
        if not isinstance(projection, ShiftLinear):
            return projection(x), None, None
        raw = projection.linear(x)
        previous = self._shift_state(name, cache)
        if previous is None:
            previous = raw.new_zeros(raw.shape[0], raw.shape[2])
        return raw, projection.shift_proj(x), previous

    def _per_head(self, query, keys, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """QK-norm and RoPE, which work head by head; in and out `[batch, seq, heads * head_dim]`."""
        query = query.unflatten(-1, (self.heads, self.head_dim))
        keys = keys.unflatten(-1, (self.kv_heads, self.head_dim))
        if self.config.qk_norm:
            query, keys = self.q_norm(query), self.k_norm(keys)
        if self.config.use_rope:
            query = rotate(query, positions, self.config.rope_base)
            keys = rotate(keys, positions, self.config.rope_base)
        return query.flatten(2), keys.flatten(2)

    def _attend(self, query, keys, values, log_gates, cache_position, allowed, cache) -> torch.Tensor:
        """Store the new entries, then attend with plain tensor ops over the cache (a static one over the
        pattern's window only). Takes and returns the `[batch, seq, heads * head_dim]` layout."""
        query, keys, values = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in (query, keys, values))
        if cache is not None:
            keys, values, log_gates = cache.update(
                keys, values, log_gates, self.layer_idx, {"cache_position": cache_position}
            )
        if isinstance(cache, StaticCache):
            window = allowed.shape[-1]
            keys, values, log_gates = keys[:, :, :window], values[:, :, :window], log_gates[..., :window]
        return forgetting_attention(query, keys, values, log_gates, cache_position, allowed).transpose(1, 2).flatten(2)

    def _attend_in_place(self, query, keys, values, log_gates, cache_position, allowed, cache, starts=None):
        """A step as one `kvg::group_query_attention` op, which the exporter lowers to onnxruntime's
        GroupQueryAttention: it writes the new keys and values into the cache buffer itself and reads only
        the window. `starts` (int64 `[kv_heads]`, or None: all 0): where each kv head's buffer rows begin in the
        window, forget-gate pruning having dropped each head's oldest slots as far as that head allows; the
        op then reads each head's own slots alone. Takes and returns the `[batch, seq, heads * head_dim]` layout."""
        if cache is None:
            raise ValueError("in_place_attention needs a cache to write to")
        batch, seq = query.shape[:2]
        window = allowed.shape[-1]
        _check_consecutive(cache_position)
        per_head = (t.unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2) for t in (keys, values))
        written = {"cache_position": cache_position, "window": window}
        if starts is not None:
            earliest = starts.min().item()
            torch._check(earliest >= 0)
            torch._check(earliest <= window)
            group = self.heads // self.kv_heads
            written |= {
                "window": window - earliest,
                "head_starts": starts.repeat_interleave(group) if group > 1 else starts,
            }
        key_cache, value_cache, gates = cache.update_gates(*per_head, log_gates, self.layer_idx, written)
        # A head's gate slots past its own window are zero (a runtime zeroes what pruning moves out of them):
        # its keys' sums are its own, the ones the bound was proved for
        decay = decay_after(gates[..., : written["window"]])  # c_last - c_j
        bias = decay.unsqueeze(2)  # one row for every query: softmax ignores each row's c_last - c_i
        if query.dtype != torch.float32:  # where fp16 or bf16 would round that constant into every score
            queries_at = gate_slots(written, decay.device).expand(batch, self.heads, seq)
            bias = bias - decay.gather(-1, queries_at).unsqueeze(-1)  # c_i - c_j
        if allowed.shape[0] != batch:  # a pattern without a mask is shared by the rows; the op takes one per row
            allowed = allowed.expand(batch, -1, -1, -1)
        out, key_cache, value_cache = group_query_attention(
            query, keys, values, key_cache, value_cache, bias, allowed, cache_position, starts, self.heads,
            self.kv_heads,
        )  # fmt: skip
        cache.set_keys_values(self.layer_idx, key_cache, value_cache)
        return out


def _check_consecutive(cache_position: torch.Tensor) -> None:
    if not is_tracing():
        first, seq = int(cache_position[0]), cache_position.shape[0]
        if not torch.equal(cache_position.cpu(), torch.arange(first, first + seq)):
            raise ValueError("in-place attention writes the new tokens to consecutive cache positions")


class FoxBlock(nn.Module):
    def __init__(self, config: FoxConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = ForgettingAttention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.mlp_size, config.hidden_act)

    def forward(self, hidden: torch.Tensor, *attention_args) -> torch.Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden), *attention_args)
        return hidden + self.mlp(self.mlp_norm(hidden))


class FoxPreTrainedModel(PreTrainedModel):
    config_class = FoxConfig
    base_model_prefix = "model"
    _no_split_modules = ["FoxBlock"]

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, (RMSNorm, HeadRMSNorm)):
            nn.init.ones_(module.weight)
        elif isinstance(module, ForgettingAttention):
            module.reset_forget_gate_bias()  # after its fgate_proj child: `apply` visits children first

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, allow_pickle: bool = False, **kwargs):
        """As transformers', but a folder holding only pickle weights is refused unless `allow_pickle`.

        Pickle can run code when loaded; with `allow_pickle` transformers loads it with `weights_only=True`.
        """
        folder = Path(pretrained_model_name_or_path)
        if folder.is_dir() and not allow_pickle:
            names = os.listdir(folder)
            pickles = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt")))
            if pickles and not any(n.endswith(".safetensors") for n in names):
                raise OSError(
                    f"{folder} holds only pickle weights ({', '.join(pickles)}), which can run code when loaded. "
                    "Convert them to safetensors, or pass allow_pickle=True to load them with weights_only=True."
                )
        return super().from_pretrained(pretrained_model_name_or_path, *args, use_safetensors=not allow_pickle, **kwargs)


def attention_pattern(
    attention_mask: torch.Tensor | None, cache_position: torch.Tensor, kv_length: int, batch: int, windowed: bool,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """RoPE positions `[batch, seq]`, new-token flags `[batch, seq]` (None without a mask) and the attention
    pattern `[batch or 1, 1, seq, window]`: true where a query may attend a key slot, a real token at or
    before the query's own slot, or that slot itself (so a padding query attends itself alone rather than
    nothing, and no kernel meets a row with every key masked). Built once per forward and shared by
    every layer. Without `causal` the pattern leaves out "at or before the query's slot", for a kernel
    that masks the later slots itself (GroupQueryAttention), which spares the exported graph its nodes.

    `attention_mask` `[batch, filled]` marks real tokens (0 = padding). A `windowed` (static) cache is
    attended over the mask's length only, so a step's cost follows the filled length, not the buffer's;
    the mask must then reach past the new tokens. Otherwise the window is the whole cache (`kv_length`)
    and a shorter mask is extended with zeros. Positions count real tokens, so a left-padded row's first
    token is at position 0.
    """
    if attention_mask is not None and not torch.compiler.is_compiling():
        length = attention_mask.shape[-1]
        if length > kv_length:
            raise ValueError(f"attention_mask covers {length} positions; the cache holds {kv_length}")
        if windowed and int(cache_position[-1]) >= length:
            raise ValueError(
                f"attention_mask covers {length} positions but a new token goes to slot {int(cache_position[-1])}; "
                "a static cache's mask must cover every filled slot and the new tokens"
            )
        if not windowed and length < kv_length:
            attention_mask = F.pad(attention_mask, (0, kv_length - length))
    window = kv_length if attention_mask is None else attention_mask.shape[-1]
    slots = torch.arange(window, device=cache_position.device)
    earlier = (slots.unsqueeze(0) <= cache_position.unsqueeze(-1))[None, None]
    if attention_mask is None:
        return cache_position.unsqueeze(0).expand(batch, -1), None, earlier if causal else torch.ones_like(earlier)
    key_mask = attention_mask.bool()
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0).index_select(-1, cache_position)
    own = (slots.unsqueeze(0) == cache_position.unsqueeze(-1))[None, None]
    allowed = key_mask[:, None, None, :] | own
    return positions, key_mask.index_select(-1, cache_position), earlier & allowed if causal else allowed


class FoxModel(FoxPreTrainedModel):
    def __init__(self, config: FoxConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(FoxBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: GatedCache | tuple | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache_position: torch.LongTensor | None = None,
        in_place_attention: bool | str = False,
        window_offsets: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """`in_place_attention`: attend through `kvg::group_query_attention`, the form the exporter lowers to
        onnxruntime's GroupQueryAttention, or with "fused" through `kvg::fox_attention`, the fused operator's; the
        attention window is then the mask's length, as for a static cache, and must end with the new tokens.
        `window_offsets` (int64 `[layers, kv_heads]`, in-place attention only): the rows of layer i's head h start
        that many slots into the window (see `ForgettingAttention._attend_in_place`)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        hidden = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = past_key_values
        if isinstance(cache, tuple):
            cache = DynamicCache.from_legacy_cache(cache)
        if cache is None and use_cache:
            cache = DynamicCache()
        seq = hidden.shape[1]
        if cache_position is None:
            past = cache.get_seq_length() if cache is not None else 0
            cache_position = torch.arange(past, past + seq, device=hidden.device)
        if cache is None or is_tracing() or seq <= PREFILL_CHUNK:
            hidden = self._layers(hidden, attention_mask, cache, cache_position, in_place_attention, window_offsets)
        else:  # each chunk attends to what the cache holds by then: no layer builds a [heads, seq, seq] term
            chunks = []
            for begin in range(0, seq, PREFILL_CHUNK):
                slots = cache_position[begin : begin + PREFILL_CHUNK]
                mask = None if attention_mask is None else attention_mask[:, : int(slots[-1]) + 1]
                part = hidden[:, begin : begin + PREFILL_CHUNK]
                chunks.append(self._layers(part, mask, cache, slots, in_place_attention, window_offsets))
            hidden = torch.cat(chunks, dim=1)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), past_key_values=cache)

    def _layers(
        self, hidden, attention_mask, cache, cache_position, in_place_attention, window_offsets=None
    ) -> torch.Tensor:  # fmt: skip
        """Every layer over the new tokens `hidden` `[batch, seq, hidden]` at slots `cache_position`."""
        batch = hidden.shape[0]
        kv_length = cache.get_mask_sizes(cache_position)[0] if cache is not None else hidden.shape[1]
        windowed = isinstance(cache, StaticCache) or in_place_attention
        positions, keep, allowed = attention_pattern(
            attention_mask, cache_position, kv_length, batch, windowed, causal=not in_place_attention
        )
        if in_place_attention == "fused":  # the fused op builds the pattern from the window's mask itself
            allowed = attention_mask
            if allowed is None:
                allowed = torch.ones(1, kv_length, dtype=torch.long, device=cache_position.device)
        for block in self.layers:
            hidden = block(hidden, positions, cache_position, keep, allowed, cache, in_place_attention, window_offsets)
        return hidden


class FoxForCausalLM(FoxPreTrainedModel, GenerationMixin):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config: FoxConfig):
        super().__init__(config)
        self.model = FoxModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: GatedCache | tuple | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        cache_position: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        in_place_attention: bool | str = False,
        window_offsets: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """`labels` `[batch, seq]` are the inputs themselves (shifted here, -100 ignored), as in transformers;
        `in_place_attention` and `window_offsets` as in `FoxModel.forward`."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cache_position=cache_position,
            in_place_attention=in_place_attention,
            window_offsets=window_offsets,
        )
        hidden = outputs.last_hidden_state
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ):
        """generate() builds this project's gated caches: 'dynamic' (default), 'offloaded' or 'static'."""
        given = model_kwargs.get("past_key_values")
        if given is not None:
            if isinstance(given, tuple):
                model_kwargs["past_key_values"] = DynamicCache.from_legacy_cache(given)
            return
        if generation_config.use_cache is False:
            return
        kind = generation_config.cache_implementation
        if kind in (None, "dynamic", "offloaded"):
            model_kwargs["past_key_values"] = DynamicCache(offloading=kind == "offloaded")
        elif kind == "static":
            rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
            model_kwargs["past_key_values"] = StaticCache(
                self.config.num_hidden_layers, max_cache_len=max_cache_length, max_batch_size=rows
            )
        else:
            raise ValueError(
                f"cache_implementation {kind!r} is not supported by FoX; use 'dynamic', 'static' or 'offloaded'"
            )
