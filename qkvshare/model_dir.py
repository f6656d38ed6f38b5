"""Do a model directory's weights fit the model its config.json builds? The check every command runs before loading.

Why: transformers loads a checkpoint whose config.json was edited, or copied from another run, without refusing
it. A tensor the config has no place for is only logged and dropped (a QKV checkpoint whose config now says layer 0
is Q-K=V loses that layer's v_proj, and perplexity prints a wrong number with exit status 0), a tensor the config
needs but the files lack is initialised at random, and a changed shape ends in a size-mismatch traceback.

How: the names and shapes in the safetensors headers (no tensor data is read) are compared with the state dict of
the model the config builds on the meta device (nothing allocated, no accelerate needed), the way transformers
matches them: the base model's prefix may be absent from the files, tied copies (`lm_head.weight` tied to the
embeddings) need not be saved, and a saved copy of a buffer the model recomputes (a RoPE `inv_freq`) is ignored.

Scope: QKVShare and Llama-architecture checkpoints (`CHECKED_MODEL_TYPES`), whose files hold the model's own
tensor names. Other architectures may rename tensors while loading (transformers' conversion mappings), so they are
left to transformers. A directory with only pickle weights is not read here (pickles are never opened to check).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, PreTrainedConfig

import qkvshare
from qkvshare.configuration_qkvshare import LLAMA_ARCHITECTURES
from qkvshare.evaluation.common import read_config_json, safetensors_files

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
