"""`python -m qkvshare.train ARGS` (and `accelerate launch -m qkvshare.train ARGS`): kept for existing launch lines.

It becomes `python -m qkvshare_cli train ARGS` in the same process (`os.execv`: the launcher's environment, rank
variables included, stays), so the library does not import its command line.
"""

import os
import sys

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, "-m", "qkvshare_cli", "train", *sys.argv[1:]])
