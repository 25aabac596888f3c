"""The ONNX contract between the exporter and the runtime, in one place (docs/graphs.md says what each means).

Both sides import it, so it imports neither torch nor onnxruntime: the graph's input and output names, the
names of their axes, the cache tensors' names and layout, the manifest's file and format, the fused operator's
identity, and which caches the runtime holds in place (the only ones forget-gate pruning can shrink). Cache
tensors are named from templates (`past_key_values.{i}.key`, `present.{i}.key`), which the manifest also
records, so the runtime reads every name from the artifact rather than spelling it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Graph inputs and outputs besides the cache
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
CACHE_POSITION = "cache_position"  # static graphs only: the slots a run writes
LOGITS = "logits"
LOGITS_TO_KEEP = "logits_to_keep"  # optional: the last positions whose logits a run returns (passes/last_logits.py)
WINDOW_OFFSETS = "window_offsets"  # optional: each kv head's window start (passes/window_offsets.py)

PAST_PREFIX, PRESENT_PREFIX = "past_key_values.", "present."
PAST_TEMPLATE = PAST_PREFIX + "{layer}.{field}"
PRESENT_TEMPLATE = PRESENT_PREFIX + "{layer}.{field}"
SHIFT_FIELDS = ("key_shift", "value_shift")  # FoX-Pro's token-shift states: [batch, kv_heads*head_dim], no slots
CACHE_FIELDS = ("key", "value", "gate", *SHIFT_FIELDS)  # in the order of kvg_export's TENSOR_FIELDS
# A fused FoX-Pro graph's outputs besides the contract's: each new token's shift state `[batch, seq, width]`, so that
# a speculative run that keeps its first tokens only keeps the state after the last of them
# (exporters/graph/passes/shift_states.py); which ones a graph gives: `CacheLayout.each_token`, from `operator_shifts`
SHIFT_STATES_TEMPLATE = "shift_states.{layer}.{field}"

# Axis names the manifest gives sizes that vary
BATCH_AXIS, SEQ_AXIS = "batch", "seq"
PAST_AXIS, TOTAL_AXIS = "past", "total"  # a dynamic cache's length before a run, and after it
WINDOW_AXIS = "window"  # a static graph's attention mask: the slots a run attends
KEPT_AXIS = "kept"  # the logits' sequence axis: seq, or logits_to_keep when that is above 0
# A present key's or value's first two axes where a run folds its heads into rows (see `Artifact.folds`)
ROWS_AXIS, ROW_HEADS_AXIS = "rows", "row_heads"

MANIFEST_NAME = "kvg_config.json"
FORMAT_VERSION = 2  # 2: a static graph's attention_mask is the attention window, not the buffer
DEFAULT_OPSET = 20
DYNAMIC_MAX_POSITIONS = 1 << 16  # the most positions a dynamic graph is traced for

# The fused FoX attention operator (exporters/native/fox_attention.cc holds its contract): its node's domain, type
# and version, and its inputs and outputs in the node's order. The C++ op's `Input` and `Output` enums spell the same
# names (tests/test_fused_attention.py holds them equal); the exporter's schema, its passes, the tests and the bench
# read these.
OP_DOMAIN, OP_NAME, OP_VERSION = "kvg.fox", "FoxAttention", 3
OP_PRO_INPUTS = ("key_shift_logits", "past_key_shift", "value_shift_logits", "past_value_shift", "query_norm",
                 "key_norm", "output_norm", "output_gate_logits")  # FoX-Pro's, each optional  # fmt: skip
OP_INPUTS = ("query", "key", "value", "gate_logits", "gate_bias", "past_key", "past_value", "past_gate",
             ATTENTION_MASK, CACHE_POSITION, "window_starts", *OP_PRO_INPUTS)  # fmt: skip
OP_INTEGER_INPUTS = (ATTENTION_MASK, CACHE_POSITION, "window_starts")  # int64; every other input is float
# The inputs the attribute packed_offsets places in the node's joined projection, in its order
OP_PACKED_INPUTS = ("query", "key", "value", "gate_logits", "key_shift_logits", "value_shift_logits",
                    "output_gate_logits")  # fmt: skip
OP_OUTPUTS = ("output", "present_key", "present_value", "present_gate", "present_key_shift", "present_value_shift",
              "key_shift_states", "value_shift_states")  # fmt: skip


def is_shift_state(name: str) -> bool:
    """Whether a cache field (`key_shift`) or a cache tensor's name (`past_key_values.0.key_shift`,
    `present.0.value_shift`) is a token-shift state: one per row, written over each run rather than into slots."""
    return name.rpartition(".")[2] in SHIFT_FIELDS


def past_of(present: str) -> str:
    """The past input that a present output continues."""
    return PAST_PREFIX + present.removeprefix(PRESENT_PREFIX)


def held_in_place(static: bool, attention: str) -> bool:
    """Whether the runtime holds a cache's keys, values and gates in place, one buffer bound as past and present:
    a static cache's always, a dynamic one's where the fused operator or GroupQueryAttention appends to it. Only
    such a cache can move its slots, so only it can be pruned."""
    return static or attention in ("fused", "gqa")


def operator_shifts(config) -> tuple[str, ...]:
    """The token shifts (of CACHE_FIELDS) that the fused operator does itself for a model, and so gives each new
    token's state of: every shift the model has, but none with RoPE, which turns the keys between the shift (and
    QK-norm) and attention. A RoPE model's graph does its shifts, QK-norm and RoPE around the operator, and its
    shift states are only the presents. The fused model (kvg_export/fox/modeling.py) hands the operator exactly
    these shifts, and `cache_layout` names the graph's each-token outputs from them: one decision for both."""
    if config.use_rope:
        return ()
    return tuple(f for f, on in (("key_shift", config.use_k_shift), ("value_shift", config.use_v_shift)) if on)


@dataclass(frozen=True)
class CacheLayout:
    """What one model's cache holds: its layer count and which of CACHE_FIELDS each layer carries; and which of
    those shift fields the graph also gives each new token's state of (`each_token`, SHIFT_STATES_TEMPLATE)."""

    num_layers: int
    fields: tuple[str, ...]
    static: bool
    each_token: tuple[str, ...] = ()

    def past_names(self) -> list[str]:
        return [PAST_TEMPLATE.format(layer=i, field=f) for i in range(self.num_layers) for f in self.fields]

    def present_names(self) -> list[str]:
        return [PRESENT_TEMPLATE.format(layer=i, field=f) for i in range(self.num_layers) for f in self.fields]

    def input_names(self) -> list[str]:
        head = [INPUT_IDS, ATTENTION_MASK] + ([CACHE_POSITION] if self.static else [])
        return head + self.past_names()

    def output_names(self) -> list[str]:
        return [LOGITS, *self.present_names()]

    def shift_state_names(self) -> list[str]:
        """The graph's outputs of each new token's shift states (SHIFT_STATES_TEMPLATE), after the contract's and in
        the graph's order: none unless `each_token` names shifts."""
        return [SHIFT_STATES_TEMPLATE.format(layer=i, field=f)
                for i in range(self.num_layers) for f in self.fields if f in self.each_token]  # fmt: skip


def cache_shape(config, field: str, batch: int, length: int) -> tuple[int, ...]:
    """key/value `[batch, kv_heads, length, head_dim]`, gate `[batch, heads, length]`,
    shifts `[batch, kv_heads * head_dim]`."""
    if field == "gate":
        return (batch, config.num_heads, length)
    if field in ("key", "value"):
        return (batch, config.kv_heads, length, config.head_dim)
    return (batch, config.kv_heads * config.head_dim)


def cache_layout(config, static: bool, attention: str = "standard") -> CacheLayout:
    """The layout of a FoX config's graph attending through `attention` (exporters/pipeline/export.py's kinds): key,
    value and
    gate always; the shift states its options ask for; and a fused graph's each-token states of the shifts its
    operator does (`operator_shifts`)."""
    shifts = [f for f, on in (("key_shift", config.use_k_shift), ("value_shift", config.use_v_shift)) if on]
    each_token = operator_shifts(config) if attention == "fused" else ()
    return CacheLayout(config.num_hidden_layers, ("key", "value", "gate", *shifts), static, each_token)
