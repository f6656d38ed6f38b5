"""`qkvshare synthetic`: train bidirectional encoders on the paper's five synthetic tasks over a grid of variants.

One run ("cell") = (variant, task, embedding size, layers, heads, length, seed) trained with the paper's recipe
(section 4.1: Adam 1e-3, 5% linear warmup then cosine to 0, grad-norm clip 5, batch 128, 2 epochs over 10k
sequences, token accuracy on 2k held-out sequences). Outputs in `--output_dir`:

- `results.csv`: one row per finished cell, appended as soon as the cell ends. A rerun skips every cell whose key
  (grid point + recipe) is already there, so a sweep is resumable and can be extended by adding grid values.
- `loss_curves.jsonl`: the training loss of each cell (one JSON line per cell, same key).
- `table.md`: mean ± std token accuracy per variant and task in the paper's layout, next to the paper's numbers.
- `attention_maps.png` (rows: tasks, columns: variants) from the models of the "figure cell" (the first value of
  every grid list, first seed), saved under `models/` as safetensors; `loss_curves.png` (one panel per task).

Design choices
- The encoder is `QKVShareForTokenClassification` with `is_causal=False`, `num_labels=10` and GPT-2-style blocks
  (pre-LayerNorm, GELU MLP 4x, biases) with learned absolute positions added to the token embedding, like the
  paper's synthetic encoder. With Q=K the scores K K^T are a Gram matrix (symmetric, diagonal-dominant up to norms),
  so the absolute position is the only way to route by position; "+" adds the only asymmetric term.
- The "+" 1x1 map starts from xavier-uniform weights, as in the original code behind the paper's synthetic table.
  Measured on the default grid (3 seeds): with the library's `unit_scale` init (sum(w) = 1, scores start as without
  "+") (Q=K=V)+ stays at Q=K=V's level or below on REVERSE/SWAP (.305/.369 vs .471/.385); with xavier it reaches
  .733/.735. Note that P.w = row(i).w_r + col(j).w_c + b: the row term is constant along a softmax row, so "+" acts
  as a learned temperature sum(w) plus a key-position bias, not as an (i, j)-dependent routing.
- Cells are independent: the seed fixes the initialization, the data and the shuffling. Cells run in `--workers`
  processes with `--threads` torch threads each (tiny models: one thread per process is the efficient choice).
- `--position_types learned rope alibi` trains every variant with each position scheme (default: learned, the
  paper's). A cell's position type is part of its key only when it is not "learned", so earlier results stay
  valid; the table labels such rows `variant [rope]`, and the paper's numbers sit next to the learned rows only.
  The QV source's claim (K=V loses least when positions stay out of V) is what `rope` and `alibi` test.
- `--grid default` (emb 64, 2 layers, 4 heads, length 32, seeds 0-2: 90 cells) is sized for about 15 minutes on
  2 free CPU cores and is the cheapest measured corner of the paper's grid that separates the variants (see the
  comment on `qkvshare_settings.synthetic.GRIDS`, where the arguments are); `--grid paper` is the paper's full grid
  (3 x 2 x 2 x 3 x 3 seeds = 108 runs per variant and task, 3240 in all). Any axis can be overridden
  (`--lengths 16 32`), and the table then covers exactly the cells of the requested grid.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from qkvshare import QKVShareConfig, QKVShareForTokenClassification
from qkvshare.analysis import sweeps
from qkvshare.analysis.sweeps import SweepResult, get_lr
from qkvshare.configuration_qkvshare import (
    ARCHITECTURE_STYLES,
    ATTENTION_MAP_PE_INITS,
    POSITION_EMBEDDING_TYPES,
    resolve_variant,
)
from qkvshare_settings.conventions import slug
from qkvshare_settings.synthetic import TASKS, SweepArgs

from .plots import plot_attention_maps, plot_loss_curves
from .tasks import NUM_SYMBOLS, make_dataset

# The paper's table (Table 2; docs/research.md, section 4.5): mean token accuracy over its whole grid.
PAPER_TABLE: dict[str, dict[str, float]] = {
    "QKV": {"reverse": 0.698, "sort": 0.971, "sub": 1.0, "swap": 0.588, "copy": 1.0},
    "Q=K-V": {"reverse": 0.705, "sort": 0.967, "sub": 1.0, "swap": 0.597, "copy": 1.0},
    "(Q=K-V)+": {"reverse": 0.718, "sort": 0.963, "sub": 1.0, "swap": 0.671, "copy": 1.0},
    "Q-K=V": {"reverse": 0.701, "sort": 0.958, "sub": 1.0, "swap": 0.590, "copy": 1.0},
    "Q=K=V": {"reverse": 0.514, "sort": 0.939, "sub": 1.0, "swap": 0.446, "copy": 1.0},
    "(Q=K=V)+": {"reverse": 0.581, "sort": 0.957, "sub": 1.0, "swap": 0.576, "copy": 1.0},
}

CSV_FIELDS = [
    "key",
    "variant",
    "task",
    "embedding_size",
    "layers",
    "heads",
    "length",
    "seed",
    "train_size",
    "test_size",
    "epochs",
    "batch_size",
    "lr",
    "map_pe_init",
    "position_type",
    "token_accuracy",
    "sequence_accuracy",
    *sweeps.RUN_FIELDS,
]


@dataclass(frozen=True)
class Cell:
    """One training run of the sweep, with the recipe it used (part of its identity)."""

    variant: str
    task: str
    embedding_size: int
    layers: int
    heads: int
    length: int
    seed: int
    train_size: int
    test_size: int
    epochs: int
    batch_size: int
    lr: float
    warmup_fraction: float
    grad_clip: float
    map_pe_init: str
    attn_implementation: str
    position_type: str = "learned"

    @property
    def label(self) -> str:
        """The variant as the table and figures name it: with its position type unless that is "learned"."""
        return self.variant if self.position_type == "learned" else f"{self.variant} [{self.position_type}]"

    @property
    def key(self) -> str:
        return (
            f"{self.variant}|{self.task}|e{self.embedding_size}|l{self.layers}|h{self.heads}|t{self.length}|s{self.seed}"
            f"|n{self.train_size}/{self.test_size}|ep{self.epochs}|b{self.batch_size}|lr{self.lr:g}"
            f"|w{self.warmup_fraction:g}|c{self.grad_clip:g}"
            # the "+" init changes nothing else: other variants keep their key (and results) across inits
            + (f"|pe-{self.map_pe_init}" if self.variant.strip().endswith("+") else "")
            + (f"|pos-{self.position_type}" if self.position_type != "learned" else "")
        )

    @property
    def grid_point(self) -> tuple[int, int, int, int, int]:
        return (self.embedding_size, self.layers, self.heads, self.length, self.seed)


def validate(args: SweepArgs) -> list[Cell]:
    """Check every argument before any training and return the cells of the sweep (a clear ValueError if bad)."""
    axes = args.axes()
    for task in args.tasks:
        if task not in TASKS:
            raise ValueError(f"task {task!r} is not a synthetic task; allowed: {', '.join(TASKS)}.")
    if args.map_pe_init not in ATTENTION_MAP_PE_INITS:
        raise ValueError(f"map_pe_init={args.map_pe_init!r}; allowed: {', '.join(ATTENTION_MAP_PE_INITS)}.")
    for position_type in args.position_types:
        if position_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position type {position_type!r} is not known; allowed: {', '.join(POSITION_EMBEDDING_TYPES)}."
            )
    if len(set(args.position_types)) != len(args.position_types):
        raise ValueError(f"position_types has duplicates: {args.position_types}.")
    for heads in axes["heads"]:
        for variant in args.variants:
            for emb in axes["embedding_sizes"]:
                resolve_variant(variant, {"num_attention_heads": heads, "hidden_size": emb})  # names a bad variant
    for emb in axes["embedding_sizes"]:
        for heads in axes["heads"]:
            if emb % heads:
                raise ValueError(f"embedding size {emb} is not divisible by {heads} heads; choose sizes heads divide.")
    for length in axes["lengths"]:
        if length < 2 or ("swap" in args.tasks and length % 2):
            raise ValueError(f"length {length}: lengths must be >= 2, and even when the swap task is included.")
    for name in ("train_size", "test_size", "epochs", "batch_size", "workers", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}={getattr(args, name)} must be a positive integer.")
    if not 0 <= args.warmup_fraction < 1 or args.lr <= 0 or args.grad_clip <= 0:
        raise ValueError("need 0 <= warmup_fraction < 1, lr > 0 and grad_clip > 0.")
    grid = {"variant", "task", "embedding_size", "layers", "heads", "length", "seed", "position_type"}
    recipe = {f.name: getattr(args, f.name) for f in dataclasses.fields(Cell) if f.name not in grid}  # one value each
    return [
        Cell(variant, task, emb, layers, heads, length, seed, **recipe, position_type=position_type)
        for position_type in args.position_types
        for emb in axes["embedding_sizes"]
        for layers in axes["layers"]
        for heads in axes["heads"]
        for length in axes["lengths"]
        for seed in axes["seeds"]
        for task in args.tasks
        for variant in args.variants
    ]


def build_model(cell: Cell, attn_implementation: str | None = None):
    """The synthetic encoder of a cell: a bidirectional QKVShareForTokenClassification with 10 labels."""
    e = cell.embedding_size
    shape = dict(hidden_size=e, intermediate_size=4 * e, num_hidden_layers=cell.layers, num_attention_heads=cell.heads)
    # a bidirectional classifier of every position over the task's symbols, with no special tokens
    encoder = dict(is_causal=False, num_labels=NUM_SYMBOLS, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    config = QKVShareConfig.from_preset(
        "tiny",
        variant=cell.variant,
        vocab_size=NUM_SYMBOLS,
        max_position_embeddings=cell.length,
        attention_map_pe_init=cell.map_pe_init,
        attn_implementation=attn_implementation or cell.attn_implementation,
        **shape,
        **encoder,
        **ARCHITECTURE_STYLES["gpt2"] | {"position_embedding_type": cell.position_type},  # pre-LayerNorm, GELU MLP
    )
    return QKVShareForTokenClassification(config)


def train_cell(cell: Cell, save_dir: str | None = None) -> tuple[dict, list[float]]:
    """Train and evaluate one cell. Returns its CSV row and its per-step training losses."""
    torch.manual_seed(cell.seed)
    model = build_model(cell)
    # Disjoint seeds for train and test data; the shuffling generator is seeded too, so a cell is reproducible.
    x_train, y_train = make_dataset(cell.task, cell.train_size, cell.length, seed=2 * cell.seed)
    x_test, y_test = make_dataset(cell.task, cell.test_size, cell.length, seed=2 * cell.seed + 1)
    shuffle = torch.Generator().manual_seed(cell.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=cell.lr)
    total_steps = cell.epochs * math.ceil(cell.train_size / cell.batch_size)

    def batches() -> Iterator[torch.Tensor]:  # a fresh order each epoch, from the seeded generator
        for _ in range(cell.epochs):
            order = torch.randperm(cell.train_size, generator=shuffle)
            for begin in range(0, cell.train_size, cell.batch_size):
                yield order[begin : begin + cell.batch_size]

    def loss(batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=x_train[batch], labels=y_train[batch]).loss

    losses, summary = sweeps.train_steps(model, optimizer, batches(), loss, total_steps, cell)
    token_acc, seq_acc = evaluate(model, x_test, y_test, cell.batch_size)
    if save_dir is not None:
        model.save_pretrained(save_dir)  # safetensors
    row = dataclasses.asdict(cell) | summary
    row |= {"key": cell.key, "token_accuracy": round(token_acc, 5), "sequence_accuracy": round(seq_acc, 5)}
    return {name: row[name] for name in CSV_FIELDS}, losses


def evaluate(model, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> tuple[float, float]:
    """Token accuracy and whole-sequence accuracy of `model` on (x, y)."""
    model.eval()
    with torch.no_grad():
        correct = [
            model(input_ids=x[i : i + batch_size]).logits.argmax(-1) == y[i : i + batch_size]
            for i in range(0, len(x), batch_size)
        ]
    correct = torch.cat(correct)
    return float(correct.float().mean()), float(correct.all(-1).float().mean())


def _worker(job: tuple[Cell, str | None, int]) -> tuple[str, dict, list[float]]:
    cell, save_dir, threads = job
    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()  # one tqdm bar for the sweep, not one per save/load
    row, losses = train_cell(cell, save_dir)
    return cell.key, row, losses


def figure_point(args: SweepArgs) -> tuple[int, int, int, int, int]:
    """Grid point (emb, layers, heads, length, seed) whose models are saved for the attention-map figure."""
    axes = args.axes()
    return tuple(axes[name][0] for name in ("embedding_sizes", "layers", "heads", "lengths", "seeds"))


def run_sweep(args: SweepArgs) -> SweepResult:
    """Run every cell not yet in `results.csv`, then write the table and figures from all rows of this sweep."""
    start = time.perf_counter()
    cells = validate(args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, curves_path = out / "results.csv", out / "loss_curves.jsonl"
    todo, skipped = sweeps.pending(cells, csv_path)
    point = figure_point(args)

    def save_dir(cell: Cell) -> str | None:
        in_figure = cell.grid_point == point and cell.position_type == args.position_types[0]
        return str(out / "models" / model_dir_name(cell)) if in_figure else None

    jobs = [(cell, save_dir(cell), args.threads) for cell in todo]
    upgrade_results(csv_path)
    trained = sweeps.run_cells(
        jobs, _worker, csv_path, curves_path, CSV_FIELDS, curve_labels, args.workers, "synthetic cells"
    )

    keys = {cell.key for cell in cells}
    rows = [row for row in sweeps.read_results(csv_path) if row["key"] in keys]
    table = results_table(rows, args.variants, args.tasks, args.position_types)
    (out / "table.md").write_text(table + "\n")
    files = {"results": str(csv_path), "loss_curves": str(curves_path), "table": str(out / "table.md")}
    if args.plots:
        hf_logging.disable_progress_bar()

        labels = list(dict.fromkeys(cell.label for cell in cells))
        files["loss_curves_png"] = plot_loss_curves(curves_path, keys, labels, args.tasks, out / "loss_curves.png")
        figure_cells = [
            cell for cell in cells if cell.grid_point == point and cell.position_type == args.position_types[0]
        ]
        missing = [cell for cell in figure_cells if not (out / "models" / model_dir_name(cell)).exists()]
        if missing:
            names = ", ".join(f"{c.task} {c.variant}" for c in missing[:4]) + (" ..." if len(missing) > 4 else "")
            print(
                f"qkvshare synthetic: attention_maps.png leaves out {len(missing)} figure cell(s) whose model is not "
                f"in {out / 'models'} ({names}): trained by a version that named model folders differently, or "
                "deleted. Delete their rows from results.csv to retrain them.",
                file=sys.stderr,
            )
        files["attention_maps_png"] = plot_attention_maps(
            figure_cells,
            out / "models",
            model_dir_name,
            list(dict.fromkeys(cell.label for cell in figure_cells)),
            args.tasks,
            args.map_layer,
            out / "attention_maps.png",
        )
    return SweepResult(trained, skipped, rows, table, files, seconds=time.perf_counter() - start)


def model_dir_name(cell: Cell) -> str:
    """The directory name of a cell's saved model (the variant through `slug`, e.g. ``copy_Q-K_eq_V_e64_...``)."""
    grid = f"e{cell.embedding_size}_l{cell.layers}_h{cell.heads}_t{cell.length}_s{cell.seed}"
    position = "" if cell.position_type == "learned" else f"_{cell.position_type}"
    return f"{cell.task}_{slug(cell.variant)}{position}_{grid}"


def upgrade_results(csv_path: Path) -> None:
    """Add the `position_type` column ("learned") to a results.csv written before it existed, so rows appended
    now line up with the header."""
    if not csv_path.exists():
        return
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "position_type" in reader.fieldnames:
            return
        rows = list(reader)
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows({name: row.get(name, "learned") for name in CSV_FIELDS} for row in rows)


def curve_labels(row: dict) -> dict:
    """The curve of a cell in curves.jsonl: its variant (with the position type when not learned) and task."""
    label = row["variant"] if row["position_type"] == "learned" else f"{row['variant']} [{row['position_type']}]"
    return {"variant": label, "task": row["task"]}


def results_table(
    rows: list[dict], variants: list[str], tasks: list[str], position_types: list[str] | None = None
) -> str:
    """Markdown table in the paper's layout: mean ± std token accuracy (runs of the grid), paper's value alongside
    (learned positions only: the paper's). One row per variant and position type; rows without a `position_type`
    (older CSVs) count as learned."""
    header = "| variant | " + " | ".join(t.upper() for t in tasks) + " | avg | paper avg |"
    lines = [
        "Token accuracy, mean ± std over the runs of this grid; in brackets the paper's mean over its full grid.",
        "",
        header,
        "|" + "---|" * (len(tasks) + 3),
    ]
    for position_type in position_types or ["learned"]:
        learned = position_type == "learned"
        for variant in variants:
            cells, means = [], []
            mine = [
                r for r in rows if r["variant"] == variant and (r.get("position_type") or "learned") == position_type
            ]
            for task in tasks:
                values = [float(r["token_accuracy"]) for r in mine if r["task"] == task]
                paper = PAPER_TABLE.get(variant, {}).get(task) if learned else None
                paper_text = f" ({paper:.3f})" if paper is not None else ""
                if values:
                    mean, std = sweeps.mean_std(values)
                    cells.append(f"{mean:.3f} ± {std:.3f}{paper_text}")
                    means.append(mean)
                else:
                    cells.append(f"-{paper_text}")
            avg = f"{sum(means) / len(means):.3f}" if len(means) == len(tasks) and means else "-"
            paper_values = [PAPER_TABLE.get(variant, {}).get(t) if learned else None for t in tasks]
            paper_avg = (
                f"{sum(paper_values) / len(paper_values):.3f}" if all(v is not None for v in paper_values) else "-"
            )
            label = variant if learned else f"{variant} [{position_type}]"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {avg} | {paper_avg} |")
    counts = {(r["variant"], r.get("position_type") or "learned", r["task"]) for r in rows}
    lines += ["", f"{len(rows)} runs ({len(counts)} variant x position x task combinations)."]
    return "\n".join(lines)


def run_synthetic(args: SweepArgs) -> SweepResult:
    """`qkvshare synthetic`: check the settings (a `ValueError` naming the bad one, before any training), run the
    sweep's missing cells and print its table; returns the sweep's result."""
    cells = validate(args)
    print(
        f"{len(cells)} cells ({len(args.variants)} variants x {len(args.tasks)} tasks x grid {args.grid!r}: "
        f"{args.axes()}), {args.workers} worker(s) -> {os.path.abspath(args.output_dir)}"
    )
    result = run_sweep(args)
    sweeps.print_sweep_result(result)
    return result


__all__ = ["SweepArgs", "Cell", "PAPER_TABLE", "get_lr", "run_sweep", "train_cell", "run_synthetic"]
