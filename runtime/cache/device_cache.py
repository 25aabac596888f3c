"""The key/value/gate cache of one generation, held on the session's device and bound through IOBinding: the
batch-synchronous layout, every row's tokens at the same positions (the engine's rows come and go in RowCache).

Each cache tensor is held in one of three ways between steps:
- in place: one buffer bound as both `past_key_values.*` and `present.*`, which the graph writes the new
  entries into, so nothing about it moves between steps. A static artifact holds its keys, values and
  gates so, and a gqa or fused dynamic artifact too: the attention appends to its keys and values (and a
  scatter to its gates), each present as long as the longer of past and the attention window, in buffers that
  `reserve` makes long enough and doubles when they are not, so growing costs O(1) a step on average;
- swapped: the shift states, in two buffers that trade roles every step (runtime/cache/shift_states.py);
- fed back: `present.*` left on the device by onnxruntime and bound as the next step's `past_*`, for the keys,
  values and gates of a standard dynamic artifact.

Forget-gate pruning moves an in-place cache's slots (runtime/cache/pruned_window.py); speculative decoding keeps a
run's first tokens and drops the rest (`keep`), or goes back to where `hold` was (`rewind`).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.artifact import Artifact
from runtime.cache import buffers
from runtime.cache.pruned_window import PrunedWindow
from runtime.cache.pruning import PruningError
from runtime.cache.shift_states import ShiftStates
from runtime.contract import BATCH_AXIS, PAST_AXIS, WINDOW_OFFSETS, held_in_place, is_shift_state

# A gqa dynamic artifact's key, value and gate buffers first hold the prompt and up to this many new tokens, and
# double when a generation goes further: a long max_new_tokens allocates only what is generated.
RESERVED_NEW_TOKENS = 256


class DeviceCache:
    def __init__(self, artifact: Artifact, batch: int):
        self.artifact, self.batch, self.device = artifact, batch, artifact.device
        in_place = held_in_place(artifact.static, artifact.attention)
        self.length = 0 if in_place and not artifact.static else None  # where `reserve` sets the buffers' length
        self.stale_bindings = True  # buffers were replaced, or their folding changed: bind every tensor again
        pairs = zip(artifact.past_names(), artifact.present_names(), strict=True)
        self.slotted = [(past, present) for past, present in pairs if not is_shift_state(past)]  # keys, values, gates
        self.dtypes = {past: artifact.input_spec(past)["dtype"] for past, _ in self.slotted}
        self.in_place = {past for past, _ in self.slotted if in_place}
        # Outputs after `logits` in binding order, as `advance` finds them
        self.fed_back = [(i, past, present) for i, (past, present) in enumerate(self.slotted) if not in_place]
        fields = len(artifact.manifest["cache"]["fields"])
        layer_of = {past: index // fields for index, past in enumerate(artifact.past_names())}
        layer_buffers = [[] for _ in range(artifact.manifest["model"]["num_layers"])]  # each layer's in-place ones
        for past in self.in_place:
            layer_buffers[layer_of[past]].append(past)
        # Each layer's present keys and values that its runs give folded while its heads' windows are staggered
        self.folding = {present: layer_of[past] for past, present in self.slotted
                        if past in self.in_place and artifact.folds(present)}  # fmt: skip
        capacity = artifact.manifest["cache"]["max_cache_len"] if in_place else None  # the slots a request may fill
        self.window = PrunedWindow(artifact, layer_buffers, self.dtypes, capacity)
        self.states = ShiftStates(artifact, batch)
        self.past: dict[str, ort.OrtValue] = {}
        self.held: tuple[int, dict[str, np.ndarray]] | None = None  # see `hold`
        # A request's progress: its mask (see `start`), the rows still generating, where the latest run began (a
        # prompt's chunk: its last position, the one whose logits choose) and the positions filled, the tokens kept
        # that the next run feeds again first and that the latest fed, and the tokens a row the next step may write
        self.mask, self.live = np.ones((batch, 0), dtype=np.int64), np.ones(batch, dtype=bool)
        self.run_start = self.filled = self.again = self.lead = 0
        self.room = 1  # see `make_room`
        self.rewinds = False  # whether keeping fewer of the latest run's tokens goes back to its start (see `keep`)
        self.reset()

    @property
    def capacity(self) -> int | None:
        """The slots a request may fill (None: any number)."""
        return self.window.capacity

    @property
    def dropped(self) -> np.ndarray:
        """The oldest positions pruning has dropped, by layer and kv head."""
        return self.window.dropped

    def reserve(self, length: int) -> None:
        """Make a gqa dynamic artifact's key, value and gate buffers hold `length` positions: at least double
        them, keeping what they hold (through the host: this happens a few times in a long generation)."""
        if self.length is None or length <= self.length:
            return
        grown_length = max(length, 2 * self.length)
        for past in self.in_place:
            dtype = self.dtypes[past]
            host = buffers.to_host(self.past[past], dtype)
            grown = np.zeros((*host.shape[:2], grown_length, *host.shape[3:]), host.dtype)
            grown[:, :, : self.length] = host
            self.past[past] = buffers.from_host(grown, dtype, self.device)
        self.length, self.stale_bindings = grown_length, True

    def _zeros(self, name: str) -> ort.OrtValue:
        past = self.length if name in self.in_place else 0  # a static buffer's length is a number in the spec
        return buffers.zeros_of(self.artifact.input_spec(name), {BATCH_AXIS: self.batch, PAST_AXIS: past}, self.device)

    def reset(self) -> None:
        """Start a new generation.

        In-place buffers are allocated zeroed once and then kept: a stale slot is never attended (it lies
        after the query, with weight exactly 0, or is rewritten first), but it must be finite, since
        0 * NaN is NaN. The shift states restart from zero and a fed-back cache from empty every generation.
        Pruning stops until `start` starts it again.
        """
        self.stale_bindings, self.held = True, None
        self.window.start(None)
        self.states.reset()
        gates = set(self.artifact.gate_names())
        for past, _ in self.slotted:
            # Where heads keep windows of their own, a head's gate slots past its window enter its sums, which
            # they leave exact only while zero: no generation's gates are left for the next one's
            own_windows = self.window.kind == "head" and past in gates
            if past not in self.in_place or past not in self.past or own_windows:
                self.past[past] = self._zeros(past)

    def start(self, thresholds: np.ndarray | None, mask: np.ndarray, width: int) -> None:
        """Begin a request of prompts `width` long, attended as `mask` `[batch, width + new tokens]` says (the cache
        keeps it, and marks in it where rows end, see `end_row`): from now on drop the slots every head's decay has
        put below its threshold (`[layers, heads]`, see runtime/cache/pruning.py; None: keep every slot), else make
        the buffers hold the prompts and RESERVED_NEW_TOKENS more from the start."""
        self.window.start(thresholds)
        self.mask, self.live = mask, np.ones(self.batch, dtype=bool)
        self.run_start = self.filled = self.again = self.lead = 0
        if thresholds is None:  # the last new token is never fed back
            self.reserve(width + min(max(mask.shape[1] - width - 1, 0), RESERVED_NEW_TOKENS))

    def buffer_length(self, width: int) -> int:
        """The most slots a run over prompts `width` long attends: a static buffer's length, a growing buffer's, or
        `width` while the cache holds nothing."""
        return self.artifact.manifest["cache"]["max_cache_len"] if self.artifact.static else self.length or width

    def end_row(self, row: int, index: int = 0) -> None:
        """`row` generates no more after the token chosen from the latest run's position `index` (after those it fed
        again): the positions from that token's on are padding, and pruning keeps no slot for the row."""
        self.mask[row, self.run_start + self.lead + index + 1 :] = 0
        self.live[row] = False

    def make_room(self, width: int) -> list[tuple[int, PruningError]]:
        """Before a decode step of up to `width` tokens a row (a token and the drafts after it, see `keep`): prune at
        the decode's cadence, and where a pruned cache is full, as far as the rows still generating allow, never
        past where `rewind` may go back to. `room` then says how many of them fit; where not one does, every row
        generating fails with the error (returned, by row), as its rows share every slot."""
        held = None if self.held is None else self.held[0]
        try:
            self.room, moved = self.window.make_room(self.past, self.filled, width, self.live, True, held)
        except PruningError as error:
            return [(int(row), error) for row in np.flatnonzero(self.live)]
        self.stale_bindings |= moved  # a layer's presents may now come folded, or no longer
        return []

    def prepare_step(self, rows: int, width: int = 1) -> tuple[int, np.ndarray]:
        """Before a decode step of `width` tokens a row over every row (`rows`: the batch), no more than `make_room`
        left room for: the slot the first is written to, and the step's attention mask."""
        slot, mask = self._window(self.mask, self.filled, width)
        self.run_start, self.filled, self.lead, self.again = self.filled, self.filled + width, self.again, 0
        return slot, mask

    def keep(self, kept: int, row: int | None = None) -> int:
        """Of the latest run's positions after those it fed again keep the first `kept` (the drafts chosen, and the
        token before them), in every row: its rows hold the same positions, so `row` is None. The others' gates are
        cleared, as `reset` leaves slots, and a fed-back cache is cut. Where the model shifts tokens, the states
        become those after the last kept token (ShiftStates.keep), or the cache goes back to the run's start, and
        the next run must feed the run's first tokens again, up to those kept: returns how many (else 0)."""
        if row is not None:
            raise ValueError("a generation's rows keep the same positions: keep(kept) keeps them in every row")
        end, self.filled = self.filled, self.run_start + self.lead + kept
        if self.filled >= end:
            return 0
        if self.states.keep(slice(None), self.lead + kept):
            self.filled, self.again = self.run_start, self.lead + kept
        self._cut(end)
        return self.again

    def take_rows(self, source: DeviceCache, rows: np.ndarray) -> None:
        """Become `source` with row i holding its row `rows[i]`: a prompt prefilled once and forked into the rows of
        its several answers (`rows` repeats it). Every slot, shift state, pruned window and the request's progress,
        so the rows decode on as the source's would. A buffer of the same shape (beams reordered within a cache) is
        written over where it lies, its bindings kept; another is replaced."""
        replaced = False
        for past, _ in self.slotted:
            host = np.ascontiguousarray(buffers.to_host(source.past[past], self.dtypes[past])[rows])
            held = self.past.get(past)
            if held is not None and held.shape() == list(host.shape):
                buffers.overwrite(held, host, self.dtypes[past])
            else:
                self.past[past], replaced = buffers.from_host(host, self.dtypes[past], self.device), True
        self.length = source.length
        self.states.take_rows(source.states, rows)
        self.window.take_state(source.window)
        self.mask, self.live = source.mask[rows].copy(), source.live[rows].copy()
        self.run_start, self.filled, self.again, self.lead = source.run_start, source.filled, source.again, source.lead
        self.room, self.held = source.room, None
        self.stale_bindings |= replaced or source is not self  # another cache's windows may fold other layers

    def hold(self) -> None:
        """Remember where the cache is, to come back to after several runs (a draft model's round of drafts, see
        runtime/speculative/draft_model.py): the filled positions and the shift states, which the runs overwrite."""
        self.held = self.filled, self.states.snapshot()

    def rewind(self) -> None:
        """Back to where `hold` was, and pruning free again: the positions filled since are dropped as `keep` drops
        them, and the shift states written over, in the buffers they are now in, so that no binding goes stale."""
        end, (self.filled, states), self.held = self.filled, self.held, None
        self._cut(end)
        self.states.restore(states)

    def _cut(self, end: int) -> None:
        """Drop positions [filled, end): their gates are cleared, as `reset` leaves slots, and a fed-back cache is
        cut to the first `filled`."""
        heads = self.window.heads
        for layer, past in enumerate(self.artifact.gate_names()):
            if past in self.in_place:  # each kv head's slots start at its own dropped position
                with buffers.on_host(self.past[past], self.dtypes[past], self.device) as host:
                    group = host.shape[1] // heads
                    for head, dropped in enumerate(self.window.dropped[layer]):
                        host[:, head * group : (head + 1) * group, self.filled - dropped : end - dropped] = 0
        for _, past, _ in self.fed_back:
            host = buffers.to_host(self.past[past], self.dtypes[past])[:, :, : self.filled]
            self.past[past] = buffers.from_host(np.ascontiguousarray(host), self.dtypes[past], self.device)

    def prepare_chunk(self, row: int | None, span: tuple[int, int]) -> tuple[int, int, np.ndarray]:
        """Before feeding the prompts' positions [first, last) into every row (`row` None), or into `row` alone (a
        batch prefilled row by row, which drops nothing: see runtime/decode/prefill.py's `chunking`): make room for
        them, pruning what the rows allow at every chunk, and grow the buffers to hold them. Returns how many fit
        (all, without pruning: `Model.check_request` saw to that), the slot the first is written to, and the
        chunk's attention mask."""
        first, last = span
        new = last - first
        if row is None:
            new, moved = self.window.make_room(self.past, first, new, self.live, False, None)
            self.stale_bindings |= moved
        slot, mask = self._window(self.mask if row is None else self.mask[row : row + 1], first, new)
        self.filled, self.lead, self.again = first + new, 0, 0
        self.run_start = self.filled - 1  # the chunk's last position alone chooses a token
        return new, slot, mask

    def _window(self, mask: np.ndarray, filled: int, new: int) -> tuple[int, np.ndarray]:
        """The slot a run of `new` positions after the first `filled` of `mask` writes first, and its attention mask,
        the buffers grown to hold them."""
        slot = filled - self.window.offset
        self.reserve(slot + new)
        return slot, self.window.mask(mask, filled + new)

    def held_in(self, past: str) -> ort.OrtValue:
        """The buffer that holds cache tensor `past` now (its contents, for a test or a check to read)."""
        return self.past[past] if past in self.past else self.states.current[past]

    @property
    def feeds_back(self) -> bool:
        """Whether `advance` needs the step's outputs."""
        return bool(self.fed_back)

    def bind(self, binding: ort.IOBinding, ahead: bool = False) -> None:
        """Bind every past input and present output (after `logits`, which the caller binds first); `ahead`: for the
        run after the next one, the shift states' buffers trading roles in between. A run so bound (a chunk) moves
        the shift states on, so the decode steps' own bindings are stale after it."""
        if self.window.kind != "one":
            binding.bind_ortvalue_input(WINDOW_OFFSETS, self.window.offsets_value)
        for past, present in self.slotted:
            binding.bind_ortvalue_input(past, self.past[past])
            layer = self.folding.get(present)
            if layer is not None and self.window.folded(layer):
                buffers.bind_rows(
                    binding.bind_output, present, self.past[past], self.dtypes[past], self.device, 0, self.batch, True
                )
            elif past in self.in_place:
                binding.bind_ortvalue_output(present, self.past[past])
            else:
                binding.bind_output(present, self.device)
        self.states.bind(binding, self.batch, ahead)
        self.stale_bindings = True

    def bind_row(self, binding: ort.IOBinding, row: int, chunk: int, chunks: int) -> None:
        """Chunk `chunk` of `chunks` of a prompt prefilled into `row` alone (GroupQueryAttention takes a later
        chunk of a prompt for one row only): the row's part of every buffer, bound by address (see
        ShiftStates.bind_row for its shift state). Only for caches held in place (a fed-back cache's rows are new
        tensors each run)."""
        for past, present in self.slotted:
            dtype = self.dtypes[past]
            buffers.bind_rows(binding.bind_input, past, self.past[past], dtype, self.device, row, 1)
            buffers.bind_rows(binding.bind_output, present, self.past[past], dtype, self.device, row, 1)
        self.states.bind_row(binding, row, chunk, chunks)
        self.stale_bindings = True  # the next decode step binds every row again

    def bind_step(self, binding: ort.IOBinding, following: ort.IOBinding, rows: int, resized: bool) -> None:
        """Before a decode step on `binding` (of all `rows`, the cache's batch), the next one to run on `following`:
        decode steps alternate between two bindings as the shift states' buffers do, so each is bound in full only
        when `resized` (the row count changed) or its bindings are stale; in between, only the fed-back tensors
        change."""
        if resized or self.stale_bindings:
            self.bind(following, ahead=True)
            self.bind(binding)
            self.stale_bindings = False
            return
        for _, past, present in self.fed_back:
            binding.bind_ortvalue_input(past, self.past[past])
            binding.bind_output(present, self.device)

    def advance(
        self, outputs: list[ort.OrtValue] | None, width: int = 1, states: dict[str, np.ndarray] | None = None
    ) -> None:  # fmt: skip
        """Make this step's presents the next step's pasts (`outputs`: logits, then the presents in binding order;
        needed only when `feeds_back`; `prepare_step` counted the `width` tokens filled); `states`: each shift
        state's values after each token, where the graph gives them (see `keep`)."""
        for index, past, _ in self.fed_back:
            self.past[past] = outputs[1 + index]
        self.states.advance(states)
