"""What a decode loop asks of a cache, whichever its layout: DeviceCache, a generation's batch with every row at the
same positions, or RowCache, the engine's rows that requests come and go from on one slot clock.

A prompt's chunk is prepared (the cache makes room and says where its tokens go) and bound, into every row or one
row alone; a decode step likewise, after the cache has made room for it; a run advances the cache; the loop keeps
the tokens of a run it chose (the rest are drafts the cache drops) and ends a row when it stops. A reader asks where
a tensor is held, never for its slots. Going back over several runs (`hold`, `rewind`) is the batch layout's alone:
a draft model's own cache, which no row shares.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import onnxruntime as ort

from runtime.cache.pruning import PruningError


class Cache(Protocol):
    device: str
    feeds_back: bool  # whether `advance` needs the step's outputs
    room: int  # the tokens a row the next step may write (after `make_room`)

    def prepare_chunk(self, row: int | None, span: tuple[int, int]) -> tuple[int, int, np.ndarray]:
        """Before feeding a prompt's tokens [first, last) into `row` (None: the same span of every row's prompt): how
        many of them fit, the slot the first is written to, and the chunk's attention mask."""

    def bind_row(self, binding: ort.IOBinding, row: int, chunk: int, chunks: int) -> None:
        """Bind `row` alone for chunk `chunk` of `chunks` of a prompt prefilled into it."""

    def make_room(self, width: int) -> list[tuple[int, PruningError]]:
        """Before a decode step of up to `width` tokens a row: prune, move or drop what makes room; returns the rows
        that have no room for one token (they end), each with the error that says why."""

    def prepare_step(self, rows: int, width: int) -> tuple[int, np.ndarray]:
        """Before a decode step of `width` tokens a row over rows [0, rows): the slot the first is written to, and
        the step's attention mask."""

    def bind_step(self, binding: ort.IOBinding, following: ort.IOBinding, rows: int, resized: bool) -> None:
        """Bind the step's cache tensors on `binding`, and the next step's on `following` where they change."""

    def advance(
        self, outputs: list[ort.OrtValue] | None, width: int, states: dict[str, np.ndarray] | None = None
    ) -> None:
        """After the step: `outputs` where `feeds_back`; `states`, each shift state's value after each of the step's
        tokens `[rows, width, state]` where the artifact gives them (the state to keep when a row keeps fewer)."""

    def keep(self, kept: int, row: int | None = None) -> int:
        """Of the latest step's tokens of `row` (None: of every row) keep the first `kept`; returns how many of them
        the row's next step must feed again first (a model whose shift states went back to the step's start)."""

    def end_row(self, row: int, index: int = 0) -> None:
        """`row` generates no more after the token chosen at position `index` of the latest step."""

    def held_in(self, past: str) -> ort.OrtValue:
        """The buffer that holds cache tensor `past` now."""
