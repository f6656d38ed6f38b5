"""Learning-rate schedule: linear warmup, then cosine decay to a fraction of the peak (the paper's recipe).

The one home of the schedule: `qkvshare train` uses it with a 10% floor, the synthetic sweep with a 0 floor and
a warmup given as a fraction of the steps (`warmup_steps_for_fraction`). It is a pure function of the optimizer
step, so resuming needs only the step counter (no scheduler state to save) and any value can be checked directly.
"""

from __future__ import annotations

import math


def get_lr(step: int, *, peak_lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float = 0.1) -> float:
    """LR used by optimizer step `step` (0-based).

    Warmup: `peak_lr * (step + 1) / warmup_steps` for `step < warmup_steps` (the first step already moves).
    Then cosine from `peak_lr` at `step == warmup_steps` down to `min_lr_ratio * peak_lr` at `step == max_steps`
    (held there if training runs longer).
    """
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    min_lr = min_lr_ratio * peak_lr
    return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def warmup_steps_for_fraction(warmup_fraction: float, total_steps: int) -> int:
    """Warmup steps for a warmup given as a share of the run: at least one step when the share is positive."""
    return max(1, math.ceil(warmup_fraction * total_steps)) if warmup_fraction > 0 else 0
