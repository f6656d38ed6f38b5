"""Reading a source (a model directory, a .gguf file, their tokenizers) and writing the converted model directory.

Writing is all or nothing (`publish`): the directory is written whole into a folder beside the target
(`.NAME.incomplete`) and moved into place by renames only when complete, so a failed write (a full disk) leaves a
previous conversion at the target untouched, and a conversion killed while saving leaves no directory at the
target that would load as a model without its tokenizer or `conversion.json`. The stages of `--method transfer`
keep their progress in another folder beside the target (`work_dir_for`).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from qkvshare import QKVShareForCausalLM
from qkvshare.analysis.conventions import torch_dtype
from qkvshare.configuration_qkvshare import llama_config_dict
from qkvshare.convert.conversion import ConversionRecord, check_architecture
from qkvshare.evaluation.common import read_config_json, weight_files
from qkvshare.model_dir import check_weights_fit_config
from qkvshare.train.tokenizer import TOKENIZER_FILES
from qkvshare_cli.convert import RECORD_FILE, check_source_path


def _require_gguf() -> None:
    """transformers reads GGUF files with the `gguf` package, which no extra of ours installs (one file format)."""
    if importlib.util.find_spec("gguf") is None:
        raise ValueError("reading a .gguf file needs the package gguf, which is not installed; pip install gguf.")


def read_source_config(source: str) -> dict[str, Any]:
    """The source's config as a dict, every field filled as transformers' config class fills it, without reading
    its weights. A directory must hold a supported config.json and weight files (checked complete): a `ValueError`
    naming the file otherwise."""
    path = check_source_path(source)
    if path.is_dir():
        d = read_config_json(path)
        check_architecture(d)
        config = llama_config_dict(d, str(path / "config.json"))
        weight_files(path)  # none, or a truncated one: said here, not as transformers' OSError after the calibration
        return config
    _require_gguf()
    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()


def load_source_tokenizer(source: str) -> Any:
    """The tokenizer saved with the source (a directory's files, or the one inside a .gguf), or None."""
    path = check_source_path(source)
    if path.is_file():
        _require_gguf()
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def load_source(source: str, dtype: torch.dtype | None = None) -> Any:
    """A Llama-architecture causal LM from a directory or a .gguf file (float32 by default).

    A model loaded from GGUF is de-quantized by transformers but still marked as quantized, which
    `save_pretrained` refuses; it is copied into a plain model of its class, which saves normally.
    """
    dtype = dtype or torch.float32
    check_architecture(read_source_config(source))  # before reading any weight
    path = check_source_path(source)
    if path.is_dir():
        check_weights_fit_config(path, model_class=AutoModelForCausalLM, label=f"SRC {source!r}")
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    plain_config = copy.deepcopy(loaded.config)
    if hasattr(plain_config, "quantization_config"):
        del plain_config.quantization_config
    plain = type(loaded)(plain_config).to(dtype)
    with torch.no_grad():
        plain.load_state_dict(loaded.state_dict(), strict=True)
    return plain.eval()


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


class ConversionWriteError(RuntimeError):
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
    except (OSError, RuntimeError) as err:
        shutil.rmtree(staging, ignore_errors=True)
        reason = " ".join(str(err).split())
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
