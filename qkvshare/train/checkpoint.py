"""Crash-safe training checkpoints built on `accelerator.save_state`.

Design notes
- A checkpoint is `<output_dir>/checkpoints/checkpoint-<step>/`: accelerate's state (model as safetensors,
  optimizer, GradScaler, every rank's RNG states), the tokenizer, and `trainer_state.json` (step, tokens seen,
  the model config and what fixes the data order). With the LR a pure function of the step and the data order a
  pure function of (seed, step), that is everything needed to continue exactly.
- Atomicity: every rank writes into `.tmp-checkpoint-<step>/`; only when all are done does the main process
  rename it to its final name (`os.replace`, atomic on one filesystem). A crash mid-save leaves a `.tmp-*`
  directory that `latest` ignores and the next save removes; the previous checkpoint is untouched.
- `trainer_state.json` is written last, so a directory without it is never taken for a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from .args import TrainingSetupError

STATE_FILE = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
# Config keys that do not change the model's function (bookkeeping written by transformers).
_IGNORED_CONFIG_KEYS = {"transformers_version", "_name_or_path", "architectures", "auto_map", "dtype", "torch_dtype",
                        "use_cache", "_attn_implementation_autoset", "output_attentions", "output_hidden_states"}  # fmt: skip


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under `output_dir`, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT_RE.fullmatch(p.name))]
    return [p for _, p in sorted(found) if (p / STATE_FILE).is_file()]


def resolve_resume_path(resume: str, output_dir: str) -> Path:
    """`latest` -> the newest complete checkpoint of `output_dir`; a path -> that checkpoint (checked)."""
    if resume == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise TrainingSetupError(
                f"--resume_from_checkpoint latest: no complete checkpoint under {checkpoint_root(output_dir)}; "
                "drop the flag to start a new run (with --overwrite_output_dir if the directory is not empty)."
            )
        return found[-1]
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise TrainingSetupError(
            f"--resume_from_checkpoint {resume!r} is not a checkpoint (no {STATE_FILE}); pass a "
            f"<output_dir>/checkpoints/checkpoint-<step> directory or 'latest'."
        )
    return path


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    with open(Path(path) / STATE_FILE) as f:
        return json.load(f)


def comparable_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    """The config fields that define the model (bookkeeping keys removed), as JSON stores them (string keys)."""
    return {k: v for k, v in json.loads(json.dumps(config_dict)).items() if k not in _IGNORED_CONFIG_KEYS}


def check_compatible(state: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Raise if the checkpoint at `path` was written by a run with another model config or data layout.

    `current` has the same keys as the stored state: `model_config`, `block_size`, `global_batch_blocks`, `seed`.
    """
    problems = []
    old, new = comparable_config(state["model_config"]), comparable_config(current["model_config"])
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            problems.append(f"model {key}: checkpoint {old.get(key)!r}, now {new.get(key)!r}")
    for key in ("block_size", "global_batch_blocks", "seed"):
        if state.get(key) != current.get(key):
            problems.append(f"{key}: checkpoint {state.get(key)!r}, now {current.get(key)!r}")
    if problems:
        raise TrainingSetupError(
            f"checkpoint {path} comes from an incompatible run:\n  " + "\n  ".join(problems) + "\n"
            "Resume with the same --preset/--variant/--config_overrides, --block_size, global batch "
            "(per-device batch x accumulation x processes) and --seed, or start a new --output_dir."
        )


def save_checkpoint(accelerator: Any, output_dir: str, step: int, state: dict[str, Any], tokenizer: Any,
                    save_total_limit: int | None) -> Path:  # fmt: skip
    """Write checkpoint `step` atomically (all ranks call this) and delete the oldest beyond the limit."""
    root = checkpoint_root(output_dir)
    tmp, final = root / f".tmp-checkpoint-{step}", root / f"checkpoint-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crash mid-save
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tokenizer.save_pretrained(tmp)
        with open(tmp / STATE_FILE, "w") as f:
            json.dump(state, f, indent=2)
        if final.exists():  # the same step saved again (a resumed run): swap, never leave no checkpoint
            trash = root / f".old-checkpoint-{step}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash)
        else:
            os.replace(tmp, final)
        if save_total_limit is not None:
            for old in list_checkpoints(output_dir)[:-save_total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final
