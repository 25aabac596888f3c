"""The key/value/gate cache of one generation, held on the session's device and bound through IOBinding.

Each cache tensor is held in one of three ways between steps:
- in place: one buffer bound as both `past_key_values.*` and `present.*`, which the graph writes the new
  entries into, so nothing about it moves between steps. A static artifact holds its keys, values and
  gates so; a gqa dynamic artifact its keys and values, in buffers as long as the generation needs,
  which onnxruntime's GroupQueryAttention appends to (present is as long as the longer of past and
  the attention window);
- swapped: two buffers that trade roles every step, for a static artifact's shift states, which the
  graph reads besides replacing;
- fed back: `present.*` left on the device by onnxruntime and bound as the next step's `past_*` (every
  tensor of a standard dynamic artifact; a gqa dynamic artifact's gates and shift states).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.artifact import NUMPY_DTYPES, Artifact


def _field(name: str) -> str:
    return name.rsplit(".", 1)[-1]


class DeviceCache:
    def __init__(self, artifact: Artifact, batch: int, length: int):
        """`length`: the cache positions this generation needs (prompt and new tokens)."""
        self.artifact, self.batch, self.device = artifact, batch, artifact.device
        appends = not artifact.static and artifact.attention == "gqa"
        self.length = length if appends else None  # the in-place buffers' length where it depends on the request
        self.pairs = list(zip(artifact.past_names(), artifact.present_names(), strict=True))
        if artifact.static:
            self.in_place = {past for past, _ in self.pairs if not _field(past).endswith("shift")}
        else:
            self.in_place = {past for past, _ in self.pairs if appends and _field(past) in ("key", "value")}
        self.swapped = {past: present for past, present in self.pairs if artifact.static and past not in self.in_place}
        self.fed_back = [(i, past, present) for i, (past, present) in enumerate(self.pairs)
                         if past not in self.in_place and past not in self.swapped]  # fmt: skip
        self.past: dict[str, ort.OrtValue] = {}
        self.spare: dict[str, ort.OrtValue] = {}  # swapped tensors: the buffer present is written to
        self.reset()

    def fits(self, batch: int, length: int) -> bool:
        """Whether a generation of `batch` rows needing `length` positions can reuse these buffers."""
        return batch == self.batch and (self.length is None or length <= self.length)

    def _zeros(self, name: str) -> ort.OrtValue:
        spec = self.artifact.input_spec(name)
        past = self.length if name in self.in_place else 0  # a static buffer's length is a number in the spec
        shape = [self.batch if axis == "batch" else past if axis == "past" else axis for axis in spec["axes"]]
        return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, NUMPY_DTYPES[spec["dtype"]]), self.device, 0)

    def reset(self) -> None:
        """Start a new generation.

        In-place buffers are allocated zeroed once and then kept: a stale slot is never attended (it lies
        after the query, with weight exactly 0, or is rewritten first), but it must be finite, since
        0 * NaN is NaN. Everything else restarts from zero (shift states) or from empty every generation.
        """
        for past, _ in self.pairs:
            if past not in self.in_place or past not in self.past:
                self.past[past] = self._zeros(past)
            if past in self.swapped:
                self.spare[past] = self._zeros(past)

    @property
    def feeds_back(self) -> bool:
        """Whether `advance` needs the step's outputs."""
        return bool(self.fed_back)

    def bind(self, binding: ort.IOBinding) -> None:
        """Bind every past input and present output (after `logits`, which the caller binds first)."""
        for past, present in self.pairs:
            binding.bind_ortvalue_input(past, self.past[past])
            if past in self.in_place:
                binding.bind_ortvalue_output(present, self.past[past])
            elif past in self.swapped:
                binding.bind_ortvalue_output(present, self.spare[past])
            else:
                binding.bind_output(present, self.device)

    def rebind(self, binding: ort.IOBinding) -> None:
        """Between decode steps: bind what `advance` changed; in-place buffers stay bound."""
        for past, present in self.swapped.items():
            binding.bind_ortvalue_input(past, self.past[past])
            binding.bind_ortvalue_output(present, self.spare[past])
        for _, past, present in self.fed_back:
            binding.bind_ortvalue_input(past, self.past[past])
            binding.bind_output(present, self.device)

    def advance(self, outputs: list[ort.OrtValue] | None) -> None:
        """Make this step's presents the next step's pasts (`outputs`: logits, then one per pair, in binding
        order; needed only when `feeds_back`)."""
        for index, past, _ in self.fed_back:
            self.past[past] = outputs[1 + index]
        for past in self.swapped:
            self.past[past], self.spare[past] = self.spare[past], self.past[past]
