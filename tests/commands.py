"""The `qkvshare` commands as functions of their argv, for tests: `command("train")(argv, on_step=hook)` is
`qkvshare train ARGV` (the command line's parse, extras check and exit statuses), with the library function's test
hooks passed through."""

from collections.abc import Callable

import qkvshare_cli


def command(name: str) -> Callable[..., int]:
    def run(argv: list[str] | None = None, **hooks: object) -> int:
        return qkvshare_cli.main([name, *(argv or [])], **hooks)

    run.__name__ = f"qkvshare_{name}"
    return run
