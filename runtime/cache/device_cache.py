"""The key/value/gate cache of one generation, held on the session's device and bound through IOBinding.

Each cache tensor is held in one of three ways between steps:
- in place: one buffer bound as both `past_key_values.*` and `present.*`, which the graph writes the new
  entries into, so nothing about it moves between steps. A static artifact holds its keys, values and
  gates so, and a gqa dynamic artifact too: onnxruntime's GroupQueryAttention appends to its keys and
  values and a scatter to its gates, each present as long as the longer of past and the attention
  window, in buffers that `reserve` makes long enough and doubles when they are not, so growing costs
  O(1) a step on average;
- swapped: two buffers that trade roles every step, for the shift states of both, which the graph reads
  besides replacing;
- fed back: `present.*` left on the device by onnxruntime and bound as the next step's `past_*`, for
  every tensor of a standard dynamic artifact.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.artifact import Artifact, window_kind
from runtime.cache import buffers
from runtime.cache.pruning import PRUNE_EVERY, PruningError, needed_slots
from runtime.contract import BATCH_AXIS, PAST_AXIS, WINDOW_OFFSETS, held_in_place, is_shift_state

# A gqa dynamic artifact's key, value and gate buffers first hold the prompt and up to this many new tokens, and
# double when a generation goes further: a long max_new_tokens allocates only what is generated.
RESERVED_NEW_TOKENS = 256


class DeviceCache:
    def __init__(self, artifact: Artifact, batch: int):
        self.artifact, self.batch, self.device = artifact, batch, artifact.device
        in_place = held_in_place(artifact.static, artifact.attention)
        self.length = 0 if in_place and not artifact.static else None  # where `reserve` sets the buffers' length
        self.stale_bindings = False  # in-place buffers were replaced, or their folding changed: bind every tensor again
        self.pairs = list(zip(artifact.past_names(), artifact.present_names(), strict=True))
        self.dtypes = {past: artifact.input_spec(past)["dtype"] for past, _ in self.pairs}
        self.in_place = {past for past, _ in self.pairs if in_place and not is_shift_state(past)}
        self.swapped = {past: present for past, present in self.pairs if in_place and past not in self.in_place}
        self.fed_back = [(i, past, present) for i, (past, present) in enumerate(self.pairs)
                         if past not in self.in_place and past not in self.swapped]  # fmt: skip
        self.past: dict[str, ort.OrtValue] = {}
        self.spare: dict[str, ort.OrtValue] = {}  # swapped tensors: the buffer present is written to
        self.fresh: dict[str, ort.OrtValue] = {}  # swapped tensors: a row's zero state, for `bind_row`
        layers, fields = artifact.manifest["model"]["num_layers"], len(artifact.manifest["cache"]["fields"])
        self.layer_buffers: list[list[str]] = [[] for _ in range(layers)]  # each layer's in-place buffers
        for index, past in enumerate(artifact.past_names()):  # layer by layer, its fields in order
            if past in self.in_place:
                self.layer_buffers[index // fields].append(past)
        self.gate_names = artifact.gate_names()
        self.shift_names = [past for past, _ in self.pairs if is_shift_state(past)]
        self.states_given = bool(artifact.shift_states())  # each token's shift states, by a step (see `keep`)
        # Each layer's present keys and values that its runs give folded while its heads' windows are staggered
        self.folding = {present: index // fields for index, (past, present) in enumerate(self.pairs)
                        if past in self.in_place and artifact.folds(present)}  # fmt: skip
        limit = artifact.manifest["cache"]["max_cache_len"]
        self.capacity = limit if in_place else None  # the slots a pruned request may fill (None: any number)
        self.thresholds: np.ndarray | None = None  # per layer and head, while a pruned request runs
        self.windows = window_kind(artifact.manifest)
        # Whether a prompt's chunk too runs with each head its own window, not only a decode step
        self.chunk_heads_staggered = artifact.manifest["cache"].get("heads_apart_in_chunks", False)
        self.heads = artifact.manifest["model"]["num_kv_heads"]
        # window_offsets: each window's start past `offset`
        self.offsets = np.zeros((layers, self.heads) if self.windows == "head" else layers, dtype=np.int64)
        self.offsets_value = ort.OrtValue.ortvalue_from_numpy(self.offsets)  # bound once, read at every run
        self.reset()

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
        spec = self.artifact.input_spec(name)
        past = self.length if name in self.in_place else 0  # a static buffer's length is a number in the spec
        shape = [self.batch if axis == BATCH_AXIS else past if axis == PAST_AXIS else axis for axis in spec["axes"]]
        return buffers.zeros(shape, spec["dtype"], self.device)

    def reset(self) -> None:
        """Start a new generation.

        In-place buffers are allocated zeroed once and then kept: a stale slot is never attended (it lies
        after the query, with weight exactly 0, or is rewritten first), but it must be finite, since
        0 * NaN is NaN. Everything else restarts from zero (shift states) or from empty every generation.
        Pruning stops until `start` starts it again.
        """
        self.thresholds, self.stale_bindings = None, True
        self.held: tuple[int, dict[str, np.ndarray]] | None = None  # see `hold`
        self.dropped = np.zeros((len(self.gate_names), self.heads), dtype=np.int64)  # positions each head dropped
        self.offsets[:] = 0
        self.offset = 0  # positions dropped from the front of every head's buffer rows: where the window starts
        self.pruned_at = 0  # the filled positions when slots were last dropped
        self.counted = 0  # the window start up to which `window_mask` has counted the dropped positions
        for past, _ in self.pairs:
            # Where heads keep windows of their own, a head's gate slots past its window enter its sums, which
            # they leave exact only while zero: no generation's gates are left for the next one's
            own_windows = self.windows == "head" and past in self.gate_names
            if past not in self.in_place or past not in self.past or own_windows:
                self.past[past] = self._zeros(past)
            if past in self.swapped:
                self.spare[past] = self._zeros(past)

    def start(self, thresholds: np.ndarray | None, width: int, new_tokens: int) -> None:
        """Begin a request of prompts `width` long and up to `new_tokens` more: from now on drop the slots every
        head's decay has put below its threshold (`[layers, heads]`, see runtime/cache/pruning.py; None: keep
        every slot), else make the buffers hold the prompts and RESERVED_NEW_TOKENS more from the start."""
        self.thresholds = None if thresholds is None else np.asarray(thresholds)
        if self.thresholds is None:
            self.reserve(width + min(new_tokens - 1, RESERVED_NEW_TOKENS))  # the last new token is never fed back

    def window_mask(self, mask: np.ndarray, end: int) -> np.ndarray:
        """The attention mask of positions [offset, end) `[batch, end - offset]` for the slots the buffers hold.
        Its first column counts the positions dropped before it as well, so that the mask's running sum (a
        token's RoPE position) stays that of the whole sequence; a 0 (padding, or a finished row) stays 0. The
        count is written into `mask` itself, once each time the window moves (its columns before the window are
        never read again), so a decode step slices the mask as it would without pruning."""
        offset = self.offset
        if offset != self.counted:  # the column at `counted` holds the count up to it
            counts = mask[:, self.counted : offset + 1].sum(-1)
            mask[:, offset] = np.where(mask[:, offset] > 0, counts, 0)
            self.counted = offset
        return np.ascontiguousarray(mask[:, offset:end])

    def buffer_length(self, width: int) -> int:
        """The most slots a run over prompts `width` long attends: a static buffer's length, a growing buffer's, or
        `width` while the cache holds nothing."""
        return self.artifact.manifest["cache"]["max_cache_len"] if self.artifact.static else self.length or width

    def decode_after(self, mask: np.ndarray, filled: int) -> None:
        """Decode runs follow, after the first `filled` positions of `mask` `[batch, >= every position fed]`, the
        prompt's last the latest run's; the cache keeps the mask and marks in it where rows end (see `end_row`)."""
        self.mask, self.live = mask, np.ones(self.batch, dtype=bool)
        self.run_start, self.filled = filled - 1, filled
        self.saved_states: dict[str, ort.OrtValue] = {}  # the shift states a run of several tokens read
        self.token_states: dict[str, np.ndarray] = {}  # or the latest step's after each token (DecodeStep's)
        self.again = 0  # tokens kept that the next run feeds again first (see `keep`)
        self.lead = 0  # such tokens at the start of the latest run

    def end_row(self, row: int, index: int = 0) -> None:
        """`row` generates no more after the token chosen from the latest run's position `index` (after those it fed
        again): the positions from that token's on are padding, and pruning keeps no slot for the row."""
        self.mask[row, self.run_start + self.lead + index + 1 :] = 0
        self.live[row] = False

    def prepare_step(self, rows: int, width: int = 1) -> tuple[int, int, np.ndarray]:
        """Before a decode step of up to `width` tokens a row (over every row: `rows` is the batch; a token and the
        drafts after it, see `keep`): how many fit, the slot the first is written to and the step's attention mask,
        pruning first at the decode's cadence. A step of several keeps the shift states it reads, where the graph
        does not give them after each token: it writes its own into other buffers (a swapped state's spare, a
        fed-back state's new present), so those it read stay as they were, to go back to (see `keep`)."""
        new, slot, window = self.prepare_chunk(self.mask, self.filled, width, self.live, cadence=True)
        self.run_start, self.filled, self.lead, self.again = self.filled, self.filled + new, self.again, 0
        saved = new > 1 and not self.states_given
        self.saved_states = {name: self.past[name] for name in self.shift_names} if saved else {}
        return new, slot, window

    def keep(self, kept: int) -> int:
        """Of the latest run's positions after those it fed again keep the first `kept` (the drafts chosen, and the
        token before them): the others' gates are cleared, as `reset` leaves slots, and a fed-back cache is cut. A
        run's shift states are those after its last token, so where the model shifts tokens and some are dropped,
        they become the states after the last kept token where the graph gives each token's; else the cache goes
        back to the run's start and its states, and the next run must feed the run's first tokens again, up to
        those kept: returns how many (else 0)."""
        end, self.filled = self.filled, self.run_start + self.lead + kept
        if self.filled >= end:
            return 0
        for past, states in self.token_states.items():
            with buffers.on_host(self.past[past], self.dtypes[past], self.device) as state:
                state[...] = states[:, self.lead + kept - 1]
        if self.saved_states:
            self.filled, self.again = self.run_start, self.lead + kept
        self._cut(end)
        for past, state in self.saved_states.items():
            if past in self.swapped:  # the run wrote the spare, which `advance` made current: they trade back, out of
                self.spare[past], self.stale_bindings = self.past[past], True  # the decode bindings' alternation
            self.past[past] = state
        return self.again

    def hold(self) -> None:
        """Remember where the cache is, to come back to after several runs (a draft model's round of guesses, see
        runtime/speculative/draft_model.py): the filled positions and a copy of each shift state, which the runs
        overwrite."""
        self.held = self.filled, {name: buffers.to_host(self.past[name], self.dtypes[name]).copy()
                                  for name in self.shift_names}  # fmt: skip

    def rewind(self) -> None:
        """Back to where `hold` was, and pruning free again: the positions filled since are dropped as `keep` drops
        them, and the shift states written over, in the buffers they are now in, so that no binding goes stale."""
        end, (self.filled, states), self.held = self.filled, self.held, None
        self._cut(end)
        for past, state in states.items():
            if past in self.swapped:
                buffers.overwrite(self.past[past], state, self.dtypes[past])
            else:
                self.past[past] = buffers.from_host(state, self.dtypes[past], self.device)

    def _cut(self, end: int) -> None:
        """Drop positions [filled, end): their gates are cleared, as `reset` leaves slots, and a fed-back cache is
        cut to the first `filled`."""
        for layer, past in enumerate(self.gate_names):
            if past in self.in_place:  # each kv head's slots start at its own dropped position
                with buffers.on_host(self.past[past], self.dtypes[past], self.device) as host:
                    group = host.shape[1] // self.heads
                    for head, dropped in enumerate(self.dropped[layer]):
                        host[:, head * group : (head + 1) * group, self.filled - dropped : end - dropped] = 0
        for _, past, _ in self.fed_back:
            if past not in self.shift_names:
                host = buffers.to_host(self.past[past], self.dtypes[past])[:, :, : self.filled]
                self.past[past] = buffers.from_host(np.ascontiguousarray(host), self.dtypes[past], self.device)

    def prepare_chunk(
        self, mask: np.ndarray, filled: int, new: int, rows=slice(None), cadence: bool = False
    ) -> tuple[int, int, np.ndarray]:  # fmt: skip
        """Before a run of up to `new` positions after the first `filled` of `mask` `[batch, >= filled + new]`:
        make room for them (see `make_room`; `rows` None: drop nothing, as a prompt prefilled row by row) and
        grow the buffers to hold them.
        Returns how many of them fit, the slot the first is written to, and the run's attention mask."""
        if rows is not None:
            new = self.make_room(filled, new, rows, cadence)
        slot = filled - self.offset
        self.reserve(slot + new)
        return new, slot, self.window_mask(mask, filled + new)

    def make_room(self, filled: int, new: int, rows, cadence: bool = False) -> int:
        """Before a run of up to `new` positions after `filled`: drop (when pruning) the slots that `rows` (those
        still generating) no longer need, at least every PRUNE_EVERY positions, every chunk of a prompt (unless
        `cadence`: a decode run's drafts) and whenever the new ones would not fit otherwise; each kv head as far
        as its own query heads allow where the graph takes each head's window (in a prompt's chunk too, where the
        artifact says so), else each layer or all of them as far as all of theirs do. Returns how many of the
        `new` positions fit (all, without pruning: `Model.check_request` saw to that); raises PruningError
        naming the head that leaves no room for one."""
        if self.thresholds is None:
            return new
        full = self.capacity is not None and filled - self.offset + new > self.capacity  # the longest rows'
        if not (full or (new > 1 and not cadence) or filled - self.pruned_at >= PRUNE_EVERY):
            return new
        self.pruned_at = filled
        slots = filled - self.dropped  # per layer and kv head
        needs = self._needs(slots, rows)  # [layers, heads]
        group = needs.shape[1] // self.heads
        kept = needs.reshape(len(needs), self.heads, group).max(-1)  # per layer and kv head
        if self.windows == "one":
            kept[:] = kept.max()
        elif self.windows == "layer" or (new > 1 and not self.chunk_heads_staggered):  # the heads kept together
            kept[:] = kept.max(1, keepdims=True)
        if self.held is not None:  # never drop a position that `rewind` may go back to
            kept = np.maximum(kept, filled - self.held[0])
        room = new if self.capacity is None else min(new, self.capacity - int(kept.max()))
        if room < 1:
            raise PruningError.no_room(needs, self.thresholds, self.capacity)
        for layer, drops in enumerate(slots - kept):
            if drops.max() > 0:
                self._drop(layer, group, drops, slots[layer])
        self.offset = int(self.dropped.min())
        offsets = self.dropped - self.offset
        offsets = offsets if self.windows == "head" else offsets[:, 0]
        if not np.array_equal(offsets, self.offsets):  # a layer's presents may now come folded, or no longer
            self.offsets[:], self.stale_bindings = offsets, True  # (see `_folded`)
        return room

    def _needs(self, slots: np.ndarray, rows) -> np.ndarray:
        """How many of its newest slots each query head still needs in some of `rows`, `[layers, heads]`
        (`slots`: what each kv head's rows hold). Each layer's gates are read as long as its longest rows: a
        head's slots past its own are zero (see `reset`), which adds nothing to its sums and is never
        droppable, so it needs what it needs of its own, less the slots it lacks."""
        longest = slots.max(1)
        gates = [buffers.to_host(self.past[name], "float32")[rows, :, :filled]
                 for name, filled in zip(self.gate_names, longest, strict=True)]  # fmt: skip
        lacking = (longest[:, None] - slots).repeat(self.thresholds.shape[1] // self.heads, axis=1)
        return needed_slots(gates, self.thresholds) - lacking

    def _drop(self, layer: int, group: int, drops: np.ndarray, filled: np.ndarray) -> None:
        """Move each kv head's kept slots of `layer` (and its query heads' gates) to the front of its rows, the head's
        oldest `drops[h]` of its `filled[h]` slots dropped; each buffer visits the host once for all its heads."""
        for past in self.layer_buffers[layer]:
            gates = past in self.gate_names  # a head's gate slots past its window must be zero (see `reset`)
            with buffers.on_host(self.past[past], self.dtypes[past], self.device) as host:
                for head in np.flatnonzero(drops > 0):
                    heads = slice(head * group, (head + 1) * group) if gates else head
                    buffers.move_slots(host, slice(None), int(drops[head]), int(filled[head]), 0, heads, gates)
        self.dropped[layer] += np.maximum(drops, 0)

    @property
    def feeds_back(self) -> bool:
        """Whether `advance` needs the step's outputs."""
        return bool(self.fed_back)

    def _folded(self, present: str) -> bool:
        """Whether the next run gives `present` folded: its layer's heads' windows are staggered."""
        layer = self.folding.get(present)
        return layer is not None and self.offsets[layer].min() != self.offsets[layer].max()

    def bind(self, binding: ort.IOBinding, ahead: bool = False) -> None:
        """Bind every past input and present output (after `logits`, which the caller binds first); `ahead`: for the
        run after the next one, the swapped states' buffers trading roles in between. A run so bound (a chunk) moves
        the swapped states on, so the decode steps' own bindings are stale after it."""
        if self.windows != "one":
            binding.bind_ortvalue_input(WINDOW_OFFSETS, self.offsets_value)
        for past, present in self.pairs:
            if past in self.swapped:
                read, written = (self.spare[past], self.past[past]) if ahead else (self.past[past], self.spare[past])
                binding.bind_ortvalue_input(past, read)
                binding.bind_ortvalue_output(present, written)
                continue
            binding.bind_ortvalue_input(past, self.past[past])
            if self._folded(present):
                buffers.bind_rows(
                    binding.bind_output, present, self.past[past], self.dtypes[past], self.device, 0, self.batch, True
                )
            elif past in self.in_place:
                binding.bind_ortvalue_output(present, self.past[past])
            else:
                binding.bind_output(present, self.device)
        self.stale_bindings = True

    def bind_row(self, binding: ort.IOBinding, row: int, chunk: int, chunks: int) -> None:
        """Chunk `chunk` of `chunks` of a prompt prefilled into `row` alone (GroupQueryAttention takes a later
        chunk of a prompt for one row only): the row's part of every buffer, bound by address. Its shift state
        starts at zero and goes back and forth between the row's two buffers so that the last chunk leaves it
        where decode reads. Only for caches held in place (a fed-back cache's rows are new tensors each run)."""
        for past, present in self.pairs:
            dtype = self.dtypes[past]
            if past in self.in_place:
                buffers.bind_rows(binding.bind_input, past, self.past[past], dtype, self.device, row, 1)
                buffers.bind_rows(binding.bind_output, present, self.past[past], dtype, self.device, row, 1)
                continue
            if past not in self.fresh:
                self.fresh[past] = buffers.zeros([1, *self.past[past].shape()[1:]], dtype, self.device)
            current = (self.past[past], self.spare[past], self.fresh[past])
            buffers.bind_row_state(binding, (past, present), current, dtype, self.device, row, chunk, chunks)
        self.stale_bindings = True  # the next decode step binds every row again

    def bind_step(self, binding: ort.IOBinding, following: ort.IOBinding, rows: int, fresh: bool) -> None:
        """Before a decode step on `binding` (of all `rows`, the cache's batch), the next one to run on `following`:
        decode steps alternate between two bindings as the swapped states' buffers do, so each is bound in full only
        when it is `fresh` or its bindings are stale; in between, only the fed-back tensors change."""
        if fresh or self.stale_bindings:
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
        """Make this step's presents the next step's pasts (`outputs`: logits, then one per pair, in binding
        order; needed only when `feeds_back`; `prepare_step` counted the `width` tokens filled); `states`: each
        shift state's values after each token, where the graph gives them (see `keep`)."""
        self.token_states = {} if states is None else states
        for index, past, _ in self.fed_back:
            self.past[past] = outputs[1 + index]
        for past in self.swapped:
            self.past[past], self.spare[past] = self.spare[past], self.past[past]
