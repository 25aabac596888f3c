"""runtime/cache/row_cache.py: a static artifact's cache as rows on one slot clock. Rows that join, prefill in chunks
between decode steps, sit on an earlier request's leftovers and move get eager PyTorch's logits alone; blocks
written into a row read back as written."""

import numpy as np
import pytest
import torch

from kvg_export import DynamicCache
from kvg_export.presets import load_model
from runtime.artifact import Artifact, SessionOptions
from runtime.cache import buffers
from runtime.cache.prefix_cache import Block
from runtime.cache.row_cache import RowCache
from runtime.contract import is_shift_state

CPU = SessionOptions(provider="cpu")
PAD = 0
# Against eager PyTorch: the worst measured is 7.2e-7 (a cached value) and 3.3e-7 (a logit), three units in the
# last place of values up to about 3 (the tests pass at 1e-6 here); 2e-6 leaves room for another CPU's rounding and
# no more: a wrong slot, mask or state is off by orders more
TOLERANCE = 2e-6
EAGER_FIELDS = {"key": "keys", "value": "values", "gate": "gates"}  # the cache layers' names; shift states alike


@pytest.fixture(scope="module", params=["fox-pro-tiny", "fox-gqa-tiny"])  # token shift states; RoPE and 2 kv heads
def opened(request, exported):
    preset = request.param
    return preset, Artifact.open(exported(preset, "static")[0].path, CPU), load_model(preset)


def slotted(cache: RowCache) -> list[str]:
    """The past inputs whose slots rows hold (keys, values and gates), from the manifest."""
    return [name for name in cache.artifact.past_names() if name.rsplit(".", 1)[1] in ("key", "value", "gate")]


def junk(cache: RowCache, seed: int) -> None:
    """Every slot of every row filled with random values, as earlier requests leave them."""
    rng = np.random.default_rng(seed)
    for row in range(cache.rows):
        shapes = {name: host.shape for name, host in cache.read_block(row, 0, cache.length, 0, 1)[0].items()}
        slots = {name: rng.normal(0, 2, shapes[name]).astype(np.float32) for name in slotted(cache)}
        cache.write_prefix(row, 0, [Block(cache.length, 0, slots, {})])


def run_chunk(artifact: Artifact, cache: RowCache, row: int, ids: list[int], first: int, at: int, chunk: int,
              chunks: int, resumed: bool = False) -> np.ndarray:  # fmt: skip
    """Chunk `chunk` of `chunks` of a prompt whose first token is at slot `first`, its tokens `ids` at slots [at,
    at + len(ids)), into `row` alone; every position's logits `[len(ids), vocab]`."""
    binding = artifact.session.io_binding()
    mask = np.zeros((1, at + len(ids)), dtype=np.int64)
    mask[:, first:] = 1
    binding.bind_cpu_input("input_ids", np.array([ids], dtype=np.int64))
    binding.bind_cpu_input("attention_mask", mask)
    binding.bind_cpu_input("cache_position", np.arange(at, at + len(ids), dtype=np.int64))
    binding.bind_output("logits", "cpu")
    cache.bind_row(binding, row, chunk, chunks, resumed)
    artifact.session.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()[0].copy()


def run_step(artifact: Artifact, cache: RowCache, ids: list[int], firsts: list[int], clock: int) -> np.ndarray:
    """One decode step over rows [0, len(ids)) at slot `clock`, row r's window from slot firsts[r], bound afresh;
    the last position's logits `[rows, vocab]`."""
    binding = artifact.session.io_binding()
    binding.bind_cpu_input("input_ids", np.array(ids, dtype=np.int64)[:, None])
    mask = (np.arange(clock + 1) >= np.array(firsts)[:, None]).astype(np.int64)
    binding.bind_cpu_input("attention_mask", mask)
    binding.bind_cpu_input("cache_position", np.array([clock], dtype=np.int64))
    binding.bind_output("logits", "cpu")
    cache.bind_step(binding, artifact.session.io_binding(), len(ids), resized=True)  # and a next step's, unused here
    artifact.session.run_with_iobinding(binding)
    cache.advance()
    return binding.get_outputs()[0].numpy()[:, -1].copy()


def eager_logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


PROMPTS = [[5, 9, 14, 3], [7, 7, 21, 30, 11, 4], [40, 2, 17]]
FED = [[33, 8, 12, 60, 3], [19, 25, 6], [11, 50, 4, 4, 70]]  # what each row is fed after its prompt


def test_rows_that_join_prefill_between_steps_and_move_get_the_logits_of_eager_alone(opened):
    """Three rows on leftovers (every slot random): rows 0 and 2 prefill at slots 2 and 3 and decode; row 1 (free,
    fed padding at the clock) then prefills in two chunks with a decode step between them, its token shift state
    kept aside, and joins; every row's slots move to the front (compaction), and decoding goes on. Each row's
    logits at every position are eager's on that row's tokens alone, and the first chunk's block (its slots and
    shift states) is eager's cache after those tokens, though a decode step of the other rows ran since."""
    _, artifact, model = opened
    cache = RowCache(artifact, 3)
    junk(cache, seed=1)
    got = {row: [] for row in range(3)}  # (position in the row's tokens, logits)
    a, b, c = PROMPTS
    got[0] += enumerate(run_chunk(artifact, cache, 0, a, first=2, at=2, chunk=0, chunks=1))
    got[2] += enumerate(run_chunk(artifact, cache, 2, c, first=3, at=3, chunk=0, chunks=1))
    step = run_step(artifact, cache, [FED[0][0], PAD, FED[2][0]], [2, 6, 3], clock=6)  # row 1 free: its own slot
    got[0].append((4, step[0]))
    got[2].append((3, step[2]))
    got[1] += enumerate(run_chunk(artifact, cache, 1, b[:3], first=2, at=2, chunk=0, chunks=2))
    step = run_step(artifact, cache, [FED[0][1], PAD, FED[2][1]], [2, 7, 3], clock=7)  # over row 1's slot 7
    got[0].append((5, step[0]))
    got[2].append((4, step[2]))
    slots, states = cache.read_block(1, 2, 5, chunk=0, chunks=2)
    got[1] += [(3 + i, logits) for i, logits in enumerate(run_chunk(artifact, cache, 1, b[3:], 2, 5, 1, 2))]
    step = run_step(artifact, cache, [FED[0][2], FED[1][0], FED[2][2]], [2, 2, 3], clock=8)
    for row, position in ((0, 6), (1, 6), (2, 5)):
        got[row].append((position, step[row]))
    cache.move([0, 1, 2], 2, 9, 0)  # compaction: the clock goes back by 2
    for index, clock in ((3, 7), (4, 8)):
        step = run_step(artifact, cache, [FED[0][index], FED[1][index - 2], FED[2][index]], [0, 0, 1], clock)
        for row, position in ((0, index + 4), (1, index + 4), (2, index + 3)):
            got[row].append((position, step[row]))
    for row, (prompt, fed) in enumerate(zip(PROMPTS, FED, strict=True)):
        want = eager_logits(model, prompt + fed)
        positions = [position for position, _ in got[row]]
        assert positions == list(range(len(prompt) + (3 if row == 1 else 5)))
        worst = max(float(np.abs(logits - want[position]).max()) for position, logits in got[row])
        assert worst < TOLERANCE, f"row {row}: {worst}"
    eager = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([b[:3]]), past_key_values=eager)
    for name, host in {**slots, **states}.items():
        layer, field = name.split(".")[1:]
        want = getattr(eager.layers[int(layer)], EAGER_FIELDS.get(field, field))[0].numpy()
        np.testing.assert_allclose(host, want, rtol=0, atol=TOLERANCE, err_msg=name)
    assert set(states) == {name for name in artifact.past_names() if name.endswith("shift")}


def test_a_prompt_resumed_from_its_first_chunks_block_gets_the_logits_of_eager(opened):
    """A block read after a prompt's first chunk, written into another row at other slots and resumed from (its
    shift states too), gives the prompt's second chunk eager's logits: what the prefix cache relies on."""
    _, artifact, model = opened
    cache = RowCache(artifact, 2)
    junk(cache, seed=2)
    prompt = PROMPTS[1]
    run_chunk(artifact, cache, 0, prompt[:3], first=0, at=0, chunk=0, chunks=2)
    slots, states = cache.read_block(0, 0, 3, chunk=0, chunks=2)
    cache.write_prefix(1, 4, [Block(3, 0, slots, states)])
    cache.resume(states)
    logits = run_chunk(artifact, cache, 1, prompt[3:], first=4, at=7, chunk=0, chunks=1, resumed=True)
    assert np.abs(logits - eager_logits(model, prompt)[3:]).max() < TOLERANCE


def test_blocks_written_into_a_row_read_back_as_written_and_a_move_shifts_every_slotted_buffer(exported):
    """write_prefix puts each block's slots at the row's slots from `begin` on and touches no other row or slot;
    read_block and gates give them back; move shifts the slots of the rows named in every key, value and gate
    buffer as a numpy copy of the same slots does (the slots it leaves keep their values), and no shift state."""
    artifact = Artifact.open(exported("fox-pro-tiny", "static")[0].path, CPU)
    cache = RowCache(artifact, 3)
    rng = np.random.default_rng(3)
    names = slotted(cache)
    shapes = {name: cache.read_block(0, 0, 4, 0, 1)[0][name].shape for name in names}  # 4 slots: [heads, 4, ...]

    def block(begin: int, end: int) -> Block:
        return Block(end, begin, {name: rng.normal(size=(shapes[name][0], end - begin, *shapes[name][2:]))
                                  .astype(np.float32) for name in names}, {})  # fmt: skip

    blocks = [block(0, 4), block(4, 9)]
    cache.write_prefix(1, 10, blocks)
    before = {row: cache.read_block(row, 0, cache.length, 0, 1) for row in range(3)}
    for name in names:
        want = np.zeros((shapes[name][0], cache.length, *shapes[name][2:]), np.float32)
        want[:, 10:19] = np.concatenate([blocks[0].slots[name], blocks[1].slots[name]], axis=1)
        np.testing.assert_array_equal(before[1][0][name], want, err_msg=name)
        assert not before[0][0][name].any() and not before[2][0][name].any()
    gates = cache.gates(1, 12, 19)
    gate_names = [name for name in names if name.endswith(".gate")]
    assert len(gates) == len(gate_names) == artifact.manifest["model"]["num_layers"]
    for gate, name in zip(gates, gate_names, strict=True):
        np.testing.assert_array_equal(gate, before[1][0][name][None, :, 12:19])
    for row in range(3):  # every row's shift states and slots something to keep or to move
        run_chunk(artifact, cache, row, PROMPTS[row], first=0, at=0, chunk=0, chunks=1)
        cache.write_prefix(row, 0, [Block(cache.length, 0, {name: rng.normal(size=before[row][0][name].shape)
                                                             .astype(np.float32) for name in names}, {})])  # fmt: skip
    unmoved = {row: cache.read_block(row, 0, cache.length, 0, 1) for row in range(3)}
    assert unmoved[0][1] and all(state.any() for state in unmoved[0][1].values())  # fox-pro-tiny's token shift
    cache.move([0, 2], 5, 20, 1)
    for row in range(3):
        slots, states = cache.read_block(row, 0, cache.length, 0, 1)
        for name in names:
            want = unmoved[row][0][name].copy()
            if row != 1:
                want[:, 1:16] = unmoved[row][0][name][:, 5:20]
            np.testing.assert_array_equal(slots[name], want, err_msg=f"row {row} {name}")
        for name, state in states.items():
            np.testing.assert_array_equal(state, unmoved[row][1][name], err_msg=f"row {row} {name}")


# FoX-Pro: a row that keeps fewer holes its whole step, unless the step gave each token's shift states
@pytest.mark.parametrize(("preset", "given"), [("fox-tiny", False), ("fox-pro-tiny", False), ("fox-pro-tiny", True)])
def test_trim_takes_the_clock_back_over_the_latest_slots_every_running_row_left_as_holes(exported, preset, given):
    """After a wide step's keeps, the clock goes back to the last slot some running row keeps (a free row's slots
    count for nothing), and those slots are no row's holes: the next step writes them. Given each token's shift
    states, a row that keeps fewer takes the state after its last kept token."""
    cache = RowCache(Artifact.open(exported(preset, "static")[0].path, CPU), 3)
    cache.clock = 10
    for row in (0, 1):
        cache.join(row, None)
    cache.holes[2, :] = True  # a free row's leftovers
    rng = np.random.default_rng(4)

    def step(width: int, kept: dict[int, int]) -> None:
        shifted = [past for past in cache.artifact.past_names() if is_shift_state(past)]
        widths = {past: buffers.to_host(cache.held_in(past), "float32").shape[1] for past in shifted}
        states = {past: rng.standard_normal((3, width, size), dtype=np.float32) for past, size in widths.items()}
        cache.advance(width=width, states=states if given else None)
        for row, count in kept.items():
            cache.keep(count, row)
            for past, values in states.items() if given and count < width else ():
                kept_state = buffers.to_host(cache.held_in(past), "float32")[row]
                np.testing.assert_array_equal(kept_state, values[row, count - 1])
        running, end = list(cache.running), cache.clock
        while end > 0 and cache.holes[running, end - 1].all():  # the naive rule, slot by slot
            end -= 1
        before = cache.holes.copy()
        cache.trim()
        assert cache.clock == end
        assert not cache.holes[running, end:].any() and (cache.holes[:, :end] == before[:, :end]).all()

    step(4, {0: 1, 1: 3})
    step(3, {0: 1, 1: 1})
    step(3, {0: 3, 1: 3})  # every draft kept: nothing to take back
    cache.end_row(1)
    step(4, {0: 2})  # a lone row's rejected drafts
    # each step leaves the most any row kept (3, 1, 3, 2); FoX-Pro's rows without each token's states go back over a
    # step they keep part of and feed those tokens again, so only the step that kept everything stays
    shifts = any(is_shift_state(past) for past in cache.artifact.past_names())
    assert cache.clock == 10 + (3 if shifts and not given else 3 + 1 + 3 + 2)


@pytest.mark.parametrize("given", [False, True])
def test_keeping_for_every_running_row_at_once_is_keeping_for_each(exported, given):
    """`keep(kept)` over every running row leaves the holes, gates and shift states that `keep(kept, row)` for each
    running row leaves (and a free row's untouched)."""
    artifact = Artifact.open(exported("fox-pro-tiny", "static")[0].path, CPU)
    shifted = [past for past in artifact.past_names() if is_shift_state(past)]
    caches = [RowCache(artifact, 3), RowCache(artifact, 3)]
    rng = np.random.default_rng(5)
    widths = {past: buffers.to_host(caches[0].held_in(past), "float32").shape[1] for past in shifted}
    states = {past: rng.standard_normal((3, 4, size), dtype=np.float32) for past, size in widths.items()}
    read = {past: rng.standard_normal((3, size), dtype=np.float32) for past, size in widths.items()}
    for cache in caches:  # the same leftovers in both, and the same states for the step to read
        junk(cache, 7)
        for past, host in read.items():
            buffers.overwrite(cache.held_in(past), host.copy(), "float32")
    for cache in caches:
        cache.clock = 10
        for row in (0, 2):
            cache.join(row, None)
        cache.advance(width=4, states=states if given else None)
    together = caches[0].keep(2)
    apart = [caches[1].keep(2, row) for row in (0, 2)]
    assert apart == [together, together]
    np.testing.assert_array_equal(caches[0].holes, caches[1].holes)
    first = 10 + (0 if together else 2)  # of the step's slots [10, 14); without each token's states, all of them
    assert together == (0 if given else 2)
    assert caches[0].holes[[0, 2], first:14].all() and not caches[0].holes[[0, 2], :first].any()
    assert not caches[0].holes[1].any()
    for gate in artifact.gate_names():
        host = buffers.to_host(caches[0].held_in(gate), "float32")
        assert not host[[0, 2], :, first:14].any() and host[1, :, first:14].all()
    for past in shifted:  # the state after the last kept token, or the one the step read
        want = states[past][:, 1] if given else read[past]
        np.testing.assert_array_equal(buffers.to_host(caches[0].held_in(past), "float32")[[0, 2]], want[[0, 2]])
    for past in artifact.past_names():
        np.testing.assert_array_equal(*(buffers.to_host(cache.held_in(past), "float32") for cache in caches), past)
