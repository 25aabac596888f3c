"""Parity validation, run at every export: eager PyTorch, the ExportedProgram and onnxruntime, step by step.

A left-padded batch is prefilled and then decoded greedily (eager's tokens are fed to all three, each
system carrying its own cache, present fed back as past). Every step's logits and every present tensor
are compared with eager's; an export whose differences pass the dtype's tolerance is good.

A gqa dynamic graph is run by onnxruntime twice per step: as the contract says (past exactly as long as
the filled positions) and as the runtime runs it (key, value and gate buffers longer than that, which
present keeps), so both are checked against the same eager step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import onnxruntime as ort
import torch
from torch.export import ExportedProgram

from exporters.contract import CacheLayout, cache_shape
from exporters.last_logits import NAME as LOGITS_TO_KEEP
from exporters.window_offsets import NAME as WINDOW_OFFSETS
from exporters.wrappers import ExportableFox
from kvg_export import FoxForCausalLM

PROMPT_LENGTH, DECODE_STEPS, PADDING = 8, 16, 3
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
    step: str  # "prefill" or "decode N"
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
    got, want = (t if isinstance(t, torch.Tensor) else torch.from_numpy(np.asarray(t)) for t in (got, want))
    got, want = got.float(), want.float()
    if not want.numel():
        return 0.0
    largest = (got - want).abs().max()
    return float(largest / want.abs().max().clamp(min=1))


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().numpy()


def validation_prompt(vocab_size: int, batch: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids `[batch, PROMPT_LENGTH]`, the first row left-padded by PADDING positions when batch > 1."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch, PROMPT_LENGTH), generator=generator)
    mask = torch.ones(batch, PROMPT_LENGTH, dtype=torch.long)
    if batch > 1:
        ids[0, :PADDING], mask[0, :PADDING] = pad_id, 0
    return ids, mask


def validate_export(
    model: FoxForCausalLM,
    layout: CacheLayout,
    program: ExportedProgram,
    session: ort.InferenceSession,
    max_cache_len: int | None,
    batch: int = 2,
    longer_buffers: bool = False,
) -> ValidationReport:
    """Run prefill plus DECODE_STEPS greedy steps through the three systems and compare them with eager;
    `longer_buffers` (gqa dynamic graphs) also runs onnxruntime with key, value and gate buffers longer
    than the filled positions."""
    dtype = str(model.dtype).removeprefix("torch.")
    report = ValidationReport(dtype, TOLERANCES[dtype], batch, PROMPT_LENGTH, DECODE_STEPS)
    ids, mask = validation_prompt(model.config.vocab_size, batch, model.config.pad_token_id or 0)
    eager, exported = ExportableFox(model, layout), program.module()

    def zeros(length: int) -> list[torch.Tensor]:
        return [
            torch.zeros(cache_shape(model.config, name.rsplit(".", 1)[1], batch, length),
                        dtype=torch.float32 if name.endswith("gate") else model.dtype)
            for name in layout.past_names()
        ]  # fmt: skip

    empty = zeros(max_cache_len if layout.static else 0)
    # Separate buffers per system: a static cache is written in place, by eager and by the program alike.
    pasts = {"eager": empty, "program": [t.clone() for t in empty], "onnx": [_numpy(t).copy() for t in empty]}
    if longer_buffers:  # twice what the steps fill
        pasts["onnx-longer"] = [_numpy(t) for t in zeros(2 * (PROMPT_LENGTH + DECODE_STEPS))]
    pasts["onnx-last"] = [_numpy(t).copy() for t in empty]  # fed logits_to_keep 1, as the runtime prefills
    keep_last = {LOGITS_TO_KEEP: np.ones(1, dtype=np.int64)}
    in_place = any(node.op == "placeholder" and node.name == WINDOW_OFFSETS for node in program.graph.nodes)
    offsets = {WINDOW_OFFSETS: torch.zeros(layout.num_layers, dtype=torch.long)} if in_place else {}
    tokens, full_mask, start = ids, mask, 0
    for step in range(DECODE_STEPS + 1):
        stop = full_mask.shape[1]
        head = [tokens, full_mask]
        if layout.static:  # the mask is the attention window, as the runtime passes it
            head = [tokens, full_mask, torch.arange(start, stop)]
        with torch.no_grad():
            want = eager(*head, *pasts["eager"])
            got_program = exported(*head, *pasts["program"], **offsets)
        runs = {
            system: session.run(
                None,
                dict(zip(layout.input_names(), [_numpy(t) for t in head] + past, strict=True))
                | (keep_last if system == "onnx-last" else {}),
            )
            for system, past in pasts.items()
            if system.startswith("onnx")
        }
        diffs = {
            name: max(difference(p, w), *(difference(_filled(run[index], w), w) for run in runs.values()))
            for index, (name, w, p) in enumerate(zip(layout.present_names(), want[1:], got_program[1:], strict=True), 1)
        }
        worst = max(diffs, key=diffs.get)
        eager_next = want[0][:, -1].argmax(-1)
        onnx_next = [torch.from_numpy(run[0][:, -1]).argmax(-1) for run in runs.values()]
        entry = StepReport(
            "prefill" if step == 0 else f"decode {step}",
            difference(got_program[0], want[0]),
            max(difference(run[0], want[0][:, -run[0].shape[1] :]) for run in runs.values()),
            worst,
            diffs[worst],
            all(torch.equal(eager_next, chosen) for chosen in onnx_next),
        )
        report.steps.append(entry)
        report.failure = report.failure or _failure(entry, want[0][:, -1], eager_next, onnx_next, report.tolerance)
        pasts = {"eager": list(want[1:]), "program": list(got_program[1:])}
        pasts |= {system: list(run[1:]) for system, run in runs.items()}
        tokens, start = eager_next.unsqueeze(1), stop
        full_mask = torch.cat([full_mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
    return report


def _filled(present: np.ndarray, want: torch.Tensor) -> np.ndarray:
    """A present key, value or gate cut to eager's length (a longer buffer keeps its length)."""
    return present[:, :, : want.shape[2]] if present.ndim > 2 else present


def _failure(entry: StepReport, logits, eager_next, onnx_next: list, tolerance: float) -> str | None:
    """Why this step fails, or None. A greedy flip is a failure only where eager's margin exceeds the noise."""
    if entry.program_logits > tolerance:
        return f"{entry.step}: ExportedProgram logits differ by {entry.program_logits:.2e} > {tolerance:.0e}"
    if entry.onnx_logits > tolerance:
        return f"{entry.step}: onnxruntime logits differ by {entry.onnx_logits:.2e} > {tolerance:.0e}"
    if entry.worst_present_diff > tolerance:
        return f"{entry.step}: {entry.worst_present} differs by {entry.worst_present_diff:.2e} > {tolerance:.0e}"
    rows, noise = torch.arange(logits.shape[0]), tie_margin(logits.float().numpy(), tolerance)
    margins = [(logits[rows, eager_next] - logits[rows, chosen]).float() for chosen in onnx_next]
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
    tolerance (fp16 cannot tell them apart); the steps after that are not compared."""
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


def eager_generate(model: FoxForCausalLM, prompts: list[list[int]], new_tokens: int):
    """transformers' generate() on a left-padded batch, greedy, on the model's device: the new tokens and the
    logits of each step `[batch, vocab]` (float32, on the host), what `greedy_disagreement` compares with."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
    with torch.no_grad():
        out = model.generate(
            ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences[:, width:].tolist(), [step.float().cpu().numpy() for step in out.logits]
