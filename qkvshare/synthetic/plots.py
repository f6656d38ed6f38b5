"""Figures of `qkvshare synthetic`: learned attention maps (rows: tasks, columns: variants) and loss curves.

Attention maps are read with `attn_implementation="eager"` and `output_attentions=True` from the models saved for
the sweep's figure cell, averaged over heads and over a batch of fresh test sequences, so positional structure
(anti-diagonal for REVERSE, shifted diagonals for SWAP, the diagonal for COPY/SUB) stands out from content.
Loss curves are averaged over every run of a variant and task, on a common 0..1 training-progress axis.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from qkvshare import QKVShareForTokenClassification
from qkvshare.analysis.plotting import pyplot

from .tasks import make_dataset


@torch.no_grad()
def mean_attention_map(
    model_dir: str | Path, task: str, length: int, layer: int, num_sequences: int = 64
) -> torch.Tensor:
    """(T, T) attention of one layer of a saved encoder, mean over heads and `num_sequences` test sequences."""
    model = QKVShareForTokenClassification.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    x, _ = make_dataset(task, num_sequences, length, seed=10_007)
    attentions = model(input_ids=x, output_attentions=True).attentions  # per layer: (B, H, T, T)
    return attentions[layer].mean(dim=(0, 1))


def plot_attention_maps(
    cells: list,
    models_dir: Path,
    dir_name: Callable,
    variants: list[str],
    tasks: list[str],
    layer: int,
    path: Path,
) -> str | None:
    """Grid of attention maps for the figure cells whose models exist; returns the PNG path (None if none exist)."""
    by_key = {(c.task, c.label): c for c in cells if (Path(models_dir) / dir_name(c)).exists()}
    if not by_key:
        return None
    plt = pyplot("the synthetic figures", hint="or pass --no_plots")
    fig, axes = plt.subplots(len(tasks), len(variants), figsize=(1.9 * len(variants), 1.9 * len(tasks)), squeeze=False)
    for r, task in enumerate(tasks):
        for c, variant in enumerate(variants):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            cell = by_key.get((task, variant))
            if cell is not None:
                attention = mean_attention_map(Path(models_dir) / dir_name(cell), task, cell.length, layer)
                ax.imshow(attention.numpy(), cmap="viridis", vmin=0.0)
            if r == 0:
                ax.set_title(variant, fontsize=9)
            if c == 0:
                ax.set_ylabel(task.upper(), fontsize=9)
    any_cell = next(iter(by_key.values()))
    fig.suptitle(
        f"Attention (layer {layer}, mean over heads and 64 inputs)\nemb {any_cell.embedding_size}, "
        f"{any_cell.layers} layers, {any_cell.heads} heads, length {any_cell.length}, seed {any_cell.seed}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_loss_curves(
    curves_path: Path, keys: set[str], variants: list[str], tasks: list[str], path: Path, points: int = 100
) -> str | None:
    """One panel per task, one line per variant: mean training loss over the runs (interpolated to `points`)."""
    curves: dict[tuple[str, str], list[torch.Tensor]] = {}
    if not Path(curves_path).exists():
        return None
    with open(curves_path) as f:
        for line in f:
            record = json.loads(line)
            if record["key"] not in keys or not record["losses"]:
                continue
            losses = torch.tensor(record["losses"])[None, None]  # (1, 1, steps)
            resampled = torch.nn.functional.interpolate(losses, size=points, mode="linear", align_corners=True)[0, 0]
            curves.setdefault((record["variant"], record["task"]), []).append(resampled)
    if not curves:
        return None
    plt = pyplot("the synthetic figures", hint="or pass --no_plots")
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3.0), squeeze=False)
    progress = torch.linspace(0, 1, points)
    for i, task in enumerate(tasks):
        ax = axes[0][i]
        for variant in variants:
            runs = curves.get((variant, task))
            if runs:
                ax.plot(progress, torch.stack(runs).mean(0), label=variant, linewidth=1.2)
        ax.set_title(task.upper(), fontsize=10)
        ax.set_xlabel("training progress")
        ax.set_ylim(bottom=0)
        if i == 0:
            ax.set_ylabel("train loss (mean over runs)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


__all__ = ["plot_attention_maps", "plot_loss_curves", "mean_attention_map"]
