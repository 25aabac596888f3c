"""Speculative decoding by prompt lookup against plain decoding: the trained presets continuing held-out Python.

The presets were trained on the standard library, so their prompts here are other people's code: the first
`--prompt-tokens` tokens of third-party modules this project installs (onnx, httpx, click, starlette). Each
preset's default artifact (dynamic, fp32, the fused operator, pruning as its config asks: what `make export` makes)
continues each prompt greedily for `--new-tokens`
tokens, batch 1, plain and with `--speculative ngram` alternating in one process (each first in turn), after a
warm-up of each; a figure is the median over `--runs` of decode tokens/s, and each speculative run's tokens must
be the plain run's. Then kvg-serve on each preset's static artifact (pruning alike), a server without and one with
`--speculative
ngram` up at once, taking turns (each first in turn) at each level of `--clients` of each run: that many clients
at once stream eight requests (two segments of `--serve-prompt-tokens` tokens of each module) of `--new-tokens`
greedy tokens; a figure is the median of all tokens over the level's wall time. Last, beside onnxruntime-genai's
own prompt lookup: fox-py and a LLaMA of its dims trained alike (bench/peer-models/llama-py: the same recipe, text
and tokenizer), run by genai, each continuing the first `--peer-prompt-tokens` of each module (the LLaMA's RoPE
was trained on segments of 512 positions, which prompt and new tokens stay within). A speed-up is the median of the
ratios of runs taken in turn (paired: this machine's speed drifts between minutes).
Writes results/speculative.json and the tables in bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
from peers import genai_python, trained_genai_model
from report import publish
from run import HERE, RESULTS, Worker, artifact, machine
from serve_load import concurrent, server_flags

from exporters.pipeline.options import AS_CONFIG
from runtime.artifact import SessionOptions
from runtime.decode.generator import GenerationConfig, Generator
from runtime.serving.serve_process import kvg_serve
from runtime.speculative.prompt_lookup import PromptLookup

BEGIN, END = "<!-- speculative:begin -->", "<!-- speculative:end -->"
PRESETS = ("fox-py", "fox-pro-py")
SERVE_LENGTH = 2048  # the served static artifact's slots: rows of 768 positions at different offsets
LOOKUP = PromptLookup()  # kvg-generate's --speculative ngram
MODULES = ("onnx.helper", "httpx._client", "click.core", "starlette.routing")  # none is in the presets' corpus
PEER_CHECKPOINT = HERE / "peer-models" / "llama-py"  # the LLaMA of fox-py's dims, trained alike
# onnxruntime-genai's prompt lookup at its best on eight other modules (jinja2.compiler, requests.models,
# urllib3.response, fastapi.routing, pydantic.fields, tqdm.std, yaml.constructor, uvicorn.config) among n-grams of 2
# to 8 and 4 to 16 drafts (its limit), chained lookup and adaptive drafts: geometric mean 2.26x its plain decode,
# where 2-grams and 8 drafts (as this runtime's) gave 1.86x
GENAI_LOOKUP = {"ngram_size": 4, "max_draft_tokens": 16}


def held_out_prompt(generator: Generator, module: str, tokens: int, segment: int = 0) -> list[int]:
    """Segment `segment` of `tokens` tokens of a module's source (0: its first)."""
    source = Path(importlib.util.find_spec(module).origin).read_text()
    return generator.model.encode(source)[0][segment * tokens : (segment + 1) * tokens]


def serve_levels(preset: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Tokens/s through kvg-serve at each level of `--clients`, without and with prompt lookup: both servers up
    (after a warm-up run each), taking turns at each level of each run, so that a ratio compares two runs seconds
    apart rather than minutes (this machine's speed drifts by up to 1.5x between minutes), each first in turn."""
    static = artifact(preset, "static", SERVE_LENGTH, "fused", prune=AS_CONFIG)
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
                for system, url in in_turn(list(urls.items()), run):
                    level_run = asyncio.run(concurrent(url, prompts, level, args.new_tokens))
                    figures[system][level].append(level_run["tokens_per_s"])
    return {f"{level} clients": paired(figures["plain"][level], figures["speculative"][level]) for level in levels}


def in_turn(systems: list, run: int) -> list:
    """The systems, the first going last on even runs: each goes first in turn, so no order effect stays."""
    return systems[:: 1 if run % 2 else -1]


def paired(plain: list[float], spoken: list[float]) -> dict:
    """Runs taken in turn: each system's figures, and the median and range of the speculative run's over the plain
    run's of the same turn."""
    ratios = [s / p for s, p in zip(spoken, plain, strict=True)]
    return {"plain_tokens_per_s": plain, "speculative_tokens_per_s": spoken, "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)]}  # fmt: skip


Decode = Callable[[bool], dict]  # one greedy run, plain or speculative: its tokens/s, tokens, drafts proposed, accepted


def runtime_decode(generator: Generator, prompt: list[int], config: GenerationConfig) -> Decode:
    settings = {False: config, True: replace(config, speculative=LOOKUP)}

    def decode(speculative: bool) -> dict:
        result = generator.generate([prompt], settings[speculative])
        return {"tokens_per_s": result.decode_tokens_per_s, "tokens": result.tokens,
                "proposed": result.drafts_proposed, "accepted": result.drafts_accepted}  # fmt: skip

    return decode


def genai_decode(worker: Worker, request: dict) -> Decode:
    """onnxruntime-genai's generator in its worker (bench/worker.py), plain or with GENAI_LOOKUP."""

    def decode(speculative: bool) -> dict:
        answer = worker.ask(request | {"speculative": GENAI_LOOKUP if speculative else {}})
        return {"tokens_per_s": answer["decode_tokens_per_s"], "tokens": answer["tokens"],
                "proposed": answer.get("drafts_proposed", 0), "accepted": answer.get("drafts_accepted", 0)}  # fmt: skip

    return decode


def measure(systems: dict[str, Decode], runs: int) -> dict[str, dict]:
    """Each system's plain and speculative runs, after one of each: a plain and a speculative run of one system, then
    of the next, each system and each setting first in turn; each system's medians, ratio and acceptance."""
    for decode in systems.values():
        for speculative in (False, True):
            decode(speculative)
    outcomes = {name: {False: [], True: []} for name in systems}
    for run in range(runs):
        for name, decode in in_turn(list(systems.items()), run):
            for speculative in in_turn([False, True], run):
                outcomes[name][speculative].append(decode(speculative))
    figures = {}
    for name, runs_of in outcomes.items():
        plain, spoken = runs_of[False], runs_of[True]
        proposed, accepted = sum(o["proposed"] for o in spoken), sum(o["accepted"] for o in spoken)
        figures[name] = paired([o["tokens_per_s"] for o in plain], [o["tokens_per_s"] for o in spoken]) | {
            "acceptance": accepted / proposed if proposed else None,
            "identical_tokens": all(s["tokens"] == p["tokens"] for p, s in zip(plain, spoken, strict=True)),
        }
    return figures


def beside_genai(generator: Generator, args: argparse.Namespace) -> list[dict]:
    """fox-py's prompt lookup (the runtime, `generator`) and onnxruntime-genai's on the LLaMA of its dims trained
    alike, module by module, both continuing the same prompt ids (one tokenizer)."""
    worker = Worker("genai", str(trained_genai_model(PEER_CHECKPOINT, "fp32", args.threads)), args.threads,
                    str(genai_python()))  # fmt: skip
    config = GenerationConfig(args.new_tokens, args.new_tokens)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            for module in MODULES:
                prompt = held_out_prompt(generator, module, args.peer_prompt_tokens)
                np.save(Path(folder) / "prompt.npy", np.array(prompt))
                request = {"batch": 1, "prompt": len(prompt), "new_tokens": args.new_tokens,
                           "text": str(Path(folder) / "prompt.npy")}  # fmt: skip
                systems = {"runtime": runtime_decode(generator, prompt, config), "genai": genai_decode(worker, request)}
                rows.append({"module": module, **measure(systems, args.runs)})
                print(f"beside genai, {module}: {rows[-1]['runtime']['ratio']:.2f}x against "
                      f"{rows[-1]['genai']['ratio']:.2f}x", file=sys.stderr)  # fmt: skip
    finally:
        worker.close()
    return rows


def accepted(figures: dict) -> str:
    return "-" if figures["acceptance"] is None else f"{figures['acceptance']:.0%}"


def table(results: dict) -> str:
    settings = results["settings"]
    lines = [
        BEGIN,
        "## Speculative decoding: prompt lookup on held-out code",
        "",
        f"`make bench` (bench/speculative.py), {results['machine']['date']}, {results['machine']['cores']} cores: "
        "each trained preset's default artifact (what `make export` makes: dynamic, fp32, the fused operator, "
        "forget-gate pruning at its config's tolerance) continues the first "
        f"{settings['prompt_tokens']} tokens of a third-party module greedily for {settings['new_tokens']} tokens, "
        f"batch 1, {settings['threads']} threads, plain and `--speculative ngram` ({LOOKUP.min_ngram}- to "
        f"{LOOKUP.ngram}-grams, {LOOKUP.tokens} drafts after a match of {LOOKUP.ngram}, that share after a shorter "
        f"one) alternating, each first in turn; decode tokens/s, medians of {settings['runs']} runs, the speed-up the "
        "median of each pair's ratio; \"same tokens\": every speculative run's tokens were the plain run's.",
        "",
        "| preset | module | plain tok/s | prompt lookup tok/s | speed-up (range) | drafts accepted | same tokens |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for row in results["rows"]:
        low, high = row["ratio_range"]
        lines.append(
            f"| {row['preset']} | {row['module']} | {statistics.median(row['plain_tokens_per_s']):.0f} | "
            f"{statistics.median(row['speculative_tokens_per_s']):.0f} | {row['ratio']:.2f}x ({low:.2f} to "
            f"{high:.2f}) | {accepted(row)} | {'yes' if row['identical_tokens'] else 'NO'} |"
        )
    lines += [
        "",
        f"Through kvg-serve (the static artifact of {SERVE_LENGTH} slots, pruning alike, "
        f"`--max-batch {max(settings['clients'])}`, every running request speculating, kvg-serve's default with "
        "ngram): eight requests of "
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
    if results["genai"]:
        lines += [
            "",
            f"Beside onnxruntime-genai's prompt lookup ({', '.join(f'`{k}={v}`' for k, v in GENAI_LOOKUP.items())}): "
            f"fox-py's default artifact through this runtime, and {PEER_CHECKPOINT.name} (bench/peer-models: a LLaMA "
            "of fox-py's dims trained by its recipe on the same text and tokenizer) through genai 0.18, fp32, each "
            f"continuing the first {settings['peer_prompt_tokens']} tokens of each module for "
            f"{settings['new_tokens']}; medians of {settings['runs']} runs as above, plain and prompt lookup taking "
            "turns within each system; 'same' means each system's prompt-lookup tokens were its plain ones:",
            "",
            "| module | fox-py plain tok/s | fox-py lookup | speed-up (range) | accepted | same | "
            f"{PEER_CHECKPOINT.name} genai plain tok/s | genai lookup | speed-up (range) | accepted | same |",
            "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
        ]
        for row in results["genai"]:
            cells = []
            for system in ("runtime", "genai"):
                figures = row[system]
                low, high = figures["ratio_range"]
                cells += [f"{statistics.median(figures['plain_tokens_per_s']):.0f}",
                          f"{statistics.median(figures['speculative_tokens_per_s']):.0f}",
                          f"{figures['ratio']:.2f}x ({low:.2f} to {high:.2f})", accepted(figures),
                          "yes" if figures["identical_tokens"] else "NO"]  # fmt: skip
            lines.append(f"| {row['module']} | {' | '.join(cells)} |")
    return "\n".join([*lines, END])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 8], help="the served levels")
    parser.add_argument("--serve-prompt-tokens", type=int, default=512)
    parser.add_argument("--peer-prompt-tokens", type=int, default=256)
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="leave out onnxruntime-genai")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    config = GenerationConfig(args.new_tokens, args.new_tokens)  # every run makes them all
    rows, serve, genai = [], {}, []
    for preset in PRESETS:
        folder = artifact(preset, "dynamic", None, "fused", prune=AS_CONFIG)
        generator = Generator.open(folder, SessionOptions("cpu", args.threads))
        for module in MODULES:
            prompt = held_out_prompt(generator, module, args.prompt_tokens)
            figures = measure({"runtime": runtime_decode(generator, prompt, config)}, args.runs)["runtime"]
            rows.append({"preset": preset, "module": module, **figures})
            print(f"{preset} {module}: {rows[-1]['ratio']:.2f}x", file=sys.stderr)
        served = [held_out_prompt(generator, m, args.serve_prompt_tokens, s) for m in MODULES for s in (0, 1)]
        serve[preset] = serve_levels(preset, served, args)
        if preset == "fox-py" and args.peers:
            genai = beside_genai(generator, args)
    settings = {"runs": args.runs, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                "threads": args.threads, "clients": args.clients, "serve_prompt_tokens": args.serve_prompt_tokens,
                "peer_prompt_tokens": args.peer_prompt_tokens}  # fmt: skip
    results = {"machine": machine(), "settings": settings, "rows": rows, "serve": serve, "genai": genai}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.json").write_text(json.dumps(results, indent=2) + "\n")
    publish(args.out, BEGIN, END, table(results))
    same = [row["identical_tokens"] for row in rows]
    same += [row[system]["identical_tokens"] for row in genai for system in ("runtime", "genai")]
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
