"""Stage (c) of `qkvshare convert --method transfer`: end-to-end distillation of the converted model against the
source's logits, run as `qkvshare train --init_from STAGE_MODEL --teacher SRC` (the same loop, checkpoints,
resume and DDP as any training run) inside the conversion's work folder.

The text is the calibration text's train split (never its validation or test split), written to a jsonl file with
about the tokens the budget reads; the run validates on the validation split, which gives `eval/kl`. A conversion
killed during this stage resumes from the run's last checkpoint (`--resume_from_checkpoint latest`); one that had
finished it reuses the run's final model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkvshare_cli.train import parse_args as parse_train_args


@dataclass
class DistillSettings:
    """Stage (c)'s budget and optimiser (the command's --distill_* flags)."""

    tokens: int = 0  # 0: no stage (c)
    batch_size: int = 4  # blocks per step
    block_size: int = 512
    learning_rate: float = 3e-5  # configs/uptrain-smollm2.yaml's peak: larger first AdamW steps hurt a close init
    warmup_steps: int = 2
    temperature: float = 1.0
    lm_weight: float = 0.0
    save_steps: int = 10
    seed: int = 0

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.tokens / (self.batch_size * self.block_size)))


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


def distill_argv(
    model_dir: Path, teacher: str, train_file: Path, validation_file: Path, out: Path, s: DistillSettings
) -> list[str]:
    """`qkvshare train` flags of stage (c); `--resume_from_checkpoint latest` when `out` holds a checkpoint."""
    eval_blocks = 16
    argv = [
        *("--init_from", str(model_dir), "--teacher", teacher, "--output_dir", str(out)),
        *("--train_file", str(train_file), "--validation_file", str(validation_file)),
        *("--block_size", str(s.block_size), "--per_device_train_batch_size", str(s.batch_size)),
        *("--max_steps", str(s.steps), "--learning_rate", str(s.learning_rate)),
        *("--warmup_steps", str(min(s.warmup_steps, s.steps)), "--weight_decay", "0.0"),
        *("--distill_temperature", str(s.temperature), "--distill_lm_weight", str(s.lm_weight)),
        *("--save_steps", str(s.save_steps), "--save_total_limit", "1", "--eval_steps", str(s.steps)),
        *("--logging_steps", str(max(1, min(10, s.steps))), "--max_eval_samples", str(eval_blocks)),
        *("--report_to", "none", "--sample_max_new_tokens", "0", "--seed", str(s.seed)),
    ]
    if (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("checkpoint-*")):
        argv += ["--resume_from_checkpoint", "latest"]
    elif out.exists():
        argv += ["--overwrite_output_dir"]  # killed before its first checkpoint: only this stage's own files
    return argv


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
    of the distilled model and the run's final metrics; a `RuntimeError` naming the command to rerun when the
    training run stops (the conversion is then resumable)."""
    from qkvshare.train.pretrain import execute

    out = work / "distill"
    metrics_file = out / "final_metrics.json"
    if metrics_file.is_file():  # finished by an earlier run of this conversion
        return out, json.loads(metrics_file.read_text())
    work.mkdir(parents=True, exist_ok=True)
    train_file, validation_file = work / "distill-train.jsonl", work / "distill-validation.jsonl"
    if not train_file.is_file():
        write_text_file(train_file, train_texts, tokenizer, settings.tokens)
    if not validation_file.is_file():
        write_text_file(validation_file, validation_texts, tokenizer, 16 * settings.block_size)
    args = parse_train_args(distill_argv(model_dir, teacher, train_file, validation_file, out, settings))
    status = execute(args)
    if status != 0:
        raise RuntimeError(
            f"the distillation stage stopped (qkvshare train exit status {status}, its message above); rerun the "
            "same `qkvshare convert` command to continue from its last checkpoint."
        )
    return out, json.loads(metrics_file.read_text())
