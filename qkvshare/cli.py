"""The `qkvshare` command: one entry point, one module per subcommand.

Subcommand modules are imported only when used, so `qkvshare costs` does not pay for lm-eval's import.
Each module exposes `main(argv: list[str] | None) -> int`.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "qkvshare.train.pretrain",
        "pretrain a model with Accelerate (also: accelerate launch -m qkvshare.train)",
    ),
    "eval": ("qkvshare.evaluation.harness", "5-shot lm-evaluation-harness suite and side-by-side table"),
    "perplexity": ("qkvshare.evaluation.perplexity", "token-weighted perplexity on held-out text"),
    "synthetic": ("qkvshare.synthetic.sweep", "the paper's synthetic encoder tasks, table and attention maps"),
    "costs": ("qkvshare.analysis.costs", "parameters, MACs and KV-cache bytes of every variant (analytic)"),
    "bench": ("qkvshare.analysis.bench", "measured cache bytes, decode speed and capacity against Llama"),
    "compare": ("qkvshare.analysis.compare", "pretrain several variants identically and tabulate them"),
    "analyze": ("qkvshare.analysis.weights", "per-layer similarity and effective rank of Q, K, V weights"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: qkvshare <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `qkvshare <command> --help` for the options of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"qkvshare: unknown command {command!r}.\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
