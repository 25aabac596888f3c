"""The training loop: AdamW with a warm-up and a cosine decay on random segments of the training split,
validation at intervals, checkpoints to resume from, and at the end the run's report (`training.json`),
its loss curve and the finished model folder.

The weights start from the recipe's seed and batch k is drawn from (seed, k), so a resumed run sees what
an uninterrupted one would. Run eagerly, on one machine with the same torch and thread count, a run
repeats bit for bit, resumed or not; the compiled step's kernels do not repeat their last bits run to run.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

import kvg_export.fox  # noqa: F401  (registers FoX with the Auto classes a preset's config.json is read by)
from kvg_export.folders import write_whole, written_whole
from kvg_export.training.checkpoint import STATE_NAME, load_checkpoint, save_checkpoint, save_model_folder
from kvg_export.training.curve import plot_losses
from kvg_export.training.data import TrainingData
from kvg_export.training.recipe import TrainingRecipe

EVAL_BATCH = 16
PUBLISHED_FILES = ("model.safetensors", "tokenizer.json", "training.json", "loss_curve.png")


def mean_loss(model: PreTrainedModel, segments: list[np.ndarray]) -> float:
    """Mean next-token cross-entropy in nats over every segment's tokens after its first."""
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for length in sorted({len(s) for s in segments}):
            same = [s for s in segments if len(s) == length]
            for begin in range(0, len(same), EVAL_BATCH):
                ids = torch.from_numpy(np.stack(same[begin : begin + EVAL_BATCH]))
                logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
                total += float(F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum"))
                count += ids[:, 1:].numel()
    model.train(was_training)
    return total / count


def _optimizer(model: PreTrainedModel, recipe: TrainingRecipe) -> torch.optim.AdamW:
    """Weight decay on matrices (projections, embeddings), none on norms and biases."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": recipe.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=recipe.learning_rate, betas=recipe.betas)


def _start_or_resume(preset: Path, checkpoint: Path, recipe: TrainingRecipe, data: TrainingData, log):
    if not (checkpoint / STATE_NAME).is_file():
        torch.manual_seed(recipe.seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(preset)).train()
        state = {"step": 0, "seconds": 0.0, "train_losses": [], "validation_losses": [],
                 "recipe": recipe.to_json(), "tokenizer_sha256": data.tokenizer_sha256}  # fmt: skip
        return model, state
    model, state = load_checkpoint(checkpoint)
    if state["recipe"] != recipe.to_json():
        raise ValueError(
            f"{checkpoint} was made with another recipe than {preset / 'preset.json'} holds now; "
            "pass --fresh to start over (or restore the recipe to resume)"
        )
    if state["tokenizer_sha256"] != data.tokenizer_sha256:
        raise ValueError(
            f"{checkpoint} was trained on another corpus than this Python's stdlib ({platform.python_version()}) "
            "gives; resume with the Python that started the run, or pass --fresh"
        )
    log(f"resuming {preset.name} from {checkpoint} at step {state['step']} of {recipe.steps}")
    return model, state


def train(
    preset: Path,
    run_dir: Path,
    *,
    compile_loss: bool = True,
    pause_after: int | None = None,
    corpus_root: Path | None = None,
    log: Callable[[str], None] = print,
    progress: bool = True,
) -> Path | None:
    """Train `preset` in `run_dir` (resuming its checkpoint if there is one) and return the finished model
    folder, or None when `pause_after` steps of this run ended it before the recipe's last step."""
    recipe = TrainingRecipe.from_preset(preset)
    vocab_size = AutoConfig.from_pretrained(preset).vocab_size
    started = time.perf_counter()
    data = TrainingData.prepare(vocab_size, corpus_root)
    sizes = ", ".join(f"{name} {len(stream):,}" for name, stream in data.streams.items())
    log(f"corpus: Python {data.corpus['python']} stdlib, tokens {sizes} ({time.perf_counter() - started:.1f} s)")
    checkpoint = run_dir / "checkpoint"
    model, state = _start_or_resume(preset, checkpoint, recipe, data, log)
    optimizer = _optimizer(model, recipe)
    if "optimizer" in state:
        optimizer.load_state_dict(state.pop("optimizer"))

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    step_loss = torch.compile(loss_of) if compile_loss else loss_of
    last = recipe.steps if pause_after is None else min(recipe.steps, state["step"] + pause_after)
    tokens_per_step = recipe.batch_size * recipe.seq_len
    recent = deque(maxlen=20)  # recent step times, for the tokens/s shown
    seconds_before, loop_started = state["seconds"], time.perf_counter()
    bar = tqdm(total=recipe.steps, initial=state["step"], desc=preset.name, unit="step", disable=not progress)
    try:
        while state["step"] < last:
            began, step = time.perf_counter(), state["step"]
            rate = recipe.learning_rate_at(step)
            batch = data.batch(recipe.seed, step, recipe.batch_size, recipe.seq_len)
            loss = _optimizer_step(model, optimizer, step_loss, batch, rate, recipe.grad_clip)
            state["step"] = step = step + 1
            state["train_losses"].append((step, loss))
            recent.append(time.perf_counter() - began)
            bar.update()
            bar.set_postfix_str(
                f"loss {loss:.3f}, {tokens_per_step * len(recent) / sum(recent):,.0f} tok/s, lr {rate:.2e}"
            )
            if step % recipe.eval_every == 0 or step == recipe.steps:
                state["validation_losses"].append((step, _validation_loss(model, data, recipe, step, bar.write)))
            if step % recipe.checkpoint_every == 0 or step == last:
                state["seconds"] = seconds_before + time.perf_counter() - loop_started
                save_checkpoint(checkpoint, model, data.tokenizer, preset, optimizer, state)
    except KeyboardInterrupt:
        bar.close()
        log(_interrupted(checkpoint, state["step"]))
        raise
    bar.close()
    if state["step"] < recipe.steps:
        log(f"paused at step {state['step']} of {recipe.steps}; the same command resumes from {checkpoint}")
        return None
    return _finish(preset, run_dir, model, data, recipe, state, log)


def _validation_loss(model, data: TrainingData, recipe: TrainingRecipe, step: int, write) -> float:
    """The model's mean loss on the validation segments, written as a line of its own."""
    validation = mean_loss(model, data.evaluation_segments("validation", recipe.seq_len, recipe.eval_segments))
    write(f"step {step}: validation loss {validation:.4f} nats/token, perplexity {math.exp(validation):.2f}")
    return validation


def _optimizer_step(model, optimizer, step_loss, batch: torch.Tensor, rate: float, grad_clip: float) -> float:
    """One step of the recipe's optimizer at learning rate `rate` on `batch`; its loss."""
    for group in optimizer.param_groups:
        group["lr"] = rate
    loss = step_loss(batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _interrupted(checkpoint: Path, step: int) -> str:
    """What an interrupted run says: where the same command goes on from."""
    if not (checkpoint / STATE_NAME).is_file():
        return f"interrupted at step {step}, before the first checkpoint; the same command starts over"
    saved = torch.load(checkpoint / STATE_NAME, weights_only=True)["step"]
    return f"interrupted at step {step}; the same command resumes from the checkpoint of step {saved}"


def _finish(preset, run_dir, model, data: TrainingData, recipe: TrainingRecipe, state: dict, log) -> Path:
    """Evaluate on the whole validation and test splits, then write the model folder with its report and curve."""
    began = time.perf_counter()
    report = {
        "preset": preset.name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "recipe": recipe.to_json(),
        "corpus": data.corpus,
        "tokenizer_sha256": data.tokenizer_sha256,
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count()},
        "train_seconds": round(state["seconds"], 1),
        "tokens_seen": state["step"] * recipe.batch_size * recipe.seq_len,
        "validation_history": state["validation_losses"],
    }
    for split in ("validation", "test"):
        segments = data.evaluation_segments(split, recipe.seq_len)
        loss, unigram = mean_loss(model, segments), data.unigram_loss(split, recipe.seq_len)
        report[split] = {
            "segments": len(segments),
            "segment_tokens": recipe.seq_len,
            "predicted_tokens": sum(len(s) - 1 for s in segments),
            "loss": loss,
            "perplexity": math.exp(loss),
            "unigram_loss": unigram,
            "unigram_perplexity": math.exp(unigram),
        }
        log(f"{split}: loss {loss:.4f} nats/token, perplexity {math.exp(loss):.2f} "
            f"(unigram baseline {unigram:.4f}, perplexity {math.exp(unigram):.1f})")  # fmt: skip
    report["final_evaluation_seconds"] = round(time.perf_counter() - began, 1)
    out = run_dir / "model"
    with written_whole(out) as staging:
        save_model_folder(staging, model, data.tokenizer, preset)
        (staging / "training.json").write_text(json.dumps(report, indent=2) + "\n")
        title = (
            f"{preset.name}: {report['parameters'] / 1e6:.2f}M parameters, {report['tokens_seen'] / 1e6:.1f}M tokens"
        )
        plot_losses(staging / "loss_curve.png", title, state["train_losses"], state["validation_losses"],
                    recipe.eval_segments, report["validation"]["unigram_loss"])  # fmt: skip
    log(f"model: {out} (trained {state['seconds'] / 60:.1f} min)")
    return out


def publish_to_preset(model_folder: Path, preset: Path) -> None:
    """Make a finished run the preset's committed weights: each file replaced whole, config.json kept."""
    for name in PUBLISHED_FILES:
        write_whole(preset / name, (model_folder / name).read_bytes())
