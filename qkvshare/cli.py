"""`python -m qkvshare.cli`: the `qkvshare` command.

Its code is the top-level module `qkvshare_cli`, outside this package, so that `qkvshare --help` and bad
arguments are answered without importing torch (see that module's docstring). This name stays for
`from qkvshare.cli import main` and `python -m qkvshare.cli`.
"""

import sys

from qkvshare_cli import COMMANDS, Command, light_imports, main

__all__ = ["COMMANDS", "Command", "light_imports", "main"]

if __name__ == "__main__":
    sys.exit(main())
