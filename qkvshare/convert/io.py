"""Reading a source (a model directory, a .gguf file, their tokenizers) and writing the converted model directory."""

from __future__ import annotations

import copy
import importlib.util
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from qkvshare import QKVShareForCausalLM
from qkvshare.analysis.common import llama_config_dict
from qkvshare.analysis.conventions import torch_dtype
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
