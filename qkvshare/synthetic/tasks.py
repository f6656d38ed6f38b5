"""The paper's five synthetic sequence tasks (section 4.1): digits 0..9 in, one target digit per input token.

COPY y = x; REVERSE y = flip(x); SORT y = sort(x) ascending; SUB y = 9 - x; SWAP y = cat(x[T/2:], x[:T/2]).
Inputs are uniform over the 10 symbols; targets have the input's length, so every task is per-token
classification with 10 classes and the metric is token accuracy. Data are generated from a seeded
`torch.Generator`, so a (task, length, size, seed) tuple always gives the same tensors.
"""

from __future__ import annotations

import torch

from qkvshare_settings.synthetic import TASKS

NUM_SYMBOLS = 10


def task_targets(task: str, x: torch.Tensor) -> torch.Tensor:
    """Targets (..., T) of `task` for inputs `x` (..., T) of digits 0..9."""
    if task == "copy":
        return x.clone()
    if task == "reverse":
        return x.flip(-1)
    if task == "sort":
        return x.sort(dim=-1).values
    if task == "sub":
        return (NUM_SYMBOLS - 1) - x
    if task == "swap":
        if x.shape[-1] % 2:
            raise ValueError(f"swap needs an even sequence length (it exchanges the two halves); got {x.shape[-1]}.")
        half = x.shape[-1] // 2
        return x.roll(-half, dims=-1)  # (x[T/2:], x[:T/2]): the halves exchanged
    raise ValueError(f"task={task!r} is not a synthetic task; allowed: {', '.join(TASKS)}.")


def make_dataset(task: str, num_sequences: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`num_sequences` uniform digit sequences of `length` and their targets, both (N, T) int64."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not a synthetic task; allowed: {', '.join(TASKS)}.")
    if length < 2 or num_sequences < 1:
        raise ValueError(
            f"need length >= 2 and num_sequences >= 1; got length={length}, num_sequences={num_sequences}."
        )

    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, NUM_SYMBOLS, (num_sequences, length), generator=generator)
    return x, task_targets(task, x)


__all__ = ["TASKS", "NUM_SYMBOLS", "task_targets", "make_dataset"]
