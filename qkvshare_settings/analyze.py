"""`qkvshare analyze MODEL`: per layer, how similar the Q, K and V projection weights are, and their effective rank.

This module holds the command's arguments; the definitions and the computation are `qkvshare.analysis.weights`.
"""

from __future__ import annotations

import argparse

from .conventions import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qkvshare analyze", description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument("model", help="model directory (QKVShare or Llama-architecture; safetensors weights)")
    p.add_argument("--format", choices=("markdown", "json"), default="markdown", help="output format")
    p.add_argument("--output", help="also write the output to this file")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line of `qkvshare analyze`."""
    return build_parser().parse_args(argv)
