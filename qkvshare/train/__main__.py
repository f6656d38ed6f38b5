"""`python -m qkvshare.train` / `accelerate launch -m qkvshare.train`: the same as `qkvshare train`."""

import sys

from .pretrain import main

if __name__ == "__main__":
    sys.exit(main())
