"""The resumable-sweep machinery shared by `qkvshare synthetic` and `qkvshare vision`.

A sweep is a list of independent runs ("cells"), each with a key that names its grid point and its recipe. Every
finished cell is appended to `results.csv` at once (and its loss curve to a JSON-lines file), so an interrupted
sweep loses at most the cells in flight, and a rerun trains only the keys not in the CSV yet (`pending`).

The commands' arguments (one flag per field of `SweepArgs` / `VisionArgs`) are `qkvshare_cli.synthetic` and
`qkvshare_cli.vision`.
"""

from __future__ import annotations

import csv
import json
import multiprocessing
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


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


def print_sweep_result(result: Any, start: float) -> None:
    """Print a finished sweep: its table, the cells trained and skipped with the wall time since `start`
    (`time.perf_counter()`), and the files it wrote (`result.table`, `.trained`, `.skipped`, `.files`)."""
    print(result.table)
    print(
        f"trained {len(result.trained)} cells, skipped {len(result.skipped)} finished ones, "
        f"{time.perf_counter() - start:.0f} s wall"
    )
    for name, path in result.files.items():
        print(f"{name}: {path}")


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value) of a non-empty collection."""
    values = list(values)
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return mean, std


__all__ = ["read_results", "pending", "run_cells", "print_sweep_result", "mean_std"]
