"""Gated key/value caches for whole models: a list of per-layer caches behind one object.

`DynamicCache` grows as tokens arrive; `StaticCache` allocates `max_cache_len` once and writes in place.
Both carry, per layer, keys, values, float32 forget gates and (for FoX-Pro's key/value shift) the last
token's projections. Operations are written once per layer (`cache_layers.py`) and fanned out here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from kvg_export.cache_layers import SHIFT_FIELDS, DynamicLayer, GatedLayer, StaticLayer, is_tracing

LayerTensors = tuple[torch.Tensor, ...]


class GatedCache:
    """A cache made of per-layer caches, given up front or created as `update` reaches new layers.

    With `offloading`, every layer but the one in use lives in host memory; the next layer is copied
    back on a side stream while the current one computes (CUDA only; on CPU the moves are no-ops).
    """

    def __init__(
        self,
        layers: list[GatedLayer] | None = None,
        layer_factory: type[GatedLayer] | None = None,
        offloading: bool = False,
    ):
        if (layers is None) == (layer_factory is None):
            raise ValueError("give exactly one of `layers` (all layers up front) or `layer_factory` (lazy layers)")
        self.layers: list[GatedLayer] = layers if layers is not None else []
        self.layer_factory = layer_factory
        self.offloading = offloading
        self._prefetch_stream: torch.cuda.Stream | None = None
        # Where a cache of shift states can go back to (see `checkpoint`): a length and each layer's shift states
        # there; the tokens fed since; and the tokens a crop left for the next run to feed again (see `crop`)
        self.kept: tuple[int, list[tuple[torch.Tensor | None, torch.Tensor | None]]] | None = None
        self.fed: list[torch.Tensor] = []
        self.again: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layers={self.layers})"

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"this cache has {len(self.layers)} layers; there is no layer {layer_idx}")
        layer = self.layers[layer_idx]
        return layer.keys, layer.values, layer.gates

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for layer_idx in range(len(self.layers)):
            yield self[layer_idx]

    def _layer(self, layer_idx: int) -> GatedLayer:
        if self.layer_factory is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_factory())
        if layer_idx >= len(self.layers):
            raise IndexError(f"this cache has {len(self.layers)} layers; there is no layer {layer_idx}")
        return self.layers[layer_idx]

    def _check_batch(self, layer_idx: int, batch: int) -> None:
        first = self.layers[0] if self.layers else None
        if layer_idx > 0 and first is not None and first.keys is not None and first.keys.shape[0] != batch:
            raise ValueError(
                f"layer {layer_idx} is updated with batch {batch} but layer 0 holds batch {first.keys.shape[0]}"
            )

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        gate_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store one layer's new keys `[batch, kv_heads, seq, head_dim]`, values and gates `[batch, heads, seq]`.

        Returns that layer's keys, values and gates to attend over.
        """
        layer = self._layer(layer_idx)
        if not is_tracing():
            self._check_batch(layer_idx, key_states.shape[0])
        if not self.offloading:
            return layer.update(key_states, value_states, gate_states, cache_kwargs)
        self._wait_for_prefetch(key_states.device)
        self.prefetch(layer_idx + 1)
        result = layer.update(key_states, value_states, gate_states, cache_kwargs)
        self.offload(layer_idx)
        return result

    def update_gates(self, key_states, value_states, gate_states, layer_idx: int, cache_kwargs: dict | None = None):
        """As `update`, but store only the gates; the keys and values are written by a kernel that then hands
        its buffers to `set_keys_values`. Returns that layer's keys and values before the update, gates after."""
        self._check_on_device(layer_idx, key_states.shape[0])
        return self._layer(layer_idx).update_gates(key_states, value_states, gate_states, cache_kwargs)

    def buffers(self, key_states, value_states, gate_states, layer_idx: int, cache_kwargs: dict | None = None):
        """For a kernel that writes keys, values and gates itself: that layer's buffers before the update, which the
        kernel hands back updated through `set_keys_values`."""
        self._check_on_device(layer_idx, key_states.shape[0])
        return self._layer(layer_idx).buffers(key_states, value_states, gate_states, cache_kwargs)

    def _check_on_device(self, layer_idx: int, batch: int) -> None:
        if self.offloading:
            raise ValueError("a kernel that writes the cache itself needs the cache on its device; turn offloading off")
        if not is_tracing():
            self._check_batch(layer_idx, batch)

    def set_keys_values(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, gates: torch.Tensor | None = None
    ) -> None:
        self._layer(layer_idx).set_keys_values(keys, values, gates)

    def update_shift(
        self,
        layer_idx: int,
        key_shift: torch.Tensor | None = None,
        value_shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Store one layer's newest key/value projections `[batch, kv_heads * head_dim]`; return the previous ones."""
        return self._layer(layer_idx).update_shift(key_shift, value_shift)

    def shift_states(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if layer_idx >= len(self.layers):
            return None, None
        layer = self.layers[layer_idx]
        return layer.key_shift, layer.value_shift

    def _wait_for_prefetch(self, device: torch.device) -> None:
        if device.type == "cuda":
            if self._prefetch_stream is None:
                self._prefetch_stream = torch.cuda.Stream(device)
            torch.cuda.current_stream(device).wait_stream(self._prefetch_stream)

    def prefetch(self, layer_idx: int) -> None:
        """Start copying a layer (wrapping past the last to the first) back to its device on a side stream."""
        if not self.layers:
            return
        stream = self._prefetch_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self.layers[layer_idx % len(self.layers)].prefetch()

    def offload(self, layer_idx: int) -> None:
        self.layers[layer_idx].offload()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """How many positions the layer holds (for a static cache: one past the highest written position), counting
        those a crop left to feed again: the positions a caller has fed."""
        return self._held(layer_idx) + (0 if self.again is None else self.again.shape[1])

    def _held(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, cache_position: torch.Tensor, layer_idx: int = 0) -> tuple[int, int]:
        """(kv_length, kv_offset) of the attention mask for a forward pass over `cache_position`."""
        if layer_idx >= len(self.layers):
            return cache_position.shape[0], 0
        return self.layers[layer_idx].get_mask_sizes(cache_position)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """The most positions a layer can hold; -1 when unbounded."""
        return self.layers[layer_idx].get_max_cache_shape() if layer_idx < len(self.layers) else -1

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.kept, self.fed, self.again = None, [], None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)
        self._rows_changed(lambda tokens: tokens.index_select(0, beam_idx.to(tokens.device)))

    def checkpoint(self) -> None:
        """Keep the length and shift states as they are, for `crop` to go back to: a run's shift states are those
        after its last token, so a crop among the tokens fed since (see `feed`) can only start again from here.
        The states are copied, as a static cache overwrites its own."""
        states = [
            tuple(None if state is None else state.clone() for state in (layer.key_shift, layer.value_shift))
            for layer in self.layers
        ]
        self.kept, self.fed = (self._held(), states), []

    def feed(self, tokens: torch.Tensor) -> None:
        """Record a run's tokens `[batch, seq]` into a cache of shift states, keeping the states first where none
        are kept: on an empty cache and on the first run since a crop, as no crop of assisted decoding goes back
        further than that."""
        if self.kept is None:
            self.checkpoint()
        self.fed.append(tokens)

    def take_again(self) -> torch.Tensor | None:
        """The tokens `[batch, n]` a crop left to feed again (see `crop`), which the caller now feeds before its
        own, at the n positions before those `get_seq_length` counts."""
        again, self.again = self.again, None
        return again

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` positions (negative: drop that many from the end). Where the layers hold
        shift states (after the latest run's last token) and the new end lies among the runs since the checkpoint,
        the cache goes back to the checkpoint's length and states, and the tokens from there to the new end are left
        for the next run to feed again (`take_again`): the length the caller sees is `max_length` all the same."""
        kept, self.kept = self.kept, None  # the next run keeps the states anew, where the next crop comes back to
        if not any(layer.has_shift for layer in self.layers):
            for layer in self.layers:
                layer.crop(max_length)
            return
        held, length = self._held(), self.get_seq_length()
        keep = max(length + max_length, 0) if max_length < 0 else max_length
        if keep >= length:
            return
        if keep >= held:  # no run since the latest crop: fewer tokens to feed again
            self.again = self.again[:, : keep - held] if keep > held else None
            return
        if kept is None or keep < kept[0]:
            where = "no earlier ones are kept" if kept is None else f"earlier ones are kept only at {kept[0]}"
            raise ValueError(
                f"cannot crop to {keep} positions a cache that holds key/value shift states: a run leaves those "
                f"after its last token, and {where} (see GatedCache.checkpoint); re-run the prompt up to the crop "
                "point into a new cache instead"
            )
        start, states = kept
        del self.layers[len(states) :]  # layers that were not there yet held nothing
        for layer, shift in zip(self.layers, states, strict=True):
            layer.crop(start, shift)
        self.again = torch.cat(self.fed, dim=1)[:, : keep - start] if keep > start else None

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)
        self._rows_changed(lambda tokens: tokens.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)
        self._rows_changed(lambda tokens: tokens[indices])

    def _rows_changed(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The kept states are of the old rows: the next run keeps them anew. Tokens to feed again follow the rows."""
        self.kept, self.fed = None, []
        if self.again is not None:
            self.again = rows(self.again)

    @property
    def max_batch_size(self) -> int:
        sizes = {layer.keys.shape[0] for layer in self.layers if layer.keys is not None}
        if len(sizes) > 1:
            raise ValueError(f"layers hold different batch sizes: {sorted(sizes)}")
        if not sizes:
            raise ValueError("the cache holds nothing yet, so it has no batch size")
        return sizes.pop()

    @property
    def max_cache_len(self) -> int:
        return max((layer.get_max_cache_shape() for layer in self.layers), default=-1)

    @property
    def is_compileable(self) -> bool:
        return bool(self.layers) and all(layer.is_compileable for layer in self.layers)

    @property
    def is_sliding(self) -> list[bool]:
        return [layer.is_sliding for layer in self.layers]


class DynamicCache(GatedCache):
    """A cache that grows by concatenation: the default for eager decoding and the dynamic ONNX graph.

    Built empty (layers appear on first update) or from per-layer tuples
    `(keys, values, gates[, key_shift, value_shift])`, whose tensors it holds without copying.
    """

    def __init__(self, layer_tensors: Iterable[LayerTensors] | None = None, offloading: bool = False):
        if layer_tensors is None:
            super().__init__(layer_factory=DynamicLayer, offloading=offloading)
        else:
            layers = [DynamicLayer.from_tensors(*tensors) for tensors in layer_tensors]
            super().__init__(layers=layers, offloading=offloading)

    def to_legacy_cache(self) -> tuple[LayerTensors, ...]:
        """One tuple per layer: (keys, values, gates), plus (key_shift, value_shift) when a shift is held."""
        legacy = []
        for layer in self.layers:
            triple = (layer.keys, layer.values, layer.gates)
            legacy.append((*triple, layer.key_shift, layer.value_shift) if layer.has_shift else triple)
        return tuple(legacy)

    @classmethod
    def from_legacy_cache(cls, legacy: Sequence[LayerTensors] | None) -> DynamicCache:
        return cls(legacy) if legacy is not None else cls()


class StaticCache(GatedCache):
    """A cache of `max_cache_len` positions, allocated on first update or by `early_initialization`."""

    def __init__(
        self, num_layers: int, max_cache_len: int, max_batch_size: int | None = None, offloading: bool = False
    ):
        layers = [StaticLayer(max_cache_len, max_batch_size) for _ in range(num_layers)]
        super().__init__(layers=layers, offloading=offloading)

    @classmethod
    def from_tensors(cls, layer_tensors: Iterable[LayerTensors]) -> StaticCache:
        """A static cache over existing buffers `(keys, values, gates[, key_shift, value_shift])` per layer."""
        layers = [StaticLayer.from_tensors(*tensors) for tensors in layer_tensors]
        if not layers:
            raise ValueError("a static cache needs at least one layer of tensors")
        cache = cls(num_layers=0, max_cache_len=layers[0].max_cache_len)
        cache.layers = layers
        return cache

    def early_initialization(
        self,
        batch_size: int,
        kv_heads: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shift: Sequence[str] = (),
    ) -> None:
        """Allocate every buffer now (export needs them before tracing); `shift` names the shift states to hold."""
        unknown = set(shift) - set(SHIFT_FIELDS)
        if unknown:
            raise ValueError(f"unknown shift states {sorted(unknown)}; choose from {list(SHIFT_FIELDS)}")
        keys = torch.zeros((batch_size, kv_heads, 0, head_dim), dtype=dtype, device=device)
        gates = torch.zeros((batch_size, heads, 0), dtype=torch.float32, device=device)
        for layer in self.layers:
            layer.lazy_initialization(keys, gates)
            for name in shift:
                layer.allocate_shift(name, kv_heads * head_dim)


# A cache is a pytree as soon as its classes exist: torch.export takes and returns it. (pytree.py imports the
# classes above, so this import comes last.)
from kvg_export.pytree import register_cache_pytrees  # noqa: E402

register_cache_pytrees()
