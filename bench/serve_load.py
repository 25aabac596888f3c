"""`make bench-serve`: kvg-serve under 1, 8 and 32 concurrent streaming clients, against the same requests
run one after another through the Generator that `kvg-generate` runs, in one interleaved run.

The server (a `kvg-serve` process on the model's static artifact) and the sequential baseline (in this
process, on the dynamic artifact `make export` makes by default) take turns, in a rotating order, each run.
So does a third system: the Generator over the server's static artifact taking the 8-client level's requests
--batch at a time, each batch in one call (all its rows start and end together, no HTTP): what the batched
decode step itself gives, against which the server's scheduling and HTTP work can be read.
Every request is a random prompt of --prompt tokens and exactly --new-tokens greedy new ones. Each client
sends its requests one after another over a stream (a closed loop), so a level keeps that many requests in
flight. Throughput is all tokens generated over the level's wall time; time to first token is from sending
a request to its first streamed text, time per output token the rest of the request's time over its
remaining tokens (both as a client sees them). Writes results/serve.json and the table in README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from contextlib import AsyncExitStack

import numpy as np
from report import record
from run import add_attention_option, artifact, machine, settle, spread
from sse_client import Connection

from runtime.artifact import SessionOptions
from runtime.decode.generator import GenerationConfig, Generator
from runtime.serving.serve_process import kvg_serve

BEGIN, END = "<!-- serve:begin -->", "<!-- serve:end -->"
STATIC_LENGTH = 512  # room for a 128-token prompt and 128 new tokens, with rows at different offsets
TARGET_AT_8 = 4.0  # total tokens/s at 8 clients over the sequential figure (issue 33)
BATCHED = "batches in one call (Generator, static artifact)"


def workload(count: int, vocab: int, prompt: int, seed: int) -> list[list[int]]:
    return np.random.default_rng(seed).integers(3, vocab, (count, prompt)).tolist()


def sequential(generator: Generator, prompts: list[list[int]], new_tokens: int, batch: int = 1) -> dict:
    """The prompts through `generator`, `batch` at a time in one call, one call after another."""
    config = GenerationConfig(new_tokens, new_tokens)
    start, ttfts, tpots = time.perf_counter(), [], []
    for first in range(0, len(prompts), batch):
        rows = len(prompts[first : first + batch])
        result = generator.generate(prompts[first : first + batch], config)
        ttfts += [result.time_to_first_token_s] * rows
        tpots += [rows / result.decode_tokens_per_s] * rows  # each step yields a token of every row
    wall = time.perf_counter() - start
    return {"tokens_per_s": len(prompts) * new_tokens / wall, "ttft_s": ttfts, "tpot_s": tpots}


async def one_request(connection: Connection, prompt: list[int], new_tokens: int) -> tuple[float, float, int]:
    body = {"prompt": prompt, "max_tokens": new_tokens, "min_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    sent, first, tokens = time.perf_counter(), None, 0
    async for chunk in connection.events("/v1/completions", body):
        if isinstance(chunk, dict) and chunk["choices"] and first is None:
            first = time.perf_counter()
        if isinstance(chunk, dict) and chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return first - sent, (end - first) / max(tokens - 1, 1), tokens


async def concurrent(url: str, prompts: list[list[int]], clients: int, new_tokens: int) -> dict:
    """`clients` streams at once, each taking the next waiting prompt when its last request ends."""
    waiting = list(reversed(prompts))
    results = []

    async def client(connection: Connection) -> None:
        while waiting:
            results.append(await one_request(connection, waiting.pop(), new_tokens))

    async with AsyncExitStack() as connections:
        opened = [await connections.enter_async_context(await Connection.open(url)) for _ in range(clients)]
        start = time.perf_counter()
        await asyncio.gather(*(client(connection) for connection in opened))
        wall = time.perf_counter() - start
    assert all(tokens == new_tokens for _ttft, _tpot, tokens in results), "a request ended early"
    return {
        "tokens_per_s": sum(tokens for *_rest, tokens in results) / wall,
        "ttft_s": [ttft for ttft, _tpot, _tokens in results],
        "tpot_s": [tpot for _ttft, tpot, _tokens in results],
    }


def server_flags(max_batch: int, threads: int, flags: list[str]) -> list[str]:
    """kvg-serve's flags for a benchmark: its rows, a queue that holds every client, the CPU and its threads."""
    return ["--max-batch", str(max_batch), "--max-queue", "256", "--provider", "cpu", "--threads", str(threads), *flags]


def percentiles(values: list[float]) -> dict:
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def summarize(name: str, runs: list[dict], baseline: list[dict]) -> dict:
    ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, baseline, strict=True)]
    return {
        "system": name,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "tokens_per_s_runs": [r["tokens_per_s"] for r in runs],
        "vs_sequential": spread(ratios),
        "ttft_s": percentiles([v for r in runs for v in r["ttft_s"]]),
        "tpot_s": percentiles([v for r in runs for v in r["tpot_s"]]),
    }


def table(results: dict) -> str:
    settings = results["settings"]
    lines = [
        BEGIN,
        f"{settings['model']}, prompts of {settings['prompt']} tokens, {settings['new_tokens']} greedy new tokens "
        f"each, {settings['runs']} interleaved runs (medians; latency percentiles over every request of every "
        f"run); server `--max-batch {settings['max_batch']}`, onnxruntime {settings['threads']} threads, "
        f"on {results['machine']['cores']} cores.",
        "",
        "| system | clients | requests | tokens/s | vs sequential (min to max) | TTFT p50 / p99 (ms) "
        "| per token p50 / p99 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        ttft, tpot, ratio = row["ttft_s"], row["tpot_s"], row["vs_sequential"]
        lines.append(
            f"| {row['system']} | {row['clients']} | {row['requests']} | {row['tokens_per_s']:.0f} | "
            f"{ratio['median']:.2f}x ({ratio['min']:.2f} to {ratio['max']:.2f}) | "
            f"{ttft['p50'] * 1e3:.0f} / {ttft['p99'] * 1e3:.0f} | "
            f"{tpot['p50'] * 1e3:.1f} / {tpot['p99'] * 1e3:.1f} |"
        )
    at_8 = next((row for row in results["rows"] if row["clients"] == 8 and row["system"] == "kvg-serve"), None)
    if at_8:
        ratio = at_8["vs_sequential"]
        met = "met" if ratio["median"] >= TARGET_AT_8 else "not met"
        runs = "in every run" if ratio["min"] >= TARGET_AT_8 else "not in every run"
        lines += [
            "",
            f"Target: at 8 clients, {TARGET_AT_8:.0f}x the sequential tokens/s: {met} by the median ({runs}).",
        ]
    batched = next((row for row in results["rows"] if row["system"] == BATCHED), None)
    if batched:
        lines.append(
            f"Batches of {batched['clients']} in one call each, without scheduling or HTTP: "
            f"{batched['vs_sequential']['median']:.2f}x."
        )
    return "\n".join([*lines, END])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="fox-small")
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=0, help="per level (default: twice its clients, at least 8)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=16, help="the server's rows (the artifact's max batch)")
    parser.add_argument("--batch", type=int, default=8, help="rows of the Generator's batched calls (0: none)")
    parser.add_argument("--server-flags", default="", help='more kvg-serve flags, e.g. "--max-queue 8"')
    add_attention_option(parser)
    args = parser.parse_args(argv)
    threads = os.cpu_count()
    static = artifact(args.model, "static", STATIC_LENGTH, args.attention)
    generator = Generator.open(artifact(args.model, "dynamic", None, args.attention), SessionOptions("cpu", threads))
    batched = Generator.open(static, SessionOptions("cpu", threads)) if args.batch else None
    vocab = generator.model.artifact.vocab_size
    counts = {c: args.requests or max(2 * c, 8) for c in [*args.clients, args.batch]}
    levels = ["sequential", *(["batch"] if args.batch else []), *args.clients]
    runs: dict = {level: [] for level in levels}
    with kvg_serve(static, server_flags(args.max_batch, threads, args.server_flags.split())) as (server, url):
        asyncio.run(concurrent(url, workload(2, vocab, args.prompt, seed=10**6), 2, args.new_tokens))  # warm-up
        sequential(generator, workload(1, vocab, args.prompt, seed=2**31), args.new_tokens)
        for run in range(args.runs):
            for level in levels[run % len(levels) :] + levels[: run % len(levels)]:
                prompts = workload(counts.get(level, 8), vocab, args.prompt, seed=run)
                if level == "sequential":
                    runs[level].append(sequential(generator, prompts, args.new_tokens))
                    settle(os.getpid())
                elif level == "batch":
                    prompts = workload(counts[args.batch], vocab, args.prompt, seed=run)
                    runs[level].append(sequential(batched, prompts, args.new_tokens, args.batch))
                    settle(os.getpid())
                else:
                    runs[level].append(asyncio.run(concurrent(url, prompts, level, args.new_tokens)))
                    settle(server.pid)
                print(f"run {run + 1}/{args.runs}: {level}: {runs[level][-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    baseline = runs["sequential"]
    rows = [{**summarize("sequential (Generator, dynamic artifact)", baseline, baseline), "clients": 1, "requests": 8}]
    if args.batch:
        rows.append({**summarize(BATCHED, runs["batch"], baseline), "clients": args.batch,
                     "requests": counts[args.batch]})  # fmt: skip
    rows += [{**summarize("kvg-serve", runs[c], baseline), "clients": c, "requests": counts[c]} for c in args.clients]
    results = {"machine": machine(), "settings": {**vars(args), "threads": threads}, "rows": rows}
    record("serve.json", results, BEGIN, END, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
