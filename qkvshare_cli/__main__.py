"""`python -m qkvshare_cli ARGS`: the `qkvshare` command (for `accelerate launch -m qkvshare_cli train ...`)."""

import sys

from qkvshare_cli import main

sys.exit(main())
