"""One decoder layer's gated cache: keys, values, float32 forget gates and optional shift states.

A layer is the unit every cache operation is written for; the containers in `cache.py` only fan
operations out. Shapes: keys and values `[batch, kv_heads, seq, head_dim]`, gates
`[batch, heads, seq]` (heads may exceed kv_heads under GQA), shift states `[batch, kv_heads * head_dim]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

TENSOR_FIELDS = ("keys", "values", "gates", "key_shift", "value_shift")
SHIFT_FIELDS = ("key_shift", "value_shift")


def is_tracing() -> bool:
    """Checks that read tensor values or raise on shapes only run eagerly, never under export or compile."""
    return torch.compiler.is_compiling()


def gate_slots(cache_kwargs: dict, device: torch.device) -> torch.Tensor:
    """Where the new gates go, `[1, heads or 1, seq]`: cache_kwargs' `cache_position`, less each head's window
    start where the heads' buffers are staggered (`head_starts` `[heads]`, see
    `ForgettingAttention._attend_in_place`)."""
    slots = cache_kwargs["cache_position"].to(device).view(1, 1, -1)
    starts = cache_kwargs.get("head_starts")
    return slots if starts is None else slots - starts.to(device).view(1, -1, 1)


def check_states(layer: GatedLayer, key_states: torch.Tensor, value_states: torch.Tensor, gate_states: torch.Tensor):
    """Refuse an update whose shapes or dtypes do not fit each other or what the layer already holds."""
    if key_states.ndim != 4:
        raise ValueError(f"key_states must be [batch, kv_heads, seq, head_dim]; got shape {tuple(key_states.shape)}")
    batch, kv_heads, seq = key_states.shape[:3]
    if value_states.shape[:3] != key_states.shape[:3]:
        raise ValueError(
            f"value_states {tuple(value_states.shape)} and key_states {tuple(key_states.shape)} must agree on "
            "[batch, kv_heads, seq]"
        )
    if gate_states.ndim != 3 or gate_states.shape[0] != batch or gate_states.shape[2] != seq:
        raise ValueError(
            f"gate_states must be [batch={batch}, heads, seq={seq}] to match key_states {tuple(key_states.shape)}; "
            f"got {tuple(gate_states.shape)}"
        )
    if gate_states.shape[1] % kv_heads:
        raise ValueError(f"gate heads ({gate_states.shape[1]}) must be a multiple of kv_heads ({kv_heads})")
    if gate_states.dtype != torch.float32:
        raise ValueError(f"gate_states must be float32, got {gate_states.dtype}: gates and their sums stay float32")
    if layer.keys is None:
        return
    cached = (layer.keys.shape[0], layer.keys.shape[1], layer.gates.shape[1], layer.keys.shape[3])
    given = (batch, kv_heads, gate_states.shape[1], key_states.shape[3])
    if cached != given:
        raise ValueError(
            f"this layer holds [batch, kv_heads, heads, head_dim] = {list(cached)} but the update has {list(given)}; "
            "reset or rebuild the cache for a new batch or model"
        )
    if key_states.dtype != layer.keys.dtype:
        raise ValueError(f"key_states are {key_states.dtype} but the cache holds {layer.keys.dtype}")


def check_shift(layer: GatedLayer, name: str, state: torch.Tensor):
    if state.ndim != 2:
        raise ValueError(f"{name} must be [batch, kv_heads * head_dim]; got shape {tuple(state.shape)}")
    cached = getattr(layer, name)
    if cached is not None and cached.shape != state.shape:
        raise ValueError(f"{name} {tuple(state.shape)} does not match the held state {tuple(cached.shape)}")
    if layer.keys is not None and state.shape[0] != layer.keys.shape[0]:
        raise ValueError(f"{name} has batch {state.shape[0]} but the cached keys have batch {layer.keys.shape[0]}")


class GatedLayer(ABC):
    """What every layer kind shares: the tensors, and batch operations applied to each of them."""

    is_compileable = False
    is_sliding = False

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.gates: torch.Tensor | None = None
        self.key_shift: torch.Tensor | None = None
        self.value_shift: torch.Tensor | None = None
        self.device: torch.device | None = None

    def __repr__(self) -> str:
        shape = None if self.keys is None else tuple(self.keys.shape)
        return f"{type(self).__name__}(keys={shape}, shift={self.has_shift})"

    @property
    def has_shift(self) -> bool:
        return self.key_shift is not None or self.value_shift is not None

    @classmethod
    def from_tensors(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        gates: torch.Tensor,
        key_shift: torch.Tensor | None = None,
        value_shift: torch.Tensor | None = None,
    ) -> GatedLayer:
        """A layer that holds (not copies) the given tensors, e.g. an exported graph's cache inputs."""
        layer = cls._sized_for(keys)
        if not is_tracing():
            check_states(layer, keys, values, gates)
        layer.device = keys.device
        layer.keys, layer.values, layer.gates = keys, values, gates
        layer.key_shift, layer.value_shift = key_shift, value_shift
        return layer

    @classmethod
    @abstractmethod
    def _sized_for(cls, keys: torch.Tensor) -> GatedLayer:
        """An empty layer able to hold `keys` `[batch, kv_heads, seq, head_dim]`."""

    @abstractmethod
    def lazy_initialization(self, key_states: torch.Tensor, gate_states: torch.Tensor) -> None: ...

    @abstractmethod
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        gate_states: torch.Tensor,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store new entries; return the keys, values and gates attention should read."""

    @abstractmethod
    def update_gates(self, key_states, value_states, gate_states, cache_kwargs=None):
        """As `update`, but store only the gates, at cache_kwargs' `cache_position` (see `gate_slots`) in a buffer
        at least its `window` long: the keys and values are left to a kernel that writes them into the buffers itself
        (see `fox/in_place_attention.py`) and hands back the updated buffers through `set_keys_values`.
        Returns the keys and values before the update and the gates after it."""

    @abstractmethod
    def buffers(self, key_states, value_states, gate_states, cache_kwargs=None):
        """For a kernel that writes the new keys, values and gates into the buffers itself (see
        `fox/fused_attention.py`): check the new entries and allocate on first use, store nothing, and return the
        buffers, which the kernel hands back updated through `set_keys_values`."""

    def set_keys_values(self, keys: torch.Tensor, values: torch.Tensor, gates: torch.Tensor | None = None) -> None:
        """Hold the buffers such a kernel returned: as long as the gates, batch and heads unchanged."""
        if gates is not None:
            self.gates = gates
        if not is_tracing():
            expected = (*self.keys.shape[:2], self.gates.shape[2], self.keys.shape[3])
            if keys.shape != expected or values.shape != expected:
                raise ValueError(
                    f"replacement buffers {tuple(keys.shape)} and {tuple(values.shape)} do not match this "
                    f"layer's {expected}"
                )
        self.keys, self.values = keys, values

    @abstractmethod
    def update_shift(
        self, key_shift: torch.Tensor | None = None, value_shift: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Store the newest token's projections; return the ones they replace (None before the first)."""

    @abstractmethod
    def get_seq_length(self) -> int: ...

    @abstractmethod
    def get_max_cache_shape(self) -> int: ...

    @abstractmethod
    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]: ...

    @abstractmethod
    def crop(self, max_length: int, shift: tuple[torch.Tensor | None, torch.Tensor | None] | None = None) -> None:
        """Keep the first `max_length` positions (negative: drop that many from the end). A layer holds only the
        latest token's shift states, so one that holds them must be given `shift`, the states after the new end."""

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in TENSOR_FIELDS:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))

    def _resolve_crop_length(self, max_length: int, shift: tuple | None) -> int | None:
        """The length a crop keeps, or None when nothing is cut; refuses to crop away a shift state it is not given
        again."""
        length = self.get_seq_length()
        if max_length < 0:
            max_length = max(length + max_length, 0)
        if length <= max_length:
            return None
        if self.has_shift and shift is None:
            raise ValueError(
                "cannot crop a cache that holds key/value shift states without the states after the new end: the "
                "projection of the token before it is not kept; re-run the prompt up to the crop point instead"
            )
        return max_length

    def offload(self) -> None:
        """Move this layer's tensors to host memory; `prefetch` brings them back."""
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.keys is not None and self.keys.device != self.device:
            self._map(lambda t: t.to(self.device, non_blocking=True))

    def reset(self) -> None:
        """Zero every entry but keep the tensors, so static addresses survive."""
        for name in TENSOR_FIELDS:
            tensor = getattr(self, name)
            if tensor is not None:
                tensor.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch for beam search; a layer holding nothing is left as it is."""
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))


class DynamicLayer(GatedLayer):
    """A layer that grows by concatenation: the cache for eager decoding and the dynamic ONNX graph."""

    @classmethod
    def _sized_for(cls, keys: torch.Tensor) -> DynamicLayer:
        return cls()

    def lazy_initialization(self, key_states: torch.Tensor, gate_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros((batch, kv_heads, 0, head_dim))
        self.values = key_states.new_zeros((batch, kv_heads, 0, head_dim))
        self.gates = gate_states.new_zeros((batch, gate_states.shape[1], 0))

    def _check_and_allocate(self, key_states, value_states, gate_states) -> None:
        if not is_tracing():
            check_states(self, key_states, value_states, gate_states)
        if self.keys is None:
            self.lazy_initialization(key_states, gate_states)

    def buffers(self, key_states, value_states, gate_states, cache_kwargs=None):
        self._check_and_allocate(key_states, value_states, gate_states)
        return self.keys, self.values, self.gates

    def update_gates(self, key_states, value_states, gate_states, cache_kwargs=None):
        """The gates are held as such a kernel holds keys and values: a past exactly as long as the filled
        positions grows by the new ones, and a longer one, which a runtime may bind as past and present,
        keeps its length."""
        self._check_and_allocate(key_states, value_states, gate_states)
        length, window = self.gates.shape[-1], cache_kwargs["window"]
        grown = F.pad(self.gates, (0, torch.sym_max(length, window) - length))
        self.gates = grown.scatter(-1, gate_slots(cache_kwargs, grown.device).expand_as(gate_states), gate_states)
        return self.keys, self.values, self.gates

    def update(self, key_states, value_states, gate_states, cache_kwargs=None):
        self._check_and_allocate(key_states, value_states, gate_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.gates = torch.cat([self.gates, gate_states], dim=-1)
        return self.keys, self.values, self.gates

    def update_shift(self, key_shift=None, value_shift=None):
        previous = (self.key_shift, self.value_shift)
        for name, state in zip(SHIFT_FIELDS, (key_shift, value_shift), strict=True):
            if state is not None:
                if not is_tracing():
                    check_shift(self, name, state)
                setattr(self, name, state)
        return previous

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def get_max_cache_shape(self) -> int:
        return -1

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.get_seq_length() + cache_position.shape[0], 0

    def crop(self, max_length: int, shift=None) -> None:
        keep = self._resolve_crop_length(max_length, shift)
        if keep is None:
            return
        self.keys = self.keys[..., :keep, :]
        self.values = self.values[..., :keep, :]
        self.gates = self.gates[..., :keep]
        if shift is not None:
            self.key_shift, self.value_shift = shift

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices, ...])


class StaticLayer(GatedLayer):
    """A layer of fixed `max_cache_len` whose buffers are allocated once and written in place.

    New entries go to `cache_position` by one scatter per tensor (lowered to ONNX ScatterElements), so
    the buffers keep their addresses for CUDA graphs and the runtime can update them in place.
    """

    is_compileable = True

    def __init__(self, max_cache_len: int, max_batch_size: int | None = None):
        super().__init__()
        if max_cache_len < 1:
            raise ValueError(f"max_cache_len must be positive, got {max_cache_len}")
        self.max_cache_len = max_cache_len
        self.max_batch_size = max_batch_size  # a limit until allocation, then the batch the buffers hold
        self.filled = 0  # one past the highest written position; tracked eagerly, never guessed from values

    @classmethod
    def _sized_for(cls, keys: torch.Tensor) -> StaticLayer:
        return cls(keys.shape[2], keys.shape[0])

    def lazy_initialization(self, key_states: torch.Tensor, gate_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        if self.max_batch_size is not None and batch > self.max_batch_size:
            raise ValueError(
                f"batch {batch} exceeds this static cache's max_batch_size {self.max_batch_size}; "
                "build the cache with a larger max_batch_size"
            )
        self.max_batch_size, self.device = batch, key_states.device
        length = self.max_cache_len
        self.keys = key_states.new_zeros((batch, kv_heads, length, head_dim))
        self.values = key_states.new_zeros((batch, kv_heads, length, head_dim))
        self.gates = gate_states.new_zeros((batch, gate_states.shape[1], length))
        self._mark_static(self.keys, self.values, self.gates)

    def allocate_shift(self, name: str, width: int) -> None:
        """Allocate a zero shift state ahead of time (for export, which cannot allocate lazily)."""
        setattr(self, name, self.keys.new_zeros((self.max_batch_size, width)))
        self._mark_static(getattr(self, name))

    @staticmethod
    def _mark_static(*tensors: torch.Tensor) -> None:
        if not is_tracing():
            for tensor in tensors:
                torch._dynamo.mark_static_address(tensor)

    def _check_positions(self, cache_position: torch.Tensor, seq: int) -> None:
        if cache_position.ndim != 1 or cache_position.shape[0] != seq:
            raise ValueError(f"cache_position must be [seq={seq}]; got shape {tuple(cache_position.shape)}")
        low, high = (int(v) for v in torch.aminmax(cache_position))
        if low < 0 or high >= self.max_cache_len:
            raise ValueError(
                f"cannot write positions {low}..{high} into a static cache of max_cache_len {self.max_cache_len}; "
                "build the cache with a larger max_cache_len or generate fewer tokens"
            )
        self.filled = max(self.filled, high + 1)

    def _store_gates(self, key_states, value_states, gate_states, cache_kwargs) -> torch.Tensor:
        """Check the new entries, allocate on first use, write the gates; return where the entries go."""
        cache_position = self._prepare(key_states, value_states, gate_states, cache_kwargs)
        self.gates.scatter_(2, gate_slots(cache_kwargs, self.keys.device).expand_as(gate_states), gate_states)
        return cache_position

    def _prepare(self, key_states, value_states, gate_states, cache_kwargs) -> torch.Tensor:
        """Check the new entries and allocate on first use; return where the entries go."""
        cache_position = (cache_kwargs or {}).get("cache_position")
        if cache_position is None:
            raise ValueError("a static cache layer needs cache_kwargs={'cache_position': ...} to know where to write")
        if not is_tracing():
            check_states(self, key_states, value_states, gate_states)
            self._check_positions(cache_position, key_states.shape[2])
        if self.keys is None:
            self.lazy_initialization(key_states, gate_states)
        return cache_position.to(self.keys.device)

    def update(self, key_states, value_states, gate_states, cache_kwargs=None):
        seq_index = self._store_gates(key_states, value_states, gate_states, cache_kwargs).view(1, 1, -1, 1)
        self.keys.scatter_(2, seq_index.expand_as(key_states), key_states)
        self.values.scatter_(2, seq_index.expand_as(value_states), value_states)
        return self.keys, self.values, self.gates

    def update_gates(self, key_states, value_states, gate_states, cache_kwargs=None):
        self._store_gates(key_states, value_states, gate_states, cache_kwargs)  # the window lies inside the buffer
        return self.keys, self.values, self.gates

    def buffers(self, key_states, value_states, gate_states, cache_kwargs=None):
        self._prepare(key_states, value_states, gate_states, cache_kwargs)
        return self.keys, self.values, self.gates

    def written(self, cache_position: torch.Tensor) -> None:
        """Record slots that a kernel outside this cache wrote into its buffers (an onnxruntime session bound to
        them in place), so that the filled length follows."""
        self._check_positions(cache_position, cache_position.shape[0])

    def update_shift(self, key_shift=None, value_shift=None):
        previous = []
        for name, state in zip(SHIFT_FIELDS, (key_shift, value_shift), strict=True):
            cached = getattr(self, name)
            if state is None:
                previous.append(cached)
                continue
            if not is_tracing():
                check_shift(self, name, state)
            if cached is None:
                setattr(self, name, torch.zeros_like(state))
                self._mark_static(getattr(self, name))
                previous.append(None)
            else:
                previous.append(cached.clone())
            getattr(self, name).copy_(state)
        return tuple(previous)

    def get_seq_length(self) -> int:
        return self.filled

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.max_cache_len, 0

    def reset(self) -> None:
        super().reset()
        self.filled = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder in place, so the buffers keep their addresses."""
        for name in TENSOR_FIELDS:
            tensor = getattr(self, name)
            if tensor is not None:
                tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))

    def crop(self, max_length: int, shift=None) -> None:
        """Forget every position from `max_length` on; the shift states are written into their buffers."""
        keep = self._resolve_crop_length(max_length, shift)
        if keep is None:
            return
        self.keys[..., keep:, :].zero_()
        self.values[..., keep:, :].zero_()
        self.gates[..., keep:].zero_()
        self.filled = keep
        if shift is not None:
            self.update_shift(*shift)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError("a static cache has a fixed batch; build it with the repeated batch size instead")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError("a static cache has a fixed batch; build it with the selected batch size instead")
