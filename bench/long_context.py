"""`make bench-long`: time to first token, decode speed and peak memory against the prompt's length, from 512
to 32,768 tokens, for the runtime on a static and on a dynamic artifact and for onnxruntime-genai (fp32) on a
same-size LLaMA built for as long a context.

Long prompts are where a gated cache's prefill and memory part ways with a plain one, and `make bench`'s
128-token prompt never gets there. The prompts are held-out text by default, whose forget gates are what
pruning meets in use. Each system runs in a worker process of its own (bench/worker.py) that
takes the prompt lengths in ascending order, so the peak RSS read after a length's runs is that length's
(VmHWM only grows). At each length the systems run interleaved (A B C A B C ...), after a warm-up at the first; each
figure is the median with min and max. A length a system cannot hold (past its artifact's max_cache_len or
genai's context_length) is skipped, and a worker that dies (out of memory, most likely) is left out of the
longer prompts; the table says which. Writes long_context.json and long_context.png under --out, and, when
--out is the default, the table in bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import matplotlib
import matplotlib.ticker
import numpy as np
from report import fmt_spread, publish
from run import RESULTS, Worker, add_attention_option, artifact, interleaved_runs, machine, ratio, summary
from tokenizers import Tokenizer

from kvg_export.corpus import read_split, token_stream
from kvg_export.presets import preset_folder
from runtime.artifact import read_manifest
from runtime.cache.pruning import parse_tolerance

matplotlib.use("Agg")
import matplotlib.pyplot as plt

GENAI = "genai-fp32"
PRUNED = ("runtime-static-pruned", "runtime-dynamic-pruned")  # the runtime with forget-gate pruning
SYSTEMS = ("runtime-static", "runtime-dynamic", *PRUNED, GENAI)
DEFAULT_PROMPTS = (512, 4096, 16384, 32768)
BEGIN, END = "<!-- long:begin -->", "<!-- long:end -->"
PROMPT_IDS = {"text": "prompts of held-out text (the stdlib corpus's test split)", "random": "random prompt ids"}
STYLES = ("-", "--", ":", "-.")  # a line style per model in the plot


def capacity(folder: Path) -> int | None:
    """The most positions (prompt and new tokens) an artifact or a genai model holds; None where the runtime
    sets no limit (a dynamic artifact exported without --max-cache-len)."""
    genai = folder / "genai_config.json"
    if genai.is_file():
        return json.loads(genai.read_text())["model"]["context_length"]
    return read_manifest(folder)["cache"]["max_cache_len"]


def fits(prompt: int, new_tokens: int, limit: int | None) -> bool:
    """Whether a prompt and its new tokens fit in `limit` positions (None: no limit); genai asks for all of
    them (its max_length), the runtime for one fewer (the last token is never fed back)."""
    return limit is None or prompt + new_tokens <= limit


def targets(
    model: str, context: int, peers: bool, threads: int, prune: float | None, attention: str
) -> dict[str, tuple[str, str]]:  # fmt: skip
    """Each system's folder and the interpreter its worker runs in; made once, then reused. The runtime's
    artifacts attend as `attention` says and keep every key, and with `prune` (a log pruning tolerance) also drop
    what it allows."""
    python = sys.executable
    made = {
        "runtime-static": (artifact(model, "static", context, attention), python),
        "runtime-dynamic": (artifact(model, "dynamic", None, attention), python),
    }
    if prune is not None:
        made[PRUNED[0]] = (artifact(model, "static", context, attention, prune=prune), python)
        made[PRUNED[1]] = (artifact(model, "dynamic", None, attention, prune=prune), python)
    if peers:
        import peers as peer_models

        genai = peer_models.genai_model(model, "fp32", threads, context)
        made[GENAI] = (str(genai), str(peer_models.genai_python()))
    return made


def held_out_ids(model: str, length: int, folder: Path) -> str:
    """The first `length` tokens of held-out text (the stdlib corpus's test split, longest documents first, as
    bench/kept_keys.py reads it) in `model`'s tokenizer, saved in `folder` for the workers; the path.

    A trained model's forget gates on text are what pruning keeps or drops in use; on random ids they differ
    (fox-pro-py's neediest layer keeps about 14k of 16k random positions, 9k of 16k text ones)."""
    preset = preset_folder(model)
    eos = json.loads((preset / "config.json").read_text()).get("eos_token_id")
    tokenizer = Tokenizer.from_file(str(preset / "tokenizer.json"))
    ids = token_stream(tokenizer, read_split("test"), eos, longest_first=True)[:length]
    if len(ids) < length:
        raise SystemExit(f"the held-out text has {len(ids)} {model} tokens, not {length}: use --prompt-ids random")
    path = folder / f"{model}.npy"
    np.save(path, ids)
    return str(path)


def measure(model: str, args: argparse.Namespace, threads: int, folder: Path) -> list[dict]:
    """One row per prompt length and system: its figures, or why it was not run at that length (`folder`: where
    the prompt's token ids are saved for the workers)."""
    context = max(args.prompts) + args.new_tokens
    text = held_out_ids(model, max(args.prompts), folder) if args.prompt_ids == "text" else None
    made = targets(model, context, args.peers, threads, args.prune, args.attention)
    limits = {system: capacity(Path(folder)) for system, (folder, _) in made.items()}
    workers = {system: Worker(system, folder, threads, python) for system, (folder, python) in made.items()}
    lost: dict[str, int] = {}  # system -> its worker's exit status
    rows = []
    try:
        for prompt in sorted(args.prompts):
            fitting, at_length = {}, []
            for system in workers:
                where = {"model": model, "prompt": prompt, "system": system}
                if system in lost:
                    at_length.append(where | {"skipped": "its worker died at a shorter prompt"})
                elif not fits(prompt, args.new_tokens, limits[system]):
                    needed = prompt + args.new_tokens
                    at_length.append(where | {"skipped": f"needs {needed} positions, holds {limits[system]}"})
                else:
                    fitting[system] = workers[system]
            request = {"batch": 1, "prompt": prompt, "new_tokens": args.new_tokens, "text": text}
            warmup = args.warmup if prompt == min(args.prompts) else 0  # a worker's first runs are what warm up
            runs = interleaved_runs(fitting, request, warmup, args.runs, lost)
            at_length += rows_at(model, prompt, runs, {system: lost[system] for system in fitting if system in lost})
            rows += sorted(at_length, key=lambda row: SYSTEMS.index(row["system"]))
            print(f"{model}, prompt {prompt}: done", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return rows


def rows_at(model: str, prompt: int, runs: dict[str, list[dict]], died: dict[str, int]) -> list[dict]:
    """The rows of one prompt length from each system's runs (`died`: the systems whose worker died at this
    length, with its exit status); ratios to genai's run in the same round."""
    rows = []
    for system, answers in runs.items():
        row = {"model": model, "prompt": prompt, "system": system}
        if system in died:
            killed = " (killed: out of memory?)" if died[system] == -9 else ""
            rows.append(row | {"skipped": f"its worker died here, exit status {died[system]}{killed}"})
            continue
        row |= summary(answers)
        if GENAI in runs and GENAI not in died:
            row["ttft_vs_genai"] = ratio(answers, runs[GENAI], "ttft_s")
            row["decode_vs_genai"] = ratio(answers, runs[GENAI])
        rows.append(row)
    return rows


def table(results: dict) -> str:
    lines = [
        "| model | prompt tokens | system | TTFT s | decode tok/s | peak RSS MB | TTFT vs genai | decode vs genai |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        where = f"| {row['model']} | {row['prompt']} | {row['system']} |"
        if "skipped" in row:
            lines.append(f"{where} not run: {row['skipped']} | | | | |")
            continue
        versus = [fmt_spread(row[key], digits=2) if key in row else "" for key in ("ttft_vs_genai", "decode_vs_genai")]
        lines.append(
            f"{where} {fmt_spread(row['ttft_s'], digits=2)} | {fmt_spread(row['decode_tokens_per_s'])} | "
            f"{row['peak_rss_mb']:.0f} | {versus[0]} | {versus[1]} |"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """TTFT, decode tokens/s and peak RSS against the prompt's length (log scale): a line per model and system,
    the median with the min-to-max range as error bars."""
    measured = [row for row in results["rows"] if "skipped" not in row]
    panels = (("ttft_s", "time to first token, s", "log"), ("decode_tokens_per_s", "decode tokens/s", "linear"),
              ("peak_rss_mb", "peak RSS, MB", "log"))  # fmt: skip
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5))
    models = list(dict.fromkeys(row["model"] for row in measured))
    colors = {system: f"C{index}" for index, system in enumerate(SYSTEMS)}
    for axis, (key, label, scale) in zip(axes, panels, strict=True):
        for model, style in zip(models, STYLES, strict=False):
            for system in SYSTEMS:
                points = [row for row in measured if (row["model"], row["system"]) == (model, system)]
                if not points:
                    continue
                x = [row["prompt"] for row in points]
                if key == "peak_rss_mb":
                    axis.plot(x, [row[key] for row in points], style, marker="o", color=colors[system])
                    continue
                middle = [row[key]["median"] for row in points]
                error = [[m - row[key]["min"] for m, row in zip(middle, points, strict=True)],
                         [row[key]["max"] - m for m, row in zip(middle, points, strict=True)]]  # fmt: skip
                axis.errorbar(x, middle, error, fmt=style, marker="o", color=colors[system], capsize=3)
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted({row["prompt"] for row in measured}), minor=False)
        axis.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%d"))
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        axis.set_yscale(scale)
        if scale == "log":  # labels at 1, 2 and 5 of each decade, as plain numbers
            axis.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
            axis.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            axis.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xlabel("prompt tokens (log scale)")
        axis.set_ylabel(label)
        axis.grid(True, which="major", alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[s], marker="o", label=s) for s in SYSTEMS]
    handles += [plt.Line2D([], [], color="gray", linestyle=s, label=m) for m, s in zip(models, STYLES, strict=False)]
    axes[0].legend(handles=handles, fontsize=8)
    settings = results["settings"]
    figure.suptitle(f"batch 1, fp32, {settings['new_tokens']} new tokens, {settings['threads']} threads")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def report(results: dict) -> str:
    """The README section: how the run was made, the table and the plot."""
    settings, machine_info = results["settings"], results["machine"]
    return "\n".join(
        [
            BEGIN,
            f"Run {machine_info['date']} on {machine_info['cpu']} ({machine_info['cores']} cores, "
            f"{settings['threads']} threads): batch 1, fp32, {PROMPT_IDS[settings['prompt_ids']]}, "
            f"{settings['new_tokens']} greedy new "
            f"tokens, median (min to max) of {settings['runs']} interleaved runs after {settings['warmup']} "
            f"warm-up round(s) at the shortest prompt; static artifact and genai context {settings['context']} "
            "positions. vs genai: the "
            "figure over onnxruntime-genai's in the same round (TTFT above 1 is slower, decode above 1 faster).",
            "",
            table(results),
            "",
            "![long context](results/long_context.png)",
            END,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["fox-small", "fox-pro-py"])
    parser.add_argument("--prompts", nargs="+", type=int, default=list(DEFAULT_PROMPTS), help="prompt lengths")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="warm-up rounds, at the shortest prompt length (a worker's first runs are what warm up)",
    )
    parser.add_argument(
        "--new-tokens", type=int, default=256,
        help="greedy tokens generated after each prompt: a round's decode lasts that many steps of each system",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-ids", choices=sorted(PROMPT_IDS), default="text",
        help="the prompts' tokens: held-out text (realistic forget gates) or random ids",
    )  # fmt: skip
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="leave out onnxruntime-genai")
    add_attention_option(parser)
    parser.add_argument(
        "--prune", type=parse_tolerance, default=-10.0, metavar="X|none",
        help="the log pruning tolerance of the runtime's pruned systems (none: leave them out)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=RESULTS,
        help="folder for long_context.json and .png; bench/README.md's table is rewritten only for the default",
    )  # fmt: skip
    args = parser.parse_args(argv)
    threads = os.cpu_count()
    context = max(args.prompts) + args.new_tokens
    settings = {**vars(args), "out": str(args.out), "threads": threads, "dtype": "fp32", "context": context}
    if args.peers:
        from peers import RUNTIME_PACKAGES

        settings["genai_packages"] = list(RUNTIME_PACKAGES)
    results = {"machine": machine(), "settings": settings}
    with tempfile.TemporaryDirectory() as folder:
        results["rows"] = [row for model in args.models for row in measure(model, args, threads, Path(folder))]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long_context.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / "long_context.png")
    text = report(results)
    publish(args.out, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
