"""The key/value/gate cache of one generation, held on the session's device and bound through IOBinding.

Static artifacts: one buffer per cache tensor, bound as both `past_key_values.*` and `present.*`, so
the graph's scatter updates it in place and nothing about the cache moves between steps. Shift states
are read by the graph besides being replaced, so each has two buffers that swap roles every step.
Dynamic artifacts: `present.*` outputs are left on the device and bound as the next step's `past_*`.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.artifact import NUMPY_DTYPES, Artifact


def _is_shift(name: str) -> bool:
    return name.endswith("_shift")


class DeviceCache:
    def __init__(self, artifact: Artifact, batch: int):
        self.artifact, self.batch = artifact, batch
        self.device, self.static = artifact.device, artifact.static
        self.pairs = list(zip(artifact.past_names(), artifact.present_names(), strict=True))
        self.shift_pairs = [(past, present) for past, present in self.pairs if _is_shift(past)]
        self.past: dict[str, ort.OrtValue] = {}
        self.spare: dict[str, ort.OrtValue] = {}  # static shift states: the buffer present is written to
        self.reset()

    def _zeros(self, name: str) -> ort.OrtValue:
        spec = self.artifact.input_spec(name)
        shape = [self.batch if axis == "batch" else 0 if axis == "past" else axis for axis in spec["axes"]]
        return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, NUMPY_DTYPES[spec["dtype"]]), self.device, 0)

    def reset(self) -> None:
        """Start a new generation.

        Static buffers are allocated zeroed once and then kept: a stale slot is never attended (it lies
        after the query, with weight exactly 0, or is rewritten first), but it must be finite, since
        0 * NaN is NaN. Shift states restart from zero every generation.
        """
        for past, _ in self.pairs:
            if not self.static or past not in self.past or _is_shift(past):
                self.past[past] = self._zeros(past)
            if self.static and _is_shift(past):
                self.spare[past] = self._zeros(past)

    def bind(self, binding: ort.IOBinding) -> None:
        """Bind every past input and present output (after `logits`, which the caller binds first)."""
        for past, present in self.pairs:
            if not self.static:
                binding.bind_ortvalue_input(past, self.past[past])
                binding.bind_output(present, self.device)
            elif not _is_shift(past):
                binding.bind_ortvalue_input(past, self.past[past])
                binding.bind_ortvalue_output(present, self.past[past])
        if self.static:
            self._bind_shifts(binding)

    def rebind(self, binding: ort.IOBinding) -> None:
        """Between decode steps: a dynamic cache's pasts are the last presents, bound with fresh outputs;
        a static cache only swaps its shift-state buffers."""
        if self.static:
            self._bind_shifts(binding)
        else:
            self.bind(binding)

    def _bind_shifts(self, binding: ort.IOBinding) -> None:
        """Static artifacts: rebind the shift states after `advance` swapped their two buffers."""
        for past, present in self.shift_pairs:
            binding.bind_ortvalue_input(past, self.past[past])
            binding.bind_ortvalue_output(present, self.spare[past])

    def advance(self, outputs: list[ort.OrtValue] | None) -> None:
        """Make this step's presents the next step's pasts (dynamic: `outputs` after logits, in binding order)."""
        if not self.static:
            self.past = {past: value for (past, _), value in zip(self.pairs, outputs[1:], strict=True)}
            return
        for past in self.spare:
            self.past[past], self.spare[past] = self.spare[past], self.past[past]
