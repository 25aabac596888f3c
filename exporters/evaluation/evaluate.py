"""The quality yardstick: perplexity and next-token top-1 agreement on held-out text, computed by eager
PyTorch and by an exported artifact through the torch-free runtime, side by side.

The text (by default the stdlib corpus's test split, as the trained presets were trained on its training
split) is tokenized once with the model's tokenizer: its files, joined with the end-of-text token, cut into
consecutive segments of `context` tokens (shorter where a static artifact's `max_cache_len` is). For segments
of up to DEFAULT_CONTEXT tokens (the trained presets' training length) the files come in path order, so
that the first N segments span many files (the export's quality check scores 64). For longer segments they
come longest first (ties in path order), so that the first segments hold one long file each and a late
position has that many tokens of its own file before it, not a run of unrelated files: under Python 3.11
the test split's 181k tokens give 22 segments of 8,192, the first three in its longest file (25k tokens).
Both systems score the same segments with the same arithmetic (runtime.decode.scoring), so their figures compare
position by position; bands of segment positions and log-spaced position bins (the curve `--plot` draws)
show how quality holds over the context.

Eager's half (EagerRun) can be made separately from the artifact's: an export scores eager in its torch half, and
judges the artifact in its own torch-free process; torch is imported only where eager runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import pairwise
from pathlib import Path

import numpy as np

from exporters.checkpoint_tokenizer import CheckpointTokenizer, TokenizerError, read_tokenizer
from exporters.checks.manifest import source_digest
from exporters.progress import Progress, untracked
from kvg_export.corpus import Document, describe, read_split, segments, split_digest, token_stream
from kvg_export.folders import write_whole
from kvg_export.presets import load_model, resolve_checkpoint
from runtime.artifact import ArtifactError, SessionOptions
from runtime.decode.generator import Generator
from runtime.decode.scoring import POSITIONS_PER_BLOCK, Scores, score_segments

DEFAULT_CONTEXT = 512
EAGER_BATCH_TOKENS = 16 * DEFAULT_CONTEXT  # tokens per eager forward: 16 segments of 512, 1 of 8,192
BAND_GROWTH = 4  # default bands end at 512, 2048, 8192, ... positions
CURVE_BINS = 24
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


def relative_diff(artifact: float | None, eager: float) -> float | None:
    """The artifact's figure against eager's, relative; None where no artifact was scored."""
    return None if artifact is None else (artifact - eager) / eager


@dataclass
class Band:
    """The figures over the tokens at segment positions first..last (inclusive; a token at position p is
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
        return relative_diff(self.artifact_perplexity, self.eager_perplexity)

    @classmethod
    def whole(cls, eager: Scores, artifact: Scores | None) -> Band:
        """The band of every predicted position: the overall figures."""
        return cls.of(int(eager.positions.min()), int(eager.positions.max()), eager, artifact)

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

    def to_json(self) -> dict:
        return {**asdict(self), "relative_perplexity_diff": self.relative_perplexity_diff}


def default_bands(segment_tokens: int) -> list[tuple[int, int]]:
    """The bands a segment longer than DEFAULT_CONTEXT is judged in when none are asked for: 0-511, 512-2047,
    2048-8191, 8192-32767, ..., the last cut at the segment's end; none for a shorter segment, whose overall
    figures are its first band's."""
    if segment_tokens <= DEFAULT_CONTEXT:
        return []
    ends = [DEFAULT_CONTEXT]
    while ends[-1] * BAND_GROWTH < segment_tokens:
        ends.append(ends[-1] * BAND_GROWTH)
    return [(first, end - 1) for first, end in pairwise([0, *ends, segment_tokens])]


def position_bins(segment_tokens: int, count: int = CURVE_BINS) -> list[tuple[int, int]]:
    """Up to `count` log-spaced bins (first, last position, inclusive) tiling positions 1 to segment_tokens - 1:
    one position's perplexity is too noisy to read, and the early positions change fastest."""
    edges = np.unique(np.geomspace(1, segment_tokens, count + 1).round().astype(int))
    return [(int(first), int(end) - 1) for first, end in pairwise(edges)]


@dataclass
class Evaluation:
    model: str
    text: dict  # what was scored: source, files, digest, tokens
    segment_tokens: int
    segments: int
    eager: SystemResult
    overall: Band  # every predicted position, judged by the thresholds on perplexity and top-1 agreement
    artifact: SystemResult | None = None
    thresholds: Thresholds = field(default_factory=Thresholds)
    bands: list[Band] = field(default_factory=list)  # judged by the thresholds like the overall figures
    curve: list[Band] = field(default_factory=list)  # the position_bins: perplexity against position, not judged

    @property
    def predicted_tokens(self) -> int:
        return self.overall.predicted_tokens

    @property
    def top1_agreement(self) -> float | None:
        return self.overall.top1_agreement

    @property
    def relative_perplexity_diff(self) -> float | None:
        return self.overall.relative_perplexity_diff

    @property
    def failures(self) -> list[str]:
        """The thresholds the artifact misses, each with its figures (none without an artifact)."""
        if self.artifact is None:
            return []
        found, limits = [], self.thresholds
        judged = [("perplexity", self.overall)] + [(f"positions {b.first}-{b.last}: perplexity", b) for b in self.bands]
        for what, band in judged:
            diff = band.relative_perplexity_diff
            if not abs(diff) <= limits.max_relative_perplexity_diff:  # NaN fails too
                found.append(
                    f"{what} {band.artifact_perplexity:.6g} differs from eager's {band.eager_perplexity:.6g} by "
                    f"{diff:+.3%}, over {limits.max_relative_perplexity_diff:.3%}"
                )
        if self.top1_agreement < limits.min_top1_agreement:
            found.append(f"top-1 agreement {self.top1_agreement:.3%} is under {limits.min_top1_agreement:.3%}")
        return found

    def to_json(self) -> dict:
        figures = asdict(self)
        del figures["overall"]
        return {
            **figures,
            "predicted_tokens": self.predicted_tokens,
            "top1_agreement": self.top1_agreement,
            "relative_perplexity_diff": self.relative_perplexity_diff,
            "passed": not self.failures,
            "failures": self.failures,
            "bands": [b.to_json() for b in self.bands],
            "curve": [b.to_json() for b in self.curve],
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
                f"perplexity within {limits.max_relative_perplexity_diff:.2%}{' in every band' if self.bands else ''}"
                f" and top-1 agreement >= {limits.min_top1_agreement:.2%}: pass"
            )
            lines.append(f"thresholds: {verdict}")
        return "\n".join(lines)


def _documents(split: str, text_paths: list[Path] | None) -> tuple[list[Document], dict]:
    if text_paths is None:
        documents = read_split(split)
        corpus = describe({split: documents})
        return documents, {"source": corpus["source"], "python": corpus["python"], "split": split,
                           **corpus["splits"][split]}  # fmt: skip
    files = check_text_paths(text_paths)
    documents = [Document(str(p), p.read_bytes().decode("utf-8", errors="replace")) for p in files]
    return documents, {
        "source": "files",
        "paths": [str(p) for p in text_paths],
        "files": len(files),
        "bytes": sum(len(d.text.encode()) for d in documents),
        "sha256": split_digest(documents),
    }


def check_text_paths(text_paths: list[Path] | None) -> list[Path]:
    """The text files `text_paths` (files, or folders searched for them) name; None: the corpus's, none to check."""
    files = []
    for path in text_paths or ():
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise EvalError(f"text path {path} does not exist")
    if text_paths is not None and not files:
        names = ", ".join(str(p) for p in text_paths)
        raise EvalError(f"no text to evaluate: {names} holds no files ending in {', '.join(TEXT_SUFFIXES)}")
    return files


def check_tokenizer(checkpoint: Path, vocab_size: int) -> CheckpointTokenizer:
    """The checkpoint's tokenizer (exporters/checkpoint_tokenizer.py), if it fits the model's vocabulary."""
    try:
        found = read_tokenizer(checkpoint)
    except TokenizerError as error:
        raise EvalError(str(error)) from None
    if found is None:
        raise EvalError(f"{checkpoint} has no tokenizer files: the text cannot be tokenized for this model")
    size = found.bpe().get_vocab_size()
    if size > vocab_size:
        raise EvalError(
            f"{checkpoint / found.source}: {size} ids, but the model's vocabulary has {vocab_size}: "
            "the tokenizer does not belong to this model"
        )
    return found


def _open_artifact(folder: Path, checkpoint: Path, vocab_size: int, options: SessionOptions) -> Generator:
    try:
        generator = Generator.open(folder, options)
    except ArtifactError as error:
        raise EvalError(str(error)) from None
    manifest = generator.model.artifact.manifest
    if manifest["model"]["vocab_size"] != vocab_size or manifest["source"]["sha256"] != source_digest(checkpoint):
        raise EvalError(
            f"{folder} was exported from {manifest['source']['model']!r}, whose weights differ from {checkpoint}'s; "
            "evaluate it against the model it was exported from"
        )
    return generator


def eager_logit_blocks(model, ids: np.ndarray) -> Iterator[np.ndarray]:
    """Float32 logits of whole segments `[batch, seq]`, fed from an empty cache, as `[batch, block, vocab]` blocks
    of POSITIONS_PER_BLOCK positions. A forward with a cache runs a long segment through the layers chunk by
    chunk, as the runtime prefills, where one without builds each layer's [batch, heads, seq, seq] scores at
    once (4 GB in float32 for one segment of 8,192 tokens at 16 heads). The LM head goes block by block: a
    segment's whole logits (512 x 32,000 float32, 65 MB) were the peak of a quantized export's torch half."""
    import torch

    from kvg_export.cache import DynamicCache

    with torch.no_grad():
        hidden = model.model(input_ids=torch.from_numpy(ids), past_key_values=DynamicCache(), use_cache=True)
    hidden = hidden.last_hidden_state
    for begin in range(0, hidden.shape[1], POSITIONS_PER_BLOCK):
        with torch.no_grad():
            logits = model.lm_head(hidden[:, begin : begin + POSITIONS_PER_BLOCK])
        yield logits.float().numpy()


@dataclass
class EagerRun:
    """The text's segments, the bands they are judged in, and eager fp32's scores on them."""

    text: dict  # what was scored: source, files, digest, tokens, order
    context: int
    segments: list[np.ndarray]
    bands: list[tuple[int, int]]
    scores: Scores
    seconds: float


def run_eager(
    eager_model,
    checkpoint: Path,
    *,
    split: str = "test",
    text_paths: list[Path] | None = None,
    context: int = DEFAULT_CONTEXT,
    max_segments: int | None = None,
    bands: list[tuple[int, int]] | None = None,
    for_artifact: bool = False,
    progress: Progress | None = None,
    passes: int = 1,
) -> EagerRun:
    """Tokenize the text into segments of `context` tokens and score them with `eager_model` (a FoxForCausalLM);
    `bands` (None: default_bands of the longest segment) must fit in the segments, which `for_artifact` are cut
    to an artifact's length (a band too long for them is then fixed by exporting a longer one). `progress` counts
    the segments scored, planned for `passes` over them (eager's, and an artifact's after it)."""
    config = eager_model.config
    try:
        documents, text = _documents(split, text_paths)
    except (ValueError, FileNotFoundError) as error:
        raise EvalError(str(error)) from None
    found = check_tokenizer(checkpoint, config.vocab_size)
    tokenizer = found.text_tokenizer()
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    eos = found.special_ids.get("eos") if eos is None else eos
    longest_first = context > DEFAULT_CONTEXT
    # Text as the model was trained on it (escaped, for the released FoX checkpoints), each segment after its BOS
    escaped = [Document(document.path, tokenizer.escape(document.text)) for document in documents]
    stream = token_stream(tokenizer.bpe, escaped, eos, longest_first)
    chosen = segments(stream, context, tokenizer.rules.bos)[:max_segments]
    if not chosen:
        where = f"the {split} split" if text_paths is None else "the text"
        raise EvalError(f"no text to evaluate: {where} gives {len(stream)} tokens, fewer than the 2 a segment needs")
    text["tokens"] = len(stream)
    text["order"] = "longest first" if longest_first else "path order"
    longest = max(map(len, chosen))
    bands = default_bands(longest) if bands is None else bands
    for first, last in bands:
        if last >= longest:
            longer = "--context" + (", or export a longer static artifact" if for_artifact else "")
            raise EvalError(
                f"positions {first}-{last} need segments of {last + 1} tokens; the longest here has {longest} "
                f"(raise {longer})"
            )
    began = time.perf_counter()
    eager_batch = max(1, EAGER_BATCH_TOKENS // context)
    progress = progress or untracked()
    progress.plan(passes * len(chosen), "segments scored")
    scores = score_segments(partial(eager_logit_blocks, eager_model), chosen, eager_batch, config.vocab_size,
                           progress.advance)  # fmt: skip
    return EagerRun(text, context, chosen, bands, scores, time.perf_counter() - began)


def evaluate(
    model: str,
    artifact: Path | None = None,
    *,
    split: str = "test",
    text_paths: list[Path] | None = None,
    context: int = DEFAULT_CONTEXT,
    max_segments: int | None = None,
    session_options: SessionOptions | None = None,
    thresholds: Thresholds | None = None,
    bands: list[tuple[int, int]] | None = None,
    eager: EagerRun | None = None,
    progress: Progress | None = None,
) -> Evaluation:
    """Score the text with eager PyTorch (float32) and, given an artifact, with the runtime; `bands` (first and
    last segment position, inclusive; None: default_bands of the longest segment) also get figures of their own,
    held to the same thresholds. `eager`: eager's run, made already (on the segments this artifact takes).
    `progress` counts the segments each system scores."""
    _check_segments(context, bands)
    try:
        checkpoint = resolve_checkpoint(model)
    except (ValueError, FileNotFoundError) as error:
        raise EvalError(str(error)) from None
    check_text_paths(text_paths)  # before the model loads
    vocab_size = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    generator = None
    if artifact is not None:
        generator = _open_artifact(artifact, checkpoint, vocab_size, session_options or SessionOptions())
        if generator.model.artifact.static:
            context = min(context, generator.model.artifact.manifest["cache"]["max_cache_len"])
    progress = progress or untracked()
    if eager is None:
        eager = run_eager(load_model(checkpoint), checkpoint, split=split, text_paths=text_paths, context=context,
                          max_segments=max_segments, bands=bands, for_artifact=artifact is not None,
                          progress=progress, passes=1 + (artifact is not None))  # fmt: skip
    elif eager.context != context:
        raise ValueError(f"eager scored segments of {eager.context} tokens; this artifact takes {context}")
    elif generator is not None:
        progress.plan(len(eager.segments), "segments scored")
    artifact_result = artifact_scores = None
    if generator is not None:
        artifact_result, artifact_scores = _score_artifact(generator, str(artifact), eager, vocab_size, progress)
    scored = (eager.scores, artifact_scores)
    longest = max(map(len, eager.segments))
    return Evaluation(
        model=str(model), text=eager.text, segment_tokens=context, segments=len(eager.segments),
        eager=SystemResult.of("eager PyTorch", eager.scores, eager.seconds), overall=Band.whole(*scored),
        artifact=artifact_result, thresholds=thresholds or Thresholds(),
        bands=[Band.of(first, last, *scored) for first, last in eager.bands],
        curve=[Band.of(first, last, *scored) for first, last in position_bins(longest)],
    )  # fmt: skip


def _check_segments(context: int, bands: list[tuple[int, int]] | None) -> None:
    """Refuse segments or bands that cannot be scored before the model and the text load."""
    if context < 2:
        raise EvalError(f"the context must be at least 2 tokens, got {context}")
    for first, last in bands or ():
        if not 0 <= first <= last:
            raise EvalError(f"positions {first}-{last} are not a band: give first-last with 0 <= first <= last")


def _score_artifact(
    generator: Generator, name: str, eager: EagerRun, vocab_size: int, progress: Progress
) -> tuple[SystemResult, Scores]:
    """The artifact's half: the runtime scores the segments eager scored, as many at once as the artifact's batch
    takes, with the same arithmetic, so that the two compare position by position."""
    began = time.perf_counter()
    max_batch = generator.model.artifact.manifest["cache"]["max_batch"]
    scores = score_segments(generator.teacher_forced_logits, eager.segments, max_batch, vocab_size, progress.advance)
    return SystemResult.of(name, scores, time.perf_counter() - began), scores


def write_json(evaluation: Evaluation, path: Path) -> None:
    write_whole(path, (json.dumps(evaluation.to_json(), indent=2) + "\n").encode())
