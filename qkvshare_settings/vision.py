"""Arguments of `qkvshare vision`: task, data, model, recipe and outputs, one flag per field of `VisionArgs`, and
the checks that need only the standard library.

The runs themselves (data preparation, cells, training, the table and the figures) are `qkvshare.vision.run`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .conventions import dataclass_parser
from .variants import PAPER_TABLE_VARIANTS

TASKS = ("classify", "sets")
# The paper's variants and the head-sharing ones (4 heads: GQA-2, MQA and their K=V forms).
DEFAULT_VARIANTS = (*PAPER_TABLE_VARIANTS, "GQA-2", "MQA", "Q-GQA-2", "Q-MQA")


@dataclass
class VisionArgs:
    """Arguments of `qkvshare vision` (each is also a command-line flag)."""

    output_dir: str = field(default="outputs/vision", metadata={"help": "where results.csv, table.md, PNGs go"})
    task: str = field(default="classify", metadata={"help": "classify (images) or sets (the set anomaly task)"})
    dataset: str = field(
        default="digits",
        metadata={
            "help": "digits (scikit-learn's, offline), a Hugging Face dataset name (mnist, cifar10, ...), a "
            "save_to_disk directory, or imagefolder with --data_dir"
        },
    )
    data_dir: str | None = field(default=None, metadata={"help": "the folder of --dataset imagefolder"})
    image_column: str | None = field(default=None, metadata={"help": "image column (default: detected)"})
    label_column: str | None = field(default=None, metadata={"help": "label column (default: detected)"})
    image_size: int | None = field(default=None, metadata={"help": "resize images to this side (default: native)"})
    patch_size: int | None = field(
        default=None, metadata={"help": "ViT patch side (default: the smallest >= 2 giving at most 8x8 patches)"}
    )
    max_train: int | None = field(default=None, metadata={"help": "use at most this many training images"})
    max_test: int | None = field(default=None, metadata={"help": "use at most this many test images"})
    variants: list[str] = field(
        default_factory=lambda: list(DEFAULT_VARIANTS), metadata={"help": 'paper names, e.g. QKV "(Q=K=V)+"'}
    )
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "one run per seed and variant"})
    hidden_size: int = field(default=64, metadata={"help": "model width"})
    layers: int = field(default=2, metadata={"help": "encoder blocks"})
    heads: int = field(default=4, metadata={"help": "attention heads"})
    pooling: str = field(default="cls", metadata={"help": "classify: cls (class token) or mean (patch mean)"})
    patch_position_embedding_type: str = field(
        default="learned", metadata={"help": "classify: learned (1D table) or sincos2d (fixed 2D)"}
    )
    backbone: str = field(
        default="pixels",
        metadata={"help": "sets: frozen feature extractor, pixels (fixed random projection) or an AutoModel name"},
    )
    feature_dim: int = field(default=64, metadata={"help": "sets: size of the pixels' random projection"})
    epochs: int = field(default=20, metadata={"help": "passes over the training images (sets: each image once odd)"})
    batch_size: int = field(default=64, metadata={"help": "images (or sets) per step"})
    lr: float = field(default=1e-3, metadata={"help": "AdamW peak learning rate"})
    weight_decay: float = field(default=0.05, metadata={"help": "AdamW weight decay"})
    warmup_fraction: float = field(default=0.05, metadata={"help": "linear warmup share of the steps, then cosine"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient-norm clip"})
    workers: int = field(default=2, metadata={"help": "parallel processes, one cell each"})
    threads: int = field(default=1, metadata={"help": "torch threads per worker"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "training backend: sdpa or eager"})
    map_images: int = field(default=4, metadata={"help": "classify: test images in attention_maps.png"})
    # True by default, so the flag is --no_plots (drawing the PNGs needs matplotlib)
    plots: bool = field(default=True, metadata={"help": "skip the PNG figures"})

    def data_id(self) -> str:
        """What the prepared data depend on (part of every cell's key)."""
        parts = [self.dataset if self.dataset != "imagefolder" else f"imagefolder:{self.data_dir}"]
        parts += [f"columns:{self.image_column},{self.label_column}"] if self.image_column or self.label_column else []
        parts += [f"px{self.image_size}" if self.image_size else "native"]
        parts += [f"n{self.max_train}/{self.max_test}"] if self.max_train or self.max_test else []
        parts += [f"{self.backbone}-f{self.feature_dim}" if self.backbone == "pixels" else self.backbone]
        return "|".join(parts[:-1] if self.task == "classify" else parts)


def check_choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"--{flag} {value!r} is not supported; choose one of {', '.join(allowed)}.")


def check_args(args: VisionArgs) -> None:
    """The checks of `qkvshare.vision.run.validate` that need only the standard library (a ValueError naming the
    bad flag)."""
    check_choice("task", args.task, TASKS)
    check_choice("attn_implementation", args.attn_implementation, ("sdpa", "eager"))
    if not args.variants or not args.seeds:
        raise ValueError("--variants and --seeds need at least one value each.")
    positive = ("hidden_size", "layers", "heads", "feature_dim", "epochs", "batch_size", "workers", "threads")
    for name in positive + ("image_size", "patch_size", "max_train", "max_test"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} {value} must be a positive integer.")
    if args.hidden_size % args.heads:
        raise ValueError(f"--hidden_size {args.hidden_size} is not divisible by --heads {args.heads}.")
    if args.image_size and args.patch_size and args.image_size % args.patch_size:
        raise ValueError(f"--image_size {args.image_size} is not a multiple of --patch_size {args.patch_size}.")
    if not 0 <= args.warmup_fraction < 1 or args.lr <= 0 or args.grad_clip <= 0 or args.weight_decay < 0:
        raise ValueError("need 0 <= --warmup_fraction < 1, --lr > 0, --grad_clip > 0 and --weight_decay >= 0.")
    if args.dataset == "imagefolder" and not (args.data_dir and Path(args.data_dir).is_dir()):
        raise ValueError(f"--dataset imagefolder needs --data_dir, an existing folder; got {args.data_dir!r}.")
    if args.data_dir and args.dataset != "imagefolder":
        raise ValueError("--data_dir is the folder of --dataset imagefolder; pass --dataset imagefolder with it.")
    if args.task == "classify" and args.backbone != "pixels":
        raise ValueError("--backbone is the frozen feature extractor of --task sets; classify trains from pixels.")


def parse_args(argv: list[str] | None) -> VisionArgs:
    """The command line as `VisionArgs` (one flag per field), checked by `check_args` (a ValueError if bad)."""
    parser = dataclass_parser(
        VisionArgs,
        "qkvshare vision",
        "Train ViT variants on images (or the set anomaly task) over variants x seeds (resumable).",
    )
    args = VisionArgs(**vars(parser.parse_args(argv)))
    check_args(args)
    return args
