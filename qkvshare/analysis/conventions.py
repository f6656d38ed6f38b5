"""The torch side of the command-line conventions: the `torch.dtype` of a `--dtype` name.

The conventions themselves (help layout, `--dtype` names and aliases, file names) are `qkvshare_cli.conventions`,
which the command-line parsers import without torch.
"""

from __future__ import annotations

import torch

from qkvshare_cli.conventions import dtype_name


def torch_dtype(name: str) -> torch.dtype | str:
    """The `torch.dtype` of a canonical `--dtype` name; ``auto`` stays the string transformers understands."""
    if name == "auto":
        return "auto"
    return getattr(torch, dtype_name(name))
