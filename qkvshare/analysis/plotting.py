"""Plots of the commands (matplotlib, Agg backend: files only, no display needed): `pyplot` for every figure, and
the line plots of the analysis commands."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

from qkvshare_settings.extras import require


def pyplot(feature: str, hint: str = "") -> ModuleType:
    """`matplotlib.pyplot` on the Agg backend, or a `MissingExtraError` naming the "plots" extra that ``feature``
    needs (``hint``: a way around, e.g. "or pass --no_plots")."""
    require("matplotlib", "plots", feature, hint=hint).use("Agg")
    return require("matplotlib.pyplot", "plots", feature, hint=hint)


def line_plot(
    path: str | Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    dashed: Sequence[str] = (),
    panels: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]] | None = None,
    ylabels: Mapping[str, str] | None = None,
) -> Path:
    """Save a PNG with one line per series name; ``panels`` draws several side-by-side subplots instead.

    Series listed in ``dashed`` (references such as LlamaForCausalLM) are drawn dashed, above the others.
    ``ylabels`` gives a panel its own y label (by panel title; ``ylabel`` for the others).
    """
    plt = pyplot("plots")

    groups = dict(panels) if panels else {title: series}
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, (panel_title, panel) in zip(axes[0], groups.items()):
        colors = plt.get_cmap("tab10" if len(panel) <= 10 else "tab20").colors
        for k, (name, (xs, ys)) in enumerate(panel.items()):
            ax.plot(
                xs,
                ys,
                marker="o" if len(xs) <= 30 else None,
                color=colors[k % len(colors)],
                linestyle="--" if name in dashed else "-",
                zorder=3 if name in dashed else 2,  # a reference stays visible where a series lies on it
                label=name,
            )
        ax.set_xlabel(xlabel)
        ax.set_ylabel((ylabels or {}).get(panel_title, ylabel))
        ax.set_title(panel_title)
        if logx:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if panels:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
