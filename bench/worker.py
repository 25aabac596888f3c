"""One benchmarked system in a process of its own, so each has its own peak memory.

Reads JSON requests on stdin, one per line, and answers each with one JSON line on stdout. Systems:
`eager-dynamic` and `eager-static` (transformers generate() with the gated caches), `runtime`
(the onnxruntime decode loop on an artifact folder), `read-floor` (no model run: the time to read
once the bytes a decode step must read, about the fastest any step can be where they outgrow the caches),
and the peers on a same-size LLaMA (bench/peers.py): `genai` (onnxruntime-genai, run by the interpreter of
its own environment) and `optimum` (optimum-onnx's ORTModelForCausalLM).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time

import numpy as np


def prompts(vocab: int, batch: int, length: int, text: str | None = None) -> list[list[int]]:
    """`batch` prompts of `length` tokens: the first of the token ids saved in `text` (.npy) for every row, or
    random ids where there is no text."""
    if text is None:
        return np.random.default_rng(0).integers(3, vocab, (batch, length)).tolist()
    ids = np.load(text)
    if len(ids) < length:
        raise ValueError(f"{text} holds {len(ids)} tokens, fewer than a {length}-token prompt")
    return [ids[:length].tolist()] * batch


def eager_runner(model_name: str, cache: str, threads: int):
    import torch

    from kvg_export.presets import load_model

    torch.set_num_threads(threads)
    return generate_runner(load_model(model_name), {"cache_implementation": "static"} if cache == "static" else {})


def optimum_runner(folder: str, threads: int):
    """optimum-onnx's ORTModelForCausalLM on its export of a same-size LLaMA, with transformers' generate()."""
    import onnxruntime as ort
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    torch.set_num_threads(threads)  # torch only processes the logits here
    settings = ort.SessionOptions()
    settings.intra_op_num_threads, settings.inter_op_num_threads = threads, 1
    model = ORTModelForCausalLM.from_pretrained(folder, provider="CPUExecutionProvider", session_options=settings)
    return generate_runner(model, {})


def generate_runner(model, options: dict):
    """Time transformers' generate() on `model`: the first token, then the decode."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        """generate() hands the streamer the prompt first, then each new token: the second call is the first token."""

        def __init__(self):
            self.calls, self.at = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                self.at = time.perf_counter()

        def end(self):
            pass

    def run(batch: int, prompt: int, new_tokens: int, text: str | None = None) -> dict:
        ids = torch.tensor(prompts(model.config.vocab_size, batch, prompt, text), device=model.device)
        streamer = FirstToken()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0, streamer=streamer, **options,
            )  # fmt: skip
        end = time.perf_counter()
        return {"ttft_s": streamer.at - start, "decode_tokens_per_s": batch * (new_tokens - 1) / (end - streamer.at)}

    return run


def genai_runner(folder: str, threads: int):
    """onnxruntime-genai's own generator loop on its model builder's output (threads set at build time). With
    `speculative` (genai's speculative options, e.g. prompt lookup's `ngram_size` and `max_draft_tokens`; {} for
    none) the answer also holds the new tokens, and with options the drafts genai proposed and accepted."""
    import onnxruntime_genai as og

    model = og.Model(folder)
    with open(f"{folder}/genai_config.json") as config:
        vocab = json.load(config)["model"]["vocab_size"]

    def run(batch: int, prompt: int, new_tokens: int, text: str | None = None, speculative: dict | None = None) -> dict:
        if batch != 1:
            raise ValueError("the onnxruntime-genai peer runs batch 1 only")
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=prompt + new_tokens, min_length=prompt + new_tokens, do_sample=False)
        if speculative:
            params.set_speculative_options(**speculative)
        start = time.perf_counter()
        generator = og.Generator(model, params)
        generator.append_tokens(np.array(prompts(vocab, 1, prompt, text), dtype=np.int32))
        generator.generate_next_token()
        first = time.perf_counter()
        produced = 1
        while not generator.is_done():
            generator.generate_next_token()
            produced += 1
        end = time.perf_counter()
        if produced != new_tokens:
            raise RuntimeError(f"onnxruntime-genai produced {produced} tokens, not {new_tokens}")
        answer = {"ttft_s": first - start, "decode_tokens_per_s": (new_tokens - 1) / (end - first)}
        if speculative is not None:
            answer["tokens"] = generator.get_sequence(0)[prompt:].tolist()
        if speculative:
            stats = generator.get_speculative_stats()
            answer["drafts_proposed"], answer["drafts_accepted"] = (stats["draft_tokens_proposed"],
                                                                    stats["draft_tokens_accepted"])  # fmt: skip
        return answer

    return run


def runtime_runner(artifact: str, threads: int):
    from runtime.artifact import SessionOptions
    from runtime.decode.generator import GenerationConfig, Generator

    generator = Generator.open(artifact, SessionOptions(provider="cpu", intra_op_threads=threads))

    def run(batch: int, prompt: int, new_tokens: int, text: str | None = None) -> dict:
        config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        result = generator.generate(prompts(generator.model.artifact.vocab_size, batch, prompt, text), config)
        steps = new_tokens - 1
        decode_s = result.wall_s - result.time_to_first_token_s
        return {
            "ttft_s": result.time_to_first_token_s,
            "decode_tokens_per_s": result.decode_tokens_per_s,
            "step_s": decode_s / steps,
            "step_onnxruntime_s": result.decode_onnxruntime_s / steps,
            "step_loop_s": (decode_s - result.decode_onnxruntime_s) / steps,
        }

    return run


def read_floor_runner(model_name: str, threads: int):
    """A decode step reads every weight but the embedding table (one row of it) and the cache up to its
    filled length; torch's vectorized sum over that many bytes is how fast this machine reads them."""
    import torch

    from kvg_export.presets import load_model

    torch.set_num_threads(threads)
    model = load_model(model_name)
    config = model.config
    embedding = model.get_input_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
    del model
    floats_per_position = config.num_hidden_layers * (2 * config.kv_heads * config.head_dim + config.num_heads)

    def run(batch: int, prompt: int, new_tokens: int, text: str | None = None) -> dict:  # a step reads no text
        mean_filled = prompt + new_tokens // 2
        step_bytes = weight_bytes + batch * mean_filled * floats_per_position * 4  # float32 keys, values, gates
        data = torch.ones(step_bytes // 4)
        times = []
        for _ in range(new_tokens - 1):
            start = time.perf_counter()
            data.sum()
            times.append(time.perf_counter() - start)
        step = statistics.median(times)
        return {"decode_tokens_per_s": batch / step, "step_s": step, "step_bytes": step_bytes}

    return run


def peak_memory_mb() -> float:
    """This process's peak resident memory (VmHWM): unlike getrusage's ru_maxrss it starts afresh at exec,
    so the parent's memory before spawning this worker does not count."""
    with open("/proc/self/status") as status:
        return int(re.search(r"VmHWM:\s+(\d+) kB", status.read()).group(1)) / 1024


def main() -> int:
    system, target, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if system == "runtime":
        run = runtime_runner(target, threads)
    elif system == "read-floor":
        run = read_floor_runner(target, threads)
    elif system == "genai":
        run = genai_runner(target, threads)
    elif system == "optimum":
        run = optimum_runner(target, threads)
    else:
        run = eager_runner(target, system.split("-")[1], threads)
    for line in sys.stdin:
        request = json.loads(line)
        answer = run(**request)
        answer["peak_rss_mb"] = peak_memory_mb()
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
