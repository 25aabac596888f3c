"""Forget-gate pruning at run time: which cached slots no later query can weigh above the tolerance.

The export records each head's score bound U (kvg_export/fox/pruning.py gives the proof); a request of at most
L positions may drop key j of a head once its decay c_t - c_j, the head's log forget gates summed after j, is
below log_pruning_tolerance - 2U - log L. The decay only falls as t grows, and it falls with j: the keys a head
may drop are always its oldest ones. A layer's heads and rows share its buffers' slots, so a layer drops the
oldest slots that every one of its heads may drop in every row still generating (a graph without window_offsets
keeps one window for all layers, and drops what every head of every layer may drop).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np

from runtime.errors import RequestError

PRUNE_EVERY = 64  # decode steps between two prunings (each sums every head's gates over the window)
AS_EXPORTED = "artifact"  # a tolerance that means: as the artifact's manifest records it
Tolerance = float | str | None  # a log_pruning_tolerance, AS_EXPORTED, or None: no pruning


class PruningError(RequestError):
    """A head still needs more slots than the cache has: the request cannot go on exactly."""

    @classmethod
    def no_room(cls, needs: np.ndarray, thresholds: np.ndarray, capacity: int) -> PruningError:
        """For the neediest head of `needs` `[layers, heads]` (slots each head still needs)."""
        layer, head = np.unravel_index(needs.argmax(), needs.shape)
        return cls(
            f"layer {layer} head {head} still weighs all of its last {needs[layer, head]} positions above the "
            f"pruning threshold ({thresholds[layer][head]:.1f}), which leaves no room for a new one in this "
            f"artifact's {capacity} slots; re-export with a larger --max-cache-len, or prune more (a higher "
            "--log-pruning-tolerance)"
        )


@dataclass(frozen=True)
class Pruning:
    log_tolerance: float
    score_bounds: np.ndarray  # U, float64 [layers, heads]

    @classmethod
    def of(cls, manifest: dict, log_tolerance: Tolerance = AS_EXPORTED) -> Pruning | None:
        """The artifact's pruning (its manifest's), or the tolerance asked for instead; None: keep every key."""
        recorded = manifest.get("pruning")
        if log_tolerance == AS_EXPORTED:
            log_tolerance = recorded and recorded["log_pruning_tolerance"]
        if log_tolerance is None:
            return None
        if recorded is None:
            raise ValueError(
                "this artifact records no score bounds to prune with (it was exported before pruning existed, or "
                "with a standard dynamic cache, which cannot drop slots); re-export it, with gqa attention or a "
                "static cache"
            )
        check_tolerance(log_tolerance)
        return cls(float(log_tolerance), np.asarray(recorded["score_bounds"], dtype=np.float64))

    def thresholds(self, positions: int) -> np.ndarray:
        """Per layer and head, the decay below which a key is dropped in a request of `positions` positions."""
        return self.log_tolerance - 2 * self.score_bounds - math.log(max(positions, 1))


def parse_tolerance(text: str) -> float | None:
    """A command line's --log-pruning-tolerance: a negative number, or `none`."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or none: {text!r}") from None
    try:
        check_tolerance(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def describe(pruning: Pruning | None) -> str:
    if pruning is None:
        return "no forget-gate pruning"
    tolerance = f"{pruning.log_tolerance:g}"
    return f"forget-gate pruning at log tolerance {tolerance} (a query loses at most e^{tolerance} of its weight)"


def check_tolerance(log_tolerance: float) -> None:
    if not (math.isfinite(log_tolerance) and log_tolerance < 0):
        raise ValueError(
            f"log_pruning_tolerance must be a negative number (the log of the weight a query may lose; the "
            f"official examples use -10), got {log_tolerance}"
        )


def droppable(gates: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """How many of the oldest slots each row and head may drop: gates `[rows, heads, window]` (log forget
    gates of the filled slots), thresholds `[heads]`; returns `[rows, heads]`.

    Summed in float64: the decision is about the exact decay, and float32 sums over thousands of slots drift."""
    sums = np.cumsum(gates, axis=-1, dtype=np.float64)  # c_j - c_before
    decay = sums[..., -1:] - sums  # c_t - c_j: the gates after slot j
    return (decay < thresholds[None, :, None]).sum(-1)


def needed_slots(gates: list[np.ndarray], thresholds: np.ndarray) -> np.ndarray:
    """How many of its newest slots each head still needs in some row, `[layers, heads]`: gates per layer
    `[rows, heads, window]`, thresholds `[layers, heads]`."""
    return np.stack([g.shape[-1] - droppable(g, t).min(0) for g, t in zip(gates, thresholds, strict=True)])


def due(filled: int, pruned_at: int) -> bool:
    """Whether a cache pruned at `pruned_at` positions prunes again at `filled`: every PRUNE_EVERY positions, so
    that the gates' sums cost a step little on average."""
    return filled - pruned_at >= PRUNE_EVERY


def count_dropped(mask: np.ndarray, first, dropped: np.ndarray) -> None:
    """Make each row's column `first` (one for all rows, or one a row) of an attention `mask` `[rows, slots]` count
    the `dropped` `[rows]` positions pruned before it as well, so that the mask's running sum (a token's RoPE
    position) stays that of the whole sequence; a 0 (padding, or a row that has ended) stays 0."""
    at = np.arange(len(mask)), first  # each row's column `first`
    mask[at] = np.where(mask[at] > 0, mask[at] + dropped, 0)
