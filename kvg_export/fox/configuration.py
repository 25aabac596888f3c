"""The FoX configuration, field for field the official `forgetting_transformer-project_fox` format.

Fields the official model stores but never reads (`attention_bias`, `elementwise_affine`, `fuse_norm`,
`fuse_cross_entropy`, `window_size`) are kept so real config files load and save unchanged, and are
ignored the same way. `log_pruning_tolerance` asks the official kernel to skip key blocks whose weight
is provably below the tolerance; the attention here is exact, which that approximation bounds.
"""

from __future__ import annotations

import math

from transformers import PretrainedConfig

from kvg_export.fla_format import OFFICIAL_MODEL_TYPE

FGATE_TYPES = ("full", "bias_only", "fixed", "none")
ACTIVATIONS = ("swish", "sigmoid")
OGATE_ACTIVATIONS = ("sigmoid", "silu")


class FoxConfig(PretrainedConfig):
    model_type = OFFICIAL_MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        hidden_ratio: float | None = 4,
        intermediate_size: int | None = None,
        num_hidden_layers: int = 24,
        num_heads: int = 32,
        num_kv_heads: int | None = None,
        hidden_act: str = "swish",
        window_size: int | None = None,
        max_position_embeddings: int | None = 2048,
        initializer_range: float = 0.02,
        elementwise_affine: bool | None = True,
        norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        tie_word_embeddings: bool = False,
        attention_bias: bool = False,
        fuse_norm: bool = True,
        fuse_cross_entropy: bool = True,
        rope_base: float = 500000.0,
        use_rope: bool = False,
        use_output_gate: bool = False,
        ogate_act: str = "sigmoid",
        fgate_type: str = "full",
        fgate_bias_init: bool = False,
        decay_time_min: float | None = None,
        decay_time_max: float | None = None,
        use_output_norm: bool = False,
        qk_norm: bool = False,
        qk_norm_share_param_across_head: bool = False,
        use_k_shift: bool = False,
        use_v_shift: bool = False,
        log_pruning_tolerance: float | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.hidden_act = hidden_act
        self.window_size = window_size
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.elementwise_affine = elementwise_affine
        self.norm_eps = norm_eps
        self.use_cache = use_cache
        self.attention_bias = attention_bias
        self.fuse_norm = fuse_norm
        self.fuse_cross_entropy = fuse_cross_entropy
        self.rope_base = rope_base
        self.use_rope = use_rope
        self.use_output_gate = use_output_gate
        self.ogate_act = ogate_act
        self.fgate_type = fgate_type
        self.fgate_bias_init = fgate_bias_init
        self.decay_time_min = decay_time_min
        self.decay_time_max = decay_time_max
        self.use_output_norm = use_output_norm
        self.qk_norm = qk_norm
        self.qk_norm_share_param_across_head = qk_norm_share_param_across_head
        self.use_k_shift = use_k_shift
        self.use_v_shift = use_v_shift
        self.log_pruning_tolerance = log_pruning_tolerance
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate()

    # transformers reads these generic names (e.g. for cache sizing); FoX's own names stay canonical.
    @property
    def num_attention_heads(self) -> int:
        return self.num_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.kv_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_size(self) -> int:
        """The MLP width: `intermediate_size`, else 2/3 of `hidden_ratio` x hidden, rounded up to 256."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        width = int(self.hidden_size * (self.hidden_ratio or 4) * 2 / 3)
        return 256 * math.ceil(width / 256)

    def validate(self) -> None:
        """Refuse option combinations the model cannot run, naming the field and the fix."""

        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"invalid FoX config: {message}")

        require(
            self.hidden_size % self.num_heads == 0,
            f"hidden_size {self.hidden_size} must divide into {self.num_heads} heads",
        )
        require(
            self.num_heads % self.kv_heads == 0,
            f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.kv_heads}",
        )
        require(self.fgate_type in FGATE_TYPES, f"fgate_type {self.fgate_type!r} is not one of {FGATE_TYPES}")
        require(self.hidden_act in ACTIVATIONS, f"hidden_act {self.hidden_act!r} is not one of {ACTIVATIONS}")
        require(self.ogate_act in OGATE_ACTIVATIONS, f"ogate_act {self.ogate_act!r} is not one of {OGATE_ACTIVATIONS}")
        require(not self.use_rope or self.head_dim % 2 == 0, f"RoPE needs an even head_dim, got {self.head_dim}")
        timed = self.decay_time_min is not None or self.decay_time_max is not None
        if self.fgate_bias_init:
            require(
                self.decay_time_min is not None
                and self.decay_time_max is not None
                and 0 < self.decay_time_min <= self.decay_time_max,
                "fgate_bias_init needs 0 < decay_time_min <= decay_time_max",
            )
        else:
            require(not timed, "decay_time_min/max are only used with fgate_bias_init=True")
        require(self.fgate_type != "fixed" or self.fgate_bias_init, "fgate_type 'fixed' needs fgate_bias_init=True")
