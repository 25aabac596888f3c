"""An artifact opened for generation: its session, tokenizer, special tokens, pruning policy and grammars, and the
checks a request must pass. The Generator, the engine, a draft model and the server each take one (as
onnxruntime-genai's Generator takes its Model), so no loop borrows another's context.

One Model serves any number of loops and threads at once: what it holds is read-only once opened, but for the
grammars it compiles on first use (llguidance's compiler is thread-safe).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime.artifact import Artifact, SessionOptions, runs_keep_head_windows
from runtime.cache.pruning import AS_EXPORTED, Pruning, Tolerance
from runtime.contract import held_in_place
from runtime.decode.search import GenerationConfig
from runtime.errors import RequestError
from runtime.structured.constraints import Constraint, ConstraintError, Grammar, Grammars
from runtime.text.tokenizer import TextTokenizer


class Model:
    def __init__(
        self, artifact: Artifact, tokenizer: TextTokenizer | None = None, log_pruning_tolerance: Tolerance = AS_EXPORTED
    ):  # fmt: skip
        """`log_pruning_tolerance`: forget-gate pruning as the artifact was exported with ("artifact"), at another
        tolerance, or none (None); see runtime/cache/pruning.py."""
        self.artifact, self.tokenizer = artifact, tokenizer
        try:
            self.pruning = Pruning.of(artifact.manifest, log_pruning_tolerance)
        except ValueError as error:
            raise RequestError(str(error)) from None
        if self.pruning is not None and not held_in_place(artifact.static, artifact.attention):
            raise RequestError(
                "forget-gate pruning needs a static cache or gqa attention; this dynamic artifact copies its cache "
                "each step: run it with log_pruning_tolerance None, or re-export it with --cache static"
            )
        tokens = artifact.manifest["special_tokens"]
        self.eos = tuple(tokens["eos"] or ())
        self.pad = tokens["pad"] if tokens["pad"] is not None else (self.eos[0] if self.eos else 0)
        self._grammars: Grammars | None = None  # structured outputs, set up by the first request that has one

    @classmethod
    def open(
        cls, folder: str | Path, options: SessionOptions | None = None, log_pruning_tolerance: Tolerance = AS_EXPORTED
    ) -> Model:  # fmt: skip
        artifact = Artifact.open(folder, options or SessionOptions())
        return cls(artifact, TextTokenizer.open(artifact.folder, artifact.manifest), log_pruning_tolerance)

    def encode(self, prompts: str | list[str] | list[list[int]]) -> list[list[int]]:
        """Token ids as given, or a text's as the artifact's tokenizer makes them (escaped, with its BOS first where
        the manifest's `text` says so)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts and all(isinstance(p, str) for p in prompts):
            if self.tokenizer is None:
                raise RequestError("this artifact has no tokenizer; pass token ids instead of text", "prompt")
            return self.tokenizer.encode_batch(prompts)
        return [list(map(int, p)) for p in prompts]

    def thresholds(self, positions: int) -> np.ndarray | None:
        """Pruning's thresholds `[layers, heads]` for a request of `positions` positions (None: keep every key)."""
        return None if self.pruning is None else self.pruning.thresholds(positions)

    def check_request(self, prompts: list[list[int]], config: GenerationConfig) -> None:
        """Refuse what cannot run, before any work, naming the limit and the fix."""
        limits = self.artifact.manifest["cache"]
        vocab = self.artifact.vocab_size
        if not prompts or any(len(p) == 0 for p in prompts):
            raise RequestError("empty prompt: give at least one token per row", "prompt")
        if config.num_return_sequences < 1:
            raise RequestError(f"num_return_sequences must be >= 1, got {config.num_return_sequences}")
        if config.beams is not None:
            self.check_beams(config)
        forks = config.num_return_sequences if config.beams is None else config.beams.num_beams
        rows = len(prompts) * forks  # each answer (or beam) decodes in a row of its own
        if rows > limits["max_batch"]:
            kind = "answers" if config.beams is None else "beams"
            answers = f" ({len(prompts)} prompts x {forks} {kind})" if rows > len(prompts) else ""
            raise RequestError(
                f"batch {rows}{answers} exceeds this artifact's max batch {limits['max_batch']}; "
                "re-export with a larger --max-batch",
                "prompt",
            )
        bad = sorted({t for p in prompts for t in p if not 0 <= t < vocab})
        if bad:
            raise RequestError(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab})", "prompt")
        if config.max_new_tokens < 1 or not 0 <= config.min_new_tokens <= config.max_new_tokens:
            raise RequestError("need max_new_tokens >= 1 and 0 <= min_new_tokens <= max_new_tokens")
        needed = max(map(len, prompts)) + config.max_new_tokens - 1  # the last new token is never fed back
        pruned = self.pruning is not None  # slots bound the kept positions then, not all of them
        if limits["max_cache_len"] is not None and needed > limits["max_cache_len"] and not pruned:
            raise RequestError(
                f"prompt ({max(map(len, prompts))} tokens) plus max_new_tokens ({config.max_new_tokens}) needs "
                f"{needed} cache positions, over this artifact's max_cache_len {limits['max_cache_len']}; "
                "shorten them or re-export with a larger --max-cache-len",
                "prompt",
            )
        config.sampling.validate(vocab)
        if config.speculative is not None:
            config.speculative.check(self, [p for p in prompts for _ in range(forks)], config)
            self.check_runs_of_tokens(rows)
        if config.constraint is not None:
            self.grammar(config.constraint)
            if config.min_new_tokens:
                raise ConstraintError(
                    "min_new_tokens cannot be combined with a constraint: the constraint decides where the text ends"
                )

    def check_beams(self, config: GenerationConfig) -> None:
        """Beam search scores every continuation by the model's own log-probabilities: refuse what would change
        them or choose otherwise."""
        config.beams.check(config.num_return_sequences)
        changed = [name for name, on in (("sampling (temperature > 0)", config.sampling.temperature > 0),
                                         ("penalties or logit_bias", not config.sampling.neutral),
                                         ("speculative decoding", config.speculative is not None),
                                         ("a constraint", config.constraint is not None)) if on]  # fmt: skip
        if changed:
            raise RequestError(f"beam search takes none of {', '.join(changed)}: drop them, or search without beams")

    def grammar(self, constraint: Constraint | None) -> Grammar | None:
        """The constraint compiled for this artifact's tokenizer (once; ConstraintError where it cannot be)."""
        if constraint is None:
            return None
        if self._grammars is None:
            if self.tokenizer is None:
                raise ConstraintError("structured outputs need the artifact's tokenizer; this artifact has none")
            self._grammars = Grammars(self.tokenizer, self.artifact.vocab_size, self.eos)
        return self._grammars.compile(constraint)

    def check_runs_of_tokens(self, rows: int) -> None:
        """Refuse speculative decoding where this artifact cannot run a token and its drafts in one run for `rows`."""
        if rows > 1 and self.artifact.attention == "gqa":
            raise RequestError(
                "speculative decoding runs a token and its drafts in one run, which GroupQueryAttention takes for "
                "one row only: send the prompts one by one, or use an artifact exported with another --attention",
                "prompt",
            )
        if self.pruning is not None and not runs_keep_head_windows(self.artifact.manifest):
            raise RequestError(
                "speculative decoding runs a token and its drafts in one run, which this artifact, exported "
                "before a chunk could keep each head's own window, cannot do once pruning has staggered them: "
                "re-export it, or turn pruning off (log_pruning_tolerance None)",
                "prompt",
            )
