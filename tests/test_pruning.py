"""Forget-gate pruning: the score bounds hold, the runtime drops only keys whose decay is below the threshold,
and a pruned artifact of few slots generates what an unpruned one of many does, past its slots' length."""

import dataclasses
import math
import threading

import numpy as np
import pytest
import torch
from conftest import export_here
from scripted_drafts import Scripted

from exporters.pipeline.cli import main as export_main
from exporters.pipeline.options import ExportOptions
from kvg_export.corpus import read_split, token_stream
from kvg_export.fox.pruning import score_bounds
from kvg_export.presets import load_model
from runtime.artifact import SessionOptions
from runtime.cache.pruning import PruningError, droppable
from runtime.decode.engine import Engine
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.model import Model
from runtime.decode.requests import Failed, Finished, Token
from runtime.decode.sampling import SamplingConfig
from runtime.errors import RequestError
from runtime.speculative.draft_model import DraftModel

CPU = SessionOptions(provider="cpu")
TOLERANCE = -10.0
SLOTS = 64  # the pruned artifacts' slots: fewer than the positions each test runs through
# Every head forgets, from at once to within about twenty tokens, so that every head lets keys go
FORGETTING = [-200.0, -4.0, -2.0, -1.0]
PROMPT, NEW = 150, 120


def forgetting(preset: str, biases=FORGETTING, layers=None):
    """The preset with forget-gate biases `biases` per head in every layer, or `layers[i]` in layer i."""
    model = load_model(preset).eval()
    with torch.no_grad():
        for index, block in enumerate(model.model.layers):
            attention = block.attn
            bias = attention.fgate_proj.bias if attention.config.fgate_type == "full" else attention.fgate_bias
            bias.copy_(torch.tensor(layers[index] if layers else biases))
    return model


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """preset -> (model, pruned static artifact of SLOTS slots, pruned dynamic gqa artifact, unpruned one)."""
    made = {}

    def export(preset: str):
        if preset not in made:
            folder = tmp_path_factory.mktemp(preset)
            model = forgetting(preset)
            model.save_pretrained(folder / "checkpoint")
            checkpoint = str(folder / "checkpoint")
            static = ExportOptions(checkpoint, folder / "static", "static", max_cache_len=SLOTS)
            static.log_pruning_tolerance = TOLERANCE
            dynamic = ExportOptions(checkpoint, folder / "dynamic", "dynamic", log_pruning_tolerance=TOLERANCE)
            exact = ExportOptions(checkpoint, folder / "exact", "dynamic", log_pruning_tolerance=None)
            made[preset] = (model, *(export_here(o) for o in (static, dynamic, exact)))
        return made[preset]

    return export


def prompts(vocab: int, batch: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, vocab, PROMPT - 7 * row).tolist() for row in range(batch)]


def assert_within_the_bound(model, pruned: list[np.ndarray], exact: list[np.ndarray]) -> None:
    """Each query loses at most e^TOLERANCE of its attention weight in each layer (kvg_export/fox/pruning.py),
    which moves that layer's output by at most twice that share of its values; the logits are allowed as much of
    their scale per layer (float32's own noise, at most 1.2e-5 in these tests, stays far below that)."""
    worst = max(float(abs(a - b).max()) for a, b in zip(pruned, exact, strict=True))
    scale = max(float(abs(b).max()) for b in exact)
    assert worst <= 2 * model.config.num_hidden_layers * math.exp(TOLERANCE) * scale, worst


def test_no_query_key_score_exceeds_the_bound(artifacts):
    """|q.k| / sqrt(head_dim) over every pair of a text, per head, against U from the weights alone: QK-norm
    (fox-pro-tiny) and projection norms (fox-tiny), with every layer's input scaled 50 times."""
    for preset in ("fox-pro-tiny", "fox-tiny"):
        model = forgetting(preset)
        bounds = score_bounds(model)
        captured = {}
        hooks = [
            block.register_forward_hook(lambda m, args, out, i=i, store=captured: store.setdefault(i, args[0]))
            for i, block in enumerate(model.model.layers)
        ]
        ids = torch.randint(3, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
            for layer, block in enumerate(model.model.layers):
                attention, x = block.attn, block.attn_norm(captured[layer] * 50)  # the norm undoes any scale
                q = attention.q_proj(x)
                k = attention._project("k_proj", x, None, None)
                positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
                if model.config.qk_norm or model.config.use_rope:
                    q, k = attention._per_head(q, k, positions)
                q = q.unflatten(-1, (attention.heads, -1)).transpose(1, 2)
                k = k.unflatten(-1, (attention.kv_heads, -1)).transpose(1, 2)
                k = k.repeat_interleave(attention.heads // attention.kv_heads, dim=1)
                scores = (q @ k.transpose(-1, -2)).abs().amax((0, 2, 3)) / math.sqrt(attention.head_dim)
                assert (scores <= torch.tensor(bounds[layer])).all(), (preset, layer, scores, bounds[layer])
        for hook in hooks:
            hook.remove()


def test_droppable_counts_each_heads_keys_whose_decay_is_below_its_threshold():
    rng = np.random.default_rng(0)
    gates = -rng.exponential(0.5, size=(2, 3, 40)).astype(np.float32)
    gates[1, 2] = 0.0  # a head that never forgets
    thresholds = np.array([-3.0, -8.0, -1.0])
    counts = droppable(gates, thresholds)
    for row in range(2):
        for head in range(3):
            naive = sum(float(sum(gates[row, head, j + 1 :].astype(np.float64))) < thresholds[head] for j in range(40))
            assert counts[row, head] == naive


@pytest.mark.parametrize("preset", ["fox-pro-tiny", "fox-gqa-tiny", "fox-tiny"])
def test_a_pruned_artifact_generates_the_exact_tokens_past_its_slots(artifacts, preset):
    """Static: PROMPT + NEW positions through SLOTS slots; dynamic gqa: a window that stays short. fox-gqa-tiny
    has RoPE, whose positions must stay those of the whole sequence after slots are dropped."""
    model, static, dynamic, exact = artifacts(preset)
    config = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW)
    # A gqa batch prompt is prefilled whole, row by row, so a batch goes to the dynamic artifact only
    for folder, batch in ((static, 1), (dynamic, 2)):
        rows = prompts(model.config.vocab_size, batch)
        expected = Generator.open(exact, CPU).generate(rows, config, keep_logits=True)
        generator = Generator.open(folder, CPU)
        assert generator.model.pruning.log_tolerance == TOLERANCE
        result = generator.generate(rows, config, keep_logits=True)
        assert np.min(result.pruned_positions) > 0
        assert result.tokens == expected.tokens
        assert_within_the_bound(model, result.step_logits, expected.step_logits)


def test_answers_forked_after_pruning_decode_on_as_rows_pruned_each_on_their_own(artifacts):
    """A prompt longer than the static artifact's slots is pruned while it is prefilled, then forked into the rows
    of its answers (num_return_sequences): each row's windows go with it, so the answers draw what the prompt repeated
    in the batch draws, and drop as many positions."""
    model, static, dynamic, _ = artifacts("fox-pro-tiny")
    sampling = SamplingConfig(temperature=1.0, seed=3)
    for folder in (static, dynamic):
        generator, [prompt] = Generator.open(folder, CPU), prompts(model.config.vocab_size)
        forked = generator.generate([prompt], GenerationConfig(max_new_tokens=40, sampling=sampling,
                                                               num_return_sequences=2))  # fmt: skip
        apart = generator.generate([prompt, prompt], GenerationConfig(max_new_tokens=40, sampling=sampling))
        assert np.min(forked.pruned_positions) > 0
        assert (forked.tokens, forked.pruned_positions) == (apart.tokens, apart.pruned_positions)


@pytest.mark.parametrize(
    ("preset", "attention"), [("fox-pro-tiny", "auto"), ("fox-tiny", "auto"), ("fox-pro-tiny", "gqa")]
)
def test_speculative_decoding_through_a_pruned_artifact_generates_the_exact_tokens(
    artifacts, tmp_path, preset, attention
):
    """Drafts (right at most positions) verified in runs of several tokens, which may be cut back: pruning must
    judge by the kept tokens' gates alone, a static artifact's runs find room for fewer tokens near its end,
    FoX-Pro's shift states go back with the cache, and where heads' windows are staggered in folded rows
    (GroupQueryAttention's), the gate slots a cut run wrote past a head's window are cleared. Static: one row
    through SLOTS slots; dynamic: a batch (not gqa's: it takes several tokens for one row only)."""
    model, static, dynamic, exact = artifacts(preset)
    if attention == "gqa":
        model.save_pretrained(tmp_path / "checkpoint")
        options = ExportOptions(str(tmp_path / "checkpoint"), tmp_path / "gqa", "static", max_cache_len=SLOTS)
        options.attention, options.log_pruning_tolerance = attention, TOLERANCE
        static, dynamic = export_here(options), None
    config = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW)
    for folder, batch in ((static, 1), (dynamic, 2)) if dynamic else ((static, 1),):
        rows = prompts(model.config.vocab_size, batch)
        expected = Generator.open(exact, CPU).generate(rows, config, keep_logits=True)
        drafts = Scripted.of(rows, expected.tokens, lambda row, position: position % 7 != 3, model.config.vocab_size)
        speculative = dataclasses.replace(config, speculative=drafts)
        result = Generator.open(folder, CPU).generate(rows, speculative, keep_logits=True)
        assert np.min(result.pruned_positions) > 0 and 0 < result.drafts_accepted < result.drafts_proposed
        assert result.tokens == expected.tokens
        assert_within_the_bound(model, result.step_logits, expected.step_logits)


@pytest.mark.parametrize("preset", ["fox-pro-tiny", "fox-tiny"])
def test_a_pruned_artifact_drafting_for_itself_generates_the_exact_tokens(artifacts, preset):
    """The draft's cache prunes as well, through its SLOTS slots, and goes back after each round of drafts
    (FoX-Pro's shift states with it) without dropping a position it goes back to: every draft is accepted, and the
    target's tokens are the unpruned artifact's."""
    model, static, _, exact = artifacts(preset)
    config = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW)
    rows = prompts(model.config.vocab_size, 1)
    expected = Generator.open(exact, CPU).generate(rows, config, keep_logits=True)
    draft = DraftModel(Model.open(static, CPU), tokens=5)
    drafted = dataclasses.replace(config, speculative=draft)
    result = Generator.open(static, CPU).generate(rows, drafted, keep_logits=True)
    assert np.min(result.pruned_positions) > 0 and result.drafts_accepted == result.drafts_proposed > NEW // 2
    assert result.tokens == expected.tokens
    assert_within_the_bound(model, result.step_logits, expected.step_logits)


def test_teacher_forced_through_its_slots_a_pruned_artifact_scores_a_text_as_the_exact_one(artifacts):
    """PROMPT + NEW tokens scored through SLOTS slots, in prefill chunks that prune between them: the same
    perplexity within 0.05% and logits within the bound."""
    model, static, _, exact = artifacts("fox-pro-tiny")
    ids = np.random.default_rng(5).integers(3, model.config.vocab_size, (1, PROMPT + NEW))
    pruned = Generator.open(static, CPU).teacher_forced_logits(ids, prefill_chunk=16)
    expected = Generator.open(exact, CPU).teacher_forced_logits(ids)

    def perplexity(logits: np.ndarray) -> float:
        shifted = logits[0, :-1] - logits[0, :-1].max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        return float(np.exp(-log_probs[np.arange(ids.shape[1] - 1), ids[0, 1:]].mean()))

    assert abs(perplexity(pruned) / perplexity(expected) - 1) < 5e-4
    assert_within_the_bound(model, list(pruned[0]), list(expected[0]))


def test_a_trained_preset_as_make_export_makes_it_prunes_held_out_text_within_the_bound(exported):
    """fox-pro-py's config sets -10: 2,048 tokens of held-out Python, then 64 greedy ones, pruned and with every
    key on the same artifact. Its first layer's heads forget within tens of tokens."""
    artifact = exported("fox-pro-py", "dynamic")[0].path
    generator = Generator.open(artifact, CPU)
    assert generator.model.pruning.log_tolerance == TOLERANCE
    prompt = token_stream(generator.model.tokenizer.bpe, read_split("test"), 2, longest_first=True)[:2048].tolist()
    config = GenerationConfig(max_new_tokens=64, min_new_tokens=64)
    result = generator.generate([prompt], config, keep_logits=True)
    expected = Generator.open(artifact, CPU, None).generate([prompt], config, keep_logits=True)
    assert min(result.pruned_positions[0]) > 1024
    assert result.tokens == expected.tokens
    assert_within_the_bound(load_model("fox-pro-py"), result.step_logits, expected.step_logits)


def test_every_dropped_key_decays_below_its_threshold_in_every_head(artifacts):
    """The runtime's drops against the eager model's own forget gates over the whole sequence."""
    model, static, _, _ = artifacts("fox-pro-tiny")
    row = prompts(model.config.vocab_size)
    generator = Generator.open(static, CPU)
    result = generator.generate(row, GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW))
    ids = torch.tensor([row[0] + result.tokens[0][:-1]])  # every position fed
    gates = {}
    hooks = [
        block.attn.register_forward_hook(
            lambda m, args, out, i=i: gates.__setitem__(i, m.log_forget_gate(args[0])[0].double())
        )
        for i, block in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    positions = ids.shape[1]
    bounds = torch.tensor(score_bounds(model), dtype=torch.float64)
    thresholds = TOLERANCE - 2 * bounds - math.log(PROMPT + NEW - 1)
    group = model.config.num_heads // model.config.kv_heads
    for layer, layer_gates in gates.items():
        for head in range(model.config.num_heads):
            dropped = result.pruned_positions[layer][head // group]  # by its kv head
            assert dropped > 0
            decay = layer_gates[head, dropped:positions].sum()  # after the last dropped key
            assert decay < thresholds[layer, head], (layer, head)


@pytest.mark.parametrize("attention", ["standard", "onnx-attention"])
def test_static_artifacts_of_other_attention_graphs_prune_too(artifacts, tmp_path, attention):
    """A standard graph (no window_offsets: every layer keeps one window, what all heads allow) and ONNX
    Attention over TensorScatter (each layer its own window), through SLOTS slots, against the exact run."""
    model, _, _, exact = artifacts("fox-pro-tiny")
    model.save_pretrained(tmp_path / "checkpoint")
    options = ExportOptions(str(tmp_path / "checkpoint"), tmp_path / attention, "static", max_cache_len=SLOTS)
    options.attention, options.log_pruning_tolerance = attention, TOLERANCE
    generator = Generator.open(export_here(options), CPU)
    row, config = prompts(model.config.vocab_size), GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW)
    result = generator.generate(row, config, keep_logits=True)
    expected = Generator.open(exact, CPU).generate(row, config, keep_logits=True)
    assert np.min(result.pruned_positions) > 0
    if attention == "standard":  # one window for every head of every layer
        assert len(np.unique(result.pruned_positions)) == 1
    else:  # each head its own
        assert all(len(set(layer)) > 1 for layer in result.pruned_positions)
    assert result.tokens == expected.tokens
    assert_within_the_bound(model, result.step_logits, expected.step_logits)


def serve(generator: Generator, requests: list[tuple[list[int], GenerationConfig]]) -> list[tuple[list[int], object]]:
    """Each request's tokens and its end, all submitted at once to an engine of as many rows."""
    engine = Engine(generator.model, max_batch=len(requests))
    results, ended = [([], None) for _ in requests], threading.Semaphore(0)

    def emit(index: int):
        def on_event(event):
            if isinstance(event, Token):
                results[index][0].append(event.token)
            else:
                results[index] = (results[index][0], event)
                ended.release()

        return on_event

    try:
        for index, (prompt, config) in enumerate(requests):
            engine.submit(prompt, config, emit(index))
        for _ in requests:
            assert ended.acquire(timeout=120), "a request never ended"
    finally:
        engine.close()
    return results


def test_the_serving_engine_prunes_each_row_past_its_slots(artifacts):
    """Two requests at once through the static artifact's SLOTS slots, each row dropping its own oldest
    slots: each gets the tokens it gets alone, with every key, far past the slots' length."""
    model, static, _, exact = artifacts("fox-gqa-tiny")  # RoPE: positions must count the dropped slots
    config = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW)
    rows = [prompt[:40] for prompt in prompts(model.config.vocab_size, batch=2)]
    got = serve(Generator.open(static, CPU), [(row, config) for row in rows])
    for row, (tokens, end) in zip(rows, got, strict=True):
        assert isinstance(end, Finished) and end.completion_tokens == NEW
        assert tokens == Generator.open(exact, CPU).generate([row], config).tokens[0]


@pytest.mark.parametrize("preset", ["fox-gqa-tiny", "fox-pro-tiny"])
def test_the_serving_engine_prunes_speculating_rows_by_their_kept_tokens_alone(artifacts, preset):
    """Two requests at once through SLOTS slots, verifying drafts right at most positions, each row keeping its own
    count of them: rejected drafts' slots are holes (or, with FoX-Pro's shift states, the row feeds its kept tokens
    again), which pruning, the RoPE positions and the compaction at the end of the cache must see through."""
    model, static, _, exact = artifacts(preset)
    config = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW)
    rows = [prompt[:40] for prompt in prompts(model.config.vocab_size, batch=2)]
    alone = [Generator.open(exact, CPU).generate([row], config).tokens[0] for row in rows]
    right = Scripted.of(rows, alone, lambda row, position: (position + 3 * row) % 7 != 3, model.config.vocab_size)
    got = serve(Generator.open(static, CPU), [(row, dataclasses.replace(config, speculative=right)) for row in rows])
    for (tokens, end), expected in zip(got, alone, strict=True):
        assert isinstance(end, Finished) and end.completion_tokens == NEW
        assert tokens == expected


@pytest.fixture(scope="module")
def unforgetting(tmp_path_factory):
    """A pruned static artifact of SLOTS slots whose head 3 forgets nothing."""
    folder = tmp_path_factory.mktemp("unforgetting")
    forgetting("fox-pro-tiny", [-200.0, -4.0, -2.0, 30.0]).save_pretrained(folder / "checkpoint")
    options = ExportOptions(str(folder / "checkpoint"), folder / "static", "static", max_cache_len=SLOTS)
    options.log_pruning_tolerance = TOLERANCE
    return export_here(options)


def test_a_served_request_whose_head_keeps_more_than_the_slots_fails_naming_it(unforgetting):
    generator = Generator.open(unforgetting, CPU)
    [(tokens, end)] = serve(generator, [(prompts(512)[0][:40], GenerationConfig(max_new_tokens=NEW))])
    assert isinstance(end, Failed) and len(tokens) == SLOTS - 40 + 1  # each token fed back fills a slot
    assert f"head 3 still weighs all of its last {SLOTS} positions" in end.message


@pytest.fixture(scope="module")
def parting(tmp_path_factory):
    """A pruned dynamic artifact whose layer 0's first three heads forget within tokens and its last hardly at
    all, nor does layer 1: only kv heads of their own windows can drop those three heads' keys."""
    folder = tmp_path_factory.mktemp("parting")
    model = forgetting("fox-pro-tiny", layers=[[*FORGETTING[:3], 3.0], [3.0] * 4])
    model.save_pretrained(folder / "checkpoint")
    options = ExportOptions(str(folder / "checkpoint"), folder / "dynamic", log_pruning_tolerance=TOLERANCE)
    return model, export_here(options)


@pytest.mark.parametrize("prefill_chunk", [256, 32], ids=["one-chunk", "chunks"])
def test_each_head_drops_as_far_as_it_allows(parting, prefill_chunk):
    """Those three heads' windows shrink while the others keep every position (in one window per layer, none
    could shrink), and the tokens and logits are those of the same artifact run without pruning. Prefilled in
    chunks, the heads part before the first token (GroupQueryAttention then runs one op a head)."""
    model, folder = parting
    row = prompts(model.config.vocab_size)
    config = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, prefill_chunk=prefill_chunk)
    result = Generator.open(folder, CPU).generate(row, config, keep_logits=True)
    expected = Generator.open(folder, CPU, None).generate(row, config, keep_logits=True)
    assert min(result.pruned_positions[0][:3]) > PROMPT
    assert result.pruned_positions[0][3] == 0 and result.pruned_positions[1] == [0] * 4
    assert result.tokens == expected.tokens
    assert_within_the_bound(model, result.step_logits, expected.step_logits)
    if prefill_chunk < PROMPT:
        first = Generator.open(folder, CPU).generate(row, GenerationConfig(max_new_tokens=1, prefill_chunk=32))
        assert min(first.pruned_positions[0][:3]) > 0 and first.pruned_positions[0][3] == 0


def test_a_head_that_keeps_more_than_the_slots_ends_the_request_naming_it(unforgetting):
    generator = Generator.open(unforgetting, CPU)
    with pytest.raises(PruningError, match=rf"layer 0 head 3 .* {SLOTS} slots.*--max-cache-len"):
        generator.generate(prompts(512), GenerationConfig(max_new_tokens=NEW))
    # Without pruning the request is refused up front instead
    with pytest.raises(RequestError, match="max_cache_len"):
        unpruned = Generator(Model(generator.model.artifact, None, None))
        unpruned.generate(prompts(512), GenerationConfig(max_new_tokens=NEW))


def test_the_manifest_records_the_tolerance_and_bounds_and_the_runtime_may_override_them(artifacts):
    model, static, _, exact = artifacts("fox-tiny")
    generator = Generator.open(exact, CPU)
    assert generator.model.pruning is None
    recorded = generator.model.artifact.manifest["pruning"]
    assert recorded["log_pruning_tolerance"] is None
    assert np.allclose(recorded["score_bounds"], score_bounds(model))
    overridden = Model.open(exact, CPU, -5.0).pruning
    assert overridden.log_tolerance == -5.0
    assert np.array_equal(overridden.score_bounds, recorded["score_bounds"])
    assert Model.open(static, CPU, None).pruning is None


def test_export_refuses_a_tolerance_it_cannot_prune_with(tmp_path, capsys):
    out = str(tmp_path / "out")
    with pytest.raises(SystemExit) as exited:
        export_main(["fox-tiny", "--out", out, "--log-pruning-tolerance", "3"])
    assert exited.value.code == 2
    assert "must be a negative number" in capsys.readouterr().err
    assert export_main(["fox-tiny", "--out", out, "--log-pruning-tolerance", "-10", "--attention", "standard"]) == 2
    assert "cache held in place" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_config_whose_tolerance_it_cannot_prune_at(tmp_path, capsys):
    model = load_model("fox-tiny")
    model.config.log_pruning_tolerance = 3.0
    model.save_pretrained(tmp_path / "checkpoint")
    assert export_main([str(tmp_path / "checkpoint"), "--out", str(tmp_path / "out")]) == 2
    assert "config.json: log_pruning_tolerance must be a negative number" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
