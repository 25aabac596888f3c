"""A static artifact's cache as rows that requests come and go from, for continuous batching.

Every row's keys, values and gates share one slot clock: a decode step writes slot `cache_position` of
every bound row. A request's tokens fill consecutive slots that end at the clock, so where they start
depends on when it joined; the slots before are an earlier request's leftovers, masked out by the row's
attention mask. That is exact for FoX: a token's RoPE position counts the unmasked slots before it, and a
key's gate sum runs only over the slots after it, which are all the request's own.

Rows are views into one buffer per tensor (the batch is the leading axis), bound by address: a decode step
binds rows [0, n), a prefill binds one row, and nothing is copied between steps.

The cache keeps the slot bookkeeping too: the clock, where each running row's tokens begin, what pruning has
dropped from them, and the moves that make room (a new prompt placed before the clock, the rows moved to the
front at the end of the buffers). The engine decides which requests run; the cache, where their tokens lie.

With speculative decoding a step writes several slots of every row (a token and the drafts after it), and rows
keep different counts of them: the slots a row does not keep become holes, masked out with their gates zero,
which leaves the row exact (a hole is no position for RoPE, and adds nothing to the gate sums across it), until
the rows are moved to the front, holes squeezed out. A model that shifts tokens holds the state after a step's
last token only: a row that keeps fewer takes the state after its last kept token where the graph gives each
token's (a fused graph), else goes back to the state before the step, all its slots holes, and its next step feeds
the kept tokens again (`keep`). The latest slots that every running row left as holes (a lone row's
rejected drafts) go back to the clock at once (`trim`): later steps neither read them nor lose their room.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.artifact import Artifact
from runtime.cache import buffers
from runtime.cache.prefix_cache import Block
from runtime.cache.pruning import PruningError, count_dropped, due, needed_slots
from runtime.cache.shift_states import ShiftStates
from runtime.contract import BATCH_AXIS, is_shift_state


class RowCache:
    def __init__(self, artifact: Artifact, rows: int):
        self.artifact, self.rows, self.device = artifact, rows, artifact.device
        self.length = artifact.manifest["cache"]["max_cache_len"]
        pairs = zip(artifact.past_names(), artifact.present_names(), strict=True)
        self.slotted = [pair for pair in pairs if not is_shift_state(pair[0])]  # keys, values, gates
        self.gate_names = artifact.gate_names()
        self.dtypes = {past: artifact.input_spec(past)["dtype"] for past in artifact.past_names()}
        self.buffers = {past: self._zeros(past, rows) for past, _ in self.slotted}
        self.states = ShiftStates(artifact, rows, touched=True)
        # A prompt's state between its chunks, out of the rows' buffers, which the decode steps between chunks rewrite
        self.scratch = {past: (self._zeros(past, 1), self._zeros(past, 1)) for past in self.states.names}
        self.width = 1  # the latest step's tokens a row
        self.clock = 0  # the slot the next decode step writes, in every row
        self.pruned_at = 0  # the clock when the running rows were last pruned
        self.holes = np.zeros((rows, self.length), dtype=bool)  # slots a running row does not keep (see `keep`)
        self.running: dict[int, np.ndarray | None] = {}  # decoding rows: pruning's thresholds (None: keep every key)
        self.begins = np.zeros(rows, dtype=np.int64)  # a row's first kept slot (placed: its prompt's first)
        self.dropped = np.zeros(rows, dtype=np.int64)  # a running row's oldest positions that pruning dropped

    def held_in(self, past: str) -> ort.OrtValue:
        """The buffer that holds cache tensor `past` now (its contents, for a test or a check to read)."""
        return self.buffers[past] if past in self.buffers else self.states.current[past]

    def _zeros(self, name: str, rows: int) -> ort.OrtValue:
        """Zeroed, since a slot no request wrote is still read (with weight exactly 0) and 0 * NaN is NaN; touched
        now, so that a request's first run into a row does not stall every other row on page faults."""
        return buffers.zeros_of(self.artifact.input_spec(name), {BATCH_AXIS: rows}, self.device, touched=True)

    def _bind(self, bind, name: str, past: str, value: ort.OrtValue, first: int, count: int) -> None:
        """Bind rows [first, first + count) of `value` (a buffer of tensor `past`) as `name`, by address."""
        buffers.bind_rows(bind, name, value, self.dtypes[past], self.device, first, count)

    feeds_back = False  # every tensor is written where it lies: a step's outputs are never bound as the next's inputs

    def bind_step(self, binding: ort.IOBinding, following: ort.IOBinding, rows: int, resized: bool) -> None:
        """Before a decode step over rows [0, rows) on `binding`, the next one to run on `following`: both are bound
        when `resized` (the row count changed) and then kept, keys, values and gates in place, and the shift states
        read from one buffer and written to the other, the two bindings reading them from opposite ones. A row
        that leaves the steps is free: its shift state is not kept (a request that joins brings its own, see
        `bind_row`)."""
        if resized:
            self.bind(binding, rows)
            self.bind(following, rows, ahead=True)

    def bind(self, binding: ort.IOBinding, rows: int, ahead: bool = False) -> None:
        """Rows [0, rows) of every tensor, for the next run (`ahead`: the run after it, the shift states' buffers
        trading roles between)."""
        for past, present in self.slotted:
            self._bind(binding.bind_input, past, past, self.buffers[past], 0, rows)
            self._bind(binding.bind_output, present, past, self.buffers[past], 0, rows)
        self.states.bind(binding, rows, ahead)

    def advance(
        self, outputs: list[ort.OrtValue] | None = None, width: int = 1, states: dict[str, np.ndarray] | None = None
    ) -> None:  # fmt: skip
        """After a decode step of `width` tokens a row: the clock moves on, and the spares hold the shift states now
        (`states`: their values after each token, where the graph gives them; see `keep`)."""
        self.clock, self.width = self.clock + width, width
        self.states.advance(states)

    def keep(self, kept: int, row: int | None = None) -> int:
        """Of the latest step's slots of `row` (None: of every running row), keep the first `kept`; the others become
        holes. Where the model shifts tokens and some are not kept, the state becomes the one after the last kept
        token (ShiftStates.keep), or the row goes back to its state before the step, every slot of the step a hole:
        returns how many tokens the row's next step must feed again first (else 0)."""
        if kept >= self.width:
            return 0
        selected = sorted(self.running) if row is None else [row]
        again = kept if self.states.keep(selected, kept) else 0
        first = self.clock - self.width + (0 if again else kept)
        self.holes[selected, first : self.clock] = True
        for past in self.gate_names:
            with buffers.on_host(self.buffers[past], "float32", self.device) as host:
                host[selected, :, first : self.clock] = 0
        return again

    def trim(self) -> None:
        """After a step's `keep`s: take the clock back over the latest slots that every running row left as holes (a
        lone row's rejected drafts, or the drafts no row kept), so no later step reads them nor loses their room."""
        running = list(self.running)
        if not running:
            return
        kept = np.flatnonzero(~self.holes[running, : self.clock].all(axis=0))
        end = int(kept[-1]) + 1 if len(kept) else 0
        self.holes[running, end : self.clock] = False
        self.clock, self.pruned_at = end, min(self.pruned_at, end)

    def bind_row(self, binding: ort.IOBinding, row: int, chunk: int, chunks: int, resumed: bool = False) -> None:
        """Chunk `chunk` of `chunks` of a prompt prefilled into `row` alone, with decode steps of the other rows
        between chunks. Its shift state starts at zero (or, `resumed`, where `resume` put it) and goes back and forth
        between the two scratch buffers; the last chunk writes it into the row where the next decode step reads."""
        for past, present in self.slotted:
            self._bind(binding.bind_input, past, past, self.buffers[past], row, 1)
            self._bind(binding.bind_output, present, past, self.buffers[past], row, 1)
        for past, present in self.states.pairs:
            source = self.states.zero[past] if chunk == 0 and not resumed else self.scratch[past][(chunk - 1) % 2]
            self._bind(binding.bind_input, past, past, source, 0, 1)
            self._bind(binding.bind_output, present, past, *self._state_after(past, row, chunk, chunks), 1)

    def _state_after(self, past: str, row: int, chunk: int, chunks: int) -> tuple[ort.OrtValue, int]:
        """Where chunk `chunk` of `chunks` writes the shift state: (buffer, row)."""
        return (self.states.current[past], row) if chunk == chunks - 1 else (self.scratch[past][chunk % 2], 0)

    def read_block(self, row: int, begin: int, end: int, chunk: int, chunks: int) -> tuple[dict, dict]:
        """Copies of what chunk `chunk` of `chunks` of a prompt left: the row's slots [begin, end) of every key,
        value and gate tensor, and its shift states (see runtime/cache/prefix_cache.py)."""
        slots = {
            past: buffers.to_host(self.buffers[past], self.dtypes[past])[row, :, begin:end].copy()
            for past, _ in self.slotted
        }
        states = {}
        for past in self.states.names:
            value, index = self._state_after(past, row, chunk, chunks)
            states[past] = buffers.to_host(value, self.dtypes[past])[index].copy()
        return slots, states

    def read_chunk(self, row: int, span: tuple[int, int], chunk: int, chunks: int) -> tuple[dict, dict]:
        """`read_block` of the prompt's tokens [first, last) prefilled into `row` (see `place`)."""
        begin = int(self.begins[row])
        return self.read_block(row, begin + span[0], begin + span[1], chunk, chunks)

    def restore(self, row: int, blocks: list[Block]) -> None:
        """Put a cached prefix of the prompt placed in `row` back in its slots; the prompt's first chunk resumes
        from the prefix's shift states."""
        self.write_prefix(row, int(self.begins[row]), blocks)
        self.resume(blocks[-1].states)

    def write_prefix(self, row: int, begin: int, blocks: list[Block]) -> None:
        """Put a cached prefix's blocks back into the row, its first token at slot `begin`; each buffer goes to the
        host and back once, however many blocks (off the CPU, `to_host` copies the whole buffer)."""
        for past, _ in self.slotted:
            host = buffers.to_host(self.buffers[past], self.dtypes[past])
            for block in blocks:
                host[row, :, begin + block.begin : begin + block.end] = block.slots[past]
            buffers.write_back(self.buffers[past], host, self.dtypes[past], self.device)

    def resume(self, states: dict[str, np.ndarray]) -> None:
        """Make `states` the shift states a resumed prompt's first chunk reads (see `bind_row`)."""
        for past, state in states.items():
            host = buffers.to_host(self.scratch[past][1], self.dtypes[past])
            host[0] = state
            buffers.write_back(self.scratch[past][1], host, self.dtypes[past], self.device)

    def gates(self, row: int, begin: int, end: int) -> list[np.ndarray]:
        """Slots [begin, end) of `row`'s gates, `[1, heads, end - begin]` per layer (views on the CPU)."""
        return [buffers.to_host(self.buffers[past], "float32")[row : row + 1, :, begin:end] for past in self.gate_names]

    def move(self, moved: list[int], begin: int, end: int, to: int) -> None:
        """Move slots [begin, end) of the rows `moved` to start at slot `to`, in every key, value and gate buffer."""
        if not moved or begin == to:
            return
        for past, _ in self.slotted:
            with buffers.on_host(self.buffers[past], self.dtypes[past], self.device) as host:
                buffers.move_slots(host, moved, begin, end, to)
        self.holes[np.ix_(moved, range(to, to + end - begin))] = self.holes[np.ix_(moved, range(begin, end))]

    def join(self, row: int, thresholds: np.ndarray | None) -> None:
        """`row`, its prompt prefilled, decodes from now on, pruned by `thresholds` (`[layers, heads]`, see
        runtime/cache/pruning.py; None: every key kept)."""
        self.running[row], self.dropped[row] = thresholds, 0
        self.holes[row] = False

    def end_row(self, row: int, index: int = 0) -> None:
        """`row` decodes no more (after the token chosen at `index` of the latest step: its slots go with it): free for
        the next request's prompt."""
        self.running.pop(row, None)

    def place(self, row: int, length: int, chunks: int, reserved: int) -> bool:
        """Give `row` the slots of a prompt of `length` tokens, prefilled in `chunks` runs: they end at the clock
        once its last chunk is in, one decode step after each. Moves the running rows later when the clock is not
        far enough on for the prompt to fit before that; False while it and the running rows, each with `reserved`
        slots more, do not fit."""
        running = sorted(self.running)
        if not running:
            self.clock = self.pruned_at = 0
        elif self.clock + chunks > self.length:  # it would end past the cache: the running rows move up first
            self._compact()
        end = max(self.clock + chunks, length)
        lift = end - chunks - self.clock
        first = min([int(self.begins[other]) + lift for other in running] + [end - length])
        if end - first + reserved > self.length:
            return False
        if lift and running:
            start = int(self.begins[running].min())
            self.move(running, start, self.clock, start + lift)
            self.begins[running] += lift
        self.clock += lift
        self.begins[row] = end - length
        return True

    def prepare_chunk(self, row: int, span: tuple[int, int]) -> tuple[int, int, np.ndarray]:
        """Before prefilling the prompt's tokens [first, last) into `row` (see `place`): how many (all of them), the
        slot the first is written to, and the chunk's attention mask `[1, slot + last - first]`. A chunk writes slots
        the clock has passed (a decode step meanwhile writes padding into the row's slot at the clock, which a later
        chunk overwrites); the clock lags the chunks only while no row decodes, and then catches up here, without a
        step."""
        begin, (first, last) = int(self.begins[row]), span
        self.clock = max(self.clock, begin + last)
        mask = np.zeros((1, begin + last), dtype=np.int64)
        mask[:, begin:] = 1
        return last - first, begin + first, mask

    def make_room(self, width: int) -> list[tuple[int, PruningError]]:
        """Make room for a decode step of `width` tokens a row (fewer fit only at the end of the cache, see `room`):
        there, drop what pruning allows and move the running rows to the front, and while that leaves no room for
        one, the row that holds the most slots leaves (returned, with the error naming the head that needs them);
        otherwise prune every PRUNE_EVERY slots."""
        if self.clock + width <= self.length:
            if due(self.clock, self.pruned_at):
                self._prune()
            return []
        failed = []
        while self.running:
            needs = self._prune()
            self._compact()
            if self.clock < self.length:
                break
            row = min(self.running, key=lambda r: self.begins[r])
            failed.append((row, PruningError.no_room(needs[row], self.running[row], self.length)))
            self.end_row(row)
        return failed

    @property
    def room(self) -> int:
        """The tokens a row the next step may write (after `make_room`)."""
        return self.length - self.clock

    def prepare_step(self, rows: int, width: int = 1) -> tuple[int, np.ndarray]:
        """Before a decode step of `width` tokens a row over rows [0, rows) (after `make_room`, which made room for
        them all): the slot its first writes (the clock), and its attention mask `[rows, clock + width]`. A
        running row attends its slots from its first kept one but its holes, and that first kept slot also counts the
        positions dropped before it (so that RoPE positions count them: `count_dropped`, as a generation's
        PrunedWindow.mask does); any other
        row attends its own slots alone."""
        begins = np.full(rows, self.clock, dtype=np.int64)
        dropped = np.zeros(rows, dtype=np.int64)
        running = [row for row in self.running if row < rows]
        begins[running], dropped[running] = self.begins[running], self.dropped[running]
        attended = np.arange(self.clock + width) >= begins[:, None]
        attended[:, : self.clock] &= ~self.holes[:rows, : self.clock]
        mask = attended.astype(np.int64)
        count_dropped(mask, attended.argmax(axis=1), dropped)  # at each row's first attended slot
        return self.clock, mask

    def _prune(self) -> dict[int, np.ndarray]:
        """Drop each pruned row's oldest slots that every head of every layer allows (they fall out of its mask,
        and out of the cache at the next `_compact`); returns the slots each row's heads still need
        `[layers, heads]`, by row."""
        needs = {}
        for row, thresholds in self.running.items():
            if thresholds is None:
                continue
            begin = int(self.begins[row])
            needs[row] = needed_slots(self.gates(row, begin, self.clock), thresholds)  # holes' gates are zero
            drop = self.clock - begin - int(needs[row].max())
            self.begins[row] += drop
            self.dropped[row] += drop - int(self.holes[row, begin : begin + drop].sum())  # a hole is no position
        self.pruned_at = self.clock
        return needs

    def _compact(self) -> None:
        """Move every running row's kept slots to the front, its holes squeezed out, each row's last at the new clock:
        what a slot is to a row (its RoPE position, the gates after it) holds, since a hole counts for neither."""
        kept = {row: np.flatnonzero(~self.holes[row, self.begins[row] : self.clock]) + self.begins[row]
                for row in self.running}  # fmt: skip
        end = max(map(len, kept.values()))
        for past, _ in self.slotted:
            with buffers.on_host(self.buffers[past], self.dtypes[past], self.device) as host:
                for row, slots in kept.items():
                    host[row, :, end - len(slots) : end] = host[row][:, slots]
        for row, slots in kept.items():
            self.begins[row] = end - len(slots)
        self.holes[list(kept)] = False
        self.clock = self.pruned_at = end
