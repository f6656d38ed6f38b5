"""What the commands that read a checkpoint share: checking its files, loading it, and its costs.

Used by `qkvshare eval` and `qkvshare perplexity` (whole models) and `qkvshare analyze` (weights only).
Every check runs before any weights are read, so a typo in the third of three models, or a truncated download,
fails in a second with the file named, not after the first model's evaluation, and never as a SafetensorError
traceback. Importing a `qkvshare` submodule imports `qkvshare`, which registers the QKVShare classes with
transformers' Auto classes: our checkpoints then load without `trust_remote_code`.
"""

from __future__ import annotations

import json
import os
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from qkvshare.analysis.conventions import torch_dtype

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth")
REPAIR = "Re-download the model, or re-save it with save_pretrained."


class EvalInputError(ValueError):
    """Bad user input (model, task, data): the message says what is wrong and how to fix it."""


class NonFiniteResultError(RuntimeError):
    """A computed result (a loss, a perplexity) is NaN or infinite; the message says where and what to try."""


def default_device() -> str:
    """`cuda` when a GPU is visible, otherwise `cpu`."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _looks_like_local_path(name: str) -> bool:
    # A hub id is `name` or `org/name`; anything else (absolute, ./, ~, deeper paths) can only be a directory.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


# ----------------------------------------------------------------------------------------------------------------
# checkpoint files: config.json and the safetensors weights, checked before anything is loaded
# ----------------------------------------------------------------------------------------------------------------
def read_json_file(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in `path`; an `EvalInputError` naming the file when it is unreadable or not an object."""
    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as err:
        raise EvalInputError(
            f"{path} ({what}) is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}): the file is "
            f"damaged or truncated. {REPAIR}"
        ) from err
    except (OSError, UnicodeDecodeError) as err:
        raise EvalInputError(f"{path} ({what}) is unreadable ({err}). {REPAIR}") from err
    if not isinstance(data, dict):
        raise EvalInputError(f"{path} ({what}) holds a JSON {type(data).__name__}, not an object. {REPAIR}")
    return data


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """The `config.json` of a model directory, with a clear error when it is missing or damaged."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise EvalInputError(
            f"model directory {str(model_dir)!r} has no config.json: not a Hugging Face model directory. "
            "Pass a directory written by save_pretrained (e.g. a `qkvshare train` checkpoint)."
        )
    return read_json_file(path, "the model config")


def check_safetensors_file(path: Path) -> None:
    """Raise `EvalInputError` naming `path` when it is missing, truncated or not a readable safetensors file.

    The size check reads only the header: 8 bytes of header length, the JSON header, then the data, whose
    extent is the largest `data_offsets` end; a file shorter than that was cut off (an interrupted download or
    save). `safe_open` then validates the header the way loading will (dtypes, shapes, offsets).
    """
    if not path.is_file():
        raise EvalInputError(f"weights file {path} is missing. {REPAIR}")
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else None
        if header_len is None or header_len > size - 8:
            raise EvalInputError(
                f"weights file {path} is truncated ({size:,} bytes, shorter than its own header): the download "
                f"or save was interrupted. {REPAIR}"
            )
        try:
            header = json.loads(f.read(header_len))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
            raise EvalInputError(
                f"weights file {path} is unreadable: its header is not a safetensors header ({err}). {REPAIR}"
            ) from err
    expected = 8 + header_len + end
    if size < expected:
        raise EvalInputError(
            f"weights file {path} is truncated: {size:,} of {expected:,} bytes (its header lists data up to byte "
            f"{expected:,}); the download or save was interrupted. {REPAIR}"
        )
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as err:
        raise EvalInputError(f"weights file {path} is unreadable ({err}). {REPAIR}") from err


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory (sharded via its index, or globbed), each checked complete.

    An index that lists a missing shard, a truncated file or a damaged header raises `EvalInputError` naming the
    file. Returns [] when the directory holds no safetensors weights at all (the caller decides what that means).
    """
    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json_file(index, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise EvalInputError(f"{index} has no 'weight_map' of tensor names to files. {REPAIR}")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise EvalInputError(
                f"{index} lists weight file(s) {', '.join(missing)} missing from {model_dir}: the download or save "
                f"is incomplete. {REPAIR}"
            )
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        check_safetensors_file(path)
    return files


def weight_files(model_dir: str | Path, allow_pickle: bool = True) -> list[Path]:
    """The checked safetensors files of a model directory (see `safetensors_files`); an error when it has none.

    With only pickle weights (`pytorch_model.bin`) it returns [] if `allow_pickle` (transformers loads those
    itself), else says that pickles are never loaded.
    """
    model_dir = Path(model_dir)
    files = safetensors_files(model_dir)
    if files:
        return files
    pickles = sorted(p.name for pattern in PICKLE_WEIGHTS for p in model_dir.glob(pattern))
    if pickles and allow_pickle:
        return []
    if pickles:
        raise EvalInputError(
            f"{model_dir} holds no *.safetensors weights (found {', '.join(pickles)}: pickle files are never "
            "loaded; convert them to safetensors, e.g. load the model and save_pretrained it)."
        )
    raise EvalInputError(
        f"model directory {str(model_dir)!r} has no weights (model.safetensors is missing): the save or download "
        f"did not finish. {REPAIR}"
    )


def check_causal_lm(name: str, trust_remote_code: bool = False):
    """Return the config of model `name` (a directory or a hub id) after checking it is a causal LM.

    Raises `EvalInputError` for a missing directory, a directory without `config.json`, a damaged config, a hub
    id that cannot be resolved, a config that is not a decoder-only language model (e.g. a BERT or a
    bidirectional QKVShare encoder), missing, truncated or damaged weights (see `weight_files`), or weights that
    do not fit the model the config builds (`qkvshare.model_dir.check_weights_fit_config`).
    """
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise EvalInputError(f"model {name!r} is a file; pass the model directory (the one with config.json).")
        read_config_json(path)  # damaged config.json: named here, not as transformers' OSError below
        source = str(path)
    elif _looks_like_local_path(name):
        raise EvalInputError(f"model directory {name!r} does not exist. Check the path (or pass a hub id).")
    else:
        source = name
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        where = "directory" if path.exists() else "directory or hub model id"
        raise EvalInputError(
            f"could not load a model config from {where} {name!r}: {err}. Without internet only local "
            "directories work; for code not in transformers or qkvshare pass --trust_remote_code."
        ) from err
    is_causal_type = type(config) in AutoModelForCausalLM._model_mapping or "AutoModelForCausalLM" in (
        getattr(config, "auto_map", None) or {}
    )
    # QKVShare configs double as bidirectional encoders for the synthetic tasks (is_causal=False).
    if not is_causal_type or getattr(config, "is_causal", True) is False:
        raise EvalInputError(
            f"model {name!r} (model_type {config.model_type!r}) is not a causal language model; "
            "eval and perplexity need a decoder-only LM (AutoModelForCausalLM), e.g. a `qkvshare train` checkpoint."
        )
    if path.exists():
        weight_files(path)  # a missing, truncated or damaged weights file: named now, before any model loads
        from qkvshare.model_dir import check_weights_fit_config

        check_weights_fit_config(path, config, AutoModelForCausalLM, f"model {name!r}", EvalInputError)
    return config


def check_finite_weights(model, name: str) -> None:
    """Raise `EvalInputError` naming the tensors of `model` that hold NaN or infinite values.

    A model with such weights can only produce NaN scores (or accuracies of a constant guess), so it is refused
    before any scoring. One pass over the parameters and buffers, a fraction of a forward pass.
    """
    bad = []
    for tensor_name, t in chain(model.named_parameters(), model.named_buffers()):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            bad.append(f"{tensor_name} ({nan:,} NaN, {inf:,} inf of {t.numel():,})")
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise EvalInputError(
            f"model {name!r} has non-finite weights in {len(bad)} tensor(s): {shown}. The checkpoint is damaged "
            "or its training diverged; evaluate an earlier checkpoint, or re-save a healthy model."
        )


# ----------------------------------------------------------------------------------------------------------------
# loading and costs
# ----------------------------------------------------------------------------------------------------------------
def load_tokenizer(name: str, trust_remote_code: bool = False):
    """Load the tokenizer saved with model `name`; a clear error when there is none."""
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as err:
        raise EvalInputError(
            f"no usable tokenizer at {name!r} ({err}). Save the tokenizer next to the model "
            "(tokenizer.save_pretrained(model_dir)) or pass --tokenizer."
        ) from err


def load_causal_lm(name: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False):
    """Load model `name` for inference (eval mode) in `dtype` (a `--dtype` name) on `device`."""
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def kv_cache_bytes_per_token(config, bytes_per_element: int = 2) -> int | None:
    """KV-cache bytes per token of one sequence, all layers (theory, as in the paper's cost table).

    QKVShare configs know their own (a K=V layer caches one tensor); any other model caches K and V:
    `num_key_value_heads * head_dim * 2 * num_hidden_layers * bytes`. None when the config lacks the fields.
    """
    if hasattr(config, "kv_cache_bytes_per_token"):
        return int(config.kv_cache_bytes_per_token(bytes_per_element))
    text = config.get_text_config()
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    if layers is None or heads is None:
        return None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return int(kv_heads * head_dim * 2 * layers * bytes_per_element)


def variant_of(config) -> str:
    """The paper's variant name for a QKVShare config (e.g. "Q-K=V"), else the model type (e.g. "llama")."""
    return str(getattr(config, "variant", None) or config.model_type)
