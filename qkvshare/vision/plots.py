"""Figures of `qkvshare vision`: accuracy per variant (every seed), and attention maps of a few test images.

Attention maps are read with `attn_implementation="eager"` and `output_attentions=True` from the models saved for
the first seed: the last layer's attention of the class token over the patches (with `pooling="mean"`, the mean
attention every patch receives), averaged over heads, drawn on the patch grid next to the image.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from qkvshare import QKVShareForImageClassification
from qkvshare.analysis.plotting import pyplot


def plot_accuracy(rows: list[dict], variants: list[str], task: str, path: Path) -> str | None:
    """One column per variant: each seed's accuracy as a dot, the mean as a bar."""
    if not rows:
        return None
    plt = pyplot("qkvshare vision's figures", hint="or pass --no_plots")
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(variants)), 3.4))
    for i, variant in enumerate(variants):
        values = [float(r["accuracy"]) for r in rows if r["variant"] == variant]
        if values:
            ax.bar(i, sum(values) / len(values), color="tab:blue", alpha=0.35)
            ax.plot([i] * len(values), values, "o", color="tab:blue", markersize=4)
    accuracies = [float(r["accuracy"]) for r in rows]
    low = min(accuracies)
    ax.set_ylim(max(0.0, low - 0.1 * (1 - low) - 0.02), 1.0)
    ax.set_xticks(range(len(variants)), variants, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("test accuracy" if task == "classify" else "set accuracy")
    ax.set_title(f"qkvshare vision --task {task}: per seed (dots) and mean (bars)", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


@torch.no_grad()
def patch_attention(model_dir: str | Path, pixel_values: torch.Tensor) -> torch.Tensor:
    """(B, grid, grid) last-layer attention over the patches (of the class token, or received on average)."""
    model = QKVShareForImageClassification.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    attention = model(pixel_values=pixel_values, output_attentions=True).attentions[-1].mean(dim=1)  # (B, T, T)
    if model.config.pooling == "cls":
        over_patches = attention[:, 0, 1:]  # what the class token reads
    else:
        over_patches = attention.mean(dim=1)  # what the mean-pooled output reads, on average
    side = int(round(over_patches.shape[-1] ** 0.5))
    return over_patches.reshape(-1, side, side)


def plot_attention_maps(
    cells: list, models_dir: Path, dir_name: Callable, data_path: str, num_images: int, path: Path
) -> str | None:
    """Rows: test images; columns: the image, then one attention map per variant whose model exists."""
    found = [c for c in cells if (Path(models_dir) / dir_name(c)).exists()]
    if not found or num_images < 1:
        return None
    images = load_file(data_path)["test_x"][:num_images]
    plt = pyplot("qkvshare vision's figures", hint="or pass --no_plots")
    columns = 1 + len(found)
    fig, axes = plt.subplots(len(images), columns, figsize=(1.6 * columns, 1.6 * len(images)), squeeze=False)
    maps = [patch_attention(Path(models_dir) / dir_name(c), images) for c in found]
    for r, image in enumerate(images):
        axes[r][0].imshow(((image + 1) / 2).clamp(0, 1).permute(1, 2, 0).numpy())
        for c, cell in enumerate(found, start=1):
            axes[r][c].imshow(maps[c - 1][r].numpy(), cmap="viridis", vmin=0.0)
            if r == 0:
                axes[r][c].set_title(cell.variant, fontsize=8)
        for ax in axes[r]:
            ax.set_xticks([])
            ax.set_yticks([])
    axes[0][0].set_title("image", fontsize=8)
    fig.suptitle("Last-layer attention over the patches (mean over heads), first seed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


__all__ = ["plot_accuracy", "plot_attention_maps", "patch_attention"]
