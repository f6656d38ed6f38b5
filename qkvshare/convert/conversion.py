"""The conversion: its plan (the target config and methods, every check before any weight is read), `convert` and
the record it writes (`conversion.json`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from qkvshare import QKVShareConfig, QKVShareForCausalLM
from qkvshare.analysis.common import llama_config_dict
from qkvshare.configuration_qkvshare import LLAMA_ARCHITECTURES
from qkvshare.convert.calibration import calibrate, check_calibration_ids
from qkvshare.convert.weights import build_converted
from qkvshare.version import __version__
from qkvshare_cli.convert import (
    CALIBRATIONS,
    CONVERT_OVERRIDES,
    DEFAULT_CALIBRATION,
    DEFAULT_METHOD,
    DEFAULT_RIDGE,
    KV_METHODS,
    QUERY_METHODS,
)


@dataclass
class ConversionRecord:
    """How a model was converted (written as `conversion.json` next to the weights)."""

    source: str  # what was converted: a path, or the class of an in-memory model
    source_model_type: str
    source_key_value_heads: int
    variant: str  # the converted config's paper name (Q-K=V of a GQA-3 source is Q-GQA-3)
    projection_sharing: str
    num_key_value_heads: int
    method: str | None  # K=V method (None: no tied layer)
    query_method: str | None  # Q=K method (None: no Q=K layer)
    kv_tie_point: str
    head_pooling: str | None  # "mean" when key/value heads were pooled
    calibration_tokens: int = 0
    calibration_source: str | None = None
    ridge: float | None = None
    # where the calibrated fit of layer l takes its inputs: "sequential" (the converted model's own hidden states,
    # layers < l converted) or "independent" (the source's); None when nothing was fitted
    calibration: str | None = None
    # per-layer ||y' - y|| / ||y|| of the attention output: "converted" (the model saved) and, for tied layers,
    # "key", "value" and "calibrated" measured side by side (None where a method does not apply to a layer)
    layer_errors: dict[str, list[float | None]] = field(default_factory=dict)
    seconds: float = 0.0
    qkvshare_version: str = ""
    transformers_version: str = ""

    def mean_error(self, method: str = "converted") -> float | None:
        values = [e for e in self.layer_errors.get(method, []) if e is not None]
        return sum(values) / len(values) if values else None


def check_architecture(config: dict[str, Any]) -> None:
    """A `ValueError` naming the supported architectures unless `config` (a config.json dict) is one of them."""
    if config.get("model_type") not in LLAMA_ARCHITECTURES:
        raise ValueError(
            f"the source is model_type={config.get('model_type')!r}, which `qkvshare convert` does not support; "
            f"supported architectures: {', '.join(LLAMA_ARCHITECTURES)} (Llama-style attention, RMSNorm, SwiGLU, RoPE)."
        )


def plan_conversion(
    source_config: Any,
    variant: str | None = None,
    method: str | None = None,
    query_method: str | None = None,
    **overrides: Any,
) -> tuple[QKVShareConfig, str | None, str | None]:
    """The target config and the resolved K=V and Q=K methods, or a `ValueError` saying why the source cannot be
    converted so. `source_config` is a Llama-architecture config object or `config.json` dict."""
    d = source_config.to_dict() if hasattr(source_config, "to_dict") else dict(source_config)
    check_architecture(d)
    if not hasattr(source_config, "to_dict"):  # a config.json may leave fields to their defaults
        d = llama_config_dict(d, "the source config")
    unknown = sorted(set(overrides) - set(CONVERT_OVERRIDES))
    if unknown:
        raise ValueError(
            f"override(s) {', '.join(unknown)} would change the shape of the copied weights; convert accepts only "
            f"{', '.join(CONVERT_OVERRIDES)}."
        )
    if method is not None and method not in KV_METHODS:
        raise ValueError(f"method={method!r} is not a K=V method; use one of {', '.join(KV_METHODS)}.")
    if query_method is not None and query_method not in QUERY_METHODS:
        raise ValueError(f"query_method={query_method!r} is not a Q=K method; use one of {', '.join(QUERY_METHODS)}.")
    heads = d["num_attention_heads"]
    source_kv = d.get("num_key_value_heads") or heads
    shape = f"{heads} query heads, {source_kv} key/value heads"
    try:
        config = QKVShareConfig.from_llama(d, variant, **overrides)
    except ValueError as err:
        raise ValueError(f"the source ({shape}) cannot take variant={variant!r}: {err}") from None
    if config.attention_map_pe_dim:
        raise ValueError(
            f"variant={variant!r} adds the '+' attention-map encoding, which has no counterpart in a Llama "
            "checkpoint; convert to the variant without '+' (its weights would start untrained)."
        )
    layers = range(config.num_hidden_layers)
    tied = any(config.is_kv_tied(i) for i in layers)
    query_tied = any(config.is_query_key_tied(i) for i in layers)
    if config.num_key_value_heads > source_kv:
        why = ""
        if query_tied:
            why = " (Q=K makes every query head a key head: it needs num_key_value_heads == num_attention_heads)"
        raise ValueError(
            f"variant={variant!r} needs {config.num_key_value_heads} key/value heads but the source has {source_kv} "
            f"({shape}){why}; a conversion can pool heads, not invent them. Choose at most {source_kv} (e.g. "
            "Q-K=V, which keeps the source's heads, Q-MQA or MQA)."
        )
    if method is not None and not tied:
        raise ValueError(
            f"method={method!r} chooses how K=V layers are made, but variant={variant!r} ({config.variant}) has no "
            "K=V layer; leave --method out."
        )
    if query_method is not None and not query_tied:
        raise ValueError(
            f"query_method={query_method!r} chooses how Q=K layers are made, but variant={variant!r} "
            f"({config.variant}) has no Q=K layer; leave --query_method out."
        )
    method = (method or DEFAULT_METHOD) if tied else None
    query_method = (query_method or "key") if query_tied else None
    if method == "calibrated" and "kv_tie_point" not in overrides:
        config.kv_tie_point = "pre_rope"  # the tie under which the value is a linear function of U (docstring)
    return config, method, query_method


def convert(
    source: Any,
    variant: str | None = None,
    method: str | None = None,
    *,
    query_method: str | None = None,
    calibration_ids: torch.Tensor | None = None,
    ridge: float = DEFAULT_RIDGE,
    calibration: str = DEFAULT_CALIBRATION,
    source_name: str | None = None,
    calibration_source: str | None = None,
    **overrides: Any,
) -> tuple[QKVShareForCausalLM, ConversionRecord]:
    """Convert a Llama-architecture causal LM (`LlamaForCausalLM`, Mistral, Qwen2) to `variant`.

    Args:
        source: the pretrained model (left unchanged).
        variant: a paper name (`QKVShareConfig.from_llama`): `None`/`QKV` copy, `Q-K=V` (keeps the source's
            key/value heads), `Q=K-V`, `Q=K=V`, `GQA-<g>`, `MQA`, `Q-GQA-<g>`, `Q-MQA`.
        method: K=V layers: `key`, `value` or `calibrated` (default; needs `calibration_ids`).
        query_method: Q=K layers: `key` (default) or `query`.
        calibration_ids: (batch, length) token ids from the source's tokenizer. Required by `calibrated`; with
            any method they also give the per-layer errors of the record.
        ridge: relative ridge of the calibrated fit.
        calibration: `sequential` (default: fit each layer on the converted model's own hidden states) or
            `independent` (on the source's).
        source_name, calibration_source: what the record says the source and the calibration text were.
        overrides: config fields of `CONVERT_OVERRIDES` (e.g. `kv_tie_point="post_rope"`).

    Returns the converted model (float32, eval mode) and its `ConversionRecord`. Raises `ValueError` before any
    weight is copied when the source or the request is not convertible.
    """
    started = time.perf_counter()
    if calibration not in CALIBRATIONS:
        raise ValueError(f"calibration={calibration!r} is not a calibration; use one of {', '.join(CALIBRATIONS)}.")
    config, method, query_method = plan_conversion(source.config, variant, method, query_method, **overrides)
    if method == "calibrated" or calibration_ids is not None:
        check_calibration_ids(calibration_ids, config)
    heads = source.config.num_attention_heads
    source_kv = getattr(source.config, "num_key_value_heads", None) or heads
    model = build_converted(source.state_dict(), source_kv, config, method, query_method)
    errors = {}
    if calibration_ids is not None:
        source.eval()
        errors = calibrate(source, model, calibration_ids, source_kv, method, query_method, ridge, calibration)
    record = ConversionRecord(
        source=source_name or type(source).__name__,
        source_model_type=source.config.model_type,
        source_key_value_heads=source_kv,
        variant=config.variant,
        projection_sharing=config.projection_sharing,
        num_key_value_heads=config.num_key_value_heads,
        method=method,
        query_method=query_method,
        kv_tie_point=config.kv_tie_point,
        head_pooling="mean" if config.num_key_value_heads < source_kv else None,
        calibration_tokens=int(calibration_ids.numel()) if calibration_ids is not None else 0,
        calibration_source=calibration_source if calibration_ids is not None else None,
        ridge=ridge if method == "calibrated" else None,
        calibration=calibration if method == "calibrated" else None,
        layer_errors=errors,
        seconds=round(time.perf_counter() - started, 2),
        qkvshare_version=__version__,
        transformers_version=transformers.__version__,
    )
    return model, record
