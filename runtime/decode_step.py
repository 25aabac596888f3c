"""One decode step: every row's next token in, its logits out, the cache updated where it lies.

The token ids, the cache position and the logits keep one buffer each for every step of a generation (on the
CPU, numpy arrays that onnxruntime reads and writes in place, so nothing is copied through pybind). Steps
alternate between two bindings, as the shift states alternate between their two buffers, so that a step renews
only the mask's binding (one column longer each step) and what the cache changed.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.artifact import Artifact
from runtime.device_cache import DeviceCache


class DecodeStep:
    def __init__(self, artifact: Artifact, cache: DeviceCache, run):
        """`run`: runs the session on a binding (see `generator.SessionClock`)."""
        self.artifact, self.cache, self.run = artifact, cache, run
        self.bindings = (artifact.session.io_binding(), artifact.session.io_binding())  # even steps', odd steps'
        self.steps = 0
        self.inputs = ("input_ids", "cache_position") if artifact.static else ("input_ids",)  # dynamic: no position
        self.io: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}  # ids, position, logits: host array, bound value

    def _bind_buffers(self, batch: int) -> None:
        """Bind the step's own buffers to both bindings once; later steps write into them."""
        arrays = {
            "input_ids": np.empty((batch, 1), dtype=np.int64),
            "cache_position": np.empty(1, dtype=np.int64),
            "logits": np.empty((batch, 1, self.artifact.vocab_size), dtype=np.float32),
        }
        for name in (*self.inputs, "logits"):
            self.io[name] = (arrays[name], ort.OrtValue.ortvalue_from_numpy(arrays[name], self.cache.device, 0))
        for binding in self.bindings:
            for name in (*self.inputs, "logits"):
                bind = binding.bind_ortvalue_output if name == "logits" else binding.bind_ortvalue_input
                bind(name, self.io[name][1])

    def __call__(self, tokens: np.ndarray, mask: np.ndarray, filled: int, rows) -> np.ndarray:
        """Feed `tokens` `[batch, 1]` at position `filled` (`mask` covers at least filled + 1 positions; `rows`,
        those still generating, decide what pruning drops); returns the logits `[batch, vocab]`."""
        cache = self.cache
        cache.make_room(filled, 1, rows)
        slot = filled - cache.offset
        cache.reserve(slot + 1)
        binding, following = self.bindings[self.steps % 2], self.bindings[1 - self.steps % 2]
        fresh = not self.io
        if fresh:
            self._bind_buffers(len(tokens))
        cache.bind_step(binding, following, fresh)
        on_host = cache.device == "cpu"
        for name, value in zip(self.inputs, (tokens, slot), strict=False):
            host, device = self.io[name]
            host[...] = value
            if not on_host:
                device.update_inplace(host)
        binding.bind_cpu_input("attention_mask", cache.window_mask(mask, filled + 1))
        self.run(binding)
        self.steps += 1
        cache.advance(binding.get_outputs() if cache.feeds_back else None)
        host, device = self.io["logits"]
        return (host if on_host else device.numpy())[:, -1]
