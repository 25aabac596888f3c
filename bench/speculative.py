"""Speculative decoding by prompt lookup against plain decoding: the trained presets continuing held-out Python.

The presets were trained on the standard library, so their prompts here are other people's code: the first
`--prompt-tokens` tokens of third-party modules this project installs (onnx, httpx, click, starlette). Each
preset's default artifact (dynamic, fp32, the fused operator) continues each prompt greedily for `--new-tokens`
tokens, batch 1, plain and with `--speculative ngram` alternating in one process, after a warm-up of each; a
figure is the median over `--runs` of decode tokens/s, and each speculative run's tokens must be the plain run's.
Writes results/speculative.json and the table in bench/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from report import publish
from run import RESULTS, artifact, machine

from runtime.artifact import SessionOptions
from runtime.generator import GenerationConfig, Generator
from runtime.prompt_lookup import PromptLookup

BEGIN, END = "<!-- speculative:begin -->", "<!-- speculative:end -->"
PRESETS = ("fox-py", "fox-pro-py")
MODULES = ("onnx.helper", "httpx._client", "click.core", "starlette.routing")  # none is in the presets' corpus


def held_out_prompt(generator: Generator, module: str, tokens: int) -> list[int]:
    """The first `tokens` tokens of a module's source."""
    source = Path(importlib.util.find_spec(module).origin).read_text()
    return generator.encode(source)[0][:tokens]


def measure(generator: Generator, prompt: list[int], config: GenerationConfig, runs: int) -> dict:
    """Plain and speculative runs alternating, after one of each; their medians, ratio and acceptance."""
    speculative = replace(config, speculative=PromptLookup())
    generator.generate([prompt], config), generator.generate([prompt], speculative)
    plain, spoken, proposed, accepted, identical = [], [], 0, 0, True
    for _ in range(runs):
        base = generator.generate([prompt], config)
        result = generator.generate([prompt], speculative)
        plain.append(base.decode_tokens_per_s)
        spoken.append(result.decode_tokens_per_s)
        proposed, accepted = proposed + result.drafts_proposed, accepted + result.drafts_accepted
        identical &= result.tokens == base.tokens
    ratios = [s / p for s, p in zip(spoken, plain, strict=True)]
    return {
        "plain_tokens_per_s": plain,
        "speculative_tokens_per_s": spoken,
        "ratio": statistics.median(spoken) / statistics.median(plain),
        "ratio_range": [min(ratios), max(ratios)],
        "acceptance": accepted / proposed if proposed else None,
        "identical_tokens": identical,
    }


def table(results: dict) -> str:
    settings = results["settings"]
    lines = [
        BEGIN,
        "## Speculative decoding: prompt lookup on held-out code",
        "",
        f"`make bench` (bench/speculative.py), {results['machine']['date']}, {results['machine']['cores']} cores: "
        f"each trained preset's default artifact continues the first {settings['prompt_tokens']} tokens of a "
        f"third-party module greedily for {settings['new_tokens']} tokens, batch 1, {settings['threads']} threads, "
        f"plain and `--speculative ngram` (8 drafts, 2-grams) alternating; decode tokens/s, medians of "
        f"{settings['runs']} runs; \"same tokens\": every speculative run's tokens were the plain run's.",
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
    return "\n".join([*lines, END])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    config = GenerationConfig(args.new_tokens, args.new_tokens)  # every run makes them all
    rows = []
    for preset in PRESETS:
        generator = Generator.open(artifact(preset, "dynamic", None, "fused"), SessionOptions("cpu", args.threads))
        for module in MODULES:
            prompt = held_out_prompt(generator, module, args.prompt_tokens)
            rows.append({"preset": preset, "module": module, **measure(generator, prompt, config, args.runs)})
            print(f"{preset} {module}: {rows[-1]['ratio']:.2f}x", file=sys.stderr)
    settings = {"runs": args.runs, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                "threads": args.threads}  # fmt: skip
    results = {"machine": machine(), "settings": settings, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.json").write_text(json.dumps(results, indent=2) + "\n")
    publish(args.out, BEGIN, END, table(results))
    return 0 if all(row["identical_tokens"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
