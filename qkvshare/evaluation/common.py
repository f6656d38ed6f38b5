"""What `qkvshare eval` and `qkvshare perplexity` share: finding and checking a model, loading it, and its costs.

Every check runs before any weights are read, so a typo in the third of three models fails in a second,
not after the first model's evaluation. Importing this module imports `qkvshare`, which registers the
QKVShare classes with transformers' Auto classes: our checkpoints then load without `trust_remote_code`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

import qkvshare  # noqa: F401  (registers AutoConfig/AutoModelForCausalLM for model_type "qkvshare")

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EvalInputError(ValueError):
    """Bad user input (model, task, data): the message says what is wrong and how to fix it."""


def default_device() -> str:
    """`cuda` when a GPU is visible, otherwise `cpu`."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _looks_like_local_path(name: str) -> bool:
    # A hub id is `name` or `org/name`; anything else (absolute, ./, ~, deeper paths) can only be a directory.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def check_causal_lm(name: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """Return the config of model `name` (a directory or a hub id) after checking it is a causal LM.

    Raises `EvalInputError` for a missing directory, a directory without `config.json`, a hub id that cannot
    be resolved, or a config that is not a decoder-only language model (e.g. a BERT or a bidirectional
    QKVShare encoder).
    """
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise EvalInputError(f"model {name!r} is a file; pass the model directory (the one with config.json).")
        if not (path / "config.json").is_file():
            raise EvalInputError(
                f"model directory {name!r} has no config.json: not a Hugging Face model directory. "
                "Pass a directory written by save_pretrained (e.g. a `qkvshare train` checkpoint)."
            )
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
    return config


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
    """Load model `name` for inference (eval mode) in `dtype` on `device`."""
    model = AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def kv_cache_bytes_per_token(config: PretrainedConfig, bytes_per_element: int = 2) -> int | None:
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


def variant_of(config: PretrainedConfig) -> str:
    """The paper's variant name for a QKVShare config (e.g. "Q-K=V"), else the model type (e.g. "llama")."""
    return str(getattr(config, "variant", None) or config.model_type)
