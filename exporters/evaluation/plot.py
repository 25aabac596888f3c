"""The PNG of one evaluation's perplexity against segment position: eager and artifact over log-spaced
position bins (Evaluation.curve), on a log position axis, to see whether quality holds deep into a long
context and where an artifact drifts from eager. matplotlib loads only when a plot is asked for, so that
importing the evaluation stays cheap."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from exporters.evaluation.evaluate import Evaluation
from kvg_export.folders import write_whole


def plot_perplexity_by_position(evaluation: Evaluation, path: Path) -> None:
    """Draw each bin's perplexity at its positions' geometric middle and write the PNG whole to `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    bins = evaluation.curve
    middles = np.sqrt([b.first * b.last for b in bins])
    figure = Figure(figsize=(7, 4), dpi=100)
    axes = figure.subplots()
    axes.plot(middles, [b.eager_perplexity for b in bins], "o-", markersize=3, label=evaluation.eager.name)
    if evaluation.artifact is not None:
        artifact = [b.artifact_perplexity for b in bins]
        axes.plot(middles, artifact, "s--", markersize=3, label=evaluation.artifact.name)
    axes.set_xscale("log")
    axes.set_yscale("log")  # the first positions' perplexity is tens of times the rest's
    axes.set(
        xlabel="position in segment (tokens before the predicted one)",
        ylabel="perplexity",
        title=f"{evaluation.model}: {evaluation.segments} segments of {evaluation.segment_tokens} tokens",
    )
    axes.grid(alpha=0.3, which="both")
    axes.legend()
    figure.tight_layout()
    png = io.BytesIO()
    FigureCanvasAgg(figure).print_png(png)
    write_whole(path, png.getvalue())
