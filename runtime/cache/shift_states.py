"""A FoX-Pro model's token-shift states (each layer's previous key and value projection, `[rows, kv_heads *
head_dim]`), which both cache layouts hold alike.

A run reads the states and writes new ones, so each state lives in two buffers that trade roles after every run:
decode steps alternate between two bindings, each bound once, the one reading what the other writes. A row starts
from a zero state. A run of several tokens (a token and its drafts) leaves the state after its last token; a row that
keeps fewer takes the state after its last kept token where the graph gives each token's (`after_token`), else goes
back to the state the run read, which the spare buffer still holds.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.artifact import Artifact
from runtime.cache import buffers
from runtime.contract import BATCH_AXIS, is_shift_state


class ShiftStates:
    def __init__(self, artifact: Artifact, rows: int, touched: bool = False):
        """`touched`: the buffers' pages written now (see `buffers.zeros`)."""
        self.device = artifact.device
        self.pairs = [(past, present) for past, present in zip(artifact.past_names(), artifact.present_names(),
                                                               strict=True) if is_shift_state(past)]  # fmt: skip
        self.dtypes = {past: artifact.input_spec(past)["dtype"] for past, _ in self.pairs}

        def zeros(past: str, count: int) -> ort.OrtValue:
            return buffers.zeros_of(artifact.input_spec(past), {BATCH_AXIS: count}, self.device, touched)

        self.current = {past: zeros(past, rows) for past, _ in self.pairs}  # what the next run reads
        self.spare = {past: zeros(past, rows) for past, _ in self.pairs}  # what it writes
        self.zero = {past: zeros(past, 1) for past, _ in self.pairs}  # a new row's state
        self.after_token: dict[str, np.ndarray] = {}  # the latest run's states after each token `[rows, width, size]`

    @property
    def names(self) -> list[str]:
        return [past for past, _ in self.pairs]

    def reset(self) -> None:
        """Every row back to the zero state, in the buffers bound now."""
        for past in self.current:
            for value in (self.current[past], self.spare[past]):
                with buffers.on_host(value, self.dtypes[past], self.device) as host:
                    host[...] = 0
        self.after_token = {}

    def bind(self, binding: ort.IOBinding, rows: int, ahead: bool = False) -> None:
        """Rows [0, rows) of every state, by address, for the next run (`ahead`: the run after it, the buffers
        trading roles in between)."""
        for past, present in self.pairs:
            read, written = (self.spare[past], self.current[past]) if ahead else (self.current[past], self.spare[past])
            buffers.bind_rows(binding.bind_input, past, read, self.dtypes[past], self.device, 0, rows)
            buffers.bind_rows(binding.bind_output, present, written, self.dtypes[past], self.device, 0, rows)

    def bind_row(self, binding: ort.IOBinding, row: int, chunk: int, chunks: int) -> None:
        """`row`'s states for chunk `chunk` of `chunks` of a prompt prefilled into it alone, with no other run between
        its chunks: the first chunk reads the zero state, and the row's state goes back and forth between its two
        buffers (each chunk reads one and writes the other), so that the last chunk writes the one decode reads."""
        for past, present in self.pairs:
            current, spare, dtype = self.current[past], self.spare[past], self.dtypes[past]
            written, other = (current, spare) if (chunks - 1 - chunk) % 2 == 0 else (spare, current)
            source, source_row = (self.zero[past], 0) if chunk == 0 else (other, row)
            buffers.bind_rows(binding.bind_input, past, source, dtype, self.device, source_row, 1)
            buffers.bind_rows(binding.bind_output, present, written, dtype, self.device, row, 1)

    def advance(self, after_token: dict[str, np.ndarray] | None) -> None:
        """After a run: what it wrote is current; `after_token`: its states after each of its tokens, where the
        graph gives them."""
        self.after_token = after_token or {}
        for past in self.current:
            self.current[past], self.spare[past] = self.spare[past], self.current[past]

    def keep(self, selected, kept: int) -> bool:
        """The rows `selected` (an index of the leading axis) keep the latest run's first `kept` tokens: their states
        become
        those after the last kept token where the graph gave them; else they go back to the states the run read.
        Returns whether they went back (the tokens kept must then be fed again)."""
        for past, states in self.after_token.items():
            with buffers.on_host(self.current[past], self.dtypes[past], self.device) as host:
                host[selected] = states[selected, kept - 1]
        if self.after_token or not self.pairs:
            return False
        for past in self.current:
            read = buffers.to_host(self.spare[past], self.dtypes[past])
            with buffers.on_host(self.current[past], self.dtypes[past], self.device) as host:
                host[selected] = read[selected]
        return True

    def take_rows(self, source: ShiftStates, rows: np.ndarray) -> None:
        """The current states of `source`'s rows `rows` (one per row here), written into the buffers bound now."""
        for past in self.current:
            read = buffers.to_host(source.current[past], self.dtypes[past])[rows]
            buffers.overwrite(self.current[past], np.ascontiguousarray(read), self.dtypes[past])
        self.after_token = {}

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of the current states, to `restore` after runs that go on from them."""
        return {past: buffers.to_host(value, self.dtypes[past]).copy() for past, value in self.current.items()}

    def restore(self, snapshot: dict[str, np.ndarray]) -> None:
        """Back to a `snapshot`, written into the buffers bound now."""
        for past, host in snapshot.items():
            buffers.overwrite(self.current[past], host, self.dtypes[past])
