"""The quality yardstick: perplexity and next-token top-1 agreement on held-out text, computed by eager
PyTorch and by an exported artifact through the torch-free runtime, side by side.

The text (by default the stdlib corpus's test split, as the trained presets were trained on its training
split) is tokenized once with the model's tokenizer and cut into windows of `context` tokens, shorter
where a static artifact's `max_cache_len` is; both systems score the same windows with the same
arithmetic (runtime.scoring), so their figures compare position by position.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from exporters.manifest import source_digest
from kvg_export.corpus import Document, describe, read_split, split_digest, token_stream, windows
from kvg_export.folders import write_whole
from kvg_export.presets import load_model, resolve_checkpoint
from runtime.artifact import ArtifactError, SessionOptions
from runtime.generator import Generator
from runtime.scoring import Scores, score_windows

DEFAULT_CONTEXT = 512
EAGER_BATCH = 16
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


class EvalError(Exception):
    """The evaluation cannot be made as asked; the message says what to change."""


@dataclass(frozen=True)
class Thresholds:
    max_relative_perplexity_diff: float = 1e-3  # |artifact - eager| / eager
    min_top1_agreement: float = 0.999  # positions where both rank the same token first


@dataclass
class SystemResult:
    name: str
    perplexity: float
    nll: float  # mean nats per predicted token
    top1_accuracy: float  # the top-ranked token is the one that follows
    seconds: float

    @classmethod
    def of(cls, name: str, scores: Scores, seconds: float) -> SystemResult:
        return cls(name, scores.perplexity, scores.mean_nll, scores.accuracy, round(seconds, 2))


@dataclass
class Band:
    """The figures over the tokens at window positions first..last (inclusive; a token at position p is
    predicted from the p before it): how quality holds over the context, where an error in the forget gate
    would grow with its cumulative sum."""

    first: int
    last: int
    predicted_tokens: int
    eager_perplexity: float
    artifact_perplexity: float | None = None
    top1_agreement: float | None = None

    @property
    def relative_perplexity_diff(self) -> float | None:
        if self.artifact_perplexity is None:
            return None
        return (self.artifact_perplexity - self.eager_perplexity) / self.eager_perplexity

    @classmethod
    def of(cls, first: int, last: int, eager: Scores, artifact: Scores | None) -> Band:
        chosen = (eager.positions >= first) & (eager.positions <= last)
        band = cls(first, last, int(chosen.sum()), float(np.exp(eager.nll[chosen].mean())))
        if artifact is not None:
            band.artifact_perplexity = float(np.exp(artifact.nll[chosen].mean()))
            band.top1_agreement = float((artifact.top1[chosen] == eager.top1[chosen]).mean())
        return band

    def describe(self) -> str:
        line = f"positions {self.first}-{self.last}: eager perplexity {self.eager_perplexity:.5f}"
        if self.artifact_perplexity is not None:
            line += (
                f", artifact {self.artifact_perplexity:.5f} ({self.relative_perplexity_diff:+.2e} relative), "
                f"top-1 agreement {self.top1_agreement:.4%}"
            )
        return line + f" ({self.predicted_tokens:,} tokens)"


@dataclass
class Evaluation:
    model: str
    text: dict  # what was scored: source, files, digest, tokens
    window_tokens: int
    windows: int
    predicted_tokens: int
    eager: SystemResult
    artifact: SystemResult | None = None
    top1_agreement: float | None = None
    thresholds: Thresholds = field(default_factory=Thresholds)
    bands: list[Band] = field(default_factory=list)

    @property
    def relative_perplexity_diff(self) -> float | None:
        if self.artifact is None:
            return None
        return (self.artifact.perplexity - self.eager.perplexity) / self.eager.perplexity

    @property
    def failures(self) -> list[str]:
        """The thresholds the artifact misses, each with its figures (none without an artifact)."""
        if self.artifact is None:
            return []
        found, limits = [], self.thresholds
        if abs(self.relative_perplexity_diff) > limits.max_relative_perplexity_diff:
            found.append(
                f"perplexity {self.artifact.perplexity:.6g} differs from eager's {self.eager.perplexity:.6g} by "
                f"{self.relative_perplexity_diff:+.3%}, over {limits.max_relative_perplexity_diff:.3%}"
            )
        if self.top1_agreement < limits.min_top1_agreement:
            found.append(f"top-1 agreement {self.top1_agreement:.3%} is under {limits.min_top1_agreement:.3%}")
        return found

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "relative_perplexity_diff": self.relative_perplexity_diff,
            "passed": not self.failures,
            "failures": self.failures,
            "bands": [{**asdict(b), "relative_perplexity_diff": b.relative_perplexity_diff} for b in self.bands],
        }

    def table(self) -> str:
        systems = [self.eager] + ([self.artifact] if self.artifact else [])
        width = max(16, *(len(s.name) for s in systems))
        rows = [("", *(s.name for s in systems), "difference" if self.artifact else "")]

        def row(label: str, values: list[str], difference: str = "") -> None:
            rows.append((label, *values, difference))

        diff = self.relative_perplexity_diff
        row("perplexity", [f"{s.perplexity:.5f}" for s in systems], f"{diff:+.2e} relative" if self.artifact else "")
        nll_diff = f"{self.artifact.nll - self.eager.nll:+.2e}" if self.artifact else ""
        row("nats/token", [f"{s.nll:.6f}" for s in systems], nll_diff)
        row("top-1 accuracy", [f"{s.top1_accuracy:.4%}" for s in systems])
        if self.artifact:
            differ = round((1 - self.top1_agreement) * self.predicted_tokens)
            row(
                "top-1 agreement", ["", f"{self.top1_agreement:.4%}"], f"{differ:,} of {self.predicted_tokens:,} differ"
            )
        row("seconds", [f"{s.seconds:.1f}" for s in systems])
        lines = ["  ".join(f"{cell:<{16 if i == 0 else width}}" for i, cell in enumerate(r)).rstrip() for r in rows]
        lines += [band.describe() for band in self.bands]
        if self.artifact:
            limits = self.thresholds
            verdict = "; ".join(self.failures) or (
                f"perplexity within {limits.max_relative_perplexity_diff:.2%} and top-1 agreement >= "
                f"{limits.min_top1_agreement:.2%}: pass"
            )
            lines.append(f"thresholds: {verdict}")
        return "\n".join(lines)


def _documents(split: str, text_paths: list[Path] | None) -> tuple[list[Document], dict]:
    if text_paths is None:
        documents = read_split(split)
        corpus = describe({split: documents})
        return documents, {"source": corpus["source"], "python": corpus["python"], "split": split,
                           **corpus["splits"][split]}  # fmt: skip
    files = []
    for path in text_paths:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise EvalError(f"text path {path} does not exist")
    if not files:
        names = ", ".join(str(p) for p in text_paths)
        raise EvalError(f"no text to evaluate: {names} holds no files ending in {', '.join(TEXT_SUFFIXES)}")
    documents = [Document(str(p), p.read_bytes().decode("utf-8", errors="replace")) for p in files]
    return documents, {
        "source": "files",
        "paths": [str(p) for p in text_paths],
        "files": len(files),
        "bytes": sum(len(d.text.encode()) for d in documents),
        "sha256": split_digest(documents),
    }


def _tokenizer(checkpoint: Path, vocab_size: int) -> Tokenizer:
    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        raise EvalError(f"{checkpoint} has no tokenizer.json: the text cannot be tokenized for this model")
    tokenizer = Tokenizer.from_file(str(path))
    if tokenizer.get_vocab_size() > vocab_size:
        raise EvalError(
            f"{path} has {tokenizer.get_vocab_size()} ids but the model's vocabulary has {vocab_size}: "
            "the tokenizer does not belong to this model"
        )
    return tokenizer


def _open_artifact(folder: Path, checkpoint: Path, vocab_size: int, options: SessionOptions) -> Generator:
    try:
        generator = Generator.open(folder, options)
    except ArtifactError as error:
        raise EvalError(str(error)) from None
    manifest = generator.artifact.manifest
    if manifest["model"]["vocab_size"] != vocab_size or manifest["source"]["sha256"] != source_digest(checkpoint):
        raise EvalError(
            f"{folder} was exported from {manifest['source']['model']!r}, whose weights differ from {checkpoint}'s; "
            "evaluate it against the model it was exported from"
        )
    return generator


def evaluate(
    model: str,
    artifact: Path | None = None,
    *,
    split: str = "test",
    text_paths: list[Path] | None = None,
    context: int = DEFAULT_CONTEXT,
    max_windows: int | None = None,
    session_options: SessionOptions | None = None,
    thresholds: Thresholds | None = None,
    bands: list[tuple[int, int]] = (),
) -> Evaluation:
    """Score the text with eager PyTorch (float32) and, given an artifact, with the runtime; `bands` (first and
    last window position, inclusive) also get figures of their own."""
    if context < 2:
        raise EvalError(f"the context must be at least 2 tokens, got {context}")
    for first, last in bands:
        if not 0 <= first <= last:
            raise EvalError(f"positions {first}-{last} are not a band: give first-last with 0 <= first <= last")
    try:
        checkpoint = resolve_checkpoint(model)
        documents, text = _documents(split, text_paths)
    except (ValueError, FileNotFoundError) as error:
        raise EvalError(str(error)) from None
    eager_model = load_model(checkpoint)
    config = eager_model.config
    tokenizer = _tokenizer(checkpoint, config.vocab_size)
    generator = None
    if artifact is not None:
        generator = _open_artifact(artifact, checkpoint, config.vocab_size, session_options or SessionOptions())
        if generator.artifact.static:
            context = min(context, generator.artifact.manifest["cache"]["max_cache_len"])
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    stream = token_stream(tokenizer, documents, eos)
    chosen = windows(stream, context)[:max_windows]
    if not chosen:
        where = f"the {split} split" if text_paths is None else "the text"
        raise EvalError(f"no text to evaluate: {where} gives {len(stream)} tokens, fewer than the 2 a window needs")
    text["tokens"] = len(stream)
    longest = max(map(len, chosen))
    for first, last in bands:
        if last >= longest:
            longer = "--context" + (", or export a longer static artifact" if generator else "")
            raise EvalError(
                f"positions {first}-{last} need windows of {last + 1} tokens; the longest here has {longest} "
                f"(raise {longer})"
            )

    def eager_logits(ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return eager_model(input_ids=torch.from_numpy(ids), use_cache=False).logits.float().numpy()

    began = time.perf_counter()
    eager_scores = score_windows(eager_logits, chosen, EAGER_BATCH, config.vocab_size)
    evaluation = Evaluation(
        model=str(model), text=text, window_tokens=context, windows=len(chosen),
        predicted_tokens=int(eager_scores.nll.size), thresholds=thresholds or Thresholds(),
        eager=SystemResult.of("eager PyTorch", eager_scores, time.perf_counter() - began),
    )  # fmt: skip
    if generator is not None:
        began = time.perf_counter()
        max_batch = generator.artifact.manifest["cache"]["max_batch"]
        artifact_scores = score_windows(generator.teacher_forced_logits, chosen, max_batch, config.vocab_size)
        evaluation.artifact = SystemResult.of(str(artifact), artifact_scores, time.perf_counter() - began)
        evaluation.top1_agreement = float((artifact_scores.top1 == eager_scores.top1).mean())
    evaluation.bands = [Band.of(first, last, eager_scores, artifact_scores if generator else None)
                        for first, last in bands]  # fmt: skip
    return evaluation


def write_json(evaluation: Evaluation, path: Path) -> None:
    write_whole(path, (json.dumps(evaluation.to_json(), indent=2) + "\n").encode())
