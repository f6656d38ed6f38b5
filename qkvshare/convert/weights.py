"""The converted weights (`qkvshare.convert`'s docstring has the math): mean-pooled key/value heads, the attention
state of each converted layer, and the per-head maps of the calibrated K=V fit folded into o_proj."""

from __future__ import annotations

from typing import Any

import torch

from qkvshare import QKVShareConfig, QKVShareForCausalLM


def pooling_matrix(num_heads: int, source_kv: int, target_kv: int) -> torch.Tensor:
    """(target_kv, source_kv) weights: new head j = mean over its query heads of their source key/value heads."""
    per_target, per_source = num_heads // target_kv, num_heads // source_kv
    pool = torch.zeros(target_kv, source_kv, dtype=torch.float64)
    for h in range(num_heads):
        pool[h // per_target, h // per_source] += 1.0 / per_target
    return pool


def _pooled(weight: torch.Tensor, pool: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Pool a k/v projection weight (source_kv*D, hidden) or bias (source_kv*D,) into (target_kv*D, ...)."""
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

    `method` picks the shared K=V projection (`key`/`calibrated`: W_k, `value`: W_v); `query_method="query"` gives the
    projection a shared query is taken from (`SharingMode.query_from`; Q=K: k_proj) the source's W_q, any other
    value leaves it its own source weight;
    key/value heads are mean-pooled to the config's count. o_proj is copied (`calibrate` refits it).
    """
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
    mode = config.layer_mode(layer_idx)
    # Each projection from its own source weight, except: the one k_proj of a K=V layer is W_v for method="value";
    # otherwise the projection carrying a shared query is W_q for query_method="query".
    sources = {"q_proj": q, "k_proj": k, "v_proj": v, "o_proj": projection("o_proj", False)}
    if mode.kv_tied and method == "value":
        sources["k_proj"] = v
    elif mode.query_is_shared and query_method == "query":
        sources[mode.query_from] = q
    projections = {name: sources[name] for name in mode.projections}
    return {f"{name}.{kind}": t.clone() for name, p in projections.items() for kind, t in p.items()}


def build_converted(
    source_state: dict[str, torch.Tensor],
    source_kv: int,
    config: QKVShareConfig,
    method: str | None,
    query_method: str | None,
) -> QKVShareForCausalLM:
    """A float32 `QKVShareForCausalLM` holding the source's weights, attention converted by `attention_state`."""
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


def fit_head_maps(
    features: torch.Tensor, targets: torch.Tensor, num_heads: int, ridge: float, intercept: bool
) -> torch.Tensor:
    """Per head h, M_h = argmin ||F_h M - A_h||^2 + lambda ||M||^2 (float64); (heads, D [+1 intercept row], D)."""
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
    weight = o_proj.weight.data.double()  # (hidden, H * D)
    heads, head_dim = maps.shape[0], maps.shape[-1]
    w = weight.reshape(weight.shape[0], heads, head_dim)  # (hidden, H, D)
    new = torch.einsum("ahe,hfe->ahf", w, maps[:, :head_dim])
    o_proj.weight.data.copy_(new.reshape_as(weight).to(o_proj.weight.dtype))
    if maps.shape[1] > head_dim:
        shift = torch.einsum("ahe,he->a", w, maps[:, head_dim])
        o_proj.bias.data.add_(shift.to(o_proj.bias.dtype))
