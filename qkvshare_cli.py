"""The `qkvshare` command: one entry point, one module per subcommand, help and bad input answered without torch.

Why this module lives outside the `qkvshare` package: `import qkvshare` imports torch and transformers and
registers the models with transformers' Auto classes (seconds), and Python runs a package's `__init__.py` before
any of its submodules. The console script points here, so `qkvshare --help`, `qkvshare --version` and
`qkvshare <unknown>` import only the standard library. (`qkvshare.cli` re-exports this module.)

A command runs in three steps:
1. Its light `parse` function, if `COMMANDS` declares one, checks the arguments: `--help`, usage errors and bad
   values are answered here. It is imported with `light_imports`, which leaves the `__init__.py` of the packages
   above it unexecuted (no torch) and forgets every module it loaded under them afterwards.
2. The command's extras must be installed (`qkvshare._extras`); else one message and exit status 2.
3. Its `run` function is imported for real, so `import qkvshare` happens as always (Auto classes registered), and
   called with the arguments. A `ModuleNotFoundError` for a package of an extra (`qkvshare._extras.require`)
   becomes the same one-paragraph message and exit status 2, never a traceback.

Protocol for a command's `parse` function ("module:function" in `COMMANDS`):
- `function(argv: list[str]) -> object` parses and checks argv the way `run` will (the result is discarded:
  `run` parses again). `--help` and usage errors raise `SystemExit` (argparse does); bad values raise
  `ValueError` whose message says what is wrong and how to fix it. No side effects: nothing written or downloaded.
- Its module, and whatever that imports at module level, imports neither torch nor transformers, lm_eval or
  another heavy library (import them inside the functions that run after parsing), and nothing from the
  package root (`from qkvshare import X`; the package's own modules by name or relative import are fine when
  they follow the same rule). A module that breaks the rule is caught by tests/test_cli.py; at run time the
  command then simply parses in step 3 (slower, still correct).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple


class Command(NamedTuple):
    """One subcommand of `qkvshare`."""

    run: str  # "module:function", function(argv: list[str]) -> int | None: the command itself (may import torch)
    help: str  # one line for `qkvshare --help`
    extras: tuple[str, ...] = ()  # extras (pyproject.toml, qkvshare._extras.EXTRAS) the command always needs
    parse: str | None = None  # "module:function" following the protocol above; None: `run` parses (slow help)


COMMANDS: dict[str, Command] = {
    "train": Command(
        "qkvshare.train.pretrain:main",
        "pretrain a model with Accelerate (also: accelerate launch -m qkvshare.train)",
        extras=("train",),
        parse="qkvshare.train.args:parse_args",
    ),
    "eval": Command(
        "qkvshare.evaluation.harness:main",
        "5-shot lm-evaluation-harness suite and side-by-side table",
        extras=("eval",),
        parse="qkvshare.evaluation.harness:parse_args",
    ),
    "perplexity": Command(
        "qkvshare.evaluation.perplexity:main",
        "token-weighted perplexity on held-out text",
        extras=("eval",),
        parse="qkvshare.evaluation.perplexity:parse_args",
    ),
    "synthetic": Command(
        "qkvshare.synthetic.sweep:main",
        "the paper's synthetic encoder tasks, table and attention maps",
        parse="qkvshare.synthetic.sweep:parse_args",
    ),
    "vision": Command(
        "qkvshare.vision.run:main",
        "ViT variants on images (digits by default) and the set anomaly task",
        extras=("vision",),
        parse="qkvshare.vision.run:parse_args",
    ),
    "costs": Command(
        "qkvshare.analysis.costs:main",
        "parameters, MACs and KV-cache bytes of every variant (analytic)",
        parse="qkvshare.analysis.costs:parse_args",
    ),
    "bench": Command(
        "qkvshare.analysis.bench:main",
        "measured cache bytes, decode speed and capacity against Llama",
        extras=("plots",),
        parse="qkvshare.analysis.bench:parse_args",
    ),
    "compare": Command(
        "qkvshare.analysis.compare:main",
        "pretrain several variants identically and tabulate them",
        extras=("train", "plots"),
        parse="qkvshare.analysis.compare:parse_args",
    ),
    "analyze": Command(
        "qkvshare.analysis.weights:main",
        "per-layer similarity and effective rank of Q, K, V weights",
        parse="qkvshare.analysis.weights:parse_args",
    ),
    "convert": Command(
        "qkvshare.convert:main",
        "convert a Llama-architecture checkpoint (directory or .gguf) to a sharing variant",
        parse="qkvshare.convert:parse_args",
    ),
    "export": Command(
        "qkvshare.export:main",
        "write an ExecuTorch or ONNX program with the static tied cache inside",
        extras=("export",),
        parse="qkvshare.export_args:parse_args",
    ),
}


@contextmanager
def light_imports(name: str) -> Iterator[None]:
    """Let `import name` run without executing the `__init__.py` of the packages above it.

    Each package above `name` that is not imported yet is put in `sys.modules` as a bare module object (its spec
    and `__path__`, so submodules and relative imports resolve, but its code not run). On exit these and every
    module imported under them are removed from `sys.modules`, so a later `import qkvshare` runs the real
    `__init__.py`. Objects already obtained keep working. Modules outside those packages (yaml, ...) stay imported.
    """
    parts = name.split(".")
    stubbed: list[str] = []
    for depth in range(1, len(parts)):
        package = ".".join(parts[:depth])
        if package in sys.modules:
            continue
        spec = importlib.util.find_spec(package)  # runs nothing: its parent is already in sys.modules
        if spec is None or spec.submodule_search_locations is None:
            raise ModuleNotFoundError(f"no package named {package!r}", name=package)
        sys.modules[package] = importlib.util.module_from_spec(spec)
        stubbed.append(package)
    try:
        yield
    finally:
        for key in list(sys.modules):
            if any(key == p or key.startswith(p + ".") for p in stubbed):
                del sys.modules[key]


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
        extras = f" [{', '.join(command.extras)}]" if command.extras else ""
        lines.append(f"  {name:<{width}}  {command.help}{extras}")
    lines += [
        "",
        "Run `qkvshare <command> --help` for the options of a command. A command marked [extra] needs that extra",
        'of the package: pip install "qkvshare[extra]" (or pip install -e ".[extra]" in a source checkout).',
        "`qkvshare --version` prints the version.",
    ]
    return "\n".join(lines)


def _version() -> str:
    with light_imports("qkvshare.version"):
        return importlib.import_module("qkvshare.version").__version__


def _unknown(command: str) -> int:
    import difflib  # only on this error path

    close = difflib.get_close_matches(command, COMMANDS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    print(f"qkvshare: unknown command {command!r}.{hint}\n\n{_usage()}", file=sys.stderr)
    return 2


def _preflight(name: str, command: Command, argv: list[str]) -> int | None:
    """Step 1: the command's light `parse`. An exit status when it answered (help, bad input), else None."""
    if command.parse is None:
        return None
    module = command.parse.partition(":")[0]
    try:
        with light_imports(module):
            _resolve(command.parse)(list(argv))
    except SystemExit as exit_:
        return _exit_status(exit_.code)
    except ValueError as err:
        print(f"qkvshare {name}: error: {err}", file=sys.stderr)
        return 2
    except ImportError:
        return None  # the parse module breaks the protocol or needs a missing package: step 3 reports it
    return None


def _missing_extras(command: Command) -> str | None:
    """Step 2: one sentence per extra of the command with packages missing, or None when all are installed."""
    with light_imports("qkvshare._extras"):
        extras = importlib.import_module("qkvshare._extras")
        messages = []
        for extra in command.extras:
            missing = extras.missing_packages(extra)
            if missing:
                messages.append(extras.missing_message("this command", missing, extra))
    return " ".join(messages) or None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `qkvshare` console script. Returns the exit status."""
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
    status = _preflight(name, command, rest)
    if status is not None:
        return status
    message = _missing_extras(command)
    if message:
        print(f"qkvshare {name}: error: {message}", file=sys.stderr)
        return 2
    # Step 3: the real imports from here on (`import qkvshare` registers the Auto classes); first, the filter of
    # known harmless log lines of optional dependencies, which that import would print (see qkvshare.quiet).
    with light_imports("qkvshare.quiet"):
        importlib.import_module("qkvshare.quiet").hide_known_harmless_logs()
    extras = importlib.import_module("qkvshare._extras")
    try:
        return int(_resolve(command.run)(rest) or 0)
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


if __name__ == "__main__":
    sys.exit(main())
