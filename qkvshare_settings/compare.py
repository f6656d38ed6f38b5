"""Arguments of `qkvshare compare`: its own flags (the shared training settings, the variants, the table), checked
without torch; every other flag goes to `qkvshare train` unchanged. The comparison is `qkvshare.analysis.compare`.
"""

from __future__ import annotations

import argparse
from typing import Any

from .conventions import PRESET_HELP, HelpFormatter, check_nonempty, slug

# The trainer flags every variant gets with the same value: flag -> (default, help). Sized for about 30 minutes on 2
# otherwise idle CPU cores for the eight default variants: 500 steps of 8 x 256 tokens (1.02M tokens) per variant.
# The `small` preset trained at about 6k tokens/s on 2 idle cores here (0.08 s per 512-token step), so about 3
# minutes per variant, plus half a minute of tokenization each.
SHARED_TRAIN_FLAGS: dict[str, tuple[Any, str]] = {
    "preset": ("small", PRESET_HELP),
    "max_steps": (500, "optimizer steps per variant"),
    "per_device_train_batch_size": (8, "blocks per step and device"),
    "block_size": (256, "tokens per block"),
    "learning_rate": (1e-3, "peak learning rate"),
    "warmup_steps": (50, "linear warmup steps"),
    "seed": (0, "initialisation and data-order seed"),
    "eval_steps": (500, "validation period (steps)"),
    "save_steps": (100, "checkpoint period (resume unit)"),
    "max_eval_samples": (200, "validation blocks (the same for every variant)"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qkvshare compare",
        description="Pretrain variants with identical data, tokens and seed and print the paper's LM table. "
        "Unknown flags go to `qkvshare train` unchanged.",
        allow_abbrev=False,  # a trainer flag must never be taken for a prefix of one of ours
        formatter_class=HelpFormatter,
    )
    p.add_argument("--variants", nargs="*", help="default: QKV, Q-K=V, Q=K-V, Q=K=V, GQA-g, MQA, Q-GQA-g, Q-MQA")
    p.add_argument("--output_dir", default="outputs/compare", help="runs/<variant>/, logs/, the table and the plot")
    for name, (default, help_) in SHARED_TRAIN_FLAGS.items():
        p.add_argument(f"--{name}", type=type(default), default=default, help=help_)
    p.add_argument(
        "--position_types",
        nargs="*",
        help="train each variant with each of these position_embedding_type values (learned, rope, alibi, none); "
        "default: the preset's own",
    )
    p.add_argument("--table_only", action="store_true", help="do not train; tabulate the finished variants")
    return p


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Compare's own options and the flags it passes to the trainer unchanged (`parse_known_args`).

    Every option that can be checked without the config is checked here; a `ValueError` names the bad option. The
    command checks the preset and the variant names, which need the config.
    """
    args, passthrough = build_parser().parse_known_args(argv)
    check_nonempty(args, ("variants", "position_types"))
    if args.position_types and len(set(args.position_types)) != len(args.position_types):
        raise ValueError(f"--position_types has duplicates: {args.position_types}.")
    if args.position_types and any("position_embedding_type" in a for a in passthrough):
        raise ValueError("--position_types sets position_embedding_type per run; leave it out of --config_overrides.")
    if args.variants and len({slug(v) for v in args.variants}) != len(args.variants):
        raise ValueError(f"--variants has duplicates: {args.variants}.")
    for flag in ("max_steps", "per_device_train_batch_size", "block_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1.")
    reserved = {"--variant", "--resume_from_checkpoint", "--overwrite_output_dir", "--logging_steps"}
    clash = sorted(reserved & {a.split("=")[0] for a in passthrough})
    if clash:
        verb = "is" if len(clash) == 1 else "are"
        raise ValueError(f"{', '.join(clash)} {verb} set by compare itself per variant; leave them out.")
    return args, passthrough
