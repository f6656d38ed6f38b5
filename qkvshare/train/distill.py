"""Distillation as a library call: train a student model directory on a teacher's next-token distributions.

`distill` is `train` with `--init_from STUDENT --teacher TEACHER` settings built in code (`distill_arguments`): the
same loop, checkpoints, resume, DDP and loss (`pretrain.distillation_loss`) as `qkvshare train --teacher`. It is what
`qkvshare convert --method transfer` runs as its stage (c), inside its work folder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkvshare_settings.train import DistillSettings, distill_arguments

from .pretrain import train


def distill(
    student: str | Path,
    teacher: str | Path,
    train_file: str | Path,
    validation_file: str | Path,
    output_dir: str | Path,
    settings: DistillSettings,
    teacher_model: Any = None,
    on_step: Callable[[int, float, Any], None] | None = None,
) -> dict[str, Any]:
    """Distil the model directory `student` from `teacher` (a causal LM directory or .gguf file with the student's
    vocabulary) on the documents of `train_file` (.txt/.jsonl/.parquet), validating on `validation_file`, into
    `output_dir`; returns the run's final metrics (`val_kl` among them). A run already in `output_dir` is resumed
    from its latest checkpoint. Raises what `train` raises: a `ValueError` for bad input, a `CommandStopped`
    (`TrainingInterrupted`, `TrainingDiverged`, `CheckpointWriteError`) when it stops part-way. `teacher_model`: the
    teacher already in memory (frozen, eval mode, float32), used instead of loading `teacher` a second time.
    `on_step(step, loss, model)`: called after each optimizer step and its checkpoint (`train`'s hook)."""
    args = distill_arguments(
        str(student), str(teacher), str(train_file), str(validation_file), str(output_dir), settings
    )
    return train(args, on_step=on_step, teacher_model=teacher_model)
