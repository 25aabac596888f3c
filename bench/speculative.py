"""Speculative decoding by prompt lookup against plain decoding: the trained presets continuing held-out Python.

The presets were trained on the standard library, so their prompts here are other people's code: the first
`--prompt-tokens` tokens of third-party modules this project installs (onnx, httpx, click, starlette). Each
preset's default artifact (dynamic, fp32, the fused operator) continues each prompt greedily for `--new-tokens`
tokens, batch 1, plain and with `--speculative ngram` alternating in one process (each first in turn), after a
warm-up of each; a figure is the median over `--runs` of decode tokens/s, and each speculative run's tokens must
be the plain run's. Then kvg-serve on each preset's static artifact, a server without and one with `--speculative
ngram` up at once, taking turns (each first in turn) at each level of `--clients` of each run: that many clients
at once stream eight requests (two windows of `--serve-prompt-tokens` tokens of each module) of `--new-tokens`
greedy tokens; a figure is the median of all tokens over the level's wall time. A speed-up is the median of the
ratios of runs taken in turn (paired: this machine's speed drifts between minutes).
Writes results/speculative.json and the table in bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from report import publish
from run import RESULTS, artifact, machine
from serve_load import concurrent, server_flags

from runtime.artifact import SessionOptions
from runtime.generator import GenerationConfig, Generator
from runtime.prompt_lookup import PromptLookup
from runtime.serve_process import kvg_serve

BEGIN, END = "<!-- speculative:begin -->", "<!-- speculative:end -->"
PRESETS = ("fox-py", "fox-pro-py")
SERVE_LENGTH = 2048  # the served static artifact's slots: rows of 768 positions at different offsets
LOOKUP = PromptLookup()  # kvg-generate's --speculative ngram
MODULES = ("onnx.helper", "httpx._client", "click.core", "starlette.routing")  # none is in the presets' corpus


def held_out_prompt(generator: Generator, module: str, tokens: int, window: int = 0) -> list[int]:
    """Window `window` of `tokens` tokens of a module's source (0: its first)."""
    source = Path(importlib.util.find_spec(module).origin).read_text()
    return generator.encode(source)[0][window * tokens : (window + 1) * tokens]


def serve_levels(preset: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Tokens/s through kvg-serve at each level of `--clients`, without and with prompt lookup: both servers up
    (after a warm-up run each), taking turns at each level of each run, so that a ratio compares two runs seconds
    apart rather than minutes (this machine's speed drifts by up to 1.5x between minutes), each first in turn."""
    static = artifact(preset, "static", SERVE_LENGTH, "fused")
    levels = args.clients
    systems = {"plain": [], "speculative": ["--speculative", "ngram"]}
    figures = {system: {level: [] for level in levels} for system in systems}
    with contextlib.ExitStack() as servers:
        urls = {system: servers.enter_context(kvg_serve(static, server_flags(max(levels), args.threads, flags)))[1]
                for system, flags in systems.items()}  # fmt: skip
        for url in urls.values():
            asyncio.run(concurrent(url, prompts, levels[0], args.new_tokens))
        for run in range(args.runs):
            for level in levels:
                for system, url in in_turn(urls, run):
                    level_run = asyncio.run(concurrent(url, prompts, level, args.new_tokens))
                    figures[system][level].append(level_run["tokens_per_s"])
    return {f"{level} clients": paired(figures["plain"][level], figures["speculative"][level]) for level in levels}


def in_turn(systems: dict, run: int) -> list[tuple]:
    """The systems' items, the first going last on even runs: each goes first in turn, so no order effect stays."""
    return list(systems.items())[:: 1 if run % 2 else -1]


def paired(plain: list[float], spoken: list[float]) -> dict:
    """Runs taken in turn: each system's figures, and the median and range of the speculative run's over the plain
    run's of the same turn."""
    ratios = [s / p for s, p in zip(spoken, plain, strict=True)]
    return {"plain_tokens_per_s": plain, "speculative_tokens_per_s": spoken, "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)]}  # fmt: skip


def measure(generator: Generator, prompt: list[int], config: GenerationConfig, runs: int) -> dict:
    """Plain and speculative runs alternating, each first in turn, after one of each; their medians, ratio and
    acceptance."""
    settings = {"plain": config, "speculative": replace(config, speculative=LOOKUP)}
    for setting in settings.values():
        generator.generate([prompt], setting)
    plain, spoken, proposed, accepted, identical = [], [], 0, 0, True
    for run in range(runs):
        results = {name: generator.generate([prompt], setting) for name, setting in in_turn(settings, run)}
        base, result = results["plain"], results["speculative"]
        plain.append(base.decode_tokens_per_s)
        spoken.append(result.decode_tokens_per_s)
        proposed, accepted = proposed + result.drafts_proposed, accepted + result.drafts_accepted
        identical &= result.tokens == base.tokens
    return paired(plain, spoken) | {"acceptance": accepted / proposed if proposed else None,
                                    "identical_tokens": identical}  # fmt: skip


def table(results: dict) -> str:
    settings = results["settings"]
    lines = [
        BEGIN,
        "## Speculative decoding: prompt lookup on held-out code",
        "",
        f"`make bench` (bench/speculative.py), {results['machine']['date']}, {results['machine']['cores']} cores: "
        f"each trained preset's default artifact continues the first {settings['prompt_tokens']} tokens of a "
        f"third-party module greedily for {settings['new_tokens']} tokens, batch 1, {settings['threads']} threads, "
        f"plain and `--speculative ngram` ({LOOKUP.tokens} drafts, {LOOKUP.min_ngram}- to {LOOKUP.ngram}-grams) "
        f"alternating, each first in turn; decode tokens/s, medians of {settings['runs']} runs, the speed-up the "
        "median of each pair's ratio; \"same tokens\": every speculative run's tokens were the plain run's.",
        "",
        "| preset | module | plain tok/s | prompt lookup tok/s | speed-up (range) | drafts accepted | same tokens |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for row in results["rows"]:
        low, high = row["ratio_range"]
        rate = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
        lines.append(
            f"| {row['preset']} | {row['module']} | {statistics.median(row['plain_tokens_per_s']):.0f} | "
            f"{statistics.median(row['speculative_tokens_per_s']):.0f} | {row['ratio']:.2f}x ({low:.2f} to "
            f"{high:.2f}) | {rate} | {'yes' if row['identical_tokens'] else 'NO'} |"
        )
    lines += [
        "",
        f"Through kvg-serve (the static artifact of {SERVE_LENGTH} slots, `--max-batch {max(settings['clients'])}`, "
        "every running request speculating, kvg-serve's default with ngram): eight requests of "
        f"{settings['serve_prompt_tokens']} prompt tokens and {settings['new_tokens']} new ones, all tokens over the "
        "level's wall time; both servers up, taking turns at each level, each first in turn; medians of the runs, "
        "the speed-up the median of each turn's ratio:",
        "",
        "| preset | clients | plain tok/s | prompt lookup tok/s | speed-up (range) |",
        "|---|---:|---:|---:|---:|",
    ]
    for preset, levels in results["serve"].items():
        for level, row in levels.items():
            low, high = row["ratio_range"]
            lines.append(
                f"| {preset} | {level.split()[0]} | {statistics.median(row['plain_tokens_per_s']):.0f} | "
                f"{statistics.median(row['speculative_tokens_per_s']):.0f} | {row['ratio']:.2f}x ({low:.2f} to "
                f"{high:.2f}) |"
            )
    return "\n".join([*lines, END])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 8], help="the served levels")
    parser.add_argument("--serve-prompt-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    config = GenerationConfig(args.new_tokens, args.new_tokens)  # every run makes them all
    rows, serve = [], {}
    for preset in PRESETS:
        generator = Generator.open(artifact(preset, "dynamic", None, "fused"), SessionOptions("cpu", args.threads))
        for module in MODULES:
            prompt = held_out_prompt(generator, module, args.prompt_tokens)
            rows.append({"preset": preset, "module": module, **measure(generator, prompt, config, args.runs)})
            print(f"{preset} {module}: {rows[-1]['ratio']:.2f}x", file=sys.stderr)
        served = [held_out_prompt(generator, m, args.serve_prompt_tokens, w) for m in MODULES for w in (0, 1)]
        serve[preset] = serve_levels(preset, served, args)
    settings = {"runs": args.runs, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                "threads": args.threads, "clients": args.clients,
                "serve_prompt_tokens": args.serve_prompt_tokens}  # fmt: skip
    results = {"machine": machine(), "settings": settings, "rows": rows, "serve": serve}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.json").write_text(json.dumps(results, indent=2) + "\n")
    publish(args.out, BEGIN, END, table(results))
    return 0 if all(row["identical_tokens"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
