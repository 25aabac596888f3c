"""`make bench-serve`, last: what a JSON schema costs a streamed token. One kvg-serve process over a static
fox-small artifact answers greedy streams of 128 tokens with `structured_outputs` (a schema of an array of objects
with a string, an enum and an integer each, at least 64 of them: the answer is held to the schema throughout) and
without (min_tokens 128), in turns: one client at a time, then 8 clients at once. A stream's per-token decode time
is the time from its first token to its last over the tokens between; a run's figure is the median over its
streams. Writes results/serve_structured.json and the table between the markers of bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import numpy as np
from report import record
from run import add_attention_option, artifact, artifact_vocab, machine, settle
from serve_load import server_flags
from sse_client import Connection

from runtime.serving.serve_process import kvg_serve

BEGIN, END = "<!-- serve-structured:begin -->", "<!-- serve-structured:end -->"
LENGTH = 1024
NEW_TOKENS = 128
PROMPT_TOKENS = 64
TARGET = 1.15  # per-token decode time with the schema over without, at most
SCHEMA = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "kind": {"enum": ["module", "class", "function"]},
                       "lines": {"type": "integer"}},
        "required": ["name", "kind", "lines"],
        "additionalProperties": False,
    },
}  # fmt: skip


async def per_token_s(url: str, prompt: list[int], constrained: bool) -> float:
    """A greedy stream's time from its first token to its last, over the tokens between."""
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True, "logprobs": 0}
    body.update({"structured_outputs": {"json": SCHEMA}} if constrained else {"min_tokens": NEW_TOKENS})
    arrived = []
    async with await Connection.open(url) as connection:
        async for chunk in connection.events("/v1/completions", body):
            if isinstance(chunk, dict) and (choices := chunk["choices"]):
                arrived += [time.perf_counter()] * len(choices[0]["logprobs"]["tokens"])
    if len(arrived) != NEW_TOKENS:
        raise RuntimeError(f"a stream ended after {len(arrived)} of {NEW_TOKENS} tokens")
    return (arrived[-1] - arrived[0]) / (len(arrived) - 1)


async def clients_at_once(url: str, prompts: list[list[int]], constrained: bool) -> float:
    """The median per-token decode time of streams that all run at once."""
    return statistics.median(await asyncio.gather(*(per_token_s(url, prompt, constrained) for prompt in prompts)))


def table(results: dict) -> str:
    settings = results["settings"]
    lines = [
        BEGIN,
        f"fox-small static artifact, server `--max-batch 8`, greedy streams of {NEW_TOKENS} tokens after "
        f"{PROMPT_TOKENS}-token prompts, {settings['runs']} interleaved runs (medians, min to max), onnxruntime "
        f"{settings['threads']} threads, on {results['machine']['cores']} cores.",
        "",
        "| clients | per-token decode, free (ms) | with a JSON schema (ms) | schema over free |",
        "|---:|---:|---:|---:|",
    ]
    for clients, runs in results["rows"].items():
        free, held = [run["free_s"] for run in runs], [run["schema_s"] for run in runs]
        ratios = [h / f for h, f in zip(held, free, strict=True)]
        lines.append(
            f"| {clients} | {statistics.median(free) * 1e3:.2f} | {statistics.median(held) * 1e3:.2f} | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f} to {max(ratios):.2f}) |"
        )
    lines += ["", f"Target: at most {TARGET}x at 1 and at 8 clients.", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4, help="streams one after another at 1 client, per side")
    add_attention_option(parser)
    args = parser.parse_args(argv)
    threads = os.cpu_count()
    folder = artifact("fox-small", "static", LENGTH, args.attention)
    vocab = artifact_vocab(folder)
    rng = np.random.default_rng(0)
    rows = {"1": [], "8": []}
    with kvg_serve(folder, server_flags(8, threads, [])) as (server, url):
        prompt = lambda: rng.integers(3, vocab, PROMPT_TOKENS).tolist()  # noqa: E731
        asyncio.run(clients_at_once(url, [prompt() for _ in range(2)], True))  # warm-up: the schema compiled once
        for run in range(args.runs):
            order = (False, True) if run % 2 == 0 else (True, False)
            figures = {}
            for constrained in order:
                sequential = [asyncio.run(per_token_s(url, prompt(), constrained)) for _ in range(args.requests)]
                figures[("1", constrained)] = statistics.median(sequential)
                settle(server.pid)
                figures[("8", constrained)] = asyncio.run(clients_at_once(url, [prompt() for _ in range(8)],
                                                                          constrained))  # fmt: skip
                settle(server.pid)
            for clients in rows:
                rows[clients].append({"free_s": figures[(clients, False)], "schema_s": figures[(clients, True)]})
            print(f"run {run + 1}/{args.runs}: " + ", ".join(
                f"{clients} client(s) {figures[(clients, True)] / figures[(clients, False)]:.2f}x" for clients in rows
            ), flush=True)  # fmt: skip
    results = {"machine": machine(), "settings": {**vars(args), "threads": threads}, "rows": rows}
    record("serve_structured.json", results, BEGIN, END, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
