"""`python -m qkvshare.cli`: the `qkvshare` command.

Its code is the top-level package `qkvshare_cli`, outside this package, so that `qkvshare --help` and bad
arguments are answered without importing torch (see that package's docstring). This name stays for
`from qkvshare.cli import main` and `python -m qkvshare.cli`.
"""

import sys

from qkvshare_cli import COMMANDS, Command, main

__all__ = ["COMMANDS", "Command", "main"]

if __name__ == "__main__":
    sys.exit(main())
