"""The runtime's contract beyond parity: buffers on the device, sampling, stopping, streaming, bad input."""

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from conftest import CPU_FP32_ATTENTION

import runtime.decode.generator as generator_module
from exporters.checks.validate import TOLERANCES
from kvg_export.presets import load_model
from runtime.artifact import SessionOptions
from runtime.cache.device_cache import DeviceCache
from runtime.cli.generate import main
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.sampling import SamplingConfig
from runtime.errors import ArtifactError, RequestError

CPU = SessionOptions(provider="cpu")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def static_artifact(exported):
    return exported("fox-pro-tiny", "static")[0].path


@pytest.fixture(scope="module")
def dynamic_artifact(exported):
    return exported("fox-tiny", "dynamic")[0].path


@pytest.fixture
def allocated(monkeypatch) -> list[DeviceCache]:
    """The caches Generators allocate while the test runs."""
    made = []

    def counted(*args):
        made.append(DeviceCache(*args))
        return made[-1]

    monkeypatch.setattr(generator_module, "DeviceCache", counted)
    return made


@pytest.mark.parametrize("kind", ["static", "dynamic", "static-onnx-attention"])
def test_in_place_buffers_keep_their_addresses_across_steps_and_calls(
    kind, exported, static_artifact, dynamic_artifact
):
    """A static artifact's keys, values and gates, and a gqa dynamic artifact's keys and values, are written
    in place by the graph, in buffers a later generation reuses when they are long enough. The graph made
    for fp32 on CUDA (TensorScatter and ONNX Attention) runs so on the CPU provider too."""
    artifacts = {"static": static_artifact, "dynamic": dynamic_artifact}
    path = artifacts.get(kind) or exported("fox-pro-tiny", "static", attention="onnx-attention")[0].path
    assert_addresses_stay(Generator.open(path, CPU))


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "cache"), [("fp32", "static"), ("fp16", "static"), ("bf16", "static"),
                                              ("fp16", "dynamic")])  # fmt: skip
def test_on_cuda_in_place_buffers_keep_their_addresses(exported, dtype, cache):
    """fp32 static: TensorScatter and ONNX Attention; fp16 and bf16: GroupQueryAttention, on CUDA."""
    path = exported("fox-pro-tiny", cache, dtype, provider="cuda")[0].path
    assert_addresses_stay(Generator.open(path, SessionOptions(provider="cuda")))


def assert_addresses_stay(generator: Generator) -> None:
    seen, cache = [], DeviceCache(generator.model.artifact, len(PROMPTS))

    def record(_event):
        seen.append({name: cache.held_in(name).data_ptr() for name in cache.in_place})

    generator.generate(PROMPTS, GenerationConfig(max_new_tokens=6, min_new_tokens=6), on_token=record, cache=cache)
    generator.generate(PROMPTS, GenerationConfig(max_new_tokens=4, min_new_tokens=4), on_token=record, cache=cache)
    assert seen[0] and len(seen) == 3 * (6 + 4) and all(addresses == seen[0] for addresses in seen)


def call_prompts(index: int) -> list[list[int]]:
    """A different batch for each call: one to three rows of different lengths."""
    return [[3 + (index * 7 + row * 5 + t) % 90 for t in range(4 + (index + row) % 6)] for row in range(1 + index % 3)]


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_threads_sharing_a_generator_get_the_tokens_each_call_gets_alone(kind, static_artifact, dynamic_artifact):
    """Four threads, five calls each, on one Generator started together: every call's greedy tokens equal the
    same call's made alone, on a Generator of its own."""
    folder = static_artifact if kind == "static" else dynamic_artifact
    config = GenerationConfig(max_new_tokens=12, min_new_tokens=12)
    alone = {i: Generator.open(folder, CPU).generate(call_prompts(i), config).tokens for i in range(20)}
    shared, start, got, errors = Generator.open(folder, CPU), threading.Barrier(4), {}, []

    def calls(thread: int) -> None:
        start.wait()
        try:
            for i in range(thread, 20, 4):
                got[i] = shared.generate(call_prompts(i), config).tokens
        except Exception as error:  # reported below: a thread's exception would otherwise be lost
            errors.append(error)

    threads = [threading.Thread(target=calls, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert got == alone


def test_two_streams_read_in_turns_each_get_the_tokens_they_get_alone(dynamic_artifact):
    generator = Generator.open(dynamic_artifact, CPU)
    config = GenerationConfig(max_new_tokens=10, min_new_tokens=10)
    alone = [generator.generate(call_prompts(i), config).tokens for i in (1, 4)]
    streams, tokens = [generator.stream(call_prompts(i), config) for i in (1, 4)], [{}, {}]
    for events in zip(*streams, strict=True):
        for mine, event in zip(tokens, events, strict=True):
            mine.setdefault(event.row, []).append(event.token)
    assert [[mine[row] for row in sorted(mine)] for mine in tokens] == alone


def test_a_longer_generation_after_a_shorter_one_gets_longer_buffers(dynamic_artifact):
    generator = Generator.open(dynamic_artifact, CPU)
    long = GenerationConfig(max_new_tokens=20, min_new_tokens=20)
    generator.generate(PROMPTS, GenerationConfig(max_new_tokens=3, min_new_tokens=3))
    assert (
        generator.generate(PROMPTS, long).tokens == Generator.open(dynamic_artifact, CPU).generate(PROMPTS, long).tokens
    )


@pytest.mark.parametrize("attention", ["gqa", "standard"])
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one-row", "batch"])
def test_chunked_prefill_of_a_static_artifact_gives_the_same_tokens(exported, attention, prompts):
    """On a gqa artifact one row prefills in chunks and a batch in one go (GroupQueryAttention takes a
    later chunk for one row only); the tokens must not change either way."""
    generator = Generator.open(exported("fox-pro-tiny", "static", attention=attention)[0].path, CPU)
    config = GenerationConfig(max_new_tokens=8, min_new_tokens=8)
    whole = generator.generate(prompts, config)
    chunked = generator.generate(prompts, dataclasses.replace(config, prefill_chunk=3))
    assert chunked.tokens == whole.tokens


@pytest.mark.parametrize(("kind", "rows", "chunk"), [("static", 1, 5), ("static", 2, 256), ("dynamic", 2, 256)])
def test_teacher_forced_logits_of_every_position_equal_eager_forward(
    kind, rows, chunk, static_artifact, dynamic_artifact
):
    """Scoring a text reads every position's logits, fed in the chunks a prompt is prefilled in."""
    artifact = static_artifact if kind == "static" else dynamic_artifact
    preset = json.loads((artifact / "kvg_config.json").read_text())["source"]["model"]
    ids = torch.randint(3, 512, (rows, 17), generator=torch.Generator().manual_seed(rows))
    got = Generator.open(artifact, CPU).teacher_forced_logits(ids.numpy(), prefill_chunk=chunk)
    with torch.no_grad():
        want = load_model(preset)(input_ids=ids, use_cache=False).logits
    assert got.shape == tuple(want.shape)
    assert float(abs(torch.from_numpy(got) - want).max()) < TOLERANCES["float32"]


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_seeded_sampling_is_reproducible_run_to_run(kind, static_artifact, dynamic_artifact):
    generator = Generator.open(static_artifact if kind == "static" else dynamic_artifact, CPU)
    runs = [
        generator.generate(PROMPTS, GenerationConfig(16, 16, sampling=SamplingConfig(1.0, 50, 0.95, 1.1, seed)))
        for seed in (7, 7, 8)
    ]
    assert runs[0].tokens == runs[1].tokens and runs[0].tokens != runs[2].tokens


def test_a_row_that_meets_a_stop_token_stops_while_the_others_go_on(dynamic_artifact):
    generator = Generator.open(dynamic_artifact, CPU)
    free = generator.generate(PROMPTS, GenerationConfig(max_new_tokens=10, min_new_tokens=10))
    stop = free.tokens[1][3]
    first = free.tokens[1].index(stop)
    stopped = generator.generate(PROMPTS, GenerationConfig(max_new_tokens=10, stop_tokens=(stop,)))
    assert stopped.tokens[1] == free.tokens[1][: first + 1] and stopped.finish_reasons[1] == "stop"
    for row in (0, 2):
        if stop not in free.tokens[row]:
            assert stopped.tokens[row] == free.tokens[row] and stopped.finish_reasons[row] == "length"


def test_min_new_tokens_holds_back_stop_tokens(dynamic_artifact):
    generator = Generator.open(dynamic_artifact, CPU)
    free = generator.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=8))
    stop = free.tokens[0][1]
    late = generator.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=8, min_new_tokens=5, stop_tokens=(stop,)))
    assert stop not in late.tokens[0][:5] and len(late.tokens[0]) >= 5


def drained(stream):
    """A stream's token events, and the GenerationResult it returns."""
    events = []
    while True:
        try:
            events.append(next(stream))
        except StopIteration as done:
            return events, done.value


def test_streaming_yields_every_token_and_the_text_in_order(dynamic_artifact):
    generator = Generator.open(dynamic_artifact, CPU)
    events, result = drained(
        generator.stream("the quick brown fox", GenerationConfig(max_new_tokens=12, min_new_tokens=12))
    )
    assert [e.token for e in events] == result.tokens[0]
    assert "".join(e.text for e in events) == result.text[0]
    assert result.time_to_first_token_s > 0 and result.decode_tokens_per_s > 0


def test_a_stream_ending_mid_character_yields_the_text_the_result_has(dynamic_artifact):
    """The last token's event releases what the stream held back: a byte-level tokenizer's last token may
    leave a character unfinished, which the result's text decodes as U+FFFD."""
    generator = Generator.open(dynamic_artifact, CPU)
    unfinished = 0
    for seed in range(64):
        sampling = SamplingConfig(temperature=1.0, seed=seed)
        config = GenerationConfig(max_new_tokens=6, min_new_tokens=6, sampling=sampling)
        events, result = drained(generator.stream("the quick", config))
        assert "".join(e.text for e in events) == result.text[0]
        unfinished += result.text[0].endswith("\ufffd")
    assert unfinished  # else no stream here ended mid-character, and this test checked nothing


def test_running_the_runtime_loads_no_torch(dynamic_artifact):
    probe = (
        "import sys\n"
        "from runtime.artifact import SessionOptions\n"
        "from runtime.decode.generator import GenerationConfig, Generator\n"
        f"g = Generator.open({str(dynamic_artifact)!r}, SessionOptions('cpu'))\n"
        "assert len(g.generate('hello', GenerationConfig(max_new_tokens=4)).tokens[0]) == 4\n"
        "heavy = ('torch', 'transformers', 'kvg_export', 'exporters')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_command_line_prints_generated_text(dynamic_artifact, capsys):
    assert main([str(dynamic_artifact), "--prompt", "hello", "--max-new-tokens", "5", "--provider", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "tokens/s" in err


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        (
            dict(prompts=[list(range(3, 90))], config=GenerationConfig(max_new_tokens=20)),
            "over this artifact's max_cache_len 96",
        ),
        (dict(prompts=[[5]] * 17, config=GenerationConfig(max_new_tokens=2)), "exceeds this artifact's max batch 16"),
        (dict(prompts=[[5, 6], []], config=GenerationConfig(max_new_tokens=2)), "empty prompt"),
        (dict(prompts=[[5, 512, -1]], config=GenerationConfig(max_new_tokens=2)), r"outside the vocabulary \[0, 512\)"),
    ],
)
def test_a_request_that_cannot_run_is_refused_before_any_work(static_artifact, request_kwargs, message, allocated):
    generator = Generator.open(static_artifact, CPU)
    with pytest.raises(RequestError, match=message):
        generator.generate(request_kwargs["prompts"], request_kwargs["config"])
    assert not allocated  # nothing was allocated


def broken_copy(source, tmp_path, damage):
    folder = tmp_path / "artifact"
    shutil.copytree(source, folder)
    damage(folder)
    return folder


def rename_first_past(folder):
    manifest = json.loads((folder / "kvg_config.json").read_text())
    manifest["inputs"][2]["name"] = "past_key_values.0.keys"
    (folder / "kvg_config.json").write_text(json.dumps(manifest))


def from_an_older_exporter(folder):
    manifest = json.loads((folder / "kvg_config.json").read_text())
    manifest["format_version"] = 1  # a static mask then spanned the whole buffer
    (folder / "kvg_config.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda f: shutil.rmtree(f), "is not an artifact folder"),
        (lambda f: (f / "kvg_config.json").unlink(), "has no kvg_config.json"),
        (lambda f: (f / "kvg_config.json").write_text("{not json"), "is not valid JSON"),
        (lambda f: (f / "model.onnx").write_bytes(b"garbage"), "onnxruntime cannot load"),
        (lambda f: (f / "model.onnx").unlink(), "model.onnx is missing"),
        (rename_first_past, "the graph does not match kvg_config.json"),
        (from_an_older_exporter, r"format_version 1; this runtime reads 2: re-export the model"),
    ],
    ids=["missing", "no-manifest", "corrupt-manifest", "corrupt-graph", "no-graph", "manifest-mismatch", "old-format"],
)
def test_a_missing_or_broken_artifact_is_refused_with_a_message(dynamic_artifact, tmp_path, capsys, damage, message):
    folder = broken_copy(dynamic_artifact, tmp_path, damage)
    with pytest.raises(ArtifactError, match=message):
        Generator.open(folder, CPU)
    assert main([str(folder), "--ids", "5,6", "--provider", "cpu"]) == 2
    assert re.search(message, capsys.readouterr().err)


def built_elsewhere(folder):
    manifest = json.loads((folder / "kvg_config.json").read_text())
    manifest["custom_ops"]["platform"] = "darwin-arm64"
    (folder / "kvg_config.json").write_text(json.dumps(manifest))


@pytest.mark.skipif(CPU_FP32_ATTENTION != "fused", reason="the fused operator's library cannot be built here")
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda f: (f / "libkvg_fox_attention.so").unlink(), "libkvg_fox_attention.so is missing"),
        (lambda f: (f / "libkvg_fox_attention.so").write_bytes(b"garbage"), "onnxruntime cannot load .*so"),
        (built_elsewhere, "was built for darwin-arm64 and this machine is linux"),
    ],
    ids=["missing", "corrupt", "other-platform"],
)
def test_a_fused_artifacts_library_that_cannot_load_is_refused_with_the_fix(
    dynamic_artifact, tmp_path, capsys, damage, message
):
    folder = broken_copy(dynamic_artifact, tmp_path, damage)
    with pytest.raises(ArtifactError, match=message):
        Generator.open(folder, CPU)
    assert main([str(folder), "--ids", "5,6", "--provider", "cpu"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "re-export the model on this machine" in err and "--attention gqa" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA, so the request is valid here")
def test_asking_for_cuda_where_there_is_none_is_an_error(exported, capsys):
    portable = exported("fox-pro-tiny", "dynamic", attention="standard")[0].path
    assert main([str(portable), "--ids", "5,6", "--provider", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("attention", "why"),
    [("gqa", "GroupQueryAttention, which onnxruntime runs on CUDA in fp16 and bf16 only"),
     ("fused", "the fused FoX operator, which runs on the CPU")],
)  # fmt: skip
def test_an_fp32_cpu_artifact_is_refused_on_cuda_with_the_fix(exported, capsys, attention, why):
    if attention == "fused" and CPU_FP32_ATTENTION != "fused":
        pytest.skip("the fused operator's library cannot be built here")
    artifact = exported("fox-pro-tiny", "static", attention=attention)[0].path
    assert main([str(artifact), "--ids", "5,6", "--provider", "cuda"]) == 2
    err = capsys.readouterr().err
    assert why in err
    assert "re-export it for CUDA with --provider cuda" in err
    assert "cannot load" not in err  # the artifact is fine; the provider is the problem


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA, where a bf16 artifact runs")
@pytest.mark.parametrize(("provider", "message"), [
    ("cpu", "^this bf16 artifact runs on CUDA only \\(onnxruntime's CPU provider has no bf16 MatMul\\)"),
    ("auto", "^CUDA is not available to onnxruntime here, and this bf16 artifact runs on CUDA only"),
])  # fmt: skip
def test_a_bf16_artifact_is_refused_on_the_cpu_with_the_reason(exported, tmp_path, provider, message):
    """bf16 exports are validated on CUDA only, so the artifact is an fp16 one that says bf16; the refusal
    comes from the manifest, before onnxruntime loads the graph."""
    folder = shutil.copytree(exported("fox-tiny", "static", "fp16")[0].path, tmp_path / "bf16")
    manifest = json.loads((folder / "kvg_config.json").read_text())
    (folder / "kvg_config.json").write_text(json.dumps(manifest | {"dtype": "bfloat16"}))
    with pytest.raises(ArtifactError, match=message + ".*re-export with --dtype fp16"):
        Generator.open(folder, SessionOptions(provider=provider))


def test_a_saved_optimized_graph_is_written_once_and_reused(dynamic_artifact, tmp_path):
    optimized = tmp_path / "optimized.onnx"
    config = GenerationConfig(max_new_tokens=6, min_new_tokens=6)
    plain = Generator.open(dynamic_artifact, CPU).generate(PROMPTS, config)
    first = Generator.open(dynamic_artifact, SessionOptions("cpu", optimized_model_path=optimized))
    assert optimized.is_file()
    written = optimized.stat().st_mtime_ns
    second = Generator.open(dynamic_artifact, SessionOptions("cpu", optimized_model_path=optimized))
    assert optimized.stat().st_mtime_ns == written
    assert first.generate(PROMPTS, config).tokens == second.generate(PROMPTS, config).tokens == plain.tokens


def test_a_prompt_over_a_dynamic_artifacts_configured_limit_is_refused_with_the_fix(
    dynamic_artifact, tmp_path, allocated
):
    """`kvg-export --cache dynamic --max-cache-len N` records a limit the runtime enforces before any work."""

    def limit_to_40(folder):
        manifest = json.loads((folder / "kvg_config.json").read_text())
        manifest["cache"]["max_cache_len"] = 40
        (folder / "kvg_config.json").write_text(json.dumps(manifest))

    generator = Generator.open(broken_copy(dynamic_artifact, tmp_path, limit_to_40), CPU)
    with pytest.raises(RequestError, match=r"needs 43 cache positions, over this artifact's max_cache_len 40; .*"
                       "--max-cache-len"):  # fmt: skip
        generator.generate([list(range(3, 37))], GenerationConfig(max_new_tokens=10))
    assert not allocated
    assert len(generator.generate([list(range(3, 37))], GenerationConfig(max_new_tokens=7)).tokens[0]) == 7
