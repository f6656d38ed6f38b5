"""`qkvshare vision`: train and evaluate attention variants x seeds on images (the paper's section 4.2).

Two tasks (`--task`):
- ``classify`` (default): `QKVShareForImageClassification` (a ViT from `QKVShareModel`'s blocks, bidirectional,
  class token, learned positions; "+" with m=50 as the paper's ViT) trained from scratch; metric: test accuracy.
- ``sets``: the paper's set anomaly task (`qkvshare.vision.sets`): 10 frozen-feature items, 9 of one class and 1
  of another, point at the odd one (no positions; "+" with m=10 as the paper's set task); metric: set accuracy.

One run ("cell") = (task, variant, seed) with the data, model shape and recipe as part of its key. Outputs in
`--output_dir`: `results.csv` (one row per finished cell, appended at once: a rerun skips the cells already
there, so a run is resumable and extensible), `loss_curves.jsonl`, `table.md` (mean ± std per variant, next to
the paper's numbers), `accuracy.png` (per variant, every seed) and for ``classify`` `attention_maps.png` (the class
token's attention over the patches of a few test images, last layer, mean over heads, one column per variant,
from the models of the first seed, saved under `models/` with their `ViTImageProcessor`). The data are
preprocessed once into `data/*.safetensors` (read by every cell and worker).

Design choices
- Default data: scikit-learn's bundled digits (offline; 1,437 train / 360 test 8x8 images, a fixed split), the
  `vit-small` preset (d 64, 2 layers, 4 heads, patch 2: 16 patches + class token) and a recipe sized for a few
  minutes on 2 CPU cores: AdamW (lr 1e-3, weight decay 0.05), batch 64, 5% warmup then cosine to 0 (the one
  schedule of `qkvshare.train.schedule`), grad clip 1. The paper gives the ViT's shape (224 px, patch 16, d 768,
  12 layers, 12 heads: preset `vit-paper`) but no recipe for its small datasets in our sources.
- The paper's table: our sources give only the average over its five datasets (all six variants .767-.772) and the
  set task's "+" variants (.954-.966); the table prints them under ours.
- Cells are independent and run in `--workers` spawned processes (`qkvshare.analysis.sweeps`, shared with
  `qkvshare synthetic`); a cell's seed fixes its initialization and its data order.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.utils import logging as hf_logging

from qkvshare import QKVShareConfig, QKVShareForImageClassification
from qkvshare.analysis import sweeps
from qkvshare.configuration_qkvshare import IMAGE_POOLINGS, PATCH_POSITION_EMBEDDING_TYPES, resolve_variant
from qkvshare_settings.conventions import slug
from qkvshare_settings.extras import check_extra
from qkvshare_settings.variants import PAPER_TABLE_VARIANTS
from qkvshare_settings.vision import VisionArgs, check_args, check_choice

from .data import default_patch_size, image_processor, load_images
from .plots import plot_accuracy, plot_attention_maps
from .sets import TEST_SETS_SEED, SetAnomalyModel, extract_features, make_sets

# What our sources give of the paper's vision numbers (PAPER.md, "Vision and sets"; section 4.2).
PAPER_NOTES = {
    "classify": "Paper (section 4.2; ViT-B/16-sized, from scratch): on MNIST, FashionMNIST, CIFAR-10/100 and Tiny "
    "ImageNet all six paper variants land within about 1 point (average accuracy .767-.772); per-variant, "
    "per-dataset numbers are not in our sources.",
    "sets": 'Paper (appendix A.3.2; CIFAR-100, frozen ImageNet ResNet34 features): the "+" variants are best '
    "(set accuracy .954-.966); the other variants' numbers are not in our sources.",
}
PRESET = "vit-small"
SET_ATTENTION_MAP_PE_DIM = 10  # m of "+" on the set task (the paper: 10 for synthetic and set tasks)

CSV_FIELDS = [
    "key",
    "task",
    "variant",
    "seed",
    "dataset",
    "train_size",
    "test_size",
    "hidden_size",
    "layers",
    "heads",
    "epochs",
    "accuracy",
    *sweeps.RUN_FIELDS,
]


@dataclass(frozen=True)
class Cell:
    """One training run: the task, variant and seed, and everything else that decides its result."""

    task: str
    variant: str
    seed: int
    data_id: str
    data_path: str
    patch_size: int | None
    hidden_size: int
    layers: int
    heads: int
    pooling: str
    patch_position_embedding_type: str
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    warmup_fraction: float
    grad_clip: float
    attn_implementation: str

    @property
    def key(self) -> str:
        model = f"e{self.hidden_size}|l{self.layers}|h{self.heads}"
        if self.task == "classify":
            model += f"|p{self.patch_size}|{self.pooling}|{self.patch_position_embedding_type}"
        recipe = (
            f"ep{self.epochs}|b{self.batch_size}|lr{self.lr:g}|wd{self.weight_decay:g}|w{self.warmup_fraction:g}"
            f"|c{self.grad_clip:g}"
        )
        return f"{self.task}|{self.variant}|s{self.seed}|{self.data_id}|{model}|{recipe}"


def validate(args: VisionArgs) -> None:
    """Check every argument before any data is loaded or trained (a ValueError naming the bad one).

    `qkvshare_settings.vision.check_args` (what the command line answers without torch), then the checks that need the
    config module.
    """
    check_args(args)
    check_choice("pooling", args.pooling, IMAGE_POOLINGS)
    check_choice("patch_position_embedding_type", args.patch_position_embedding_type, PATCH_POSITION_EMBEDDING_TYPES)
    shape = {"num_attention_heads": args.heads, "hidden_size": args.hidden_size}
    for variant in args.variants:
        resolve_variant(variant, shape)  # a ValueError naming the variant


# ----- data: prepared once per data id, read by every cell -----
def prepare_data(args: VisionArgs, out: Path) -> tuple[str, int | None]:
    """Write the task's tensors to `out/data/<data id>.safetensors` unless there; returns (path, patch size)."""
    path = out / "data" / f"{slug(args.data_id())}.safetensors"
    if path.exists():
        tensors = load_file(str(path))
        image_size = tensors["train_x"].shape[-1] if args.task == "classify" else None
    else:
        splits = load_images(
            args.dataset, args.data_dir, args.image_column, args.label_column, args.max_train, args.max_test
        )
        image_size = args.image_size or splits.native_size
        if args.task == "classify":
            tensors = splits.pixel_values(image_size)
        else:
            test_sets, test_odd = make_sets(splits.test_y, torch.Generator().manual_seed(TEST_SETS_SEED))
            make_sets(splits.train_y, torch.Generator())  # checks the training classes before features are made
            tensors = {
                "train_x": extract_features(splits.train_images, args.backbone, image_size, args.feature_dim),
                "train_y": splits.train_y,
                "test_x": extract_features(splits.test_images, args.backbone, image_size, args.feature_dim),
                "test_y": splits.test_y,
                "test_sets": test_sets,
                "test_odd": test_odd,
            }
        tensors["num_labels"] = torch.tensor(len(splits.class_names))
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(path))
    if args.task == "sets":
        return str(path), None

    patch = args.patch_size or default_patch_size(image_size)
    if image_size % patch:
        raise ValueError(f"--patch_size {patch} does not divide the images' side {image_size}; choose a divisor.")
    return str(path), patch


def make_cells(args: VisionArgs, data_path: str, patch_size: int | None) -> list[Cell]:
    recipe = {name: getattr(args, name) for name in Cell.__dataclass_fields__ if hasattr(args, name)}
    recipe |= dict(data_id=args.data_id(), data_path=data_path, patch_size=patch_size)
    return [Cell(**(recipe | dict(variant=variant, seed=seed))) for seed in args.seeds for variant in args.variants]


# ----- models -----
def build_config(cell: Cell, num_labels: int, image_size: int | None = None, attn_implementation: str | None = None):
    """The config of a cell: `vit-small` resized (classify), or the same blocks without positions (sets)."""
    shape = dict(
        hidden_size=cell.hidden_size,
        intermediate_size=4 * cell.hidden_size,
        num_hidden_layers=cell.layers,
        num_attention_heads=cell.heads,
        attn_implementation=attn_implementation or cell.attn_implementation,
    )
    if cell.task == "classify":
        image = dict(image_size=image_size, patch_size=cell.patch_size, num_channels=3, num_labels=num_labels)
        image |= dict(pooling=cell.pooling, patch_position_embedding_type=cell.patch_position_embedding_type)
        return QKVShareConfig.from_preset(PRESET, cell.variant, **shape, **image)
    if resolve_variant(cell.variant, shape)["attention_map_pe_dim"]:  # "+": the set task's m
        shape["attention_map_pe_dim"] = SET_ATTENTION_MAP_PE_DIM
    return QKVShareConfig.from_preset(PRESET, cell.variant, **shape)


def build_model(cell: Cell, data: dict[str, torch.Tensor]):
    """A fresh model for a cell (seeded by the caller)."""
    num_labels = int(data["num_labels"])
    if cell.task == "classify":
        return QKVShareForImageClassification(build_config(cell, num_labels, data["train_x"].shape[-1]))

    return SetAnomalyModel(build_config(cell, num_labels), data["train_x"].shape[-1])


# ----- one cell -----
def batches(cell: Cell, data: dict[str, torch.Tensor], generator: torch.Generator):
    """Training batches (inputs, labels) of one epoch: shuffled images, or freshly drawn sets."""
    if cell.task == "classify":
        order = torch.randperm(len(data["train_y"]), generator=generator)
        for begin in range(0, len(order), cell.batch_size):
            index = order[begin : begin + cell.batch_size]
            yield data["train_x"][index], data["train_y"][index]
        return
    sets, odd = make_sets(data["train_y"], generator)
    order = torch.randperm(len(sets), generator=generator)
    for begin in range(0, len(order), cell.batch_size):
        index = order[begin : begin + cell.batch_size]
        yield data["train_x"][sets[index]], odd[index]


def loss_and_logits(cell: Cell, model, inputs: torch.Tensor, labels: torch.Tensor | None = None):
    if cell.task == "classify":
        out = model(pixel_values=inputs, labels=labels)
        return out.loss, out.logits
    logits, loss = model(inputs, labels)
    return loss, logits


def evaluate(cell: Cell, model, data: dict[str, torch.Tensor]) -> float:
    """Test accuracy: images classified right, or sets whose odd item gets the highest logit."""
    if cell.task == "classify":
        inputs, labels = data["test_x"], data["test_y"]
    else:
        inputs, labels = data["test_x"][data["test_sets"]], data["test_odd"]
    model.eval()
    with torch.no_grad():
        correct = sum(
            int((loss_and_logits(cell, model, inputs[i : i + 256])[1].argmax(-1) == labels[i : i + 256]).sum())
            for i in range(0, len(labels), 256)
        )
    return correct / len(labels)


def train_cell(cell: Cell, save_dir: str | None = None) -> tuple[dict, list[float]]:
    """Train and evaluate one cell; returns its CSV row and its per-step training losses."""
    data = load_file(cell.data_path)
    torch.manual_seed(cell.seed)
    model = build_model(cell, data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cell.lr, weight_decay=cell.weight_decay)
    total = cell.epochs * math.ceil(len(data["train_y"]) / cell.batch_size)
    generator = torch.Generator().manual_seed(cell.seed)
    stream = (batch for _ in range(cell.epochs) for batch in batches(cell, data, generator))
    losses, summary = sweeps.train_steps(
        model, optimizer, stream, lambda batch: loss_and_logits(cell, model, *batch)[0], total, cell
    )
    accuracy = evaluate(cell, model, data)
    if save_dir is not None and cell.task == "classify":
        model.save_pretrained(save_dir)  # safetensors
        image_processor(data["train_x"].shape[-1]).save_pretrained(save_dir)
    row = {
        "key": cell.key,
        "task": cell.task,
        "variant": cell.variant,
        "seed": cell.seed,
        "dataset": cell.data_id,
        "train_size": len(data["train_y"]),
        "test_size": len(data["test_y"]),
        "hidden_size": cell.hidden_size,
        "layers": cell.layers,
        "heads": cell.heads,
        "epochs": cell.epochs,
        "accuracy": round(accuracy, 5),
    }
    return row | summary, losses


def _worker(job: tuple[Cell, str | None, int]) -> tuple[str, dict, list[float]]:
    cell, save_dir, threads = job
    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()
    row, losses = train_cell(cell, save_dir)
    return cell.key, row, losses


# ----- the whole run -----
def model_dir_name(cell: Cell) -> str:
    return f"{cell.task}_{slug(cell.variant)}_s{cell.seed}"


def run_vision(args: VisionArgs) -> sweeps.SweepResult:
    """Train every cell not in `results.csv` yet, then write the table and figures from all rows of this run."""
    start = time.perf_counter()
    validate(args)
    if args.plots:
        check_extra("plots", "qkvshare vision's figures", hint="or pass --no_plots")
    out = Path(args.output_dir)
    data_path, patch_size = prepare_data(args, out)  # before `out` exists: a dataset that fails to load leaves nothing
    out.mkdir(parents=True, exist_ok=True)
    cells = make_cells(args, data_path, patch_size)
    csv_path, curves_path = out / "results.csv", out / "loss_curves.jsonl"
    todo, skipped = sweeps.pending(cells, csv_path)
    first_seed = args.seeds[0]

    def save_dir(cell: Cell) -> str | None:
        return str(out / "models" / model_dir_name(cell)) if cell.seed == first_seed else None

    jobs = [(cell, save_dir(cell), args.threads) for cell in todo]
    trained = sweeps.run_cells(
        jobs, _worker, csv_path, curves_path, CSV_FIELDS, ("task", "variant"), args.workers, f"{args.task} cells"
    )
    keys = {cell.key for cell in cells}
    rows = [row for row in sweeps.read_results(csv_path) if row["key"] in keys]
    table = results_table(rows, args)
    (out / "table.md").write_text(table + "\n")
    files = {"results": str(csv_path), "loss_curves": str(curves_path), "table": str(out / "table.md")}
    if args.plots:
        hf_logging.disable_progress_bar()  # one bar for the run, not one per model loaded for the maps

        files["accuracy_png"] = plot_accuracy(rows, args.variants, args.task, out / "accuracy.png")
        if args.task == "classify":
            figure_cells = [cell for cell in cells if cell.seed == first_seed]
            maps = plot_attention_maps(
                figure_cells, out / "models", model_dir_name, data_path, args.map_images, out / "attention_maps.png"
            )
            if maps:
                files["attention_maps_png"] = maps
    return sweeps.SweepResult(trained, skipped, rows, table, files, seconds=time.perf_counter() - start)


def results_table(rows: list[dict], args: VisionArgs) -> str:
    """Markdown: accuracy mean ± std over seeds per variant, with parameters, and the paper's numbers below."""
    metric = "test accuracy" if args.task == "classify" else "set accuracy (odd item found)"
    some = rows[0] if rows else {}
    lines = [
        f"{args.task} on {args.data_id()} ({some.get('train_size', '?')} train / {some.get('test_size', '?')} test "
        f"{'images' if args.task == 'classify' else 'sets'}); {metric}, mean ± std over seeds.",
        "",
        "| variant | accuracy | seeds | parameters |",
        "|---|---|---|---|",
    ]
    means = {}
    for variant in args.variants:
        mine = [r for r in rows if r["variant"] == variant]
        if not mine:
            lines.append(f"| {variant} | - | 0 | - |")
            continue
        mean, std = sweeps.mean_std(float(r["accuracy"]) for r in mine)
        means[variant] = mean
        lines.append(f"| {variant} | {mean:.3f} ± {std:.3f} | {len(mine)} | {int(mine[0]['num_parameters']):,} |")
    paper = [means[v] for v in PAPER_TABLE_VARIANTS if v in means]
    if len(paper) > 1:
        lines += ["", f"Spread of the paper's variants here (max - min of the means): {max(paper) - min(paper):.3f}."]
    lines += ["", PAPER_NOTES[args.task]]
    return "\n".join(lines)


def vision(args: VisionArgs) -> sweeps.SweepResult:
    """`qkvshare vision`: check the settings and the data (a `ValueError` naming the bad one, before any training),
    run the sweep's missing cells and print its table; returns the sweep's result."""
    validate(args)
    print(
        f"{args.task}: {len(args.variants)} variants x {len(args.seeds)} seeds on {args.dataset}, "
        f"{args.workers} worker(s) -> {os.path.abspath(args.output_dir)}"
    )
    result = run_vision(args)  # bad data (columns, sizes, classes) is a ValueError, found before training
    sweeps.print_sweep_result(result)
    return result


__all__ = ["VisionArgs", "Cell", "run_vision", "train_cell", "vision"]
