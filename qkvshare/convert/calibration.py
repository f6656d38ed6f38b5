"""Calibration (`qkvshare.convert`'s docstring has the method): the text and token blocks to calibrate on, the
source's hidden states, and `calibrate`, which measures every layer's error and refits the o_proj of K=V layers."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from qkvshare import QKVShareConfig, QKVShareForCausalLM
from qkvshare.convert import data
from qkvshare.convert.weights import attention_state, fit_head_maps, fold_into_o_proj
from qkvshare.modeling_qkvshare import QKVShareAttention
from qkvshare.train.data import check_data_file, load_corpus
from qkvshare_settings.convert import DEFAULT_CALIBRATION, DEFAULT_CALIBRATION_TOKENS, DEFAULT_RIDGE
from qkvshare_settings.train import DataArguments

# Least squares of d_h unknowns per output needs many more rows than unknowns: at least this many tokens per d_h.
MIN_TOKENS_PER_HEAD_DIM = 4
# the K=V methods `calibrate` measures side by side (the transfer method records its own stages)
SIDE_BY_SIDE = ("key", "value", "calibrated")


def min_calibration_tokens(config: Any) -> int:
    """The fewest calibration tokens `calibrated` accepts (MIN_TOKENS_PER_HEAD_DIM x (head_dim + 1))."""
    return MIN_TOKENS_PER_HEAD_DIM * (config.head_dim + 1)


def check_calibration_ids(ids: Any, config: Any, name: str = "calibration_ids") -> None:
    """`ids` (called `name` in messages) must be a (batch, length) LongTensor of valid token ids with enough tokens for the fit."""
    if ids is None:
        raise ValueError(
            f"methods 'calibrated' and 'transfer' need calibration text: pass {name} (a (batch, length) LongTensor "
            "of token ids from the source's tokenizer), or on the command line --calibration_file (default: the "
            "embedded text), or choose --method key."
        )
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype != torch.long:
        raise ValueError(
            f"{name} must be a 2-D LongTensor (batch, length), got {type(ids).__name__} "
            f"{getattr(ids, 'shape', '')} {getattr(ids, 'dtype', '')}."
        )
    need = min_calibration_tokens(config)
    if ids.numel() < need or ids.shape[1] < 2:
        raise ValueError(
            f"{name} has {ids.numel()} tokens (shape {tuple(ids.shape)}), too few to fit "
            f"{config.head_dim}x{config.head_dim} maps: give at least {need} tokens in sequences of 2 or more "
            f"(a few thousand is usual; the default is {DEFAULT_CALIBRATION_TOKENS})."
        )
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(
            f"{name} hold ids in [{int(ids.min())}, {int(ids.max())}], outside the source's vocabulary "
            f"[0, {config.vocab_size}); tokenize with the source's tokenizer."
        )


def calibration_texts(
    calibration_file: str | None = None, seed: int = 0, split: str = "train", dataset: str | None = None
) -> tuple[Iterable[str], str]:
    """Documents of `split` ("train" to fit, "validation" to measure) and their description: a .txt file (one
    document) or .jsonl/.json file (its `text` column), cut into pieces of which every tenth validates; a datasets
    name or folder (`dataset`: its own validation split, or 5% of its documents); or by default the embedded mixed
    prose and code of `qkvshare.convert.data` (lazy), in a seeded order."""
    if dataset is not None:
        corpus = load_corpus(DataArguments(dataset_name=dataset), seed=seed)
        documents = list(corpus.train if split == "train" else corpus.validation)
        random.Random(seed).shuffle(documents)
        return documents, f"--calibration_dataset {dataset} ({corpus.description}), {split} split, seed {seed}"
    if calibration_file is None:
        return data.documents("mixed", split, seed), data.describe(split, seed)

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
    return data.split_documents(documents, split), f"{path}, {split} split"


def calibration_ids(tokenizer: Any, documents: Iterable[str], tokens: int, block_size: int) -> torch.Tensor:
    """Blocks (n, block_size) of the EOS-joined token stream of `documents`, `tokens // block_size` of them (fewer
    when the text is short: `check_calibration_ids` then says so)."""
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


def causal_mask(length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive causal mask (1, 1, T, T): what eager and sdpa attention both take."""
    upper = torch.ones(length, length, dtype=torch.bool).triu(1)
    return torch.zeros(length, length, dtype=dtype).masked_fill(upper, torch.finfo(dtype).min)[None, None]


def o_proj_input(attention: Any, hidden: torch.Tensor, position_embeddings: Any, mask: torch.Tensor) -> torch.Tensor:
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


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return float((output - reference).norm() / reference.norm().clamp_min(1e-12))


def _attention_module(config: QKVShareConfig, layer_idx: int, state: dict[str, torch.Tensor]) -> Any:

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
    config = model.config
    layers = range(config.num_hidden_layers)
    tied_any = any(config.is_kv_tied(i) for i in layers)
    errors: dict[str, list[float | None]] = {"converted": [], "drift": []}
    errors |= {m: [] for m in SIDE_BY_SIDE} if tied_any else {}
    with torch.no_grad():
        streams, inputs, rope = source_streams(source, ids)
        rope32 = tuple(t.float() for t in rope)
        mask32 = causal_mask(ids.shape[1], torch.float32)
        stream = streams[0].float()  # the converted model's residual stream (the same embeddings)
        for i in layers:
            src_attn, layer = source.model.layers[i].self_attn, model.model.layers[i]
            layer_attn = layer.self_attn
            src_dtype = src_attn.o_proj.weight.dtype
            targets = o_proj_input(src_attn, inputs[i], rope, causal_mask(ids.shape[1], src_dtype))
            o_bias = src_attn.o_proj.bias.float() if src_attn.o_proj.bias is not None else None
            reference = F.linear(targets, src_attn.o_proj.weight.float(), o_bias)  # the source's attention output
            hidden = inputs[i].float()
            own = layer.input_layernorm(stream)  # the converted model's attention input (its layers < i converted)
            own_features = o_proj_input(layer_attn, own, rope32, mask32)  # what o_proj receives: o_proj-free
            if config.is_kv_tied(i):
                src_state = {k: v.float() for k, v in src_attn.state_dict().items()}
                for name in ("value", "key"):
                    module = _attention_module(
                        config, i, attention_state(src_state, source_kv, config, i, name, query_method)
                    )
                    features = o_proj_input(module, hidden, rope32, mask32)
                    errors[name].append(relative_error(module.o_proj(features), reference))
                # `module` is now the `key` layer: calibrated = key projections + o_proj refitted on its features
                heads = config.num_attention_heads
                maps = fit_head_maps(features, targets.float(), heads, ridge, config.attention_bias)
                fold_into_o_proj(module.o_proj, maps)
                errors["calibrated"].append(relative_error(module.o_proj(features), reference))
                if method == "calibrated" and calibration == "independent":
                    layer_attn.o_proj.load_state_dict(module.o_proj.state_dict())
                elif method == "calibrated":  # sequential: the source layer's output for the converted path's input
                    own_targets = o_proj_input(src_attn, own.to(src_dtype), rope, causal_mask(ids.shape[1], src_dtype))
                    maps = fit_head_maps(own_features, own_targets.float(), heads, ridge, config.attention_bias)
                    fold_into_o_proj(layer_attn.o_proj, maps)
            features = o_proj_input(layer_attn, hidden, rope32, mask32)
            errors["converted"].append(relative_error(layer_attn.o_proj(features), reference))
            if tied_any and not config.is_kv_tied(i):
                for name in SIDE_BY_SIDE:
                    errors[name].append(None)
            stream = stream + layer_attn.o_proj(own_features).view_as(stream)
            stream = stream + layer.mlp(layer.post_attention_layernorm(stream))
            errors["drift"].append(relative_error(stream, streams[i + 1].float()))
    return errors
