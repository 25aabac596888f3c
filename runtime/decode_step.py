"""One decode step: every row's next token in, its logits out, the cache updated where it lies.

The Generator and the engine both decode through it; the cache (DeviceCache or RowCache) binds its own
tensors. The token ids, the cache position and the logits keep one buffer each while the batch holds (on the
CPU, numpy arrays that onnxruntime reads and writes in place, so nothing is copied through pybind). Steps
alternate between two bindings, as the shift states alternate between their two buffers, so that a step renews
only the mask's binding (one column longer each step) and what the cache changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import onnxruntime as ort

from runtime.artifact import Artifact
from runtime.contract import ATTENTION_MASK, CACHE_POSITION, INPUT_IDS, LOGITS


class StepCache(Protocol):
    """What a step needs of a cache (DeviceCache for a generation, RowCache for the engine's rows)."""

    device: str
    feeds_back: bool  # whether `advance` needs the step's outputs

    def prepare_step(self, rows: int) -> tuple[int, np.ndarray]: ...  # the slot a step writes, its attention mask

    def bind_step(self, binding: ort.IOBinding, following: ort.IOBinding, rows: int, fresh: bool) -> None: ...

    def advance(self, outputs: list[ort.OrtValue] | None) -> None: ...


class DecodeStep:
    def __init__(self, artifact: Artifact, cache: StepCache, run: Callable[[ort.IOBinding], None]):
        """`run`: runs the session on a binding (see `generator.SessionClock`)."""
        self.artifact, self.cache, self.run = artifact, cache, run
        self.bindings = (artifact.session.io_binding(), artifact.session.io_binding())  # even steps', odd steps'
        self.steps = 0
        self.inputs = (INPUT_IDS, CACHE_POSITION) if artifact.static else (INPUT_IDS,)  # dynamic: no position
        self.io: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}  # ids, position, logits: host array, bound value

    def _bind_buffers(self, batch: int) -> None:
        """Bind the step's own buffers for `batch` rows to both bindings; later steps write into them."""
        arrays = {
            INPUT_IDS: np.empty((batch, 1), dtype=np.int64),
            CACHE_POSITION: np.empty(1, dtype=np.int64),
            LOGITS: np.empty((batch, 1, self.artifact.vocab_size), dtype=np.float32),
        }
        for name in (*self.inputs, LOGITS):
            self.io[name] = (arrays[name], ort.OrtValue.ortvalue_from_numpy(arrays[name], self.cache.device, 0))
        for binding in self.bindings:
            for name in (*self.inputs, LOGITS):
                bind = binding.bind_ortvalue_output if name == LOGITS else binding.bind_ortvalue_input
                bind(name, self.io[name][1])

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        """Feed `tokens` `[rows, 1]` into rows [0, rows) of the cache, where and over what it says; returns the logits
        `[rows, vocab]`."""
        rows = len(tokens)
        slot, mask = self.cache.prepare_step(rows)
        binding, following = self.bindings[self.steps % 2], self.bindings[1 - self.steps % 2]
        fresh = not self.io or len(self.io[INPUT_IDS][0]) != rows
        if fresh:
            self._bind_buffers(rows)
        self.cache.bind_step(binding, following, rows, fresh)
        on_host = self.cache.device == "cpu"
        for name, value in zip(self.inputs, (tokens, slot), strict=False):
            host, device = self.io[name]
            host[...] = value
            if not on_host:
                device.update_inplace(host)
        binding.bind_cpu_input(ATTENTION_MASK, mask)
        self.run(binding)
        self.steps += 1
        self.cache.advance(binding.get_outputs() if self.cache.feeds_back else None)
        host, device = self.io[LOGITS]
        return (host if on_host else device.numpy())[:, -1]
