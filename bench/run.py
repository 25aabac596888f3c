"""`make bench`: eager PyTorch, the onnxruntime runtime and its peers (onnxruntime-genai and optimum-onnx on a
same-size LLaMA), side by side in one run.

Each system runs in its own worker process (bench/worker.py); runs are interleaved (A B C D A B C D ...)
after a warm-up, and each figure is the median of the runs with its min and max. A sweep then times
one decode step against the filled length for the dynamic artifact and static artifacts of several
lengths. Writes results/latest.json, results/*.png and the table in bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARTIFACTS = HERE / ".artifacts"
RESULTS = HERE / "results"
MAIN_STATIC_LENGTH = 512
# Runtime systems: the artifact each runs, as (cache, max_cache_len, attention, quantization). "runtime-dynamic"
# and "runtime-static" are what fp32 exports give by default on the CPU (the fused FoX operator); "-gqa" the same
# through onnxruntime's GroupQueryAttention, as before the operator and where it cannot be built; "-standard" the
# portable graph; "-int8" and "-int4" the default export quantized (`--quantize int8|int4`); "-int4-sym" with symmetric
# weights, onnxruntime-genai's own int4 recipe (its builder writes MatMulNBits without zero points).
RUNTIME_ARTIFACTS = {
    "runtime-dynamic": ("dynamic", None, "fused", None),
    "runtime-dynamic-gqa": ("dynamic", None, "gqa", None),
    "runtime-dynamic-standard": ("dynamic", None, "standard", None),
    "runtime-static": ("static", MAIN_STATIC_LENGTH, "fused", None),
    "runtime-static-gqa": ("static", MAIN_STATIC_LENGTH, "gqa", None),
    "runtime-static-standard": ("static", MAIN_STATIC_LENGTH, "standard", None),
    "runtime-dynamic-int8": ("dynamic", None, "fused", "int8"),
    "runtime-dynamic-int4": ("dynamic", None, "fused", "int4"),
    "runtime-dynamic-int4-sym": ("dynamic", None, "fused", "int4-sym"),
    "runtime-dynamic-int4-sym-gqa": ("dynamic", None, "gqa", "int4-sym"),
    "runtime-dynamic-int4-hqq": ("dynamic", None, "fused", "int4-hqq"),  # float zero points: another kernel path
}
FP32_RUNTIME = "runtime-dynamic"  # what the quantized systems are compared with, round by round
# The peers on a LLaMA of the same size (bench/peers.py), at batch 1: what each system is compared with is
# onnxruntime-genai at the same weight precision.
PEER_SYSTEMS = ("genai-fp32", "genai-int4", "optimum-fp32")
SYSTEMS = ("eager-dynamic", "eager-static", *RUNTIME_ARTIFACTS, *PEER_SYSTEMS, "read-floor")
WORKER_KINDS = ("runtime", "genai", "optimum")  # a system named <kind>-... runs that kind of worker
SWEEP_FILLS = (64, 128, 200, 256, 512, 1024, 2000)
SWEEP_ARTIFACTS = (("dynamic", None, "fused"), ("dynamic", None, "gqa"), ("dynamic", None, "standard"),
                   *(("static", n, "fused") for n in (256, 1024, 2048)), ("static", 2048, "gqa"),
                   ("static", 2048, "standard"))  # fmt: skip
SWEEP_STEPS = 16
QUIET_S = 0.03  # a worker that gains no CPU time for this long (3 clock ticks) has stopped spinning
SETTLE_LIMIT_S = 2.0


def precision(system: str) -> str | None:
    """The weight precision a system runs at, where onnxruntime-genai has it (fp32 or int4)."""
    return "int4" if "int4" in system else None if "int8" in system else "fp32"


class WorkerDied(RuntimeError):
    """A benchmark worker ended without answering (its error, if it had time to print one, is above)."""

    def __init__(self, status: int):
        super().__init__(f"a benchmark worker died (exit status {status}); its error is printed above")
        self.status = status  # negative: the signal that killed it (-9: most likely the kernel, out of memory)


class Worker:
    def __init__(
        self, system: str, target: str, threads: int, python: str = sys.executable, checkout: Path | None = None
    ):  # fmt: skip
        """`checkout`: another checkout of this project whose code the worker runs (its bench/worker.py, its
        packages first on the path), for a before-and-after comparison; None: this one."""
        kind = next((kind for kind in WORKER_KINDS if system.startswith(kind)), system)
        script = HERE / "worker.py" if checkout is None else checkout / "bench" / "worker.py"
        env = None if checkout is None else {**os.environ, "PYTHONPATH": str(checkout.resolve())}
        self.process = subprocess.Popen(
            [python, str(script), kind, target, str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip

    def ask(self, request: dict) -> dict:
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:  # it died between requests (the kernel's out-of-memory killer may pick an idle one)
            raise WorkerDied(self.process.wait()) from None
        line = self.process.stdout.readline()
        if not line:
            raise WorkerDied(self.process.wait())
        self.settle()
        return json.loads(line)

    def settle(self) -> None:
        settle(self.process.pid)

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # a worker that died leaves its last request unsent
            self.process.stdin.close()
        self.process.wait()


def interleaved_runs(
    workers: dict[str, Worker], request: dict, warmup: int, runs: int, lost: dict[str, int] | None = None
) -> dict[str, list[dict]]:
    """Each worker's answers to `request` in `warmup + runs` interleaved rounds (A B C A B C ...), the warm-up
    rounds left out. Where `lost` is given, a worker that dies is named there with its exit status and left out
    of the later rounds (its answers stop short); otherwise its death raises WorkerDied."""
    answers: dict[str, list[dict]] = {name: [] for name in workers}
    for index in range(warmup + runs):
        for name, worker in workers.items():
            if lost is not None and name in lost:
                continue
            try:
                answer = worker.ask(request)
            except WorkerDied as died:
                if lost is None:
                    raise
                lost[name] = died.status
                continue
            if index >= warmup:
                answers[name].append(answer)
    return answers


def interleaved_decode_speeds(workers: dict[str, Worker], rounds: int, new_tokens: int) -> dict[str, list[float]]:
    """Each worker's decode tokens/s at batch 1 (a 128-token prompt) in `rounds` interleaved rounds after a
    warm-up one; the workers are closed after."""
    try:
        answers = interleaved_runs(workers, {"batch": 1, "prompt": 128, "new_tokens": new_tokens}, 1, rounds)
    finally:
        for worker in workers.values():
            worker.close()
    return {name: [answer["decode_tokens_per_s"] for answer in runs] for name, runs in answers.items()}


def settle(pid: int) -> None:
    """Return once a process's threads have stopped spinning. After a run onnxruntime's pool keeps a core
    busy for about 50 ms and torch's OpenMP threads for about 10, which on a 2-core machine would slow
    whichever system runs next (fox-tiny's runtime runs take about 40 ms)."""
    stat = Path(f"/proc/{pid}/stat")
    deadline, busy = time.monotonic() + SETTLE_LIMIT_S, None
    while time.monotonic() < deadline:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        cpu_ticks = int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks (10 ms)
        if cpu_ticks == busy:
            return
        busy = cpu_ticks
        time.sleep(QUIET_S)


def _current_library(folder: Path) -> bool:
    """Whether a fused artifact carries the operator as this checkout builds it (else it is exported anew, so that a
    benchmark never times an old kernel)."""
    from exporters.native.library import LIBRARY_NAME, build

    carried = folder / LIBRARY_NAME
    return carried.is_file() and filecmp.cmp(carried, build(), shallow=False)


def add_attention_option(parser: argparse.ArgumentParser) -> None:
    """`--attention`, how a benchmark's artifacts attend: the same choice in every benchmark that exports."""
    parser.add_argument(
        "--attention", choices=["fused", "gqa"], default="fused",
        help="how the runtime's artifacts attend (fused: the CPU default; gqa: as before the fused operator)",
    )  # fmt: skip


def artifact(
    model: str, cache: str, length: int | None, attention: str, quantize: str | None = None,
    prune: float | str | None = None,
) -> str:  # fmt: skip
    """An exported artifact for the benchmark, made once and kept in bench/.artifacts. A quantized one
    (`quantize` "int8", "int4", "int4-sym" or "int4-hqq") is judged as any quantized export is, against the default
    thresholds; a random-weight preset's on perplexity alone, as its top-1 ranking is noise. `prune`: the log
    pruning tolerance the runtime prunes at (exporters.pipeline.export's AS_CONFIG: the model config's, as `make export`
    prunes; None: it keeps every key, whatever the model's config asks)."""
    from exporters.evaluation.evaluate import Thresholds
    from exporters.pipeline.export import QUALITY_THRESHOLDS, export_artifact
    from exporters.pipeline.options import AS_CONFIG, ExportOptions, QualityOptions
    from exporters.quantization.settings import BITS, Quantization
    from kvg_export.presets import preset_folder
    from runtime.artifact import is_artifact

    parts = [model, cache, *([str(length)] if length else []), attention, *([quantize] if quantize else [])]
    parts += [] if prune is None else ["prune-config" if prune == AS_CONFIG else f"prune{prune:g}"]
    out = ARTIFACTS / "-".join(parts)
    if not is_artifact(out) or (attention == "fused" and not _current_library(out)):
        print(f"exporting {out.name} ...", flush=True)
        quantization, quality = None, QualityOptions()
        if quantize:
            bits, _, variant = quantize.partition("-")
            method = "hqq" if variant == "hqq" else "rtn"
            quantization = Quantization(BITS[bits], method=method, symmetric=variant == "sym")
            if "seed" in json.loads((preset_folder(model) / "preset.json").read_text()):  # random weights
                quality.thresholds = Thresholds(QUALITY_THRESHOLDS[BITS[bits]].max_relative_perplexity_diff, 0.0)
        options = ExportOptions(model, out, cache, "fp32", length, force=True, attention=attention,
                                quantization=quantization, quality=quality, log_pruning_tolerance=prune)  # fmt: skip
        export_artifact(options, log=lambda _: None)
    return str(out)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio(runs: list[dict], baseline: list[dict], key: str = "decode_tokens_per_s") -> dict:
    """A figure (decode speed by default) over the baseline's, taken per interleaved round (both ran under the
    same load)."""
    return spread([r[key] / b[key] for r, b in zip(runs, baseline, strict=True)])


def summary(runs: list[dict]) -> dict:
    """The spread of every figure a worker answered over its runs, and its peak RSS: the worker's peak so far
    (VmHWM only grows), which is this request's own when requests run in ascending size."""
    figures = {key: spread([r[key] for r in runs]) for key in runs[0] if key != "peak_rss_mb"}
    return figures | {"peak_rss_mb": runs[-1]["peak_rss_mb"]}


def compare(model: str, batches: list[int], args, threads: int) -> list[dict]:
    import peers

    chosen = {*args.systems, "eager-dynamic", FP32_RUNTIME} if args.systems else set(SYSTEMS)  # the baselines too
    systems = [system for system in SYSTEMS if system in chosen and (args.peers or system not in PEER_SYSTEMS)]
    targets = {"eager-dynamic": model, "eager-static": model, "read-floor": model}
    targets |= {system: artifact(model, *made) for system, made in RUNTIME_ARTIFACTS.items() if system in systems}
    pythons = {system: sys.executable for system in systems}
    if args.peers and any(system in PEER_SYSTEMS for system in systems):
        targets |= {f"genai-{p}": str(peers.genai_model(model, p, threads)) for p in peers.GENAI_PRECISIONS}
        targets["optimum-fp32"] = str(peers.optimum_model(model, threads))
        pythons |= dict.fromkeys(("genai-fp32", "genai-int4"), str(peers.genai_python()))
    workers = {system: Worker(system, targets[system], threads, pythons[system]) for system in systems}
    rows = []
    try:
        for batch in sorted(batches):
            running = [system for system in systems if batch == 1 or system not in PEER_SYSTEMS]
            request = {"batch": batch, "prompt": args.prompt, "new_tokens": args.new_tokens}
            runs = interleaved_runs({system: workers[system] for system in running}, request, args.warmup, args.runs)
            for system in running:
                # batch 1's peak RSS is its own, as batches run in ascending order
                row = {"model": model, "batch": batch, "system": system, **summary(runs[system])}
                row["decode_vs_eager"] = ratio(runs[system], runs["eager-dynamic"])
                if system in RUNTIME_ARTIFACTS:
                    row["decode_vs_runtime_fp32"] = ratio(runs[system], runs[FP32_RUNTIME])
                genai = f"genai-{precision(system)}"
                if genai in runs and not system.startswith("eager") and system != "read-floor":
                    row["decode_vs_genai"] = ratio(runs[system], runs[genai])
                rows.append(row)
            print(f"{model} batch {batch}: done", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    for row in rows:
        if row["system"] in RUNTIME_ARTIFACTS:
            row |= describe_artifact(Path(targets[row["system"]]))
    return rows


def describe_artifact(folder: Path) -> dict:
    """Its size on disk and, for a quantized one, the quality its export was judged on."""
    from runtime.artifact import read_manifest

    manifest = read_manifest(folder)
    size = sum(path.stat().st_size for path in folder.glob("model.onnx*"))
    return {"model_mb": size / 1e6, "quality": manifest["validation"].get("quality")}


def sweep(model: str, threads: int, runs: int) -> list[dict]:
    """Decode step time against filled length: the dynamic artifact and static ones of several lengths.

    All systems run at once and each filled length is timed in interleaved rounds, so the ratio of two
    artifacts at one length (the static-length target) is taken under the same machine load.
    """
    workers = {system: Worker("runtime", artifact(model, *system), threads) for system in SWEEP_ARTIFACTS}
    points = []
    try:
        for fill in SWEEP_FILLS:
            fitting = [(c, n, a) for c, n, a in SWEEP_ARTIFACTS if n is None or fill + SWEEP_STEPS <= n]
            request = {"batch": 1, "prompt": fill, "new_tokens": SWEEP_STEPS}
            times = {system: [] for system in fitting}
            for index in range(runs + 1):
                for system in fitting:
                    step = workers[system].ask(request)["step_s"]
                    if index:  # the first round warms up
                        times[system].append(step)
            for (cache, length, attention), measured in times.items():
                point = {"cache": cache, "max_cache_len": length, "attention": attention, "filled": fill}
                points.append(point | {"step_s": spread(measured)})
            print(f"sweep {fill} filled: done", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return points


def artifact_vocab(folder: str) -> int:
    """The vocabulary of an artifact's model, for prompts of random ids."""
    from runtime.artifact import read_manifest

    return read_manifest(Path(folder))["model"]["vocab_size"]


def machine() -> dict:
    with open("/proc/cpuinfo") as info:
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    packages = ("torch", "transformers", "onnx", "onnxruntime-gpu", "numpy")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {name: version(name) for name in packages},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--models",
        nargs="+",
        default=["fox-tiny", "fox-mini", "fox-py", "fox-pro-py", "fox-small", "fox-base"],
        help="presets (fox-pro-760m too, opt-in: minutes to export)",
    )
    parser.add_argument(
        "--systems", nargs="+", choices=SYSTEMS, default=[],
        help="run only these (and eager-dynamic and runtime-dynamic, the baselines); default: every system",
    )  # fmt: skip
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--sweep-model", default="fox-small")
    parser.add_argument(
        "--no-peers", dest="peers", action="store_false",
        help="leave out onnxruntime-genai and optimum-onnx (which need environments of their own)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    threads = os.cpu_count()
    results = {
        "machine": machine(),
        "settings": {**vars(args), "threads": threads, "dtype": "fp32", "main_static_length": MAIN_STATIC_LENGTH},
        "compare": [row for model in args.models for row in compare(model, args.batches, args, threads)],
        "sweep": sweep(args.sweep_model, threads, runs=3) if args.sweep_model else [],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    from report import write_report

    print(write_report(results, RESULTS, HERE / "README.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
