"""Writing the converted model directory (sources are read by `qkvshare.model_dir`).

Writing is all or nothing (`publish`): the directory is written whole into a folder beside the target
(`.NAME.incomplete`) and moved into place by renames only when complete, so a failed write (a full disk) leaves a
previous conversion at the target untouched, and a conversion killed while saving leaves no directory at the
target that would load as a model without its tokenizer or `conversion.json`. The stages of `--method transfer`
keep their progress in another folder beside the target (`work_dir_for`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from qkvshare import QKVShareForCausalLM
from qkvshare.convert.conversion import ConversionRecord
from qkvshare.runtime import describe_disk_full, is_disk_full, torch_dtype
from qkvshare_settings.conventions import CommandStopped
from qkvshare_settings.convert import RECORD_FILE


def save_converted(
    model: QKVShareForCausalLM,
    record: ConversionRecord,
    output_dir: str | Path,
    tokenizer: Any = None,
    dtype: str = "float32",
) -> Path:
    """Write a normal model directory: safetensors, config (auto_map), the model code, the tokenizer (when given)
    and `conversion.json`. Returns the directory."""
    out = Path(output_dir)
    model.to(torch_dtype(dtype)).save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    (out / RECORD_FILE).write_text(json.dumps(asdict(record), indent=2) + "\n")
    return out


class ConversionWriteError(CommandStopped):
    """The converted model directory could not be written; the target is as it was before."""


def staging_dir(out: Path) -> Path:
    """Where a conversion writes its model directory before it is moved to `out`."""
    return out.parent / f".{out.name}.incomplete"


def work_dir_for(out: Path) -> Path:
    """Where `--method transfer` keeps its stages' progress until the model is in place."""
    return out.parent / f".{out.name}.qkvshare-convert"


def publish(write: Callable[[Path], None], out: str | Path) -> Path:
    """Run `write(folder)` on a new folder beside `out` and move it to `out` only when it returns.

    A previous directory at `out` (a conversion `check_output_dir` accepted for --overwrite_output_dir, or an empty
    one) is renamed aside, the new one renamed into place, and only then the old one deleted. A failed write deletes
    the partial folder and raises `ConversionWriteError`; `out` is untouched.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging, replaced = staging_dir(out), out.parent / f".{out.name}.replaced"
    for leftover in (staging, replaced if out.exists() else None):  # from a run killed while saving
        if leftover is not None and leftover.exists():
            shutil.rmtree(leftover)
    staging.mkdir()
    try:
        write(staging)
    except (OSError, RuntimeError, SafetensorError) as err:
        shutil.rmtree(staging, ignore_errors=True)
        reason = " ".join(str(err).split())
        if is_disk_full(err):
            reason = f"{describe_disk_full(out.parent)}; {reason}"
        kept = f"the previous model directory {str(out)!r} is unchanged" if out.exists() else "nothing was written"
        raise ConversionWriteError(
            f"could not write the converted model ({reason}); {kept}. Free space (or fix the cause) and rerun."
        ) from err
    if out.exists():
        os.replace(out, replaced)
        os.replace(staging, out)
        shutil.rmtree(replaced)
    else:
        os.replace(staging, out)
    return out
