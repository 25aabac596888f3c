"""Forget-gate pruning over a generation's in-place buffers (runtime/cache/device_cache.py): which of each kv head's
oldest slots are dropped, the kept slots moved to the front of the head's rows, and where each head's window
starts (the graph's window_offsets).

Every row of the batch shares one window of slots, so a head drops what it may drop in every row still generating;
where the graph takes each head's window a head drops as far as its own query heads allow, else each layer's heads
(or all layers') move together.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.artifact import Artifact, window_kind
from runtime.cache import buffers
from runtime.cache.pruning import PruningError, count_dropped, due, needed_slots


class PrunedWindow:
    def __init__(self, artifact: Artifact, layer_buffers: list[list[str]], dtypes: dict[str, str], capacity):
        """`layer_buffers`: each layer's in-place buffers (its keys, values and gates), which `drop` moves;
        `capacity`: the slots a request may fill (None: any number)."""
        self.device, self.layer_buffers, self.dtypes, self.capacity = artifact.device, layer_buffers, dtypes, capacity
        self.gate_names = artifact.gate_names()
        self.kind = window_kind(artifact.manifest)
        # Whether a prompt's chunk too runs with each head its own window, not only a decode step
        self.chunk_heads_staggered = artifact.manifest["cache"].get("heads_apart_in_chunks", False)
        self.heads = artifact.manifest["model"]["num_kv_heads"]
        layers = len(self.gate_names)
        self.thresholds: np.ndarray | None = None  # per layer and head, while a pruned request runs
        self.dropped = np.zeros((layers, self.heads), dtype=np.int64)  # positions each kv head dropped
        # window_offsets: each window's start past `offset`, bound once and read at every run
        self.offsets = np.zeros((layers, self.heads) if self.kind == "head" else layers, dtype=np.int64)
        self.offsets_value = ort.OrtValue.ortvalue_from_numpy(self.offsets)
        self.offset = 0  # positions dropped from the front of every head's buffer rows: where the window starts
        self.pruned_at = 0  # the filled positions when slots were last dropped
        self.counted = 0  # the window start up to which `mask` has counted the dropped positions

    def start(self, thresholds: np.ndarray | None) -> None:
        """A request begins (None: it keeps every slot)."""
        self.thresholds = None if thresholds is None else np.asarray(thresholds)
        self.dropped[:], self.offsets[:] = 0, 0
        self.offset = self.pruned_at = self.counted = 0

    def take_state(self, source: PrunedWindow) -> None:
        """Where `source` is: its thresholds, drops and offsets (written into the bound offsets in place)."""
        self.thresholds = source.thresholds
        self.dropped[:], self.offsets[:] = source.dropped, source.offsets
        self.offset, self.pruned_at, self.counted = source.offset, source.pruned_at, source.counted

    def mask(self, mask: np.ndarray, end: int) -> np.ndarray:
        """The attention mask of positions [offset, end) `[batch, end - offset]` for the slots the buffers hold, its
        first column counting the positions dropped before it as well (`count_dropped`). The count is written into
        `mask` itself, once each time the window moves (its columns before the window are never read again), so a
        decode step slices the mask as it would without pruning."""
        if self.offset != self.counted:  # the column at `counted` holds the count up to it
            count_dropped(mask, self.offset, mask[:, self.counted : self.offset].sum(-1))
            self.counted = self.offset
        return np.ascontiguousarray(mask[:, self.offset : end])

    def folded(self, layer: int) -> bool:
        """Whether the layer's heads' windows are staggered (its runs then give its keys and values folded)."""
        return self.offsets[layer].min() != self.offsets[layer].max()

    def make_room(
        self, past: dict[str, ort.OrtValue], filled: int, new: int, generating, cadence: bool, held: int | None
    ):
        """Before a run of up to `new` positions after `filled`: drop the slots that the rows `generating` (an index)
        no longer need, at least every PRUNE_EVERY positions, every chunk of a prompt (unless `cadence`: a decode
        run's drafts) and whenever the new ones would not fit otherwise, never past position `held` (where a rewind
        may go back to). Returns how many of the `new` positions fit, and whether the windows moved; raises
        PruningError naming the head that leaves no room for one."""
        if self.thresholds is None:
            return new, False
        full = self.capacity is not None and filled - self.offset + new > self.capacity  # the longest rows'
        if not (full or (new > 1 and not cadence) or due(filled, self.pruned_at)):
            return new, False
        self.pruned_at = filled
        slots = filled - self.dropped  # per layer and kv head
        needs = self._needs(past, slots, generating)  # [layers, heads]
        group = needs.shape[1] // self.heads
        kept = needs.reshape(len(needs), self.heads, group).max(-1)  # per layer and kv head
        if self.kind == "one":
            kept[:] = kept.max()
        elif self.kind == "layer" or (new > 1 and not self.chunk_heads_staggered):  # the heads kept together
            kept[:] = kept.max(1, keepdims=True)
        if held is not None:
            kept = np.maximum(kept, filled - held)
        room = new if self.capacity is None else min(new, self.capacity - int(kept.max()))
        if room < 1:
            raise PruningError.no_room(needs, self.thresholds, self.capacity)
        for layer, drops in enumerate(slots - kept):
            if drops.max() > 0:
                self._drop(past, layer, group, drops, slots[layer])
        self.offset = int(self.dropped.min())
        offsets = self.dropped - self.offset
        offsets = offsets if self.kind == "head" else offsets[:, 0]
        moved = not np.array_equal(offsets, self.offsets)  # a layer's presents may now come folded, or no longer
        self.offsets[:] = offsets
        return room, moved

    def _needs(self, past: dict[str, ort.OrtValue], slots: np.ndarray, generating) -> np.ndarray:
        """How many of its newest slots each query head still needs in some of the rows `generating`, `[layers, heads]`
        (`slots`: what each kv head's rows hold). Each layer's gates are read as long as its longest rows: a
        head's slots past its own are zero (see DeviceCache.reset), which adds nothing to its sums and is never
        droppable, so it needs what it needs of its own, less the slots it lacks."""
        longest = slots.max(1)
        gates = [buffers.to_host(past[name], "float32")[generating, :, :filled]
                 for name, filled in zip(self.gate_names, longest, strict=True)]  # fmt: skip
        lacking = (longest[:, None] - slots).repeat(self.thresholds.shape[1] // self.heads, axis=1)
        return needed_slots(gates, self.thresholds) - lacking

    def _drop(self, past: dict[str, ort.OrtValue], layer: int, group: int, drops: np.ndarray, filled: np.ndarray):
        """Move each kv head's kept slots of `layer` (and its query heads' gates) to the front of its rows, the head's
        oldest `drops[h]` of its `filled[h]` slots dropped; each buffer visits the host once for all its heads."""
        for name in self.layer_buffers[layer]:
            gates = name in self.gate_names  # a head's gate slots past its window must be zero (see DeviceCache.reset)
            with buffers.on_host(past[name], self.dtypes[name], self.device) as host:
                for head in np.flatnonzero(drops > 0):
                    heads = slice(head * group, (head + 1) * group) if gates else head
                    buffers.move_slots(host, slice(None), int(drops[head]), int(filled[head]), 0, heads, gates)
        self.dropped[layer] += np.maximum(drops, 0)
