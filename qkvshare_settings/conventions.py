"""The conventions every `qkvshare` command and its settings follow: help layout, `--dtype` names, file names,
flags built from typed settings dataclasses, the checks several commands share, how bad input is reported (one
paragraph on stderr, exit status 2) and how a run that stopped says so (`CommandStopped`).

Standard library only, like every module of `qkvshare_settings`. (`qkvshare.runtime.torch_dtype` turns a `--dtype`
name into a `torch.dtype` once a command runs.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Files of which a tokenizer folder holds at least one (fast, config, SentencePiece, BPE or WordPiece vocab).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
)
PRESET_HELP = "model shape preset: a QKVShareConfig.from_preset name (an unknown one is answered with the list)"


def slug(name: str) -> str:
    """A file or directory name for a variant, model id or path (the one file-name helper of the commands).

    ``Q-K=V`` -> ``Q-K_eq_V``, ``(Q=K=V)+`` -> ``Q_eq_K_eq_V_plus``, ``outputs/cpu-small`` -> ``outputs_cpu-small``,
    ``org/model`` -> ``org_model``. Never empty, never ``.`` or ``..``, so it cannot leave its parent directory.
    """
    s = name.replace("=", "_eq_").replace("(", "").replace(")", "").replace("+", "_plus")
    s = re.sub(r"[^A-Za-z0-9_.-]+", "_", s).strip("._")
    return s or "_"


class CommandStopped(Exception):
    """A command's run that stopped before it finished, for a reason other than bad input (which is a
    `ValueError`): a failed write, a diverged loss, a signal. What it saved stays; the message says what happened
    and what to do. The command line prints `qkvshare <command>: <label>: <message>` (the label left out when
    empty) and exits with `exit_status`; from Python it is an ordinary exception."""

    label = "stopped"
    exit_status = 1


def report_bad_input(command: str, err: BaseException) -> int:
    """Print what is wrong with a command's input as one paragraph on stderr (``qkvshare <command>: error: ...``,
    newlines folded, unless the error's class lays its message out in lines: `preformatted`) and return the exit
    status of bad input, 2."""
    text = str(err) if getattr(err, "preformatted", False) else " ".join(str(err).split())
    print(f"qkvshare {command}: error: {text}", file=sys.stderr)
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


def add_model_loading_arguments(parser: argparse.ArgumentParser, tokenizer_help: str) -> None:
    """Add the flags of a command that loads saved causal LMs (`eval`, `perplexity`): where and in which dtype, with
    which tokenizer, and whether hub code may run."""
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: cuda if available)")
    add_dtype_argument(parser, "float32", "weights and activations; auto: as saved")
    parser.add_argument("--tokenizer", default=None, help=tokenizer_help)
    parser.add_argument("--trust_remote_code", action="store_true", help="for hub models whose code is not installed")


def truth_value(text: str | bool) -> bool:
    """A bool flag's optional value (`--bf16 false`), read as transformers' `HfArgumentParser` reads it."""
    if isinstance(text, bool):
        return text
    if text.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if text.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(
        f"Truthy value expected: got {text} but expected one of yes/no, true/false, t/f, y/n, 1/0 (case insensitive)."
    )


def _field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def add_dataclass_arguments(
    parser: argparse.ArgumentParser, args_class: type, dash_aliases: bool = False
) -> argparse.ArgumentParser:
    """One flag per field of the dataclass `args_class` (every field has a default), its help from the field's
    metadata, its type from the field's annotation; returns `parser`.

    - `x: bool = False` is `--x [BOOL]`: given alone it means true, or takes yes/no, true/false, 1/0 (the
      convention of transformers' `HfArgumentParser`, which recipes and scripts rely on);
      `x: bool = True` is `--no_x` only, and the field's help is that flag's help.
    - `x: list[T]` (or `list[T] | None`) takes one or more values of type T; a list of strings shows its default
      in the help ("(default: a b)", not a Python list).
    - `x: T | None` takes one value of type T (str, int or float); every other field one value of its type.
    - `dash_aliases` also accepts `--output-dir` for `--output_dir`, as `HfArgumentParser` does.
    """
    hints = typing.get_type_hints(args_class)
    for f in dataclasses.fields(args_class):
        default, help_, kind = _field_default(f), f.metadata["help"], hints[f.name]
        flags = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if dash_aliases and "_" in f.name else [])
        if isinstance(kind, types.UnionType):  # `T | None`: the type of its value is T
            kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        if kind is bool and default is True:
            parser.add_argument(f"--no_{f.name}", dest=f.name, action="store_false", help=help_)
        elif kind is bool:
            parser.add_argument(*flags, type=truth_value, nargs="?", const=True, default=default, help=help_)
        elif typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            if item is str and default is not None:
                help_ = f"{help_} (default: {' '.join(default)})"
            parser.add_argument(*flags, nargs="+", type=item, default=default, help=help_)
        else:
            parser.add_argument(*flags, type=kind, default=default, help=help_)
    return parser


def dataclass_parser(args_class: type, prog: str, description: str) -> argparse.ArgumentParser:
    """A command's parser with one flag per field of `args_class` (see `add_dataclass_arguments`)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
    return add_dataclass_arguments(parser, args_class)


def check_shape_source(preset: str | None, model_dir: str | None) -> None:
    """The model shape comes from exactly one of a preset and a model directory (a `ValueError` otherwise)."""
    if (preset is None) == (model_dir is None):
        raise ValueError("give exactly one of --preset NAME or --model_dir DIR (the model shape to analyse).")


def check_nonempty(args: Any, flags: Iterable[str]) -> None:
    """A list flag given with no value (``--variants`` alone) is a mistake, not a request for the defaults."""
    for flag in flags:
        if getattr(args, flag) == []:
            raise ValueError(f"--{flag} is empty; give at least one value or leave the flag out.")


def config_model_type(model_dir: str | Path, label: str, error: type[ValueError] = ValueError) -> Any:
    """The `model_type` of a model directory's config.json, read with the standard library (a parser's check);
    `error` naming `label` (how the message names the input) when there is no config.json or it does not parse."""
    config = Path(model_dir).expanduser() / "config.json"
    if not config.is_file():
        raise error(
            f"{label} is not a model directory (no config.json there); pass a directory written by save_pretrained "
            "(e.g. a `qkvshare train` or `qkvshare convert` run)."
        )
    try:
        return json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise error(f"{label}: config.json does not parse ({err}); put back the one saved with the model.") from None
