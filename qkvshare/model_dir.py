"""Reading model directories and sources: config.json, the safetensors weights (checked complete, and checked to fit
the model their config builds), and the Llama-architecture sources of `qkvshare convert` (a directory or a .gguf
file). Every command that loads a model reads it through here, before any weight is loaded.

Why the fit check: transformers loads a checkpoint whose config.json was edited, or copied from another run, without
refusing it. A tensor the config has no place for is only logged and dropped (a QKV checkpoint whose config now says
layer 0 is Q-K=V loses that layer's v_proj, and perplexity prints a wrong number with exit status 0), a tensor the
config needs but the files lack is initialised at random, and a changed shape ends in a size-mismatch traceback.

How: the names and shapes in the safetensors headers (no tensor data is read) are compared with the state dict of
the model the config builds on the meta device (nothing allocated, no accelerate needed), the way transformers
matches them: the base model's prefix may be absent from the files, tied copies (`lm_head.weight` tied to the
embeddings) need not be saved, and a saved copy of a buffer the model recomputes (a RoPE `inv_freq`) is ignored.
A truncated or damaged file is named before any of this (its header and size are checked), so a bad download fails
in a second with the file named, never as a SafetensorError traceback.

Scope of the fit check: QKVShare and Llama-architecture checkpoints (`CHECKED_MODEL_TYPES`), whose files hold the
model's own tensor names. Other architectures may rename tensors while loading (transformers' conversion mappings),
so they are left to transformers. Pickle weights are never opened.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig

import qkvshare
from qkvshare.configuration_qkvshare import LLAMA_ARCHITECTURES, llama_config_dict
from qkvshare_settings.conventions import TOKENIZER_FILES
from qkvshare_settings.convert import check_source_path

SAFETENSORS_WEIGHTS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth")
REPAIR = "Re-download the model, or re-save it with save_pretrained."


class ModelDirError(ValueError):
    """A model directory or source that cannot be read as it is: the message names the file and the fix."""


# ----------------------------------------------------------------------------------------------------------------
# checkpoint files: config.json and the safetensors weights, checked before anything is loaded
# ----------------------------------------------------------------------------------------------------------------
def read_json_file(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in `path`; an `ModelDirError` naming the file when it is unreadable or not an object."""
    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as err:
        raise ModelDirError(
            f"{path} ({what}) is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}): the file is "
            f"damaged or truncated. {REPAIR}"
        ) from err
    except (OSError, UnicodeDecodeError) as err:
        raise ModelDirError(f"{path} ({what}) is unreadable ({err}). {REPAIR}") from err
    if not isinstance(data, dict):
        raise ModelDirError(f"{path} ({what}) holds a JSON {type(data).__name__}, not an object. {REPAIR}")
    return data


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """The `config.json` of a model directory, with a clear error when it is missing or damaged."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelDirError(
            f"model directory {str(model_dir)!r} has no config.json: not a Hugging Face model directory. "
            "Pass a directory written by save_pretrained (e.g. a `qkvshare train` checkpoint)."
        )
    return read_json_file(path, "the model config")


def check_safetensors_file(path: Path) -> None:
    """Raise `ModelDirError` naming `path` when it is missing, truncated or not a readable safetensors file.

    The size check reads only the header: 8 bytes of header length, the JSON header, then the data, whose
    extent is the largest `data_offsets` end; a file shorter than that was cut off (an interrupted download or
    save). `safe_open` then validates the header the way loading will (dtypes, shapes, offsets).
    """
    if not path.is_file():
        raise ModelDirError(f"weights file {path} is missing. {REPAIR}")
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else None
        if header_len is None or header_len > size - 8:
            raise ModelDirError(
                f"weights file {path} is truncated ({size:,} bytes, shorter than its own header): the download "
                f"or save was interrupted. {REPAIR}"
            )
        try:
            header = json.loads(f.read(header_len))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
            raise ModelDirError(
                f"weights file {path} is unreadable: its header is not a safetensors header ({err}). {REPAIR}"
            ) from err
    expected = 8 + header_len + end
    if size < expected:
        raise ModelDirError(
            f"weights file {path} is truncated: {size:,} of {expected:,} bytes (its header lists data up to byte "
            f"{expected:,}); the download or save was interrupted. {REPAIR}"
        )
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as err:
        raise ModelDirError(f"weights file {path} is unreadable ({err}). {REPAIR}") from err


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory, each checked complete: the shards its index names, or else
    `model.safetensors` (the files transformers loads; other safetensors files beside them, such as a PEFT
    adapter or a training run's own state, are not the model's weights).

    An index that lists a missing shard, a truncated file or a damaged header raises `ModelDirError` naming the
    file. Returns [] when the directory holds no safetensors weights at all (the caller decides what that means).
    """
    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json_file(index, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelDirError(f"{index} has no 'weight_map' of tensor names to files. {REPAIR}")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelDirError(
                f"{index} lists weight file(s) {', '.join(missing)} missing from {model_dir}: the download or save "
                f"is incomplete. {REPAIR}"
            )
    else:
        single = model_dir / SAFETENSORS_WEIGHTS
        files = [single] if single.is_file() else []
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
        raise ModelDirError(
            f"{model_dir} holds no *.safetensors weights (found {', '.join(pickles)}: pickle files are never "
            "loaded; convert them to safetensors, e.g. load the model and save_pretrained it)."
        )
    raise ModelDirError(
        f"model directory {str(model_dir)!r} has no weights (model.safetensors is missing): the save or download "
        f"did not finish. {REPAIR}"
    )


# ----------------------------------------------------------------------------------------------------------------
# do the weights fit the config?
# ----------------------------------------------------------------------------------------------------------------
CHECKED_MODEL_TYPES = ("qkvshare", *LLAMA_ARCHITECTURES)
SHOWN = 8  # groups of tensor names listed per kind of problem; the rest are counted
_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def saved_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of safetensors files, from their headers only."""
    shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _model_class(config: PreTrainedConfig) -> Any:
    """The class config.json's `architectures` names (QKVShare's or transformers'), else AutoModelForCausalLM."""
    for name in getattr(config, "architectures", None) or ():
        found = getattr(qkvshare, name, None) or getattr(transformers, name, None)
        if found is not None:
            return found
    return transformers.AutoModelForCausalLM


def weight_mismatches(
    saved: dict[str, tuple[int, ...]], config: PreTrainedConfig, model_class: Any = None
) -> tuple[list[str], list[str], dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]:
    """(missing, unexpected, {name: (saved shape, config's shape)}) of the tensors `saved` against the model that
    `model_class` (an Auto class or a model class; default: the config's architecture) builds from `config`."""
    model_class = model_class or _model_class(config)
    build = getattr(model_class, "from_config", model_class)  # Auto classes build through from_config
    with torch.device("meta"):
        model = build(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())  # save_pretrained writes one of each tied pair
    recomputed = {name for name, _ in model.named_buffers()} - expected.keys()  # non-persistent buffers
    ignore_missing = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or ()]
    ignore_unexpected = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]

    prefix = f"{model.base_model_prefix}."
    as_model: dict[str, str] = {}  # saved name -> the model's name (transformers adds or strips the base prefix)
    for name in saved:
        if name not in expected and name.startswith(prefix) and name[len(prefix) :] in expected:
            as_model[name] = name[len(prefix) :]
        elif name not in expected and prefix + name in expected:
            as_model[name] = prefix + name
        else:
            as_model[name] = name
    present = set(as_model.values())
    missing = sorted(n for n in expected.keys() - present - tied if not any(p.search(n) for p in ignore_missing))
    unexpected = sorted(
        s
        for s, n in as_model.items()
        if n not in expected and n not in recomputed and not any(p.search(n) for p in ignore_unexpected)
    )
    mismatched = {s: (saved[s], expected[n]) for s, n in as_model.items() if n in expected and saved[s] != expected[n]}
    return missing, unexpected, dict(sorted(mismatched.items()))


def _indices(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5' (runs of consecutive layers shortened)."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _grouped(details: dict[str, str]) -> list[str]:
    """Tensor names with a detail each, the same name and detail of several layers in one entry:
    {'model.layers.0.x': d, 'model.layers.1.x': d} -> ['model.layers.{0-1}.x d']."""
    groups: dict[tuple[str, str], list[int]] = {}
    singles = []
    for name, detail in details.items():
        match = _LAYER_INDEX.search(name)
        if match is None:
            singles.append(f"{name}{detail}")
            continue
        pattern = name[: match.start()] + "{}" + name[match.end() :]
        groups.setdefault((pattern, detail), []).append(int(match.group()))
    entries = [
        (pattern.format(idx[0]) if len(idx) == 1 else pattern.format("{" + _indices(idx) + "}")) + detail
        for (pattern, detail), idx in groups.items()
    ]
    return entries + singles


def _listed(details: dict[str, str]) -> str:
    entries = _grouped(details)
    more = f"; and {len(entries) - SHOWN} more" if len(entries) > SHOWN else ""
    return "; ".join(entries[:SHOWN]) + more


def check_weights_fit_config(
    model_dir: str | Path,
    config: PreTrainedConfig | None = None,
    model_class: Any = None,
    label: str | None = None,
    error: type[Exception] = ValueError,
) -> None:
    """Raise `error` naming every tensor of `model_dir`'s safetensors weights that is missing, unexpected or of
    another shape for the model its config builds.

    `config`: the directory's config when the caller has it (else read from config.json); `model_class`: the class
    the command loads with (an Auto class or a model class; default: the config's architecture); `label`: how the
    message names the input (default "model directory 'DIR'"). Nothing is raised for a model type outside
    `CHECKED_MODEL_TYPES` or a directory without safetensors weights (see the module docstring).
    """
    model_dir = Path(model_dir)
    label = label or f"model directory {str(model_dir)!r}"
    if config is None:
        if read_config_json(model_dir).get("model_type") not in CHECKED_MODEL_TYPES:
            return  # before AutoConfig, which does not know every model type
        config = AutoConfig.from_pretrained(str(model_dir))
    if config.model_type not in CHECKED_MODEL_TYPES:
        return
    files = safetensors_files(model_dir)
    if not files:
        return
    missing, unexpected, mismatched = weight_mismatches(saved_shapes(files), config, model_class)
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} tensor(s) of config.json's model are missing from the weights: "
            + _listed(dict.fromkeys(missing, ""))
        )
    if unexpected:
        problems.append(
            f"{len(unexpected)} tensor(s) in the weights are not in config.json's model: "
            + _listed(dict.fromkeys(unexpected, ""))
        )
    if mismatched:
        shapes = {name: f" (weights {list(s)}, config.json {list(c)})" for name, (s, c) in mismatched.items()}
        problems.append(f"{len(mismatched)} tensor(s) have another shape in config.json's model: " + _listed(shapes))
    if problems:
        weights = files[0].name if len(files) == 1 else f"{len(files)} safetensors shards"
        raise error(
            f"{label}: config.json does not match the weights ({weights}): {'. '.join(problems)}. The config and the "
            "weights come from different models (config.json edited, or copied from another run); loading would "
            "drop, re-initialise or fail on these tensors. Put back the config.json saved with these weights."
        )


# ----------------------------------------------------------------------------------------------------------------
# sources of `qkvshare convert` (and teachers): Llama-architecture directories and .gguf files
# ----------------------------------------------------------------------------------------------------------------
def check_architecture(config: dict[str, Any]) -> None:
    """A `ValueError` naming the supported architectures unless `config` (a config.json dict) is one of them."""
    if config.get("model_type") not in LLAMA_ARCHITECTURES:
        raise ValueError(
            f"the source is model_type={config.get('model_type')!r}, which `qkvshare convert` does not support; "
            f"supported architectures: {', '.join(LLAMA_ARCHITECTURES)} (Llama-style attention, RMSNorm, SwiGLU, RoPE)."
        )


def require_gguf() -> None:
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
    require_gguf()
    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()


def load_source_tokenizer(source: str) -> Any:
    """The tokenizer saved with the source (a directory's files, or the one inside a .gguf), or None."""
    path = check_source_path(source)
    if path.is_file():
        require_gguf()
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
