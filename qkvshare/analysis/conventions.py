"""The command-line conventions every `qkvshare` command follows: help layout, `--dtype` names, file names, and
how bad input is reported (one paragraph on stderr, exit status 2).

Standard library only (torch is imported by `torch_dtype` when called), so a command's argument parser can import
this module without torch or transformers: `qkvshare <command> --help` and bad arguments are answered at once.
"""

from __future__ import annotations

import argparse
import re
import sys


def slug(name: str) -> str:
    """A file or directory name for a variant, model id or path (the one file-name helper of the commands).

    ``Q-K=V`` -> ``Q-K_eq_V``, ``(Q=K=V)+`` -> ``Q_eq_K_eq_V_plus``, ``outputs/cpu-small`` -> ``outputs_cpu-small``,
    ``org/model`` -> ``org_model``. Never empty, never ``.`` or ``..``, so it cannot leave its parent directory.
    """
    s = name.replace("=", "_eq_").replace("(", "").replace(")", "").replace("+", "_plus")
    s = re.sub(r"[^A-Za-z0-9_.-]+", "_", s).strip("._")
    return s or "_"


def report_bad_input(command: str, err: BaseException) -> int:
    """Print what is wrong with a command's input as one paragraph on stderr (``qkvshare <command>: error: ...``,
    newlines folded) and return the exit status of bad input, 2."""
    print(f"qkvshare {command}: error: {' '.join(str(err).split())}", file=sys.stderr)
    return 2


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps a command's docstring layout and shows each option's default exactly once.

    argparse appends "(default: X)" unless the help text already speaks of its default (for defaults that need
    words, e.g. "default: cuda if available") or there is nothing to show (None, an empty list, an on/off flag,
    whose help says what giving it does). So help strings never spell out a plain default themselves.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        nothing = action.default is None or action.default == [] or action.nargs == 0
        if "default" in text or nothing or action.default == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


# `--dtype` names, the same in every command that has one: canonical torch names and their short aliases.
DTYPE_NAMES: dict[str, str] = {
    "auto": "auto",
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_name(value: str) -> str:
    """The canonical name (``auto``, ``float32``, ``bfloat16``, ``float16``) of a `--dtype` value or alias."""
    canonical = DTYPE_NAMES.get(value.strip().lower())
    if canonical is None:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a dtype; use auto, float32 (fp32), bfloat16 (bf16) or float16 (fp16)"
        )
    return canonical


def add_dtype_argument(parser: argparse.ArgumentParser, default: str, help: str) -> None:
    """Add `--dtype` (values and aliases of `DTYPE_NAMES`, stored as the canonical name) to a command's parser."""
    parser.add_argument(
        "--dtype",
        type=dtype_name,
        default=default,
        metavar="{auto,float32,bfloat16,float16}",
        help=f"{help} (aliases fp32, bf16, fp16)",
    )


def torch_dtype(name: str):
    """The `torch.dtype` of a canonical `--dtype` name; ``auto`` stays the string transformers understands."""
    if name == "auto":
        return "auto"
    import torch

    return getattr(torch, dtype_name(name))
