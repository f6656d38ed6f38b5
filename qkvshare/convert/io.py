"""Reading a source (a model directory, a .gguf file, their tokenizers) and writing the converted model directory."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkvshare.convert.conversion import RECORD_FILE, ConversionRecord, check_architecture

if TYPE_CHECKING:
    import torch

    from qkvshare import QKVShareForCausalLM


def check_source_path(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    what = "is a file but not a .gguf file" if path.is_file() else "does not exist"
    raise ValueError(
        f"SRC {source!r} {what}; pass a model directory (config.json and safetensors, e.g. from save_pretrained) or "
        "a .gguf file."
    )


def _require_gguf() -> None:
    """transformers reads GGUF files with the `gguf` package, which no extra of ours installs (one file format)."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ValueError("reading a .gguf file needs the package gguf, which is not installed; pip install gguf.")


def read_source_config(source: str) -> dict[str, Any]:
    """The source's config as a dict, every field filled as transformers' config class fills it, without reading
    its weights. A directory must hold a supported config.json and weight files (checked complete): a `ValueError`
    naming the file otherwise."""
    path = check_source_path(source)
    if path.is_dir():
        from qkvshare.analysis.common import llama_config_dict
        from qkvshare.evaluation.common import read_config_json, weight_files

        d = read_config_json(path)
        check_architecture(d)
        config = llama_config_dict(d, str(path / "config.json"))
        weight_files(path)  # none, or a truncated one: said here, not as transformers' OSError after the calibration
        return config
    _require_gguf()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()


def load_source_tokenizer(source: str) -> Any:
    """The tokenizer saved with the source (a directory's files, or the one inside a .gguf), or None."""
    from transformers import AutoTokenizer

    path = check_source_path(source)
    if path.is_file():
        _require_gguf()
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    from qkvshare.train.tokenizer import TOKENIZER_FILES

    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def load_source(source: str, dtype: torch.dtype | None = None) -> Any:
    """A Llama-architecture causal LM from a directory or a .gguf file (float32 by default).

    A model loaded from GGUF is de-quantized by transformers but still marked as quantized, which
    `save_pretrained` refuses; it is copied into a plain model of its class, which saves normally.
    """
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    check_architecture(read_source_config(source))  # before reading any weight
    path = check_source_path(source)
    if path.is_dir():
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
    from qkvshare.analysis.conventions import torch_dtype

    out = Path(output_dir)
    model.to(torch_dtype(dtype)).save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    (out / RECORD_FILE).write_text(json.dumps(asdict(record), indent=2) + "\n")
    return out


def check_output_dir(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--output_dir {str(out)!r} is a file; choose a directory.")
    if any(out.iterdir()) and not (overwrite and (out / RECORD_FILE).is_file()):
        hint = (
            "; --overwrite_output_dir replaces only a previous conversion (a directory with conversion.json)"
            if overwrite
            else ", or pass --overwrite_output_dir to replace a previous conversion"
        )
        raise ValueError(f"--output_dir {str(out)!r} is not empty; choose a new directory{hint}.")
