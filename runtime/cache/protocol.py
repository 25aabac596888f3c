"""What a decode loop asks of a cache, whichever its layout: DeviceCache, a generation's batch with every row at the
same positions, or RowCache, the engine's rows that requests come and go from on one slot clock. A loop prepares a
step (the cache makes room and says where the tokens go), has the cache bind its tensors, runs, and advances it; a
prompt's chunk fed into one row alone binds that row; and a reader asks where a tensor is held, never for its
slots."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import onnxruntime as ort


class Cache(Protocol):
    device: str
    feeds_back: bool  # whether `advance` needs the step's outputs

    def prepare_step(self, rows: int, width: int) -> tuple[int, int, np.ndarray]:
        """Before a decode step of up to `width` tokens a row over rows [0, rows): how many fit, the slot the first is
        written to, and the step's attention mask."""

    def bind_step(self, binding: ort.IOBinding, following: ort.IOBinding, rows: int, resized: bool) -> None:
        """Bind the step's cache tensors on `binding`, and the next step's on `following` where they change."""

    def advance(
        self, outputs: list[ort.OrtValue] | None, width: int, states: dict[str, np.ndarray] | None = None
    ) -> None:
        """After the step: `outputs` where `feeds_back`; `states`, each shift state's value after each of the step's
        tokens `[rows, width, state]` where the artifact gives them (the state to keep when a row keeps fewer)."""

    def bind_row(self, binding: ort.IOBinding, row: int, chunk: int, chunks: int) -> None:
        """Bind `row` alone for chunk `chunk` of `chunks` of a prompt prefilled into it."""

    def held_in(self, past: str) -> ort.OrtValue:
        """The buffer that holds cache tensor `past` now."""
