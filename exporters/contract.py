"""The ONNX contract's names, in one place (DESIGN.md, "The ONNX contract").

Cache tensors are named from templates (`past_key_values.{i}.key`, `present.{i}.key`), which the
artifact manifest also records so the torch-free runtime never hard-codes a name.
"""

from __future__ import annotations

from dataclasses import dataclass

LOGITS_TO_KEEP = "logits_to_keep"  # an optional input (exporters/passes/last_logits.py)
KEPT_AXIS = "kept"  # the logits' sequence axis: seq, or logits_to_keep when that is above 0
PAST_TEMPLATE = "past_key_values.{layer}.{field}"
PRESENT_TEMPLATE = "present.{layer}.{field}"
CACHE_FIELDS = ("key", "value", "gate", "key_shift", "value_shift")  # in the order of kvg_export's TENSOR_FIELDS
DEFAULT_OPSET = 20
DYNAMIC_MAX_POSITIONS = 1 << 16  # the most positions a dynamic graph is traced for


@dataclass(frozen=True)
class CacheLayout:
    """What one model's cache holds: its layer count and which of CACHE_FIELDS each layer carries."""

    num_layers: int
    fields: tuple[str, ...]
    static: bool

    def past_names(self) -> list[str]:
        return [PAST_TEMPLATE.format(layer=i, field=f) for i in range(self.num_layers) for f in self.fields]

    def present_names(self) -> list[str]:
        return [PRESENT_TEMPLATE.format(layer=i, field=f) for i in range(self.num_layers) for f in self.fields]

    def input_names(self) -> list[str]:
        head = ["input_ids", "attention_mask"] + (["cache_position"] if self.static else [])
        return head + self.past_names()

    def output_names(self) -> list[str]:
        return ["logits", *self.present_names()]


def cache_shape(config, field: str, batch: int, length: int) -> tuple[int, ...]:
    """key/value `[batch, kv_heads, length, head_dim]`, gate `[batch, heads, length]`,
    shifts `[batch, kv_heads * head_dim]`."""
    if field == "gate":
        return (batch, config.num_heads, length)
    if field in ("key", "value"):
        return (batch, config.kv_heads, length, config.head_dim)
    return (batch, config.kv_heads * config.head_dim)


def cache_layout(config, static: bool) -> CacheLayout:
    """The layout of a FoX config: key, value and gate always; the shift states its options ask for."""
    shifts = [f for f, on in (("key_shift", config.use_k_shift), ("value_shift", config.use_v_shift)) if on]
    return CacheLayout(config.num_hidden_layers, ("key", "value", "gate", *shifts), static)
