"""Parity validation, run at every export: onnxruntime against eager PyTorch and the ExportedProgram, step by step.

A left-padded batch is prefilled and then decoded greedily. The export's torch half (references.py) runs eager
and the ExportedProgram, feeding both eager's tokens, and records eager's logits and present tensors and the
program's differences from them; here, once torch and its model have returned their memory, onnxruntime runs the
same inputs (each system carrying its own cache, present fed back as past) and is compared with what eager gave.
An export whose differences pass the dtype's tolerance is good. Torch-free: the exporter's own process runs it.

A gqa dynamic graph is run by onnxruntime twice per step: as the contract says (past exactly as long as
the filled positions) and as the runtime runs it (key, value and gate buffers longer than that, which
present keeps), so both are checked against the same eager step.

A graph that takes window_offsets (forget-gate pruning) runs a layer whose heads' windows are staggered (each
head's starting at its own offset) in other branches than one whose heads start together
(exporters/graph/translations.py); the runtime feeds them once pruning has dropped slots. So such a graph is also run
with every layer's heads staggered, through each of those branches (`StaggeredRun`), on the cache the runtime
would hold, and compared with eager given the same offsets.

A fused FoX-Pro graph also outputs each new token's shift states (exporters/graph/passes/shift_states.py), which a
speculative run resumes from: they are compared with eager's state after each token of the step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from exporters.progress import Progress, untracked
from runtime.contract import LOGITS_TO_KEEP, WINDOW_OFFSETS, CacheLayout

PROMPT_LENGTH, DECODE_STEPS, PADDING = 8, 16, 3
STAGGER_SHIFT, STAGGER_CHUNK = 2, 3  # the most slots a head drops before a StaggeredRun; the prompt chunk it feeds
MIN_STATIC_LENGTH = PROMPT_LENGTH + DECODE_STEPS + 1  # the ExportedProgram takes windows shorter than the buffer
# Largest difference from eager accepted per dtype (logits and every cache tensor), as max |Δ| over
# max(1, max |eager|): a model's rounding error grows with its values, and with its depth and width.
# fp32, measured (eager against eager with another thread count, batch shape or sequence length, and exports
# against eager): eager's own noise reaches 2.1e-7 of the logits' scale on fox-tiny, 1.1e-6 on fox-base and
# 2.9e-6 on fox-pro-760m (24 layers of 1536), and exports stay within 4e-6 of it; 1e-4 leaves that 30x of room
# for larger models while an error of 0.1% in one weight still fails (tests/test_export_artifact.py).
# fp16: eager fp16 itself differs from eager fp32 by 1.3e-2 on the trained fox-py, whose logits reach 15.5,
# where one fp16 step is 7.8e-3; fp16 exports differ by at most 3.9e-3 (fox-gqa-tiny cache; the trained
# presets' logits 1.0e-3). bf16 cannot run on onnxruntime's CPU provider, so its figure is not yet measured:
# 8x fp16's, for bf16's 3 fewer mantissa bits.
TOLERANCES = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 8e-2}
HALF_PRECISION = ("float16", "bfloat16")  # where two nearly tied tokens may swap (see greedy_disagreement)
MEASURE = "max |Δ| / max(1, max |eager|)"


@dataclass
class StepReport:
    step: str  # "prefill", "decode N", or with the heads staggered "masked N", "unmasked N" or "chunk N"
    program_logits: float
    onnx_logits: float
    worst_present: str
    worst_present_diff: float
    tokens_agree: bool


@dataclass
class ValidationReport:
    dtype: str
    tolerance: float
    batch: int
    prompt_length: int
    decode_steps: int
    steps: list[StepReport] = field(default_factory=list)
    failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None

    def summary(self) -> dict:
        return {
            "passed": self.passed,
            "max_program_logits_diff": max(s.program_logits for s in self.steps),
            "max_onnx_logits_diff": max(s.onnx_logits for s in self.steps),
            "max_present_diff": max(s.worst_present_diff for s in self.steps),
            "greedy_tokens_agree": all(s.tokens_agree for s in self.steps),
            "tolerance": self.tolerance,
            "measure": MEASURE,
        }

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    def table(self) -> str:
        lines = [f"{'step':<10} {'logits Δ program':>17} {'logits Δ onnx':>14} {'worst present Δ':>16}  tokens"]
        for s in self.steps:
            present = f"{s.worst_present_diff:.2e} {s.worst_present}"
            agree = "agree" if s.tokens_agree else "DIFFER"
            lines.append(f"{s.step:<10} {s.program_logits:>17.2e} {s.onnx_logits:>14.2e} {present:>16}  {agree}")
        return "\n".join([*lines, f"Δ: {MEASURE}, as {self.dtype}'s tolerance {self.tolerance:.0e} measures it"])


def difference(got, want) -> float:
    """How far `got` is from eager's `want`, as the tolerances measure it (see TOLERANCES)."""
    got, want = np.asarray(got, dtype=np.float32), np.asarray(want, dtype=np.float32)
    if not want.size:
        return 0.0
    return float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))


def validation_prompt(vocab_size: int, batch: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Random ids `[batch, PROMPT_LENGTH]` (int64), the first row left-padded by PADDING positions when batch > 1."""
    ids = np.random.default_rng(0).integers(0, vocab_size, (batch, PROMPT_LENGTH), dtype=np.int64)
    mask = np.ones((batch, PROMPT_LENGTH), dtype=np.int64)
    if batch > 1:
        ids[0, :PADDING], mask[0, :PADDING] = pad_id, 0
    return ids, mask


@dataclass
class EagerStep:
    """One step as the torch half saw it: the graph's first inputs (input_ids, attention_mask, and a static
    cache's cache_position), eager's logits and present tensors (float32; a present cut to the positions filled so
    far, the only ones attention reads), and how far the ExportedProgram's logits and presents were from eager's."""

    feed: list[np.ndarray]
    logits: np.ndarray
    presents: list[np.ndarray]
    program_logits: float
    program_presents: list[float]
    offsets: np.ndarray | None = None  # the window_offsets fed, where the graph takes them
    # each new token's shift states `[batch, seq, width]`, layout.shift_state_names()'s order (FoX-Pro's token shift)
    shift_states: list[np.ndarray] = field(default_factory=list)


@dataclass
class StaggeredRun:
    """Steps with each layer's heads staggered (their window_offsets in each step's `offsets`), the cache they start
    from (eager's, after a prefill with the heads together and each head's first `offsets` slots dropped), and
    the branch each step is meant to take ("masked", "unmasked" or "chunk")."""

    pasts: list[np.ndarray]
    steps: list[EagerStep]
    branches: list[str]


@dataclass
class References:
    """What onnxruntime is compared with: eager's run of the validation (references.record), and each onnxruntime
    system's empty past (shape and numpy dtype per past input): "onnx" as the contract feeds it, "onnx-last" with
    logits_to_keep 1 as the runtime prefills, "onnx-longer" (gqa dynamic graphs) with buffers longer than filled."""

    dtype: str
    layout: CacheLayout
    batch: int
    starts: dict[str, list[tuple[tuple[int, ...], str]]]
    steps: list[EagerStep] = field(default_factory=list)
    staggered: list[StaggeredRun] = field(default_factory=list)


def validate_onnx(references: References, session, progress: Progress | None = None) -> ValidationReport:
    """Run onnxruntime `session` through the recorded steps, each system on its own cache, and compare it with
    eager's outputs (and take the ExportedProgram's recorded differences into the report); then through each
    StaggeredRun, as the runtime runs the graph. Each step is a unit of `progress`."""
    dtype, layout = references.dtype, references.layout
    report = ValidationReport(dtype, TOLERANCES[dtype], references.batch, PROMPT_LENGTH, DECODE_STEPS)
    pasts = {system: [np.zeros(shape, dtype=kind) for shape, kind in start]
             for system, start in references.starts.items()}  # fmt: skip
    labels = ["prefill", *(f"decode {index}" for index in range(1, len(references.steps)))]
    runs = [(pasts, zip(labels, references.steps, strict=True))]
    for run in references.staggered:  # as the runtime binds the buffers
        runs.append(({"onnx": list(run.pasts)}, zip(_numbered(run.branches), run.steps, strict=True)))
    keep_last = {LOGITS_TO_KEEP: np.ones(1, dtype=np.int64)}
    shifts = layout.shift_state_names()  # a fused FoX-Pro graph's each-token states
    presents = slice(1, len(layout.output_names()))  # of a run's outputs, what the next step takes as its past
    progress = progress or untracked()
    progress.plan(len(references.steps) + sum(len(run.steps) for run in references.staggered), "steps validated")
    for pasts, steps in runs:
        for label, step in steps:
            offsets = {} if step.offsets is None else {WINDOW_OFFSETS: step.offsets}
            outputs = {
                system: session.run(
                    layout.output_names() + shifts,
                    dict(zip(layout.input_names(), step.feed + past, strict=True))
                    | (keep_last if system == "onnx-last" else {})
                    | offsets,
                )
                for system, past in pasts.items()
            }
            entry, eager_next, onnx_next = _compared(label, step, list(outputs.values()), layout, shifts)
            report.steps.append(entry)
            failure = _failure(entry, step.logits[:, -1], eager_next, onnx_next, report.tolerance)
            report.failure = report.failure or failure
            pasts = {system: _as_pasts(run[presents], pasts[system]) for system, run in outputs.items()}
            progress.advance()
    return report


def _numbered(branches: list[str]) -> list[str]:
    """Labels for a StaggeredRun's steps: "masked 1", "masked 2", ..."""
    return [f"{branch} {branches[: index + 1].count(branch)}" for index, branch in enumerate(branches)]


def _compared(label: str, step: EagerStep, runs: list[list[np.ndarray]], layout: CacheLayout, shifts: list[str]):
    """How far each system's outputs `runs` are from eager's in `step` (the presents, then each new token's shift
    states `shifts` where eager recorded them), with eager's next tokens and each system's."""
    diffs = {
        name: max(program, *(difference(_filled(run[output], want), want) for run in runs))
        for output, (name, want, program) in enumerate(
            zip(layout.present_names(), step.presents, step.program_presents, strict=True), 1
        )
    }
    first = len(layout.output_names())
    for output, (name, want) in enumerate(zip(shifts, step.shift_states if shifts else [], strict=True), first):
        diffs[name] = max(difference(run[output], want) for run in runs)
    worst = max(diffs, key=diffs.get)
    eager_next, onnx_next = step.logits[:, -1].argmax(-1), [run[0][:, -1].argmax(-1) for run in runs]
    entry = StepReport(
        label,
        step.program_logits,
        max(difference(run[0], step.logits[:, -run[0].shape[1] :]) for run in runs),
        worst,
        diffs[worst],
        all(np.array_equal(eager_next, chosen) for chosen in onnx_next),
    )
    return entry, eager_next, onnx_next


def _as_pasts(presents: list[np.ndarray], pasts: list[np.ndarray]) -> list[np.ndarray]:
    """A step's presents as the next step's pasts: a present whose heads came folded into rows
    (exporters/graph/passes/window_offsets.py) in its past's `[batch, kv_heads, ...]` shape, the same memory."""
    return [present.reshape(past.shape[:2] + present.shape[2:]) for present, past in zip(presents, pasts, strict=True)]


def _filled(present: np.ndarray, want: np.ndarray) -> np.ndarray:
    """A present key, value or gate in eager's shape: unfolded, and cut to eager's length (a static or longer
    buffer keeps its length)."""
    if present.ndim < 3:
        return present
    return present.reshape(want.shape[:2] + present.shape[2:])[:, :, : want.shape[2]]


def _failure(entry: StepReport, logits: np.ndarray, eager_next, onnx_next: list, tolerance: float) -> str | None:
    """Why this step fails, or None. A greedy flip is a failure only where eager's margin exceeds the noise."""
    if entry.program_logits > tolerance:
        return f"{entry.step}: ExportedProgram logits differ by {entry.program_logits:.2e} > {tolerance:.0e}"
    if entry.onnx_logits > tolerance:
        return f"{entry.step}: onnxruntime logits differ by {entry.onnx_logits:.2e} > {tolerance:.0e}"
    if entry.worst_present_diff > tolerance:
        return f"{entry.step}: {entry.worst_present} differs by {entry.worst_present_diff:.2e} > {tolerance:.0e}"
    rows, noise = np.arange(logits.shape[0]), tie_margin(logits, tolerance)
    margins = [logits[rows, eager_next] - logits[rows, chosen] for chosen in onnx_next]
    if any(bool((margin > noise).any()) for margin in margins):
        return f"{entry.step}: onnxruntime's greedy token differs from eager's by a margin above the tolerance"
    return None


def tie_margin(logits: np.ndarray, tolerance: float) -> float:
    """How close eager's two best logits may be for a system within `tolerance` to pick the other one: twice
    the tolerance, on the logits' scale for half-precision models (see TOLERANCES)."""
    return 2 * tolerance * max(1.0, float(np.abs(logits).max()))


def greedy_disagreement(got_tokens, want_tokens, got_logits, want_logits, dtype: str) -> str | None:
    """Why a greedy generation `got` (tokens per row, logits `[batch, vocab]` per step) is not eager's `want`,
    or None. Each row must pick eager's tokens with logits within the dtype's tolerance, except that in half
    precision a row may part from eager's at a step where eager's two best tokens are closer than twice the
    tolerance (fp16 cannot tell which is larger); the steps after that are not compared."""
    tolerance = TOLERANCES[dtype]
    for row, (tokens, wanted) in enumerate(zip(got_tokens, want_tokens, strict=True)):
        parted = next((step for step, (a, b) in enumerate(zip(tokens, wanted, strict=True)) if a != b), None)
        for step in range(len(wanted) if parted is None else parted + 1):
            if (diff := difference(got_logits[step][row], want_logits[step][row])) > tolerance:
                return f"row {row}, step {step}: logits differ by {diff:.2e} > {tolerance:.0e}"
        if parted is None:
            continue
        logits = np.asarray(want_logits[parted][row], dtype=np.float32)
        margin = logits[wanted[parted]] - logits[tokens[parted]]
        if dtype not in HALF_PRECISION or margin > tie_margin(logits, tolerance):
            return f"row {row}, step {parted}: token {tokens[parted]}, eager's {wanted[parted]} (margin {margin:.2e})"
    return None
