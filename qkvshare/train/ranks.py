"""What the ranks of one run must agree on: a decision only the main process takes, or a flag any rank raises.

Design notes
- Some steps belong to the main process alone (taking the output directory's lock, training the BPE tokenizer);
  some failures hit one rank only (a full disk while it writes its part of a checkpoint, a signal delivered to
  one process). Either way every rank must reach the same decision, or the others block forever in the next
  collective. `on_main` runs a step on the main process and hands its result, or its error, to every rank;
  `first_message` and `max_over_ranks` combine what each rank saw.
- A single process does no communication at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from qkvshare_settings.train import TrainingSetupError

T = TypeVar("T")


def on_main(accelerator: Any, fn: Callable[[], T]) -> T:
    """Run `fn` on the main process only and return its result on every rank.

    A `TrainingSetupError` raised by `fn` is raised on every rank with the same message; any other error is
    raised as is on the main process and as a `RuntimeError` naming it on the others.
    """
    result: Any = None
    error: BaseException | None = None
    if accelerator.is_main_process:
        try:
            result = fn()
        except Exception as err:  # every rank must learn about it; re-raised below
            error = err
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        message = None if error is None else (type(error).__name__, str(error))
        payload = [(result, message)]
        broadcast_object_list(payload, from_process=0)
        result, message = payload[0]
        if error is None and message is not None:
            kind, text = message
            error = (
                TrainingSetupError(text)
                if kind == TrainingSetupError.__name__
                else RuntimeError(f"the main process failed: {kind}: {text}")
            )
    if error is not None:
        raise error
    return result


def first_message(accelerator: Any, message: str | None) -> str | None:
    """The first non-None `message` over the ranks (rank order), the same on every rank."""
    if accelerator.num_processes == 1:
        return message
    from accelerate.utils import gather_object

    return next((m for m in gather_object([message]) if m is not None), None)


def max_over_ranks(accelerator: Any, value: int) -> int:
    """The largest of each rank's `value`, the same on every rank."""
    if accelerator.num_processes == 1:
        return value
    return int(accelerator.gather(torch.tensor([value], device=accelerator.device)).max().item())
