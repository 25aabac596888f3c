"""`make bench-serve`, after the throughput levels: two workloads that throughput hides.

- A long prompt among running streams: 8 clients stream greedy tokens (a chunk per token: they ask for
  `logprobs: 0`) when a 4,096-token prompt arrives. What each stream waits between two tokens is compared
  with its median wait, for kvg-serve prefilling a chunk of at most --prefill-budget tokens (32, 64, 256)
  between two decode steps. Before that, the streams waited the prompt's whole prefill. Once the prompt has
  joined (its first token out, its row decoding beside theirs over a clock past 4,096 slots), a stream's median
  wait is compared with its median wait before it arrived: each row reads its own window, not the clock's.
- A shared prefix: 16 requests (4 clients) whose prompts share their first 1,024 tokens (a new prefix each run),
  each followed by 32 tokens of its own; time to first token with kvg-serve's prefix cache against without it.

Each configuration is a kvg-serve process of its own on one static artifact of fox-small's (4,608 slots), all
started first; runs take turns in a rotating order, each once the previous server has gone quiet. Writes
results/serve_scenarios.json and the table between the scenario markers of bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from contextlib import ExitStack

import numpy as np
from report import record
from run import add_attention_option, artifact, artifact_vocab, machine, settle
from serve_load import server_flags
from sse_client import Connection

from runtime.serving.serve_process import kvg_serve

BEGIN, END = "<!-- serve-scenarios:begin -->", "<!-- serve-scenarios:end -->"
LENGTH = 4608  # slots: a 4,096-token prompt among 8 streams of 128 + 192 tokens
ROWS = 9
GAP_TARGET = 3.0  # a stream's largest wait between two tokens over its median wait, at most
JOINED_TARGET = 1.3  # a stream's median wait once the long prompt decodes beside it over before it came, at most
LONG_PROMPT_TOKENS = 32  # the long prompt's new tokens: its row decodes among the streams a while
TTFT_TARGET = 0.3  # time to first token with the prefix cache over without, at most


async def stream_times(url: str, prompt: list[int], new_tokens: int, arrived: list[float]) -> None:
    """Append each token's arrival time to `arrived` as its chunk comes."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "min_tokens": new_tokens, "temperature": 0, "stream": True,
            "logprobs": 0}  # fmt: skip
    async with await Connection.open(url) as connection:
        async for chunk in connection.events("/v1/completions", body):
            if isinstance(chunk, dict) and (choices := chunk["choices"]):
                arrived += [time.perf_counter()] * len(choices[0]["logprobs"]["tokens"])


async def long_prompt_among_streams(url: str, vocab: int, seed: int, long_prompt: int, new_tokens: int) -> dict:
    rng = np.random.default_rng(seed)
    streams = [[] for _ in range(8)]
    running = [
        asyncio.create_task(stream_times(url, rng.integers(3, vocab, 128).tolist(), new_tokens, times))
        for times in streams
    ]
    while min(map(len, streams)) < 16 and not all(task.done() for task in running):
        await asyncio.sleep(0.005)
    sent, long_times = time.perf_counter(), []
    await stream_times(url, rng.integers(3, vocab, long_prompt).tolist(), LONG_PROMPT_TOKENS, long_times)
    await asyncio.gather(*running)
    joined = long_times[0]
    ratios, largest, medians, after_over_before = [], [], [], []
    for times in streams:
        arrived = np.array(times)
        gaps = np.diff(arrived)
        medians.append(float(np.median(gaps)))
        largest.append(float(gaps.max()))
        ratios.append(largest[-1] / medians[-1])
        before, after = gaps[arrived[1:] <= sent], gaps[arrived[:-1] > joined]
        after_over_before.append(float(np.median(after) / np.median(before)))
    return {"largest_over_median": max(ratios), "largest_gap_s": max(largest),
            "median_gap_s": statistics.median(medians), "long_prompt_ttft_s": joined - sent,
            "joined_over_before": statistics.median(after_over_before)}  # fmt: skip


async def shared_prefix(url: str, vocab: int, seed: int, prefix: int, requests: int, clients: int) -> dict:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, prefix).tolist()
    waiting = [shared + rng.integers(3, vocab, 32).tolist() for _ in range(requests)]
    ttfts = []

    async def client() -> None:
        while waiting:
            arrived = []
            sent = time.perf_counter()
            await stream_times(url, waiting.pop(), 16, arrived)
            ttfts.append(arrived[0] - sent)

    await asyncio.gather(*(client() for _ in range(clients)))
    return {"ttft_s": ttfts}


def table(results: dict) -> str:
    settings = results["settings"]
    long_rows, prefix_rows = results["long_prompt"], results["shared_prefix"]
    lines = [
        BEGIN,
        f"fox-small static artifact of {LENGTH} slots, server `--max-batch {ROWS}`, {settings['runs']} interleaved "
        f"runs (medians, min to max), onnxruntime {settings['threads']} threads, on "
        f"{results['machine']['cores']} cores.",
        "",
        f"A {settings['long_prompt']}-token prompt arriving among 8 streams of {settings['new_tokens']} greedy tokens:",
        "",
        "| server | a stream's largest wait over its median | largest wait (ms) | median wait (ms) | the long prompt's "
        "first token (s) | median wait once it joined over before |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, runs in long_rows.items():
        ratio, joined = [run["largest_over_median"] for run in runs], [run["joined_over_before"] for run in runs]
        lines.append(
            f"| {name} | {statistics.median(ratio):.1f}x ({min(ratio):.1f} to {max(ratio):.1f}) | "
            f"{statistics.median(r['largest_gap_s'] for r in runs) * 1e3:.0f} | "
            f"{statistics.median(r['median_gap_s'] for r in runs) * 1e3:.0f} | "
            f"{statistics.median(r['long_prompt_ttft_s'] for r in runs):.2f} | "
            f"{statistics.median(joined):.2f}x ({min(joined):.2f} to {max(joined):.2f}) |"
        )
    lines += [
        "",
        f"{settings['prefix_requests']} requests ({settings['prefix_clients']} clients) sharing a "
        f"{settings['prefix']}-token prefix, each with 32 tokens of its own:",
        "",
        "| server | time to first token p50 (ms) | p90 (ms) | p50 over without the cache |",
        "|---|---:|---:|---:|",
    ]
    baseline = [float(np.percentile(run["ttft_s"], 50)) for run in prefix_rows["without prefix cache"]]
    for name, runs in prefix_rows.items():
        p50s = [float(np.percentile(run["ttft_s"], 50)) for run in runs]
        ratios = [p50 / base for p50, base in zip(p50s, baseline, strict=True)]
        p90 = statistics.median(float(np.percentile(run["ttft_s"], 90)) for run in runs)
        lines.append(
            f"| {name} | {statistics.median(p50s) * 1e3:.0f} | {p90 * 1e3:.0f} | {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f} to {max(ratios):.2f}) |"
        )
    lines += ["", f"Targets: a stream's largest wait at most {GAP_TARGET:.0f}x its median; its median wait once "
              f"the long prompt decodes beside it at most {JOINED_TARGET}x before; time to first token p50 at most "
              f"{TTFT_TARGET}x without the prefix cache.", END]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--long-prompt", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--prefix-requests", type=int, default=16)
    parser.add_argument("--prefix-clients", type=int, default=4)
    add_attention_option(parser)
    args = parser.parse_args(argv)
    threads = os.cpu_count()
    folder = artifact("fox-small", "static", LENGTH, args.attention)
    vocab = artifact_vocab(folder)
    configurations = {
        "long": {
            "budget 32": ["--prefill-budget", "32"],
            "budget 64 (default)": ["--prefill-budget", "64"],
            "budget 256": ["--prefill-budget", "256"],
        },
        "prefix": {"without prefix cache": ["--prefix-cache-mb", "0"], "with prefix cache (default)": []},
    }
    results = {
        scenario: {name: [] for name in configurations[kind]}
        for scenario, kind in (("long_prompt", "long"), ("shared_prefix", "prefix"))
    }
    with ExitStack() as running:
        servers = {
            (kind, name): running.enter_context(kvg_serve(folder, server_flags(ROWS, threads, flags)))
            for kind, named in configurations.items()
            for name, flags in named.items()
        }
        order = list(servers)
        for _server, url in servers.values():  # warm-up
            asyncio.run(shared_prefix(url, vocab, 10**6, 64, 2, 2))
        for run in range(args.runs):
            for kind, name in order[run % len(order) :] + order[: run % len(order)]:
                server, url = servers[(kind, name)]
                if kind == "long":
                    figures = asyncio.run(long_prompt_among_streams(url, vocab, run, args.long_prompt, args.new_tokens))
                    results["long_prompt"][name].append(figures)
                    shown = (f"largest wait {figures['largest_over_median']:.1f}x the median, median wait once "
                             f"joined {figures['joined_over_before']:.2f}x before")  # fmt: skip
                else:
                    figures = asyncio.run(shared_prefix(url, vocab, run, args.prefix, args.prefix_requests,
                                                        args.prefix_clients))  # fmt: skip
                    results["shared_prefix"][name].append(figures)
                    shown = f"time to first token p50 {np.percentile(figures['ttft_s'], 50) * 1e3:.0f} ms"
                settle(server.pid)
                print(f"run {run + 1}/{args.runs}: {name}: {shown}", flush=True)
    results = {"machine": machine(), "settings": {**vars(args), "threads": threads}, **results}
    record("serve_scenarios.json", results, BEGIN, END, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
