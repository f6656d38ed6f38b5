"""The side-by-side markdown table of `qkvshare eval`, laid out like the paper's downstream table (Table 11).

One row per model: its name, variant, parameter count and KV-cache bytes per token, then each task's acc and
acc_norm in percent with lm-eval's standard error, then two averages over tasks. lm-eval's winogrande
defines only acc (partial scoring), so its acc_norm cell is "–" and "Avg acc_norm" uses its acc there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .tasks import OFFLINE_TASKS

METRICS = ("acc", "acc_norm")


@dataclass
class ModelRow:
    """One evaluated model: what the table prints about it besides the task scores."""

    name: str  # as given on the command line
    variant: str  # paper variant name, or the model_type for non-QKVShare models
    num_parameters: int
    kv_bytes_per_token: int | None  # at `kv_bytes_per_element` bytes per element
    results: dict[str, Any]  # lm-eval's results dict (the "results" key of its JSON)


def metric(task_results: dict[str, Any], name: str) -> tuple[float, float | None] | None:
    """(value, stderr) of metric `name` under lm-eval's default filter, or None when the task lacks it."""
    value = task_results.get(f"{name},none")
    if value is None:
        return None
    stderr = task_results.get(f"{name}_stderr,none")
    stderr = float(stderr) if isinstance(stderr, int | float) and math.isfinite(stderr) else None
    return float(value), stderr


def _cell(m: tuple[float, float | None] | None) -> str:
    if m is None:
        return "–"
    value, stderr = m
    return f"{100 * value:.2f}" + (f" ± {100 * stderr:.2f}" if stderr is not None else "")


def averages(results: dict[str, Any], tasks: list[str]) -> dict[str, float | None]:
    """Mean over tasks (in [0, 1]) of acc, and of acc_norm falling back to acc where a task has no acc_norm."""
    accs = [m[0] for t in tasks if (m := metric(results.get(t, {}), "acc"))]
    norms = [m[0] for t in tasks if (m := metric(results.get(t, {}), "acc_norm") or metric(results.get(t, {}), "acc"))]
    return {
        "acc": sum(accs) / len(accs) if accs else None,
        "acc_norm": sum(norms) / len(norms) if norms else None,
    }


def markdown_table(rows: list[ModelRow], tasks: list[str], num_fewshot: int, kv_bytes_per_element: int = 2) -> str:
    """The markdown table (with a caption line) for `rows` over `tasks`."""
    labels = [OFFLINE_TASKS[t].label if t in OFFLINE_TASKS else t for t in tasks]
    header = ["Model", "Variant", "Params", f"KV B/token ({8 * kv_bytes_per_element}-bit)"]
    header += [f"{label} {m}" for label in labels for m in METRICS] + ["Avg acc", "Avg acc_norm"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    for row in rows:
        avg = averages(row.results, tasks)
        cells = [
            row.name,
            row.variant,
            f"{row.num_parameters:,}",
            "–" if row.kv_bytes_per_token is None else f"{row.kv_bytes_per_token:,}",
        ]
        cells += [_cell(metric(row.results.get(t, {}), m)) for t in tasks for m in METRICS]
        cells += ["–" if avg[k] is None else f"{100 * avg[k]:.2f}" for k in METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    caption = (
        f"{num_fewshot}-shot accuracy (%) ± standard error, lm-evaluation-harness. Avg acc_norm uses acc for "
        "tasks without acc_norm (WinoGrande). KV B/token: KV-cache bytes per token, all layers."
    )
    return caption + "\n\n" + "\n".join(lines) + "\n"
