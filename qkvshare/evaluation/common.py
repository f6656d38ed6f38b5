"""What the commands that read a checkpoint share: checking its files, loading it, and its costs.

Used by `qkvshare eval` and `qkvshare perplexity` (whole models) and `qkvshare analyze` (weights only).
Every check runs before any weights are read, so a typo in the third of three models, or a truncated download,
fails in a second with the file named, not after the first model's evaluation, and never as a SafetensorError
traceback. Importing a `qkvshare` submodule imports `qkvshare`, which registers the QKVShare classes with
transformers' Auto classes: our checkpoints then load without `trust_remote_code`.
"""

from __future__ import annotations

import os
from itertools import chain
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from qkvshare.model_dir import check_weights_fit_config, read_config_json, weight_files
from qkvshare.runtime import torch_dtype
from qkvshare_settings.conventions import CommandStopped


class EvalInputError(ValueError):
    """Bad user input (model, task, data): the message says what is wrong and how to fix it."""


class NonFiniteResultError(CommandStopped):
    """A computed result (a loss, a perplexity) is NaN or infinite; the message says where and what to try."""

    label = "error"


def _looks_like_local_path(name: str) -> bool:
    # A hub id is `name` or `org/name`; anything else (absolute, ./, ~, deeper paths) can only be a directory.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


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


def variant_of(config) -> str:
    """The paper's variant name for a QKVShare config (e.g. "Q-K=V"), else the model type (e.g. "llama")."""
    return str(getattr(config, "variant", None) or config.model_type)
