"""The `qkvshare` command: one entry point, one module per subcommand, help and bad input answered without torch.

Why this package lives outside `qkvshare`: `import qkvshare` imports torch and transformers and registers the
models with transformers' Auto classes (seconds), and Python runs a package's `__init__.py` before any of its
submodules. So every command's arguments (parser, typed arguments, value checks) live here, in modules that import
the standard library and PyYAML only, and `qkvshare --help`, `qkvshare <command> --help`, usage errors and bad
values are answered before torch is imported. (`qkvshare.cli` re-exports `main` for `python -m qkvshare.cli`.)

A command runs in three steps:
1. `parse` (a function of this package) turns argv into the command's arguments, once. `--help` and usage errors
   raise `SystemExit` (argparse does); a bad value raises `ValueError` whose message says what is wrong and how to
   fix it, printed as `qkvshare <command>: error: ...` with exit status 2. It writes and downloads nothing.
2. The command's extras must be installed (`extras`); else one paragraph naming the packages and the
   `pip install` line, exit status 2.
3. The command's module is imported (so `import qkvshare` runs as always: Auto classes registered) and the
   function `Command.run` names (each command module's `execute`) is called with the parsed arguments; it returns
   the exit status. A `ModuleNotFoundError` for a package of an extra (raw, or `extras.require`'s
   `MissingExtraError`) becomes the same one-paragraph message and exit status 2, never a traceback.

Checks that need the config class, a model directory's contents or torch (variant names, override keys, devices)
are the command's own, in step 3, before any long work. Each command module also has `main(argv)`, which is
this `main` with the command's name in front (`python -m qkvshare.analysis.bench`, callers in Python).
"""

from __future__ import annotations

import importlib
import importlib.util
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from . import extras
from .conventions import report_bad_input
from .quiet import hide_known_harmless_logs


class Command(NamedTuple):
    """One subcommand of `qkvshare`: where its arguments are parsed and where it runs."""

    parse: str  # "module:function", function(argv: list[str]) -> arguments: step 1 (standard library only)
    run: str  # "module:function", function(arguments) -> int | None: the command itself (may import torch)
    help: str  # one line for `qkvshare --help`
    extras: tuple[str, ...] = ()  # extras (pyproject.toml, `extras.EXTRAS`) the command always needs


COMMANDS: dict[str, Command] = {
    "train": Command(
        "qkvshare_cli.train:parse_args",
        "qkvshare.train.pretrain:execute",
        "pretrain a model with Accelerate (also: accelerate launch -m qkvshare.train)",
        extras=("train",),
    ),
    "eval": Command(
        "qkvshare_cli.eval:parse_args",
        "qkvshare.evaluation.harness:execute",
        "5-shot lm-evaluation-harness suite and side-by-side table",
        extras=("eval",),
    ),
    "perplexity": Command(
        "qkvshare_cli.perplexity:parse_args",
        "qkvshare.evaluation.perplexity:execute",
        "token-weighted perplexity on held-out text",
        extras=("eval",),
    ),
    "synthetic": Command(
        "qkvshare_cli.synthetic:parse_args",
        "qkvshare.synthetic.sweep:execute",
        "the paper's synthetic encoder tasks, table and attention maps",
    ),
    "vision": Command(
        "qkvshare_cli.vision:parse_args",
        "qkvshare.vision.run:execute",
        "ViT variants on images (digits by default) and the set anomaly task",
        extras=("vision",),
    ),
    "costs": Command(
        "qkvshare_cli.costs:parse_args",
        "qkvshare.analysis.costs:execute",
        "parameters, MACs and KV-cache bytes of every variant (analytic)",
    ),
    "bench": Command(
        "qkvshare_cli.bench:parse_args",
        "qkvshare.analysis.bench:execute",
        "measured cache bytes, decode speed and capacity against Llama",
        extras=("plots",),
    ),
    "compare": Command(
        "qkvshare_cli.compare:parse_args",
        "qkvshare.analysis.compare:execute",
        "pretrain several variants identically and tabulate them",
        extras=("train", "plots"),
    ),
    "analyze": Command(
        "qkvshare_cli.analyze:parse_args",
        "qkvshare.analysis.weights:execute",
        "per-layer similarity and effective rank of Q, K, V weights",
    ),
    "convert": Command(
        "qkvshare_cli.convert:parse_args",
        "qkvshare.convert:execute",
        "convert a Llama-architecture checkpoint (directory or .gguf) to a sharing variant",
    ),
    "export": Command(
        "qkvshare_cli.export:parse_args",
        "qkvshare.export:execute",
        "write an ExecuTorch/ONNX program with the static tied cache inside, or a Llama/GGUF checkpoint",
    ),
}


def _resolve(target: str) -> Callable:
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def _exit_status(code: object) -> int:
    """The process exit status `sys.exit(code)` would give (None: 0, an int: itself, else printed and 1)."""
    if code is None or isinstance(code, int):
        return int(code or 0)
    print(code, file=sys.stderr)
    return 1


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: qkvshare <command> [options]", "", "commands:"]
    for name, command in COMMANDS.items():
        needs = f" [{', '.join(command.extras)}]" if command.extras else ""
        lines.append(f"  {name:<{width}}  {command.help}{needs}")
    lines += [
        "",
        "Run `qkvshare <command> --help` for the options of a command. A command marked [extra] needs that extra",
        'of the package: pip install "qkvshare[extra]" (or pip install -e ".[extra]" in a source checkout).',
        "`qkvshare --version` prints the version.",
    ]
    return "\n".join(lines)


def _version() -> str:
    """`qkvshare.version.__version__`, read from its file: importing `qkvshare.version` would run the package's
    `__init__.py` (torch). The file holds one literal (pyproject.toml reads it statically too)."""
    spec = importlib.util.find_spec("qkvshare")  # a top-level package: found without running it
    return runpy.run_path(str(Path(spec.submodule_search_locations[0]) / "version.py"))["__version__"]


def _unknown(command: str) -> int:
    import difflib  # only on this error path

    close = difflib.get_close_matches(command, COMMANDS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    print(f"qkvshare: unknown command {command!r}.{hint}\n\n{_usage()}", file=sys.stderr)
    return 2


def _missing_extras(command: Command) -> str | None:
    """Step 2: one sentence per extra of the command with packages missing, or None when all are installed."""
    messages = []
    for extra in command.extras:
        missing = extras.missing_packages(extra)
        if missing:
            messages.append(extras.missing_message("this command", missing, extra))
    return " ".join(messages) or None


def _run(name: str, command: Command, args: object) -> int:
    """Step 3: import and run the command; a missing optional package is one message, exit status 2."""
    hide_known_harmless_logs()  # before the command's imports print them (see qkvshare_cli.quiet)
    try:
        return int(_resolve(command.run)(args) or 0)
    except ModuleNotFoundError as err:
        top = (err.name or "").partition(".")[0]
        extra = extras.extra_providing(top, prefer=command.extras)
        if extra is None or extras.is_installed(top):
            raise  # not a missing optional package but a bug or a broken install: keep the traceback
        if isinstance(err, extras.MissingExtraError):
            message = str(err)
        else:
            message = extras.missing_message("this command", [extras.EXTRAS[extra][top]], extra)
        print(f"qkvshare {name}: error: {message}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `qkvshare` console script (argv: the command and its arguments). Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(_usage(), file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name in ("-h", "--help"):
        print(_usage())
        return 0
    if name == "--version":
        print(f"qkvshare {_version()}")
        return 0
    command = COMMANDS.get(name)
    if command is None:
        return _unknown(name)
    try:
        args = _resolve(command.parse)(rest)
    except SystemExit as exit_:
        return _exit_status(exit_.code)
    except ValueError as err:
        return report_bad_input(name, err)
    message = _missing_extras(command)
    if message:
        print(f"qkvshare {name}: error: {message}", file=sys.stderr)
        return 2
    return _run(name, command, args)
