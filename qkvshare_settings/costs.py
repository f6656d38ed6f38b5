"""`qkvshare costs`: analytic parameters, MACs and KV-cache bytes of every attention variant of a model shape.

This module holds the command's arguments; the counting conventions and the tables are `qkvshare.analysis.costs`.
"""

from __future__ import annotations

import argparse

from .conventions import (
    DTYPE_BYTES,
    DTYPE_NAMES,
    PRESET_HELP,
    HelpFormatter,
    check_nonempty,
    check_shape_source,
)
from .overrides import parse_overrides

# Cache element types: the `--dtype` names of every command (and their aliases), plus the 8-bit ones.
BYTES_PER_ELEMENT = {name: DTYPE_BYTES[c] for name, c in DTYPE_NAMES.items() if c != "auto"} | {"fp8": 1, "int8": 1}
DEFAULT_SEQ_LENS = (512, 1024, 2048, 4096, 8192)
DEFAULT_CONTEXT_LENS = (2048, 32000)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qkvshare costs", description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument("--preset", help=PRESET_HELP)
    p.add_argument("--model_dir", help="a QKVShare or Llama-architecture model directory (its config.json)")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="config field overrides")
    p.add_argument(
        "--variants",
        nargs="*",
        help="paper variant names (default: QKV, Q=K-V, Q-K=V, Q=K=V, GQA-g, "
        "MQA, Q-GQA-g, Q-MQA, (Q=K-V)+, (Q=K=V)+, every other sharing mode, QV-Ka, QV-Ka-2; g = heads/4). The "
        "first one is the reference.",
    )
    up_to = "up to the model's max_position_embeddings"
    seq_default, context_default = " ".join(map(str, DEFAULT_SEQ_LENS)), " ".join(map(str, DEFAULT_CONTEXT_LENS))
    p.add_argument(
        "--seq_lens", nargs="*", type=int, help=f"forward lengths for MACs (default: {seq_default}, {up_to})"
    )
    p.add_argument("--context_lens", nargs="*", type=int, help=f"cache contexts (default: {context_default}, {up_to})")
    p.add_argument("--dtypes", nargs="*", default=["fp16"], help=f"cache dtypes ({', '.join(BYTES_PER_ELEMENT)})")
    p.add_argument("--format", choices=("markdown", "json"), default="markdown", help="output format")
    p.add_argument("--causal_scores", action="store_true", help="count only the causal half of the T x T products")
    p.add_argument("--no_meta_check", action="store_true", help="skip building each variant on the meta device")
    p.add_argument("--output", help="also write the output to this file")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line of `qkvshare costs`, checked as far as it can be without the config; a `ValueError` names
    the bad option. Override keys, the preset and variants are checked by the command, which builds the config."""
    args = build_parser().parse_args(argv)
    check_shape_source(args.preset, args.model_dir)
    parse_overrides(args.override, "--override")
    check_nonempty(args, ("variants", "seq_lens", "context_lens", "dtypes"))
    if any(t <= 0 for t in (args.seq_lens or []) + (args.context_lens or [])):
        raise ValueError("--seq_lens and --context_lens must be positive token counts.")
    unknown = [dt for dt in args.dtypes if dt not in BYTES_PER_ELEMENT]
    if unknown:
        raise ValueError(f"--dtypes {', '.join(unknown)}: not known; allowed: {', '.join(BYTES_PER_ELEMENT)}.")
    return args
