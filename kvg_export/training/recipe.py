"""A trained preset's recipe: the `training` section of its `preset.json`, everything a run needs besides the
model's config.json, so that `kvg-train PRESET` reproduces the preset from nothing."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path


def has_recipe(preset: Path) -> bool:
    return "training" in json.loads((preset / "preset.json").read_text())


@dataclass(frozen=True)
class TrainingRecipe:
    seed: int  # weight init; batch k is drawn from a generator seeded with (seed, k)
    seq_len: int  # tokens per training segment, and per evaluation segment
    batch_size: int  # segments per step
    steps: int
    learning_rate: float  # peak, after a linear warm-up; then a cosine down to min_lr_ratio of it
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1  # on matrices only, not on norms or biases
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global gradient norm
    eval_every: int = 250  # steps between validation losses on the first eval_segments segments
    eval_segments: int = 64
    checkpoint_every: int = 250  # steps between checkpoints (and always at the end)

    @classmethod
    def from_preset(cls, preset: Path) -> TrainingRecipe:
        settings = json.loads((preset / "preset.json").read_text()).get("training")
        if settings is None:
            raise ValueError(f"{preset.name} has no training recipe: it is a random-weight preset")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"{preset / 'preset.json'}: unknown training settings {unknown}; known: {sorted(known)}")
        if "betas" in settings:
            settings = {**settings, "betas": tuple(settings["betas"])}
        recipe = cls(**settings)
        if not 0 <= recipe.warmup_steps < recipe.steps or recipe.seq_len < 2 or recipe.batch_size < 1:
            raise ValueError(f"{preset / 'preset.json'}: need 0 <= warmup_steps < steps, seq_len >= 2, batch_size >= 1")
        return recipe

    def learning_rate_at(self, step: int) -> float:
        """The rate for the update after `step` completed steps."""
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        floor = self.min_lr_ratio * self.learning_rate
        return floor + (self.learning_rate - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def to_json(self) -> dict:
        return {**asdict(self), "betas": list(self.betas)}
