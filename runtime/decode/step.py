"""One decode step: every row's next tokens in (its latest token, and any drafts after it or tokens fed again before
it), their logits out, the cache updated where it lies.

The Generator and the engine both decode through it; the cache (either layout of runtime/cache/protocol.py) binds
its own tensors. The token ids, the cache positions, the logits (and a fused FoX-Pro graph's shift states after each
token) keep one buffer each for each width while the batch holds (on the CPU, numpy arrays that onnxruntime reads
and writes in place, so nothing is copied through pybind). Steps alternate between two bindings, as the shift
states alternate between their two buffers, so that a step renews only the mask's binding (one column longer each
step) and what the cache changed: a speculative step of several tokens costs the binding of one token's step
(binding every tensor afresh for it cost fox-py about half a step).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnxruntime as ort

from runtime.artifact import Artifact
from runtime.cache.protocol import Cache
from runtime.contract import ATTENTION_MASK, CACHE_POSITION, INPUT_IDS, LOGITS


class DecodeStep:
    def __init__(self, artifact: Artifact, cache: Cache, run: Callable[[ort.IOBinding], None]):
        """`run`: runs the session on a binding (see `prefill.SessionClock`)."""
        self.artifact, self.cache, self.run = artifact, cache, run
        self.bindings = (artifact.session.io_binding(), artifact.session.io_binding())  # even steps', odd steps'
        self.steps = 0
        self.inputs = (INPUT_IDS, CACHE_POSITION) if artifact.static else (INPUT_IDS,)  # dynamic: no position
        self.state_outputs = artifact.shift_states()  # a shift state's past -> its every token's values, if given
        widths = {e["name"]: e["axes"][-1] for e in artifact.manifest["outputs"]}
        self.state_widths = {past: widths[name] for past, name in self.state_outputs.items()}
        self.rows = 0
        self.sized: dict[int, tuple[dict, dict]] = {}  # by width: the buffers by name, and the states by past
        self.bound: list[dict | None] = [None, None]  # the buffers each binding holds

    def _buffers(self, rows: int, width: int) -> tuple[dict[str, tuple[np.ndarray, ort.OrtValue]], dict]:
        """The step's own buffers for `rows` rows of `width` tokens, by graph name (a host array, and the value bound):
        ids, positions (static graphs), logits and each token's shift states, these on the host and also given by
        their past's name. Made once for each width (a speculative step's width changes step by step), later steps
        write into them."""
        if rows != self.rows:
            self.rows, self.sized = rows, {}
        if width not in self.sized:
            shapes = {INPUT_IDS: ((rows, width), np.int64), CACHE_POSITION: ((width,), np.int64),
                      LOGITS: ((rows, width, self.artifact.vocab_size), np.float32)}  # fmt: skip
            tensors = {}
            for name in (*self.inputs, LOGITS):
                array = np.empty(*shapes[name])
                tensors[name] = (array, ort.OrtValue.ortvalue_from_numpy(array, self.cache.device, 0))
            states = {past: np.empty((rows, width, size), dtype=np.float32) for past, size in self.state_widths.items()}
            for past, name in self.state_outputs.items():  # read on the host, where a row keeps fewer tokens
                tensors[name] = (states[past], ort.OrtValue.ortvalue_from_numpy(states[past]))
            self.sized[width] = tensors, states
        return self.sized[width]

    def _bind(self, binding: ort.IOBinding, tensors: dict[str, tuple[np.ndarray, ort.OrtValue]]) -> None:
        for name, (_, value) in tensors.items():
            bind = binding.bind_ortvalue_input if name in self.inputs else binding.bind_ortvalue_output
            bind(name, value)

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        """Feed `tokens` `[rows, width]` into rows [0, rows) of the cache, where and over what it says, once it has
        made room for them (`Cache.make_room`; see `fitted`); returns the logits at each position `[rows, width,
        vocab]`."""
        rows, width = tokens.shape
        slot, mask = self.cache.prepare_step(rows, width)
        resized = rows != self.rows
        tensors, states = self._buffers(rows, width)
        turn = self.steps % 2
        binding, following = self.bindings[turn], self.bindings[1 - turn]
        # Resized, both bindings: the logits then come before the cache's outputs, whose order a fed-back cache reads
        for index in (turn, 1 - turn) if resized else (turn,):
            if self.bound[index] is not tensors:
                self._bind(self.bindings[index], tensors)
                self.bound[index] = tensors
        self.cache.bind_step(binding, following, rows, resized=resized)
        on_host = self.cache.device == "cpu"
        tensors[INPUT_IDS][0][...] = tokens
        if self.artifact.static:
            tensors[CACHE_POSITION][0][...] = range(slot, slot + width)  # written in place: no array a step
        if not on_host:
            for name in self.inputs:
                host, device = tensors[name]
                device.update_inplace(host)
        binding.bind_cpu_input(ATTENTION_MASK, mask)
        self.run(binding)
        self.steps += 1
        self.cache.advance(binding.get_outputs() if self.cache.feeds_back else None, width, states)
        host, device = tensors[LOGITS]
        return host if on_host else device.numpy()


def fitted(cache: Cache, tokens: np.ndarray) -> np.ndarray:
    """`tokens` `[rows, width]` cut to what `cache` has made room for, for a loop whose rows share their positions
    (a generation's, a draft model's): where a row has no room for one, the loop fails with the row's error."""
    for _, error in cache.make_room(tokens.shape[1]):
        raise error
    return tokens[:, : cache.room]
