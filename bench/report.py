"""The readable side of a benchmark run: a markdown table with the targets marked, and PNG plots."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib
import matplotlib.ticker
from run import HERE, RESULTS, precision

matplotlib.use("Agg")
import matplotlib.pyplot as plt

TARGET_RATIOS = {"fox-small": 4.0, "fox-tiny": 13.0}  # fp32 runtime decode tokens/s over eager's, batch 1
QUANTIZED_SPEEDUP = {"runtime-dynamic-int4": 2.5}  # fox-small, batch 1: decode over the fp32 runtime's
# decode over onnxruntime-genai's at the same precision, batch 1: the fused operator's artifacts 1.1x (issue 51)
GENAI_PARITY = {
    "runtime-dynamic": 1.1,
    "runtime-static": 1.1,
    "runtime-dynamic-int4": 1.0,
    "runtime-dynamic-int4-sym": 1.1,
}  # batch 1, vs genai
LOOP_SHARE = 0.05  # the loop's own time as a share of a fox-small step
STATIC_SLOWDOWN = 1.25  # step at 200 filled: max_cache_len 2048 over max_cache_len 256
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def table_row(*cells) -> str:
    """A markdown table's row of `cells`."""
    return f"| {' | '.join(map(str, cells))} |"


def fmt_spread(spread: dict, scale: float = 1.0, digits: int = 1) -> str:
    """A spread as "median (min to max)", each times `scale`."""
    low, mid, high = (spread[k] * scale for k in ("min", "median", "max"))
    return f"{mid:.{digits}f} ({low:.{digits}f} to {high:.{digits}f})"


def table(results: dict) -> str:
    lines = [
        "| model | batch | system | decode tok/s | vs eager dynamic | vs runtime fp32 | vs genai (same precision) "
        "| first token ms | step ms (onnxruntime + loop) | peak RSS MB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["compare"]:
        first = fmt_spread(row["ttft_s"], 1e3) if "ttft_s" in row else ""  # the read floor has no first token
        fp32 = f"{row['decode_vs_runtime_fp32']['median']:.2f}x" if "decode_vs_runtime_fp32" in row else ""
        genai = fmt_spread(row["decode_vs_genai"], digits=2) if "decode_vs_genai" in row else ""
        split = ""
        if "step_loop_s" in row:
            step, inside, loop = (row[k]["median"] * 1e3 for k in ("step_s", "step_onnxruntime_s", "step_loop_s"))
            split = f"{step:.2f} ({inside:.2f} + {loop:.2f})"
        elif "step_s" in row:
            split = f"{row['step_s']['median'] * 1e3:.2f} (reads {row['step_bytes']['median'] / 1e6:.1f} MB)"
        lines.append(
            f"| {row['model']} | {row['batch']} | {row['system']} | {fmt_spread(row['decode_tokens_per_s'])} | "
            f"{row['decode_vs_eager']['median']:.2f}x | {fp32} | {genai} | {first} | {split} | "
            f"{row['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


def quantized(results: dict) -> list[str]:
    """Size and judged quality of each quantized artifact beside its fp32 one."""
    lines = []
    for row in results["compare"]:
        quality = row.get("quality")
        if row["batch"] != 1 or not quality:
            continue
        fp32 = _row(results, row["model"], 1, "runtime-dynamic")
        lines.append(
            f"- {row['model']}, {row['system']}: {row['model_mb']:.1f} MB (fp32 {fp32['model_mb']:.1f} MB), "
            f"perplexity {quality['relative_perplexity_diff']:+.2%} against eager fp32, top-1 agreement "
            f"{quality['top1_agreement']:.2%} ({quality['predicted_tokens']:,} held-out tokens)"
        )
    return lines


def _step(results: dict, cache: str, length, attention: str, filled: int) -> float | None:
    for point in results["sweep"]:
        if (point["cache"], point["max_cache_len"], point["attention"], point["filled"]) == (
            cache, length, attention, filled,
        ):  # fmt: skip
            return point["step_s"]["median"]
    return None


def _row(results: dict, model: str, batch: int, system: str) -> dict | None:
    return next(
        (r for r in results["compare"] if (r["model"], r["batch"], r["system"]) == (model, batch, system)), None
    )


def targets(results: dict) -> list[str]:
    marks = []
    for model, wanted in TARGET_RATIOS.items():
        best = max(
            (
                r
                for r in results["compare"]
                if r["model"] == model
                and r["batch"] == 1
                and r["system"].startswith("runtime")
                and "int" not in r["system"]
            ),
            key=lambda r: r["decode_vs_eager"]["median"],
            default=None,
        )
        if best is not None:
            ratio = best["decode_vs_eager"]["median"]
            met = "met" if ratio >= wanted else "not met"
            floor = _row(results, model, 1, "read-floor")
            bound = ""
            if floor is not None:
                bound = (
                    f"; reading a step's bytes once allows {floor['decode_vs_eager']['median']:.2f}x, and the "
                    f"step takes {best['step_s']['median'] / floor['step_s']['median']:.2f}x that read"
                )
            marks.append(
                f"- {model}, batch 1: runtime decode at least {wanted:g}x eager: **{met}** "
                f"({ratio:.2f}x, {best['system']}{bound})"
            )
    for system, wanted in QUANTIZED_SPEEDUP.items():
        row = _row(results, "fox-small", 1, system)
        if row is not None:
            speedup = row["decode_vs_runtime_fp32"]
            met = "met" if speedup["median"] >= wanted else "not met"
            marks.append(
                f"- fox-small, batch 1: {system} decode at least {wanted:g}x the fp32 runtime's: **{met}** "
                f"({speedup['median']:.2f}x, {speedup['min']:.2f} to {speedup['max']:.2f} over the rounds)"
            )
    for model in sorted({r["model"] for r in results["compare"]}):
        for system, wanted in GENAI_PARITY.items():
            row = _row(results, model, 1, system)
            if row is not None and "decode_vs_genai" in row:
                versus = row["decode_vs_genai"]
                met = "met" if versus["median"] >= wanted else "not met"
                marks.append(
                    f"- {model}, batch 1: {system} decode at least {wanted:g}x onnxruntime-genai's "
                    f"{precision(system)} on the same-size LLaMA: **{met}** ({fmt_spread(versus, digits=2)})"
                )
    for row in results["compare"]:
        if row["model"] == "fox-small" and row["batch"] == 1 and "step_loop_s" in row:
            share = row["step_loop_s"]["median"] / row["step_s"]["median"]
            met = "met" if share < LOOP_SHARE else "not met"
            marks.append(
                f"- fox-small, {row['system']}: loop's own time under {LOOP_SHARE:.0%} of a step: **{met}** "
                f"({share:.1%})"
            )
    long, short = _step(results, "static", 2048, "fused", 200), _step(results, "static", 256, "fused", 200)
    if long and short:
        met = "met" if long / short <= STATIC_SLOWDOWN else "not met"
        marks.append(
            f"- static (fused) step at 200 filled, max_cache_len 2048 vs 256, at most {STATIC_SLOWDOWN}x: **{met}** "
            f"({long / short:.2f}x)"
        )
    at_2000 = {
        label: _step(results, cache, length, attention, 2000)
        for label, (cache, length, attention) in {
            "dynamic fused": ("dynamic", None, "fused"),
            "dynamic gqa": ("dynamic", None, "gqa"),
            "dynamic standard": ("dynamic", None, "standard"),
            "static 2048 fused": ("static", 2048, "fused"),
            "static 2048 gqa": ("static", 2048, "gqa"),
            "static 2048 standard": ("static", 2048, "standard"),
        }.items()
    }
    if all(at_2000.values()):
        steps = ", ".join(f"{label} {step * 1e3:.2f} ms" for label, step in at_2000.items())
        marks.append(f"- step at 2000 filled: {steps}")
    return marks


def plots(results: dict, folder: Path) -> None:
    models = sorted({r["model"] for r in results["compare"]})
    columns = min(2, len(models))
    rows = -(-len(models) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(7 * columns, 4.2 * rows), squeeze=False)
    for axis, model in zip(axes.flat, models, strict=False):
        measured = [r for r in results["compare"] if r["model"] == model and r["system"] != "read-floor"]
        systems = list(dict.fromkeys(r["system"] for r in measured))
        batches = sorted({r["batch"] for r in measured})
        height = 0.8 / len(batches)
        for index, batch in enumerate(batches):
            speeds = {r["system"]: r["decode_tokens_per_s"]["median"] for r in measured if r["batch"] == batch}
            places = [i + index * height for i in range(len(systems))]
            axis.barh(places, [speeds.get(system, 0) for system in systems], height, label=f"batch {batch}")
        axis.set_yticks([i + 0.4 - height / 2 for i in range(len(systems))], systems, fontsize=8)
        axis.invert_yaxis()
        axis.set_xscale("log")
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only: minor labels collide
        axis.set_xlabel("decode tokens/s (median, log scale)")
        axis.set_title(model)
        axis.legend(fontsize=8)
    for axis in list(axes.flat)[len(models) :]:
        axis.remove()
    figure.tight_layout()
    figure.savefig(folder / "tokens_per_s.png", dpi=110)
    plt.close(figure)
    if not results["sweep"]:
        return
    figure, axis = plt.subplots(figsize=(7, 4))
    series = sorted({(p["cache"], p["max_cache_len"] or 0, p["attention"]) for p in results["sweep"]})
    for cache, length, attention in series:
        points = [p for p in results["sweep"] if (p["cache"], p["max_cache_len"] or 0, p["attention"]) == (
            cache, length, attention,
        )]  # fmt: skip
        label = f"dynamic {attention}" if cache == "dynamic" else f"static {length} {attention}"
        axis.plot([p["filled"] for p in points], [p["step_s"]["median"] * 1e3 for p in points], marker="o", label=label)
    axis.set_xlabel("filled positions")
    axis.set_ylabel("decode step, ms (median)")
    axis.set_xscale("log")
    axis.legend()
    axis.set_title("step time against filled length")
    figure.tight_layout()
    figure.savefig(folder / "step_time.png", dpi=110)
    plt.close(figure)


def write_report(results: dict, folder: Path, readme: Path) -> str:
    """Write the plots and the README's results section; return the markdown."""
    plots(results, folder)
    settings, machine = results["settings"], results["machine"]
    text = "\n".join(
        [
            BEGIN,
            f"Run {machine['date']} on {machine['cpu']} ({machine['cores']} cores, {settings['threads']} threads), "
            f"fp32 activations, prompt {settings['prompt']}, {settings['new_tokens']} new tokens, median (min to max) "
            f"of {settings['runs']} interleaved runs after {settings['warmup']} warm-up; static artifacts "
            f"{settings['main_static_length']} long.",
            "",
            table(results),
            "",
            "Targets:",
            *targets(results),
            "",
            "Quantized artifacts (the default export with `--quantize`, judged at export on held-out text):",
            "",
            *quantized(results),
            "",
            "![decode tokens/s](results/tokens_per_s.png) ![step time](results/step_time.png)",
            END,
        ]
    )
    replace_section(readme, BEGIN, END, text)
    return text


def replace_section(readme: Path, begin: str, end: str, text: str) -> None:
    """Put `text` (which starts with `begin` and ends with `end`) where those markers are, or at the end."""
    current = readme.read_text() if readme.is_file() else ""
    pattern = re.compile(re.escape(begin) + ".*" + re.escape(end), re.S)
    updated = pattern.sub(lambda _: text, current) if begin in current else current + "\n" + text + "\n"
    readme.write_text(updated)


def record(name: str, results: dict, begin: str, end: str, text: str) -> None:
    """Write a run's results to results/`name` (JSON) and its table into bench/README.md, and print the table."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / name).write_text(json.dumps(results, indent=2) + "\n")
    replace_section(HERE / "README.md", begin, end, text)
    print(text)


def publish(out: Path, begin: str, end: str, text: str) -> None:
    """Print a benchmark's README section, and put it in bench/README.md when its results went to the default
    folder (a run elsewhere is a trial, not the record)."""
    if out.resolve() == RESULTS.resolve():
        replace_section(HERE / "README.md", begin, end, text)
    print(text)
