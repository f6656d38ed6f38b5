"""The `qkvshare` command: one entry point, a table of subcommands, and how their outcomes become exit statuses.

Three packages, dependencies pointing one way (pyproject.toml's import-linter contracts check it):
- `qkvshare_settings` (standard library and PyYAML only): every command's typed settings, with their defaults,
  documentation and checks, and how they are read from argv or a YAML recipe;
- `qkvshare` (torch, transformers): the models and caches, and one Python function per command that takes those
  settings and returns its result (`qkvshare.convert.convert_checkpoint(ConvertArgs(...))`, ...);
- `qkvshare_cli` (this package): argv -> settings -> that function, and nothing else. The library never imports it.

Why the settings live outside `qkvshare`: `import qkvshare` imports torch and transformers and registers the models
with transformers' Auto classes (seconds), and Python runs a package's `__init__.py` before any of its submodules.
So `qkvshare --help`, `qkvshare <command> --help`, usage errors and bad values are answered before torch is
imported.

A command runs in three steps:
1. `parse` (a `qkvshare_settings` function) turns argv into the command's settings, once. `--help` and usage errors
   raise `SystemExit` (argparse does); a bad value raises `ValueError` whose message says what is wrong and how to
   fix it, printed as `qkvshare <command>: error: ...` with exit status 2. It writes and downloads nothing.
2. The command's extras must be installed (`qkvshare_settings.extras`); else one paragraph naming the packages and
   the `pip install` line, exit status 2.
3. `run` (`run_command`): the library function `Command.run` names is called with the settings. What it raises is
   the exit status: a `ValueError` is bad input found once the command runs (2, its message), a
   `CommandStopped` a run that stopped with what it saved kept (its own status and message, e.g. 1 or 128 + a
   signal), Ctrl-C 130; a `ModuleNotFoundError` for a package of an extra the same one paragraph as step 2, never a
   traceback. Messages are printed once, by the main process of a distributed launch.

`python -m qkvshare_cli ARGS` is the same as `qkvshare ARGS` (for `accelerate launch -m qkvshare_cli train ...`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from qkvshare_settings import extras
from qkvshare_settings.conventions import CommandStopped, report_bad_input

from .quiet import hide_known_harmless_logs


class Command(NamedTuple):
    """One subcommand of `qkvshare`: where its arguments are parsed and where it runs."""

    parse: str  # "module:function", function(argv: list[str]) -> settings: step 1 (standard library only)
    run: str  # "module:function", function(settings, **hooks) -> result: the library's API of the command
    help: str  # one line for `qkvshare --help`
    extras: tuple[str, ...] = ()  # extras (pyproject.toml, `extras.EXTRAS`) the command always needs
    interrupted: str = "interrupted."  # said after Ctrl-C (exit status 130)


COMMANDS: dict[str, Command] = {
    "train": Command(
        "qkvshare_settings.train:parse_args",
        "qkvshare.train:train",
        "pretrain a model with Accelerate (also: accelerate launch -m qkvshare_cli train)",
        extras=("train",),
        interrupted="interrupted; nothing saved since the last checkpoint.",
    ),
    "eval": Command(
        "qkvshare_settings.eval:parse_args",
        "qkvshare.evaluation.harness:evaluate",
        "5-shot lm-evaluation-harness suite and side-by-side table",
        extras=("eval",),
    ),
    "perplexity": Command(
        "qkvshare_settings.perplexity:parse_args",
        "qkvshare.evaluation.perplexity:measure_perplexity",
        "token-weighted perplexity on held-out text",
        extras=("eval",),
    ),
    "synthetic": Command(
        "qkvshare_settings.synthetic:parse_args",
        "qkvshare.synthetic.sweep:run_synthetic",
        "the paper's synthetic encoder tasks, table and attention maps",
    ),
    "vision": Command(
        "qkvshare_settings.vision:parse_args",
        "qkvshare.vision.run:vision",
        "ViT variants on images (digits by default) and the set anomaly task",
        extras=("vision",),
    ),
    "costs": Command(
        "qkvshare_settings.costs:parse_args",
        "qkvshare.analysis.costs:run_costs",
        "parameters, MACs and KV-cache bytes of every variant (analytic)",
    ),
    "bench": Command(
        "qkvshare_settings.bench:parse_args",
        "qkvshare.analysis.bench:run_bench",
        "measured cache bytes, decode speed and capacity against Llama",
        extras=("plots",),
    ),
    "compare": Command(
        "qkvshare_settings.compare:parse_args",
        "qkvshare.analysis.compare:run_compare",
        "pretrain several variants identically and tabulate them",
        extras=("train", "plots"),
    ),
    "analyze": Command(
        "qkvshare_settings.analyze:parse_args",
        "qkvshare.analysis.weights:run_analyze",
        "per-layer similarity and effective rank of Q, K, V weights",
    ),
    "convert": Command(
        "qkvshare_settings.convert:parse_args",
        "qkvshare.convert:convert_checkpoint",
        "convert a Llama-architecture checkpoint (directory or .gguf) to a sharing variant",
    ),
    "export": Command(
        "qkvshare_settings.export:parse_args",
        "qkvshare.export:export_model",
        "write an ExecuTorch/ONNX program with the static tied cache inside, or a Llama/GGUF checkpoint",
    ),
    "serve": Command(
        "qkvshare_settings.serve:parse_args",
        "qkvshare.serve:serve",
        "an OpenAI-compatible server for a QKVShare model, with the one-tensor cache",
        extras=("serve",),
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


def _is_main_process() -> bool:
    """Rank 0 of a distributed launch (torchrun, accelerate, MPI), or a single process: messages are printed once."""
    for variable in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"):
        if variable in os.environ:
            return os.environ[variable].strip() in ("", "0")
    return True


def _say(name: str, message: str) -> None:
    if _is_main_process():
        print(f"qkvshare {name}: {' '.join(message.split())}", file=sys.stderr, flush=True)


def run_command(name: str, settings: object, **hooks: object) -> int:
    """Step 3: call command `name`'s library function with its parsed `settings` (and `hooks`, keyword arguments
    that function takes, e.g. train's `on_step`); returns the exit status its outcome stands for."""
    command = COMMANDS[name]
    hide_known_harmless_logs()  # before the command's imports print them (see qkvshare_cli.quiet)
    try:
        _resolve(command.run)(settings, **hooks)
    except ModuleNotFoundError as err:
        top = (err.name or "").partition(".")[0]
        extra = extras.extra_providing(top, prefer=command.extras)
        if extra is None or extras.is_installed(top):
            raise  # not a missing optional package but a bug or a broken install: keep the traceback
        if isinstance(err, extras.MissingExtraError):
            message = str(err)
        else:
            message = extras.missing_message("this command", [extras.EXTRAS[extra][top]], extra)
        _say(name, f"error: {message}")
        return 2
    except ValueError as err:
        return report_bad_input(name, err) if _is_main_process() else 2
    except CommandStopped as err:
        _say(name, f"{err.label}: {err}" if err.label else str(err))
        return err.exit_status
    except KeyboardInterrupt:
        _say(name, command.interrupted)
        return 130
    return 0


def main(argv: list[str] | None = None, **hooks: object) -> int:
    """Entry point of the `qkvshare` console script (argv: the command and its arguments). Returns the exit status.
    `hooks` go to the command's library function (`run_command`), e.g. train's `on_step` in tests."""
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
    return run_command(name, args, **hooks)
