"""One decode step: every row's next token in, its logits out, the cache updated where it lies.

The token ids, the cache position and the logits keep one buffer each for every step of a generation (on the
CPU, numpy arrays that onnxruntime reads and writes in place, so nothing is copied through pybind); a step
renews only the mask's binding (one column longer each step) and what the cache changed.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.artifact import Artifact
from runtime.device_cache import DeviceCache


class DecodeStep:
    def __init__(self, artifact: Artifact, cache: DeviceCache, binding: ort.IOBinding, run):
        self.artifact, self.cache, self.binding, self.run = artifact, cache, binding, run
        self.inputs = ("input_ids", "cache_position") if artifact.static else ("input_ids",)  # dynamic: no position
        self.io: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}  # ids, position, logits: host array, bound value

    def _bind_buffers(self, batch: int) -> None:
        """Bind the step's own buffers and the cache once; later steps write into them."""
        self.binding.clear_binding_inputs()
        self.binding.clear_binding_outputs()
        arrays = {
            "input_ids": np.empty((batch, 1), dtype=np.int64),
            "cache_position": np.empty(1, dtype=np.int64),
            "logits": np.empty((batch, 1, self.artifact.vocab_size), dtype=np.float32),
        }
        for name in (*self.inputs, "logits"):
            self.io[name] = (arrays[name], ort.OrtValue.ortvalue_from_numpy(arrays[name], self.cache.device, 0))
            bind = self.binding.bind_ortvalue_output if name == "logits" else self.binding.bind_ortvalue_input
            bind(name, self.io[name][1])
        self.cache.bind(self.binding)

    def __call__(self, tokens: np.ndarray, mask: np.ndarray, filled: int, rows) -> np.ndarray:
        """Feed `tokens` `[batch, 1]` at position `filled` (`mask` covers at least filled + 1 positions; `rows`,
        those still generating, decide what pruning drops); returns the logits `[batch, vocab]`."""
        cache = self.cache
        cache.make_room(filled, 1, rows)
        slot = filled - cache.offset
        cache.reserve(slot + 1)
        if not self.io:
            self._bind_buffers(len(tokens))
        else:
            cache.rebind(self.binding)
        on_host = cache.device == "cpu"
        for name, value in zip(self.inputs, (tokens, slot), strict=False):
            host, device = self.io[name]
            host[...] = value
            if not on_host:
                device.update_inplace(host)
        self.binding.bind_cpu_input("attention_mask", cache.window_mask(mask, filled + 1))
        self.run()
        cache.advance(self.binding.get_outputs() if cache.feeds_back else None)
        host, device = self.io["logits"]
        return (host if on_host else device.numpy())[:, -1]
