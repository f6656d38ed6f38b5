"""The resumable-sweep machinery shared by `qkvshare synthetic` and `qkvshare vision`.

A sweep is a list of independent runs ("cells"), each with a key that names its grid point and its recipe. Every
finished cell is appended to `results.csv` at once (and its loss curve to a JSON-lines file), so an interrupted
sweep loses at most the cells in flight, and a rerun trains only the keys not in the CSV yet (`pending`). A cell
trains with `train_steps` (warmup then cosine to 0, gradient clipping), whose row ends with `RUN_FIELDS`.

The commands' arguments (one flag per field of `SweepArgs` / `VisionArgs`) are `qkvshare_settings.synthetic` and
`qkvshare_settings.vision`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import multiprocessing
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from qkvshare.train import schedule

# The columns every sweep's row ends with: what `train_steps` measures of a cell's training.
RUN_FIELDS = ("final_train_loss", "steps", "num_parameters", "train_seconds", "cpu_seconds")


def read_results(path: Path) -> list[dict]:
    """Rows of a results CSV (empty list if the file does not exist)."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def pending(cells: Sequence[Any], csv_path: Path) -> tuple[list[Any], list[str]]:
    """The cells whose `key` is not in `csv_path` yet, and the keys of those that are (skipped)."""
    done = {row["key"] for row in read_results(csv_path)}
    return [cell for cell in cells if cell.key not in done], [cell.key for cell in cells if cell.key in done]


def run_cells(
    jobs: Sequence[Any],
    worker: Callable[[Any], tuple[str, dict, list[float]]],
    csv_path: Path,
    curves_path: Path,
    fields: Sequence[str],
    labels: Sequence[str] | Callable[[dict], dict],
    workers: int = 1,
    desc: str = "cells",
) -> list[str]:
    """Run `worker(job)` for every job (in `workers` spawned processes when > 1) behind one progress bar.

    `worker` returns (key, CSV row, per-step losses); each result is appended to `csv_path` (columns `fields`,
    header written when the file is new) and to `curves_path` as ``{"key", <labels>, "losses"}`` as soon as it
    arrives, flushed. `labels` names the row's columns to copy, or maps a row to the label fields itself.
    `worker` must be a module-level function (the spawned processes import it).
    Returns the keys trained, in the order they finished.
    """
    trained: list[str] = []
    new_file = not csv_path.exists()
    with csv_path.open("a", newline="") as csv_file, curves_path.open("a") as curves_file:
        writer = csv.DictWriter(csv_file, fieldnames=list(fields))
        if new_file:
            writer.writeheader()

        def record(key: str, row: dict, losses: list[float]) -> None:
            writer.writerow(row)
            csv_file.flush()
            named = labels(row) if callable(labels) else {name: row[name] for name in labels}
            curve = {"key": key} | named | {"losses": losses}
            curves_file.write(json.dumps(curve) + "\n")
            curves_file.flush()
            trained.append(key)
            bar.update(1)

        bar = tqdm(total=len(jobs), desc=desc, unit="cell", disable=not jobs)
        if workers > 1 and len(jobs) > 1:
            with multiprocessing.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
                for result in pool.imap_unordered(worker, jobs):
                    record(*result)
        else:
            for job in jobs:
                record(*worker(job))
        bar.close()
    return trained


def get_lr(step: int, total_steps: int, peak: float, warmup_fraction: float) -> float:
    """Linear warmup over `warmup_fraction` of the steps, then cosine to 0: `qkvshare.train.schedule.get_lr`
    (the one home of the schedule) with a 0 floor."""
    warmup = schedule.warmup_steps_for_fraction(warmup_fraction, total_steps)
    return schedule.get_lr(step, peak_lr=peak, warmup_steps=warmup, max_steps=total_steps, min_lr_ratio=0.0)


def train_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    loss_fn: Callable[[Any], torch.Tensor],
    total_steps: int,
    recipe: Any,
) -> tuple[list[float], dict[str, Any]]:
    """A cell's training loop: per batch, the learning rate of `get_lr` (peak ``recipe.lr``, warmup over
    ``recipe.warmup_fraction`` of ``total_steps``), ``loss_fn(batch)``, backward, a clip of the gradient norm to
    ``recipe.grad_clip``, an optimizer step. ``recipe`` is the cell. Returns the per-step losses and the row's
    `RUN_FIELDS`: the mean loss of the last 10 steps, ``total_steps``, the parameters, and the loop's wall-clock
    seconds and CPU seconds (this process, all its threads: a cost that other load on the machine barely moves)."""
    losses: list[float] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    model.train()
    for batch in batches:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(len(losses), total_steps, recipe.lr, recipe.warmup_fraction)
        loss = loss_fn(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    train_seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    summary = {
        "final_train_loss": round(sum(losses[-10:]) / len(losses[-10:]), 5),
        "steps": total_steps,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(train_seconds, 2),
        "cpu_seconds": round(cpu_seconds, 2),
    }
    return losses, summary


@dataclasses.dataclass
class SweepResult:
    """What a sweep did: keys trained now, keys skipped (already in the CSV), its rows, table and files (name ->
    path), and its wall-clock seconds."""

    trained: list[str]
    skipped: list[str]
    rows: list[dict]
    table: str
    files: dict[str, str]
    seconds: float


def print_sweep_result(result: SweepResult) -> None:
    """Print a finished sweep: its table, the cells trained and skipped with its wall time, and its files."""
    print(result.table)
    print(
        f"trained {len(result.trained)} cells, skipped {len(result.skipped)} finished ones, {result.seconds:.0f} s wall"
    )
    for name, path in result.files.items():
        print(f"{name}: {path}")


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value) of a non-empty collection."""
    values = list(values)
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return mean, std


__all__ = [
    "RUN_FIELDS",
    "read_results",
    "pending",
    "run_cells",
    "get_lr",
    "train_steps",
    "SweepResult",
    "print_sweep_result",
    "mean_std",
]
