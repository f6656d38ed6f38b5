"""Arguments of `qkvshare synthetic`: the sweep's grid, recipe and outputs, one flag per field of `SweepArgs`.

The sweep itself (cells, training, the table and the figures) is `qkvshare.synthetic.sweep`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .conventions import dataclass_parser
from .variants import PAPER_TABLE_VARIANTS

TASKS = ("reverse", "sort", "sub", "swap", "copy")  # the paper's five synthetic tasks, in its table's order

# Grid axes per named grid. "paper": the paper's grid. "default": chosen by measurement (see the measurements in the
# comment on "default" below) to run in about 15 minutes on 2 CPU cores and still separate the variants.
GRIDS: dict[str, dict[str, list[int]]] = {
    "paper": {
        "embedding_sizes": [32, 64, 256],
        "layers": [2, 4],
        "heads": [2, 4],
        "lengths": [16, 64, 128],
        "seeds": [0, 1, 2],
    },
    # Measured (CPU time per cell, paper recipe, 1 thread): emb 32/T16 ~4 s, emb 64/T16 ~6 s, emb 64/T32 ~14 s.
    # emb 64/T16 is solved by every variant (all 1.0: no signal); emb 32 breaks Q-K=V as well (V must carry the
    # absolute position, see the QV paper's remark); emb 64, 4 heads, T32 separates them as the paper does.
    # 90 cells x ~14 CPU s / 2 workers = ~11 min on 2 free cores, plus start-up, evaluation and figures.
    "default": {
        "embedding_sizes": [64],
        "layers": [2],
        "heads": [4],
        "lengths": [32],
        "seeds": [0, 1, 2],
    },
}


@dataclass
class SweepArgs:
    """Arguments of `qkvshare synthetic` (each is also a command-line flag)."""

    # Each field's help is its flag's help text (`parse_args`); the formatter adds the default once.
    output_dir: str = field(
        default="outputs/synthetic", metadata={"help": "where results.csv, table.md, the PNGs and the models go"}
    )
    grid: str = field(default="default", metadata={"help": "default (about 15 min on 2 cores) or paper (full)"})
    variants: list[str] = field(
        default_factory=lambda: list(PAPER_TABLE_VARIANTS), metadata={"help": 'paper names, e.g. QKV "(Q=K=V)+"'}
    )
    tasks: list[str] = field(default_factory=lambda: list(TASKS), metadata={"help": "a subset of these five"})
    embedding_sizes: list[int] | None = field(default=None, metadata={"help": "overrides the grid's axis"})
    layers: list[int] | None = field(default=None, metadata={"help": "overrides the grid's axis"})
    heads: list[int] | None = field(default=None, metadata={"help": "overrides the grid's axis"})
    lengths: list[int] | None = field(default=None, metadata={"help": "overrides the grid's axis"})
    seeds: list[int] | None = field(default=None, metadata={"help": "overrides the grid's axis"})
    train_size: int = field(default=10_000, metadata={"help": "training sequences (paper: 10k)"})
    test_size: int = field(default=2_000, metadata={"help": "held-out sequences (paper: 2k)"})
    epochs: int = field(default=2, metadata={"help": "passes over the training set (paper: 2)"})
    batch_size: int = field(default=128, metadata={"help": "sequences per step (paper: 128)"})
    lr: float = field(default=1e-3, metadata={"help": "Adam peak learning rate (paper: 1e-3)"})
    warmup_fraction: float = field(
        default=0.05, metadata={"help": "linear warmup share of the steps, then cosine to 0 (paper: 0.05)"}
    )
    grad_clip: float = field(default=5.0, metadata={"help": "gradient-norm clip (paper: 5)"})
    map_pe_init: str = field(
        default="xavier", metadata={"help": 'init of the "+" map: xavier (the original code\'s), unit_scale or normal'}
    )
    position_types: list[str] = field(
        default_factory=lambda: ["learned"],
        metadata={"help": "position schemes, each a grid axis: learned (the paper's), rope, alibi, none"},
    )
    workers: int = field(default=2, metadata={"help": "parallel processes, one cell each"})
    threads: int = field(default=1, metadata={"help": "torch threads per worker"})
    attn_implementation: str = field(
        default="sdpa", metadata={"help": "training backend (sdpa or eager); the attention figure always uses eager"}
    )
    map_layer: int = field(
        default=0, metadata={"help": "the layer whose attention the figure shows (0: where routing by position shows)"}
    )
    # True by default, so the flag is --no_plots (drawing the PNGs needs matplotlib)
    plots: bool = field(default=True, metadata={"help": "skip the PNG figures"})

    def axes(self) -> dict[str, list[int]]:
        if self.grid not in GRIDS:
            raise ValueError(f"grid={self.grid!r} is not a known grid; allowed: {', '.join(GRIDS)}.")
        axes = dict(GRIDS[self.grid])
        for name in axes:
            if getattr(self, name) is not None:
                axes[name] = list(getattr(self, name))
        return axes


def parse_args(argv: list[str] | None) -> SweepArgs:
    """The command line as `SweepArgs`: one flag per field, its help from the field's metadata."""
    parser = dataclass_parser(
        SweepArgs,
        "qkvshare synthetic",
        "Train the paper's synthetic encoder tasks over a grid of attention variants (resumable).",
    )
    return SweepArgs(**vars(parser.parse_args(argv)))
