"""`qkvshare convert`: turn a pretrained Llama-architecture checkpoint into a QKVShare model of any variant.

The method (head pooling, the K=V methods and their calibrated fit, Q=K, the recorded errors) is written with the
command's arguments in `qkvshare_cli.convert`, and `qkvshare convert --help` prints it. From Python:
`convert(model, "Q-MQA", calibration_ids=ids)` on a `LlamaForCausalLM` (Mistral, Qwen2) object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkvshare_cli import main as cli_main
from qkvshare_cli.convert import (
    CALIBRATIONS,
    CONVERT_OVERRIDES,
    DEFAULT_CALIBRATION,
    DEFAULT_CALIBRATION_TOKENS,
    DEFAULT_METHOD,
    DEFAULT_RIDGE,
    KV_METHODS,
    QUERY_METHODS,
    RECORD_FILE,
    check_source_path,
)

if TYPE_CHECKING:
    import torch

    from qkvshare import QKVShareConfig, QKVShareForCausalLM

# Least squares of d_h unknowns per output needs many more rows than unknowns: at least this many tokens per d_h.
MIN_TOKENS_PER_HEAD_DIM = 4


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


# --------------------------------------------------------------------------------------------------------------
# Planning: every check before any weight is read
# --------------------------------------------------------------------------------------------------------------
def check_architecture(config: dict[str, Any]) -> None:
    """A `ValueError` naming the supported architectures unless `config` (a config.json dict) is one of them."""
    from qkvshare.configuration_qkvshare import LLAMA_ARCHITECTURES

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
    from qkvshare import QKVShareConfig

    d = source_config.to_dict() if hasattr(source_config, "to_dict") else dict(source_config)
    check_architecture(d)
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
    if config.num_key_value_heads > source_kv:
        why = ""
        if any(config.is_query_key_tied(i) for i in range(config.num_hidden_layers)):
            why = " (Q=K makes every query head a key head: it needs num_key_value_heads == num_attention_heads)"
        raise ValueError(
            f"variant={variant!r} needs {config.num_key_value_heads} key/value heads but the source has {source_kv} "
            f"({shape}){why}; a conversion can pool heads, not invent them. Choose at most {source_kv} (e.g. "
            "Q-K=V, which keeps the source's heads, Q-MQA or MQA)."
        )
    layers = range(config.num_hidden_layers)
    tied = any(config.is_kv_tied(i) for i in layers)
    query_tied = any(config.is_query_key_tied(i) for i in layers)
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


def min_calibration_tokens(config: Any) -> int:
    """The fewest calibration tokens `calibrated` accepts (MIN_TOKENS_PER_HEAD_DIM x (head_dim + 1))."""
    return MIN_TOKENS_PER_HEAD_DIM * (config.head_dim + 1)


def check_calibration_ids(ids: Any, config: Any) -> None:
    """`ids` must be a (batch, length) LongTensor of valid token ids with enough tokens for the fit."""
    import torch

    if ids is None:
        raise ValueError(
            "method='calibrated' needs calibration text: pass calibration_ids (a (batch, length) LongTensor of token "
            "ids from the source's tokenizer), or on the command line --calibration_file (default: the embedded "
            "corpus), or choose --method key."
        )
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype != torch.long:
        raise ValueError(
            f"calibration_ids must be a 2-D LongTensor (batch, length), got {type(ids).__name__} "
            f"{getattr(ids, 'shape', '')} {getattr(ids, 'dtype', '')}."
        )
    need = min_calibration_tokens(config)
    if ids.numel() < need or ids.shape[1] < 2:
        raise ValueError(
            f"the calibration set has {ids.numel()} tokens (shape {tuple(ids.shape)}), too few to fit "
            f"{config.head_dim}x{config.head_dim} maps: give at least {need} tokens in sequences of 2 or more "
            f"(a few thousand is usual; the default is {DEFAULT_CALIBRATION_TOKENS})."
        )
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(
            f"calibration_ids hold ids in [{int(ids.min())}, {int(ids.max())}], outside the source's vocabulary "
            f"[0, {config.vocab_size}); tokenize with the source's tokenizer."
        )


# --------------------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------------------
def pooling_matrix(num_heads: int, source_kv: int, target_kv: int) -> torch.Tensor:
    """(target_kv, source_kv) weights: new head j = mean over its query heads of their source key/value heads."""
    import torch

    per_target, per_source = num_heads // target_kv, num_heads // source_kv
    pool = torch.zeros(target_kv, source_kv, dtype=torch.float64)
    for h in range(num_heads):
        pool[h // per_target, h // per_source] += 1.0 / per_target
    return pool


def _pooled(weight: torch.Tensor, pool: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Pool a k/v projection weight (source_kv*D, hidden) or bias (source_kv*D,) into (target_kv*D, ...)."""
    import torch

    heads = weight.reshape(pool.shape[1], head_dim, *weight.shape[1:])  # (kv_src, D, ...)
    return torch.tensordot(pool.to(weight.dtype), heads, dims=1).reshape(-1, *weight.shape[1:])


def attention_state(
    source: dict[str, torch.Tensor],
    source_kv: int,
    config: QKVShareConfig,
    layer_idx: int,
    method: str | None,
    query_method: str | None,
) -> dict[str, torch.Tensor]:
    """The state dict of converted attention layer `layer_idx` from the source layer's (`q_proj.weight`, ...).

    `method` picks the shared K=V projection (`key`/`calibrated`: W_k, `value`: W_v), `query_method` the Q=K one;
    key/value heads are mean-pooled to the config's count. o_proj is copied (`calibrate` refits it).
    """
    import torch

    pool = pooling_matrix(config.num_attention_heads, source_kv, config.num_key_value_heads)
    has_bias = any(k.endswith(".bias") for k in source)
    if has_bias and not config.attention_bias:
        raise ValueError("the source's attention has biases but the config has attention_bias=False.")

    def projection(name: str, pooled: bool) -> dict[str, torch.Tensor]:
        out = {"weight": source[f"{name}.weight"]}
        if config.attention_bias:  # Qwen2 has no o_proj bias: a zero bias is the same function
            out["bias"] = source.get(f"{name}.bias", torch.zeros(out["weight"].shape[0], dtype=out["weight"].dtype))
        if pooled:
            out = {k: _pooled(v, pool, config.head_dim) for k, v in out.items()}
        return out

    q, k, v = projection("q_proj", False), projection("k_proj", True), projection("v_proj", True)
    shared_qk = q if query_method == "query" else k
    projections = {"o_proj": projection("o_proj", False)}
    mode = config.layer_sharing(layer_idx)
    if mode == "none":
        projections |= {"q_proj": q, "k_proj": k, "v_proj": v}
    elif mode == "qk":
        projections |= {"k_proj": shared_qk, "v_proj": v}
    elif mode == "kv":
        projections |= {"q_proj": q, "k_proj": v if method == "value" else k}
    else:  # qkv
        projections |= {"k_proj": v if method == "value" else shared_qk}
    return {f"{name}.{kind}": t.clone() for name, p in projections.items() for kind, t in p.items()}


def build_converted(
    source_state: dict[str, torch.Tensor],
    source_kv: int,
    config: QKVShareConfig,
    method: str | None,
    query_method: str | None,
) -> QKVShareForCausalLM:
    """A float32 `QKVShareForCausalLM` holding the source's weights, attention converted by `attention_state`."""
    import torch

    from qkvshare import QKVShareForCausalLM

    state, layers = {}, {}
    for key, tensor in source_state.items():
        prefix, sep, rest = key.partition(".self_attn.")
        if sep:
            layers.setdefault(prefix, {})[rest] = tensor.float()
        elif "rotary_emb" not in key:
            state[key] = tensor.float()
    for prefix, layer in layers.items():
        index = int(prefix.rsplit(".", 1)[1])
        for name, tensor in attention_state(layer, source_kv, config, index, method, query_method).items():
            state[f"{prefix}.self_attn.{name}"] = tensor
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model = QKVShareForCausalLM(config).float()
    with torch.no_grad():
        model.load_state_dict(state, strict=True)
    return model.eval()


# --------------------------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------------------------
def _causal_mask(length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive causal mask (1, 1, T, T): what eager and sdpa attention both take."""
    import torch

    upper = torch.ones(length, length, dtype=torch.bool).triu(1)
    return torch.zeros(length, length, dtype=dtype).masked_fill(upper, torch.finfo(dtype).min)[None, None]


def _o_proj_input(attention: Any, hidden: torch.Tensor, position_embeddings: Any, mask: torch.Tensor) -> torch.Tensor:
    """Run one attention module; return what its o_proj receives, (tokens, heads * head_dim)."""
    captured = []
    handle = attention.o_proj.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        attention(hidden_states=hidden, position_embeddings=position_embeddings, attention_mask=mask)
    finally:
        handle.remove()
    return captured[0].reshape(-1, captured[0].shape[-1]).float()


def source_streams(source: Any, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    """The source's residual stream on `ids` ((L + 1) tensors: each layer's input, then the last layer's output),
    each layer's attention input (its normalised hidden states) and the RoPE cos/sin."""
    import torch

    streams: list[torch.Tensor] = []
    inputs: list[torch.Tensor] = []
    rope: list[Any] = []

    def layer_hook(module: Any, args: tuple, kwargs: dict) -> None:
        streams.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    def attention_hook(module: Any, args: tuple, kwargs: dict) -> None:
        inputs.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])
        rope[:] = [kwargs.get("position_embeddings")]

    def last_hook(module: Any, args: tuple, output: Any) -> None:
        streams.append(output[0] if isinstance(output, tuple) else output)

    layers = source.model.layers
    handles = [layer.register_forward_pre_hook(layer_hook, with_kwargs=True) for layer in layers]
    handles += [layer.self_attn.register_forward_pre_hook(attention_hook, with_kwargs=True) for layer in layers]
    handles.append(layers[-1].register_forward_hook(last_hook))
    try:
        with torch.no_grad():
            source.model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return streams, inputs, rope[0]


def fit_head_maps(
    features: torch.Tensor, targets: torch.Tensor, num_heads: int, ridge: float, intercept: bool
) -> torch.Tensor:
    """Per head h, M_h = argmin ||F_h M - A_h||^2 + lambda ||M||^2 (float64); (heads, D [+1 intercept row], D)."""
    import torch

    tokens = features.shape[0]
    f = features.double().reshape(tokens, num_heads, -1).transpose(0, 1)  # (H, N, D)
    a = targets.double().reshape(tokens, num_heads, -1).transpose(0, 1)  # (H, N, D)
    if intercept:
        f = torch.cat([f, f.new_ones(num_heads, tokens, 1)], dim=-1)  # (H, N, D + 1)
    gram = f.transpose(1, 2) @ f  # (H, D', D')
    scale = gram.diagonal(dim1=1, dim2=2).mean(-1) * ridge  # lambda relative to the features' energy
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype)
    return torch.linalg.solve(gram + scale[:, None, None] * eye, f.transpose(1, 2) @ a)


def fold_into_o_proj(o_proj: Any, maps: torch.Tensor) -> None:
    """o_proj block h becomes W_o,h M_h^T; an intercept row c_h adds W_o,h c_h to the bias."""
    import torch

    weight = o_proj.weight.data.double()  # (hidden, H * D)
    heads, head_dim = maps.shape[0], maps.shape[-1]
    w = weight.reshape(weight.shape[0], heads, head_dim)  # (hidden, H, D)
    new = torch.einsum("ahe,hfe->ahf", w, maps[:, :head_dim])
    o_proj.weight.data.copy_(new.reshape_as(weight).to(o_proj.weight.dtype))
    if maps.shape[1] > head_dim:
        shift = torch.einsum("ahe,he->a", w, maps[:, head_dim])
        o_proj.bias.data.add_(shift.to(o_proj.bias.dtype))


def _relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return float((output - reference).norm() / reference.norm().clamp_min(1e-12))


def _attention_module(config: QKVShareConfig, layer_idx: int, state: dict[str, torch.Tensor]) -> Any:
    from qkvshare.modeling_qkvshare import QKVShareAttention

    module = QKVShareAttention(config, layer_idx).float()
    module.load_state_dict(state, strict=True)
    return module.eval()


def calibrate(
    source: Any,
    model: QKVShareForCausalLM,
    ids: torch.Tensor,
    source_kv: int,
    method: str | None,
    query_method: str | None,
    ridge: float = DEFAULT_RIDGE,
    calibration: str = DEFAULT_CALIBRATION,
) -> dict[str, list[float | None]]:
    """Measure every layer's attention-output error on `ids` and, for `method="calibrated"`, refit the o_proj of
    each K=V layer (module docstring), fitted on the source's hidden states (`calibration="independent"`) or on
    the converted model's own (`"sequential"`, layers below already converted). Returns {"converted": [...],
    "drift": [...], "key": [...], "value": [...], "calibrated": [...]} (the last three only with K=V layers;
    None for layers that are not tied)."""
    import torch
    import torch.nn.functional as F

    config = model.config
    layers = range(config.num_hidden_layers)
    tied_any = any(config.is_kv_tied(i) for i in layers)
    errors: dict[str, list[float | None]] = {"converted": [], "drift": []}
    errors |= {m: [] for m in KV_METHODS} if tied_any else {}
    with torch.no_grad():
        streams, inputs, rope = source_streams(source, ids)
        rope32 = tuple(t.float() for t in rope)
        mask32 = _causal_mask(ids.shape[1], torch.float32)
        stream = streams[0].float()  # the converted model's residual stream (the same embeddings)
        for i in layers:
            src_attn, layer = source.model.layers[i].self_attn, model.model.layers[i]
            layer_attn = layer.self_attn
            src_dtype = src_attn.o_proj.weight.dtype
            targets = _o_proj_input(src_attn, inputs[i], rope, _causal_mask(ids.shape[1], src_dtype))
            o_bias = src_attn.o_proj.bias.float() if src_attn.o_proj.bias is not None else None
            reference = F.linear(targets, src_attn.o_proj.weight.float(), o_bias)  # the source's attention output
            hidden = inputs[i].float()
            own = layer.input_layernorm(stream)  # the converted model's attention input (its layers < i converted)
            own_features = _o_proj_input(layer_attn, own, rope32, mask32)  # what o_proj receives: o_proj-free
            if config.is_kv_tied(i):
                src_state = {k: v.float() for k, v in src_attn.state_dict().items()}
                for name in ("value", "key"):
                    module = _attention_module(
                        config, i, attention_state(src_state, source_kv, config, i, name, query_method)
                    )
                    features = _o_proj_input(module, hidden, rope32, mask32)
                    errors[name].append(_relative_error(module.o_proj(features), reference))
                # `module` is now the `key` layer: calibrated = key projections + o_proj refitted on its features
                heads = config.num_attention_heads
                maps = fit_head_maps(features, targets.float(), heads, ridge, config.attention_bias)
                fold_into_o_proj(module.o_proj, maps)
                errors["calibrated"].append(_relative_error(module.o_proj(features), reference))
                if method == "calibrated" and calibration == "independent":
                    layer_attn.o_proj.load_state_dict(module.o_proj.state_dict())
                elif method == "calibrated":  # sequential: the source layer's output for the converted path's input
                    own_targets = _o_proj_input(
                        src_attn, own.to(src_dtype), rope, _causal_mask(ids.shape[1], src_dtype)
                    )
                    maps = fit_head_maps(own_features, own_targets.float(), heads, ridge, config.attention_bias)
                    fold_into_o_proj(layer_attn.o_proj, maps)
            features = _o_proj_input(layer_attn, hidden, rope32, mask32)
            errors["converted"].append(_relative_error(layer_attn.o_proj(features), reference))
            if tied_any and not config.is_kv_tied(i):
                for name in KV_METHODS:
                    errors[name].append(None)
            stream = stream + layer_attn.o_proj(own_features).view_as(stream)
            stream = stream + layer.mlp(layer.post_attention_layernorm(stream))
            errors["drift"].append(_relative_error(stream, streams[i + 1].float()))
    return errors


# --------------------------------------------------------------------------------------------------------------
# The conversion
# --------------------------------------------------------------------------------------------------------------
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
    import transformers

    from qkvshare.version import __version__

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


# --------------------------------------------------------------------------------------------------------------
# Sources and calibration text
# --------------------------------------------------------------------------------------------------------------
def _require_gguf() -> None:
    """transformers reads GGUF files with the `gguf` package, which no extra of ours installs (one file format)."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ValueError("reading a .gguf file needs the package gguf, which is not installed; pip install gguf.")


def read_source_config(source: str) -> dict[str, Any]:
    """The source's config as a dict, without reading its weights."""
    path = check_source_path(source)
    if path.is_dir():
        from qkvshare.evaluation.common import read_config_json

        return read_config_json(path)
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

    from qkvshare.model_dir import check_weights_fit_config

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


def calibration_texts(calibration_file: str | None, seed: int = 0) -> tuple[list[str], str]:
    """Documents to calibrate on, and their description: a .txt file (one document), a .jsonl/.json file (its
    `text` column), or by default the training side of the embedded corpus (the Python stdlib sources), shuffled
    with `seed`."""
    if calibration_file is None:
        from qkvshare.train.data import stdlib_corpus

        corpus = stdlib_corpus()
        documents = list(corpus.train)
        random.Random(seed).shuffle(documents)
        return documents, f"training split of the embedded corpus ({corpus.description}), seed {seed}"
    from qkvshare.train.data import check_data_file

    path = Path(calibration_file).expanduser()
    if not path.is_file():
        raise ValueError(f"--calibration_file {calibration_file!r} does not exist; pass a .txt or .jsonl file.")
    if path.suffix.lower() not in (".txt", ".text", ".json", ".jsonl"):
        raise ValueError(f"--calibration_file {calibration_file!r} must be a .txt or .jsonl/.json (text column) file.")
    check_data_file(path, "--calibration_file", "text", ValueError)
    if path.suffix.lower() in (".txt", ".text"):
        documents = [path.read_text(encoding="utf-8")]
    else:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        documents = [row.get("text") or "" for row in map(json.loads, lines)]
    documents = [text for text in documents if text.strip()]
    return documents, str(path)


def calibration_ids(tokenizer: Any, documents: list[str], tokens: int, block_size: int) -> torch.Tensor:
    """Blocks (n, block_size) of the EOS-joined token stream of `documents`, `tokens // block_size` of them (fewer
    when the text is short: `check_calibration_ids` then says so)."""
    import torch

    block_size = min(block_size, tokens)
    wanted = (tokens // block_size) * block_size
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for text in documents:
        # verbose=False: a document longer than the model's context is expected here (it is cut into blocks).
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        stream += ids + ([eos] if eos is not None else [])
        if len(stream) >= wanted:
            break
    usable = min(len(stream), wanted) // block_size * block_size
    return torch.tensor(stream[:usable], dtype=torch.long).view(-1, block_size)


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> ConversionRecord:
    """Check everything that needs no weights, read calibration text, load the source, convert, save."""
    import shutil

    source_config = read_source_config(args.source)
    config, method, query_method = plan_conversion(
        source_config, args.variant, args.method, args.query_method, **args.overrides
    )
    tokenizer = load_source_tokenizer(args.source)
    source_kv = source_config.get("num_key_value_heads") or source_config["num_attention_heads"]
    ids = description = None
    changes_attention = method is not None or config.num_key_value_heads < source_kv or query_method is not None
    if method == "calibrated" and tokenizer is None:
        raise ValueError(
            f"{args.source} has no tokenizer, which method='calibrated' needs to read calibration text; save the "
            "source's tokenizer next to its weights, or use --method key."
        )
    if changes_attention and tokenizer is not None:
        documents, description = calibration_texts(args.calibration_file, args.seed)
        ids = calibration_ids(tokenizer, documents, args.calibration_tokens, args.calibration_block_size)
        check_calibration_ids(ids, config)
    source = load_source(args.source)
    model, record = convert(
        source,
        args.variant,
        args.method,
        query_method=args.query_method,
        calibration_ids=ids,
        ridge=args.ridge,
        calibration=args.calibration,
        source_name=str(args.source),
        calibration_source=description,
        **args.overrides,
    )
    out = Path(args.output_dir)
    if out.exists() and args.overwrite_output_dir and (out / RECORD_FILE).is_file():
        shutil.rmtree(out)
    save_converted(model, record, out, tokenizer, args.dtype)
    _print_summary(record, config, source_config, out)
    return record


def _print_summary(record: ConversionRecord, config: Any, source_config: dict[str, Any], out: Path) -> None:
    from qkvshare import QKVShareConfig

    before = QKVShareConfig.from_llama(source_config).kv_cache_bytes_per_token()
    lines = [
        f"converted {record.source} ({record.source_model_type}, {record.source_key_value_heads} key/value heads) to "
        f"{record.variant}: method {record.method or '-'} (calibration {record.calibration or '-'}), "
        f"Q=K {record.query_method or '-'}, "
        f"kv_tie_point {record.kv_tie_point}, head pooling {record.head_pooling or '-'}",
        f"KV cache per token (16-bit): {config.kv_cache_bytes_per_token():,} bytes (source {before:,})",
    ]
    for name in ("key", "value", "calibrated", "converted"):
        mean = record.mean_error(name)
        if mean is not None:
            lines.append(f"mean attention-output error ({name}): {mean:.4f} over {record.calibration_tokens:,} tokens")
    if record.layer_errors.get("drift"):
        lines.append(f"hidden-state drift after the last layer: {record.layer_errors['drift'][-1]:.4f}")
    lines.append(f"model directory: {out.resolve()}")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    """`qkvshare convert ARGV` (the same as the console command); returns the exit status."""
    return cli_main(["convert", *(sys.argv[1:] if argv is None else argv)])


def execute(args: argparse.Namespace) -> int:
    """`qkvshare convert` with its parsed arguments: 0 done, 2 bad input (one paragraph on stderr)."""
    try:
        run(args)
    except ValueError as err:
        print(f"qkvshare convert: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0


__all__ = [
    "ConversionRecord",
    "KV_METHODS",
    "CALIBRATIONS",
    "QUERY_METHODS",
    "DEFAULT_METHOD",
    "plan_conversion",
    "convert",
    "calibrate",
    "save_converted",
    "load_source",
    "load_source_tokenizer",
    "calibration_ids",
    "calibration_texts",
    "main",
    "execute",
    "run",
]
