"""Stage (c) of `qkvshare convert --method transfer`: end-to-end distillation of the converted model against the
source's logits, through `qkvshare.train.distill` (the loop, checkpoints, resume and DDP of `qkvshare train
--teacher`) inside the conversion's work folder.

The text is the calibration text's train split (never its validation or test split), written to a jsonl file with
about the tokens the budget reads; the run validates on the validation split, which gives `eval/kl`. A conversion
killed during this stage resumes from the run's last checkpoint (`--resume_from_checkpoint latest`); one that had
finished it reuses the run's final model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from qkvshare.train.distill import distill
from qkvshare_settings.train import DistillSettings


def write_text_file(path: Path, texts: Iterable[str], tokenizer: Any, tokens: int) -> int:
    """Write documents of `texts` as jsonl until they hold `tokens` tokens (+10%, plus one block); returns the
    tokens written. The trainer then tokenizes only what its budget reads."""
    count, lines = 0, []
    for text in texts:
        lines.append(json.dumps({"text": text}) + "\n")
        count += len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]) + 1
        if count >= 1.1 * tokens + 2048:
            break
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(lines))
    tmp.replace(path)
    return count


def run_distillation(
    model_dir: Path,
    teacher: str,
    train_texts: Iterable[str],
    validation_texts: Iterable[str],
    tokenizer: Any,
    work: Path,
    settings: DistillSettings,
) -> tuple[Path, dict[str, Any]]:
    """Stage (c): distil the model saved in `model_dir` from `teacher`, in `work/distill`. Returns the directory
    of the distilled model and the run's final metrics; raises what `qkvshare.train.distill` raises when the run
    stops (the conversion is then resumable)."""
    out = work / "distill"
    metrics_file = out / "final_metrics.json"
    if metrics_file.is_file():  # finished by an earlier run of this conversion
        return out, json.loads(metrics_file.read_text())
    work.mkdir(parents=True, exist_ok=True)
    train_file, validation_file = work / "distill-train.jsonl", work / "distill-validation.jsonl"
    if not train_file.is_file():
        write_text_file(train_file, train_texts, tokenizer, settings.tokens)
    if not validation_file.is_file():
        write_text_file(validation_file, validation_texts, tokenizer, settings.eval_blocks * settings.block_size)
    return out, distill(model_dir, teacher, train_file, validation_file, out, settings)
