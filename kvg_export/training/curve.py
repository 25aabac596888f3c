"""The loss-curve PNG of a training run: training loss by step (raw and smoothed), validation loss at its
intervals, and the unigram baseline the model must beat."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no screen here, and none needed
import matplotlib.pyplot as plt
import numpy as np

SMOOTHING_STEPS = 50


def plot_losses(
    path: Path,
    title: str,
    train: list[tuple[int, float]],
    validation: list[tuple[int, float]],
    validation_segments: int,
    unigram: float,
) -> None:
    steps, losses = np.array(train, dtype=float).T if train else (np.zeros(0), np.zeros(0))
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    axes.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="training (per step)")
    if len(losses) >= SMOOTHING_STEPS:
        smooth = np.convolve(losses, np.ones(SMOOTHING_STEPS) / SMOOTHING_STEPS, mode="valid")
        axes.plot(
            steps[SMOOTHING_STEPS - 1 :], smooth, color="tab:blue", label=f"training ({SMOOTHING_STEPS}-step mean)"
        )
    if validation:
        axes.plot(
            *np.array(validation, dtype=float).T,
            "o-",
            color="tab:orange",
            markersize=3,
            label=f"validation (first {validation_segments} segments)",
        )
    axes.axhline(unigram, color="gray", linestyle="--", linewidth=1, label=f"unigram baseline ({unigram:.2f})")
    axes.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    axes.set_ylim(0, unigram * 1.3)  # the first steps' loss (about log vocab) would flatten the rest
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
