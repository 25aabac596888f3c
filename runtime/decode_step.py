"""One decode step: every row's next tokens in (its latest token, and any drafts after it or tokens fed again before
it), their logits out, the cache updated where it lies.

The Generator and the engine both decode through it; the cache (DeviceCache or RowCache) binds its own
tensors. The token ids, the cache positions and the logits keep one buffer each while the batch and the step's
width hold (on the CPU, numpy arrays that onnxruntime reads and writes in place, so nothing is copied through
pybind). Steps alternate between two bindings, as the shift states alternate between their two buffers, so that a
step renews only the mask's binding (one column longer each step) and what the cache changed: a speculative step
of several tokens costs the binding of one token's step (binding every tensor afresh for it cost fox-py about half
a step).
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

    # how many of `width` tokens a row fit, the slot the first is written to, and the step's attention mask
    def prepare_step(self, rows: int, width: int) -> tuple[int, int, np.ndarray]: ...

    def bind_step(self, binding: ort.IOBinding, following: ort.IOBinding, rows: int, fresh: bool) -> None: ...

    def advance(self, outputs: list[ort.OrtValue] | None, width: int) -> None: ...


class DecodeStep:
    def __init__(self, artifact: Artifact, cache: StepCache, run: Callable[[ort.IOBinding], None]):
        """`run`: runs the session on a binding (see `generator.SessionClock`)."""
        self.artifact, self.cache, self.run = artifact, cache, run
        self.bindings = (artifact.session.io_binding(), artifact.session.io_binding())  # even steps', odd steps'
        self.steps = 0
        self.inputs = (INPUT_IDS, CACHE_POSITION) if artifact.static else (INPUT_IDS,)  # dynamic: no position
        self.io: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}  # ids, positions, logits: host array, bound value

    def _bind_buffers(self, rows: int, width: int) -> None:
        """Bind the step's own buffers, `rows` rows of `width` tokens, to both bindings; later steps write into them."""
        arrays = {
            INPUT_IDS: np.empty((rows, width), dtype=np.int64),
            CACHE_POSITION: np.empty(width, dtype=np.int64),
            LOGITS: np.empty((rows, width, self.artifact.vocab_size), dtype=np.float32),
        }
        for name in (*self.inputs, LOGITS):
            self.io[name] = (arrays[name], ort.OrtValue.ortvalue_from_numpy(arrays[name], self.cache.device, 0))
        self.ahead = np.arange(width, dtype=np.int64)  # each token's position past the step's first slot
        for binding in self.bindings:
            for name in (*self.inputs, LOGITS):
                bind = binding.bind_ortvalue_output if name == LOGITS else binding.bind_ortvalue_input
                bind(name, self.io[name][1])

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        """Feed `tokens` `[rows, width]` into rows [0, rows) of the cache, where and over what it says; returns the
        logits at each position fed `[rows, fed, vocab]`: all of them, or fewer where a pruned cache has room for
        fewer (never for fewer than one)."""
        rows = len(tokens)
        width, slot, mask = self.cache.prepare_step(rows, tokens.shape[1])
        binding, following = self.bindings[self.steps % 2], self.bindings[1 - self.steps % 2]
        shape = self.io[INPUT_IDS][0].shape if self.io else None
        if shape != (rows, width):
            self._bind_buffers(rows, width)
        self.cache.bind_step(binding, following, rows, fresh=shape is None or shape[0] != rows)
        on_host = self.cache.device == "cpu"
        self.io[INPUT_IDS][0][...] = tokens[:, :width]
        if self.artifact.static:
            np.add(self.ahead, slot, out=self.io[CACHE_POSITION][0])  # written in place: no array a step
        if not on_host:
            for name in self.inputs:
                host, device = self.io[name]
                device.update_inplace(host)
        binding.bind_cpu_input(ATTENTION_MASK, mask)
        self.run(binding)
        self.steps += 1
        self.cache.advance(binding.get_outputs() if self.cache.feeds_back else None, width)
        host, device = self.io[LOGITS]
        return host if on_host else device.numpy()
