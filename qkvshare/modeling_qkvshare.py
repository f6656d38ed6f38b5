"""QKVShare models: Llama-style decoders (or GPT-2-style, or bidirectional encoders) whose attention layers
share projections as in "Do Transformers Need Three Projections?" (ICML 2026).

Design notes
- Each attention layer decides in `__init__` which projections exist (Llama's names, so Llama checkpoints
  load unchanged): "none" q,k,v,o; "qk" (Q=K-V) k,v,o with query = key; "kv" (Q-K=V) q,k,o with
  value = key; "qkv" (Q=K=V) k,o. A dropped projection is not created: no dead weights.
- Tied layers hand ONE tensor to the QKVShare caches (dynamic, static, quantized, sliding; see cache_qkvshare.py).
  With RoPE the tie is either after rotation (`kv_tie_point="post_rope"`, V is the rotated key) or before
  (`"pre_rope"`, V is the key projection's output; the cache stores it and keys are rotated on read from the cached
  positions).
- The "+" 2D positional encoding of the attention map (paper section 3, m channels, a 1x1 map with weight w
  and bias b) is exactly S' = S * sum(w) + P.w + b. P[i, j] concatenates a row encoding of i and a column
  encoding of j, so P.w = row(i).w_r + col(j).w_c: we never build the (n, n, m) tensor, we scale the query
  by sum(w) and add the (B, 1, q, kv) bias to the attention mask. That works on the eager and sdpa backends,
  causal or bidirectional, for any length up to max_position_embeddings.
- RoPE cos/sin, the key positions and the "+" encodings are computed once per forward in the base model.
- Sliding window (config `sliding_window`, per layer `layer_types`), as in Mistral and Gemma: one mask per attention
  type ("full_attention", "sliding_attention") per forward, built by transformers' `create_causal_mask` /
  `create_sliding_window_causal_mask` (a query sees the last `sliding_window` keys, itself included); the cache keeps
  the window only, and its key positions follow the same window (per attention type).
- ALiBi (`position_embedding_type="alibi"`, Press et al. 2022) is a fixed per-head bias -slope_h * (i - j)
  (-slope_h * |i - j| for bidirectional models) built once per forward from the query and key positions and folded
  into the attention mask, like the "+" bias: eager and sdpa only, exact with the cache (which records positions).
- QV-Ka (`key_context_dim`, the second source) replaces `k_proj` by `ctx_proj` (G = X W_ctx, shared by all heads)
  and `k_mix` (K_i = [G ; V_i] W_i^K). The `QKVShareCache` stores G and V, and the keys of every cached token are
  recomputed on read (rotated at the cached positions with RoPE); any other cache stores K and V as for QKV.
- Inputs are checked before any work: the cache (a QKVShareCache built for this model, or a transformers cache the
  model can use exactly), the shapes of input_ids/inputs_embeds and attention_mask. "+" models refuse foreign
  caches: only the QKVShare caches record the positions of cached keys, which the column term of the map needs.
- `past_key_values=` is accepted (with transformers' deprecation warning) wherever `cache=` is, as in Llama.
- Only single-dot imports of package files: `save_pretrained` copies these files into checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.integrations.sdpa_attention import pack_gqa
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import (
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, ImageClassifierOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, is_torchdynamo_compiling
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_qkvshare import CacheLayout, QKVShareCache, QKVShareQuantizedCache, QKVShareStaticCache
from .configuration_qkvshare import QKVShareConfig
from .linear_attention_qkvshare import QKVShareLinearAttention

# Backends that accept an arbitrary additive float mask (needed by the "+" encoding).
_BIAS_CAPABLE_BACKENDS = ("eager", "sdpa")
# The mask builder of each attention type (config `layer_types`).
MASK_BUILDERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on one tensor (B, H, T, D) with cos/sin (B, T, D); the same formula as Llama's apply_rotary_pos_emb."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def sinusoid(positions: torch.Tensor, channels: int) -> torch.Tensor:
    """Interleaved sin/cos encoding of positions (...,) -> (..., channels), 1/10000^(2k/channels) frequencies."""
    pairs = math.ceil(channels / 2)
    inv_freq = 1.0 / (
        10000 ** (torch.arange(0, 2 * pairs, 2, device=positions.device, dtype=torch.float32) / (2 * pairs))
    )
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., pairs)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[..., :channels]


def attention_map_encoding(
    query_positions: torch.Tensor, key_positions: torch.Tensor, dim: int, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column parts of the paper's 2D encoding P[i, j] = concat(row(i), col(j)) of the attention map.

    Returns `row` (B, q, r) and `col` (B, kv, m - r). Layouts (docs/research.md, section 2.2; docs/design.md, section 5):
    - "original" (Borji 2023, `positional-encodings` 2D): ch = ceil(m/4)*2 channels per axis, row block first,
      truncated to m channels in all (m=10: 6 row + 4 column channels);
    - "reproduction": first m//2 channels encode the row, the remaining ones the column.
    """
    if layout == "original":
        per_axis = math.ceil(dim / 4) * 2
        row_dims = min(per_axis, dim)
        row = sinusoid(query_positions, per_axis)[..., :row_dims]
        col = sinusoid(key_positions, per_axis)[..., : dim - row_dims]
    else:
        row_dims = dim // 2
        row = sinusoid(query_positions, row_dims)
        col = sinusoid(key_positions, dim - row_dims)
    return row, col


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's per-head slopes (Press et al. 2022, and their reference code): 2^(-8h/H) for h = 1..H when H is a
    power of two; otherwise the slopes of the largest power of two n < H, then every other slope of 2n."""

    def geometric(n: int) -> list[float]:
        return [2 ** (-8 * (h + 1) / n) for h in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    return geometric(closest) + geometric(2 * closest)[0::2][: num_heads - closest]


def alibi_bias(
    query_positions: torch.Tensor, key_positions: torch.Tensor, slopes: torch.Tensor, causal: bool
) -> torch.Tensor:
    """ALiBi's score bias (B, H, q, kv): -slope_h * (i - j) for query position i and key position j (keys after
    the query are masked anyway when causal), or -slope_h * |i - j| when bidirectional."""
    distance = (query_positions[:, :, None] - key_positions[:, None, :]).to(slopes.dtype)  # (B, q, kv)
    if not causal:
        distance = distance.abs()
    return -slopes[None, :, None, None] * distance[:, None]  # (B, H, q, kv)


def add_bias_to_mask(mask: torch.Tensor | None, bias: torch.Tensor) -> torch.Tensor:
    """Fold an additive score bias (B, 1, q, kv) into a (boolean or additive float) attention mask."""
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, torch.finfo(bias.dtype).min)
    return bias + mask


def grouped_decode_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """sdpa of ONE query token per sequence against grouped key/value heads, without copying the cache per head.

    query (B, H, 1, D), key and value (B, H_kv, S, D), mask (B, 1 or H, 1, S) -> (B, 1, H, D), what transformers'
    sdpa interface returns. The G = H / H_kv query heads of a group become G query rows of their key/value head,
    (B, H_kv, G, D), so the cache is read once per key/value head. transformers' sdpa integration does the same in
    eager mode but, while dynamo traces (torch.compile, torch.export), falls back to `repeat_kv`, which copies the
    whole cache to every query head in every layer and step (5x Llama's decode time at batch 8 and 16k context).
    """
    heads, groups = query.shape[1], query.shape[1] // key.shape[1]
    # transformers' own packing: the query, and a per-head mask (ALiBi: (B, H, 1, S) -> (B, H_kv, G, S)) with it
    output = torch.nn.functional.scaled_dot_product_attention(
        pack_gqa(query, groups), key, value, attn_mask=pack_gqa(mask, groups), scale=scaling, is_causal=False
    )
    return output.reshape(output.shape[0], heads, 1, value.shape[-1]).transpose(1, 2).contiguous()


class AttentionMapPE(nn.Linear):
    """The "+" variants' 1x1 map from m channels of the attention-map encoding to one score (weight w, bias b)."""

    def __init__(self, dim: int):
        super().__init__(dim, 1)


class KeyMix(nn.Module):
    """QV-Ka's per-head key maps W_i^K, of shape (d_ctx + D) x D each, applied to [G ; V_i] (the second source).

    `weight` (H, d_ctx + D, D): rows [:d_ctx] act on the shared context G, rows [d_ctx:] on the head's value.
    No bias: the source's formula has none.
    """

    def __init__(self, num_heads: int, context_dim: int, head_dim: int):
        super().__init__()
        self.context_dim, self.head_dim = context_dim, head_dim
        self.weight = nn.Parameter(torch.empty(num_heads, context_dim + head_dim, head_dim))

    def forward(self, context: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Keys (B, H, T, D) from the context (B, 1, T, d_ctx) and the values (B, H, T, D)."""
        w_context, w_value = self.weight.split([self.context_dim, self.head_dim], dim=1)
        # [G ; V_i] W_i^K = G W_i^K[:d_ctx] + V_i W_i^K[d_ctx:], without building the (B, H, T, d_ctx + D) concatenation
        return torch.matmul(context, w_context) + torch.matmul(value, w_value)


class QKVSharePlainMLP(nn.Module):
    """GPT-2-style MLP: up_proj -> activation -> down_proj (Llama's names for the two linears)."""

    def __init__(self, config: QKVShareConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


def make_norm(config: QKVShareConfig) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return LlamaRMSNorm(config.hidden_size, eps=config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


class QKVShareAttention(nn.Module):
    """Multi-head attention whose projections are shared as the layer's mode says (see the module docstring)."""

    def __init__(self, config: QKVShareConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.sharing = config.layer_sharing(layer_idx)
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = config.is_causal
        # The window of a "sliding_attention" layer (None: full attention); the mask applies it, flash attention
        # takes it as an argument.
        self.sliding_window = (
            config.sliding_window if config.layer_attention_type(layer_idx) != "full_attention" else None
        )
        # What this layer is, decided once.
        self.query_is_key = self.sharing in ("qk", "qkv")  # Q=K: symmetric scores
        self.kv_tied = self.sharing in ("kv", "qkv")  # K=V: one cached tensor
        self.pre_rope_tie = (
            self.kv_tied and config.position_embedding_type == "rope" and config.kv_tie_point == "pre_rope"
        )

        hidden, bias = config.hidden_size, config.attention_bias
        if not self.query_is_key:
            self.q_proj = nn.Linear(hidden, config.num_attention_heads * self.head_dim, bias=bias)
        if config.key_context_dim:  # QV-Ka: the keys come from a shared context and the values, not from k_proj
            self.ctx_proj = nn.Linear(hidden, config.key_context_dim, bias=bias)
            self.k_mix = KeyMix(config.num_key_value_heads, config.key_context_dim, self.head_dim)
        else:
            self.k_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        if not self.kv_tied:
            self.v_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, hidden, bias=bias)
        # The "+" variants: the paper's 1x1 conv over m channels of the attention map, shared across heads.
        self.attention_map_pe = AttentionMapPE(config.attention_map_pe_dim) if config.attention_map_pe_dim else None
        # The mask carries a float bias ("+" map, ALiBi): see the copy before the output reshape in `forward`.
        self.mask_carries_bias = bool(config.attention_map_pe_dim) or config.position_embedding_type == "alibi"

    def _heads(self, projection: nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, hidden) -> (B, heads, T, D)."""
        return projection(hidden_states).view(*hidden_states.shape[:-1], -1, self.head_dim).transpose(1, 2)

    def project(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key and value of the new tokens, before any cache. Tied tensors are the same object."""
        key = self._heads(self.k_proj, hidden_states)  # (B, H_kv, T, D)
        query = key if self.query_is_key else self._heads(self.q_proj, hidden_states)  # (B, H, T, D)
        value = key if self.kv_tied else self._heads(self.v_proj, hidden_states)  # (B, H_kv, T, D)
        if position_embeddings is not None:  # RoPE on query and key; V follows the key only for post-RoPE ties
            cos, sin = position_embeddings
            rotated_key = rotate(key, cos, sin)
            query = rotated_key if self.query_is_key else rotate(query, cos, sin)
            value = rotated_key if self.kv_tied and not self.pre_rope_tie else value
            key = rotated_key
        return query, key, value

    def project_from_context(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        cache: Cache | None,
        key_position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """QV-Ka: query, key and value of every key this forward attends to, through the cache.

        Q_i and V_i as in QKV, G = X W_ctx, K_i = [G ; V_i] W_i^K (RoPE on Q and K only). A `QKVShareCache` stores
        G and V, and the keys of all cached tokens are recomputed from them (rotated at the cached positions);
        another cache gets K and V.
        """
        query = self._heads(self.q_proj, hidden_states)  # (B, H, T, D)
        value = self._heads(self.v_proj, hidden_states)  # (B, H, T, D)
        context = self.ctx_proj(hidden_states).unsqueeze(1)  # (B, 1, T, d_ctx)
        if position_embeddings is not None:
            query = rotate(query, *position_embeddings)
        if isinstance(cache, QKVShareCache):  # G and V stored: the keys of every cached token are recomputed
            context, value = cache.update(context, value, self.layer_idx)  # (B, 1, T_all, d_ctx), (B, H, T_all, D)
            key = self.k_mix(context, value)  # (B, H, T_all, D)
            if position_embeddings is not None:
                key = rotate(key, *key_position_embeddings)
            return query, key, value
        key = self.k_mix(context, value)  # (B, H, T, D)
        if position_embeddings is not None:
            key = rotate(key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        return query, key, value

    def map_bias(self, map_encoding: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The "+" term P.w + b as a (B, 1, q, kv) score bias."""
        row, col = map_encoding
        weight, rows = self.attention_map_pe.weight[0], row.shape[-1]
        row_term = row.to(weight.dtype) @ weight[:rows]  # (B, q)
        col_term = col.to(weight.dtype) @ weight[rows:]  # (B, kv)
        return (row_term[:, :, None] + col_term[:, None, :] + self.attention_map_pe.bias)[:, None]

    def decodes_grouped(self, query: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
        """Whether this step takes `grouped_decode_sdpa`: sdpa, grouped key/value heads, one query token whose count
        is a plain int (static under torch.compile; a symbolic length, as in a dynamic-shape export, keeps the
        interface), and a mask (without one, transformers' sdpa passes `enable_gqa`, which reads no copies)."""
        return (
            self.num_key_value_groups > 1
            and attention_mask is not None
            and self.config._attn_implementation == "sdpa"
            and type(query.shape[2]) is int
            and query.shape[2] == 1
            and not (self.training and self.attention_dropout > 0)
        )

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        key_position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        map_encoding: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        if self.config.key_context_dim:  # QV-Ka: keys recomputed from the cached context and values
            query, key, value = self.project_from_context(
                hidden_states, position_embeddings, cache, key_position_embeddings
            )
        else:
            query, key, value = self.project(hidden_states, position_embeddings)

        if cache is not None and not self.config.key_context_dim:
            if self.kv_tied and isinstance(cache, QKVShareCache):
                # One tensor: the unrotated key (= value) for pre-RoPE ties, else the (rotated) key.
                stored, _ = cache.update(value if self.pre_rope_tie else key, None, self.layer_idx)
                key = rotate(stored, *key_position_embeddings) if self.pre_rope_tie else stored
                value = stored
            else:  # untied layer, or a foreign cache (e.g. DynamicCache): store key and value
                key, value = cache.update(key, value, self.layer_idx)

        if self.attention_map_pe is not None:  # S' = S * sum(w) + P.w + b
            query = query * self.attention_map_pe.weight.sum().to(query.dtype)
            attention_mask = add_bias_to_mask(attention_mask, self.map_bias(map_encoding).to(query.dtype))

        if self.decodes_grouped(query, attention_mask):
            attn_output, attn_weights = grouped_decode_sdpa(query, key, value, attention_mask, self.scaling), None
        else:
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            attn_output, attn_weights = attention_interface(
                self,
                query,
                key,
                value,
                attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
                sliding_window=self.sliding_window,
                **kwargs,
            )
        if self.mask_carries_bias:
            # sdpa with a float mask (the "+" or ALiBi bias) traced with a dynamic length records the fused CPU
            # kernel's output layout, in which (B, T, H, D) is already contiguous, so the reshape below is traced as a
            # view; exporters that decompose sdpa into math ops (torch.onnx) then get a (B, H, T, D) output and that
            # view fails. A recorded copy makes the layout explicit (eager: one (B, T, H*D) copy per layer).
            attn_output = attn_output.clone(memory_format=torch.contiguous_format)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class QKVShareDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: QKVShareConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.attention_type = config.layer_attention_type(layer_idx)  # which of the model's masks this layer takes
        # attention_kernel: "linear" layers (the paper's appendix recurrence) use their own attention module.
        attention_class = QKVShareLinearAttention if config.attention_kernel == "linear" else QKVShareAttention
        self.self_attn = attention_class(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config) if config.mlp_type == "gated" else QKVSharePlainMLP(config)
        self.input_layernorm = make_norm(config)
        self.post_attention_layernorm = make_norm(config)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class QKVSharePreTrainedModel(PreTrainedModel):
    config: QKVShareConfig
    config_class = QKVShareConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["QKVShareDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # A decode step with QKVShareStaticCache traces to one graph in every mode (tests/test_compile_export.py): no
    # host syncs on the forward path (see `QKVShareModel._check_learned_positions`).
    _can_compile_fullgraph = True
    _can_record_outputs = {"hidden_states": QKVShareDecoderLayer, "attentions": QKVShareAttention}

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, KeyMix):
            # Variance-preserving (std 1/sqrt(fan_in)): keys start at the scale a k_proj output has under the
            # N(0, initializer_range) init of the projections feeding it.
            init.normal_(module.weight, mean=0.0, std=module.weight.shape[1] ** -0.5)
            return
        if isinstance(module, QKVShareImageEmbeddings):  # its own parameters; its conv gets the Linear/Conv init
            for parameter in (module.cls_token, module.position_embeddings):
                if parameter is not None:
                    init.trunc_normal_(parameter, mean=0.0, std=self.config.initializer_range)
            return
        if not isinstance(module, AttentionMapPE):
            super()._init_weights(module)
            return
        scheme = self.config.attention_map_pe_init
        if scheme == "unit_scale":  # sum(w) = 1: scores start exactly as without "+"
            init.constant_(module.weight, 1.0 / module.weight.shape[-1])
        elif scheme == "xavier":  # the original code's init
            init.xavier_uniform_(module.weight)
        else:  # the reproduction's init
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        init.zeros_(module.bias)


class QKVShareModel(QKVSharePreTrainedModel):
    """The decoder (or encoder, with `is_causal=False`) stack without a head.

    `add_token_embeddings=False` builds no token embedding (like ViTModel's `add_pooling_layer`): the stack then
    takes only `inputs_embeds` (the image model feeds it patch embeddings).
    """

    def __init__(self, config: QKVShareConfig, add_token_embeddings: bool = True):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx) if add_token_embeddings else None
        )
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(
            [QKVShareDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = make_norm(config)
        self.rotary_emb = LlamaRotaryEmbedding(config=config) if config.position_embedding_type == "rope" else None
        # Decided once: what a QKVShareCache passed to forward must hold, and whether some layer needs cos/sin at
        # every cached position: pre-RoPE tied layers rotate their cached keys on read, and QV-Ka layers rotate the
        # keys they recompute from the cache.
        self.cache_layout = CacheLayout.for_config(config)
        pre_rope_ties = any(getattr(layer.self_attn, "pre_rope_tie", False) for layer in self.layers)
        self.rotates_cached_keys = pre_rope_ties or bool(config.key_context_dim)
        self.gradient_checkpointing = False
        self.post_init()

    def _check_cache(self, cache: Cache | None) -> None:
        """Refuse a cache this model cannot use exactly (cheap Python checks, no tensor reads)."""
        if cache is None:
            return
        if isinstance(cache, QKVShareCache):
            cache.check_layout(self.cache_layout)
            return
        name = type(cache).__name__
        fix = (
            "pass no cache (forward with use_cache=True and generate() create a QKVShareCache; "
            "generate(cache_implementation='static') a QKVShareStaticCache) or cache=QKVShareCache(config=model.config)"
        )
        if not isinstance(cache, Cache):
            raise ValueError(f"cache must be a transformers Cache, got a {name}; {fix}.")
        if self.config.attention_kernel == "linear":
            raise ValueError(
                f"cache: attention_kernel='linear' keeps a constant-size state that only QKVShareCache holds, got a "
                f"{name}; {fix}."
            )
        # The "+" map and ALiBi score every cached key by its position: (the setting, why) for the message.
        scored_by_position = None
        if self.config.attention_map_pe_dim:
            scored_by_position = (f"attention_map_pe_dim={self.config.attention_map_pe_dim} (a '+' variant)", "")
        elif self.config.position_embedding_type == "alibi":
            scored_by_position = ("position_embedding_type='alibi'", " (its bias is -slope * distance)")
        if scored_by_position:
            setting, why = scored_by_position
            raise ValueError(
                f"cache: {setting} needs the position of every cached key{why}, which only QKVShare caches record; a "
                f"{name} does not (assuming positions 0..past-1 would be wrong for left-padded batches). To fix it, "
                f"{fix}."
            )
        expected, held = self.config.num_hidden_layers, len(cache.layers)
        grows = getattr(cache, "layer_class_to_replicate", None) is not None  # DynamicCache(): layers come on use
        if held != expected and not (grows and held == 0):
            raise ValueError(
                f"cache: the {name} has {held} layers but this model has {expected}: it was built or filled for "
                f"another model. Build it with {name}(config=model.config), or {fix}."
            )

    def _check_inputs(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
    ) -> None:
        """Refuse malformed inputs with a ValueError naming them, before any work."""
        implementation = self.config._attn_implementation
        if self.config.attention_map_pe_dim and implementation not in _BIAS_CAPABLE_BACKENDS:
            raise ValueError(
                f"attention_map_pe_dim={self.config.attention_map_pe_dim} (the '+' variants) adds a score bias, which "
                f"the {implementation!r} attention backend cannot take; load the model with "
                f"attn_implementation='sdpa' or 'eager'."
            )
        if self.config.position_embedding_type == "alibi" and implementation not in _BIAS_CAPABLE_BACKENDS:
            raise ValueError(
                f"position_embedding_type='alibi' adds a per-head score bias, which the {implementation!r} attention "
                "backend cannot take; load the model with attn_implementation='sdpa' or 'eager'."
            )
        if input_ids is not None:
            name, shape, expected = "input_ids", tuple(input_ids.shape), "(batch, sequence)"
            well_formed = len(shape) == 2
        else:
            name, shape = "inputs_embeds", tuple(inputs_embeds.shape)
            expected = f"(batch, sequence, {self.config.hidden_size})"
            well_formed = len(shape) == 3 and shape[-1] == self.config.hidden_size
        if not well_formed:
            raise ValueError(f"{name} must have shape {expected}, got {shape}.")
        if 0 in shape[:2]:
            raise ValueError(
                f"{name} has shape {shape}: no tokens to run; pass at least one sequence of at least one token."
            )
        if isinstance(cache, QKVShareCache):  # a cache filled for another batch would fail deep inside torch
            cache.check_batch_size(shape[0])
        if isinstance(attention_mask, dict):  # masks per attention type, as `build_masks` (or generate()) makes them
            expected_types = set(self.cache_layout.present_attention_types)
            if set(attention_mask) != expected_types:
                raise ValueError(
                    f"attention_mask is a dict with keys {sorted(attention_mask)}, but this model's layers need masks "
                    f"for {sorted(expected_types)}; pass a 2D padding mask, or the dict that "
                    "model.model.build_masks(...) returns."
                )
        elif attention_mask is not None:
            self._check_attention_mask(attention_mask, name, shape, cache)

    @staticmethod
    def _check_attention_mask(
        attention_mask: torch.Tensor, name: str, shape: tuple[int, ...], cache: Cache | None
    ) -> None:
        """The mask must cover the batch and the keys: 2D (batch, cached + new), 4D (batch, heads, new, keys)."""
        batch, length = shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if isinstance(past, torch.Tensor):  # static caches keep their length on the device: don't sync to read it
            past = None
        held = f" and the cache holds {past} tokens" if past else ""
        mask_shape = tuple(attention_mask.shape)
        if len(mask_shape) == 2:  # padding mask over cached + new tokens (transformers' convention)
            if mask_shape[0] != batch or (past is not None and mask_shape[1] != past + length):
                keys = f"cached + {length}" if past is None else past + length
                raise ValueError(
                    f"attention_mask has shape {mask_shape} but {name} has shape {shape}{held}: a 2D mask must be "
                    f"(batch, cached + new tokens) = ({batch}, {keys})."
                )
        elif len(mask_shape) == 4:  # a prepared or custom mask, used as is
            key_length = cache.get_mask_sizes(length, 0)[0] if cache is not None else length
            if mask_shape[0] not in (1, batch) or mask_shape[2] != length or mask_shape[3] != key_length:
                raise ValueError(
                    f"attention_mask has shape {mask_shape} but {name} has shape {shape}{held}: a 4D mask must be "
                    f"(batch, heads, new tokens, keys) = ({batch} or 1, heads or 1, {length}, {key_length})."
                )
        else:
            raise ValueError(
                f"attention_mask must be 2D (batch, cached + new tokens) or 4D (batch, heads, new tokens, keys); got "
                f"shape {mask_shape} for {name} of shape {shape}."
            )

    def build_masks(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        position_ids: torch.LongTensor | None,
    ) -> dict[str, torch.Tensor | None]:
        """One attention mask per attention type of the layers ("full_attention", "sliding_attention"), from a 2D
        padding mask (or a 4D one, used as is), sized by `cache` as it is before this forward's update."""
        masks = {}
        for attention_type in self.cache_layout.present_attention_types:
            # The "+" and ALiBi biases are folded into the mask, so it must be materialized (no is_causal shortcut).
            mask = MASK_BUILDERS[attention_type](
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
                allow_is_causal_skip=not (
                    self.config.attention_map_pe_dim or self.config.position_embedding_type == "alibi"
                ),
            )
            eager = self.config._attn_implementation == "eager"
            if eager and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
                # A boolean 4D mask (True = attend) is passed through as is, and eager attention adds the mask to the
                # scores: it would add 1/0 (silently wrong logits; LlamaForCausalLM does this). Make it additive.
                mask = add_bias_to_mask(mask, mask.new_zeros(mask.shape, dtype=inputs_embeds.dtype))
            masks[attention_type] = mask
        return masks

    def _check_learned_positions(self, position_ids: torch.LongTensor, cache: Cache | None) -> None:
        """Refuse positions beyond the learned position table (the embedding lookup would fail or read garbage).

        Eager: the largest position is read back. Under torch.compile / torch.export that read would be a host sync
        (a graph break, or an export error), so only what the host knows is checked: a static cache's slots bound
        the positions of the tokens written into it, so `max_cache_len` must fit the table.
        """
        limit = self.config.max_position_embeddings
        if is_torchdynamo_compiling():
            length = getattr(cache, "max_cache_len", None)
            if isinstance(length, int) and length > limit:
                raise ValueError(
                    f"cache: max_cache_len={length} is beyond max_position_embeddings={limit} of this model's learned "
                    f"position table; build the static cache with max_cache_len <= {limit}."
                )
            return
        if position_ids.numel() and int(position_ids.max()) >= limit:
            raise ValueError(
                f"position {int(position_ids.max())} is beyond max_position_embeddings={limit} of this model's "
                "learned position table; use shorter inputs."
            )

    def _positions(
        self, inputs_embeds: torch.Tensor, position_ids: torch.LongTensor, cache: Cache | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Everything about positions, once per forward: the learned absolute embeddings (added to `inputs_embeds`),
        and for the attention layers of each attention type `position_embeddings` (RoPE cos/sin of the new tokens),
        `key_position_embeddings` (RoPE of every cached + new key, for pre-RoPE tied layers, which rotate their
        cached keys on read) and `map_encoding` (row/column encodings of the "+" attention map).
        """
        hidden_states = inputs_embeds
        if self.config.position_embedding_type == "learned":
            self._check_learned_positions(position_ids, cache)
            hidden_states = hidden_states + self.embed_positions(position_ids)

        # Positions of every key this forward attends to, per attention type: the cached ones (a QKVShareCache records
        # them when the model needs them, windowed for sliding layers) and the new ones. Foreign caches never need
        # them: `_check_cache` refuses them for "+", and with them pre-RoPE tied layers store the rotated key and the
        # value separately.
        batch_size = inputs_embeds.shape[0]
        query_position_ids = position_ids.expand(batch_size, -1)
        if isinstance(cache, QKVShareCache):
            key_position_ids = cache.update_positions(query_position_ids)
        else:
            key_position_ids = dict.fromkeys(self.cache_layout.present_attention_types, query_position_ids)

        rope = self.rotary_emb(hidden_states, position_ids=position_ids) if self.rotary_emb is not None else None
        slopes = None
        if self.config.position_embedding_type == "alibi":  # folded into the masks by `forward`, once for all layers
            slopes = torch.tensor(alibi_slopes(self.config.num_attention_heads), device=inputs_embeds.device)
        layer_inputs = {}
        for attention_type, keys in key_position_ids.items():
            inputs = {"position_embeddings": rope, "key_position_embeddings": None, "map_encoding": None}
            if rope is not None and self.rotates_cached_keys and isinstance(cache, QKVShareCache):
                inputs["key_position_embeddings"] = self.rotary_emb(hidden_states, position_ids=keys)
            if self.config.attention_map_pe_dim:
                inputs["map_encoding"] = attention_map_encoding(
                    query_position_ids, keys, self.config.attention_map_pe_dim, self.config.attention_map_pe_layout
                )
            if slopes is not None:
                inputs["alibi_bias"] = alibi_bias(query_position_ids, keys, slopes, self.config.is_causal)
            layer_inputs[attention_type] = inputs
        return hidden_states, layer_inputs

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        r"""Run the stack on new tokens, reading and extending `cache` when given.

        Raises a ValueError before any work for: a `cache` built for another model (a `QKVShareCache` whose layout
        differs, or a transformers cache with another number of layers), a non-QKVShare cache with the "+"
        variants or the linear kernel, empty or malformed `input_ids`/`inputs_embeds`, and an `attention_mask`
        whose shape does not fit (2D: (batch, cached + new tokens); 4D: (batch or 1, heads or 1, new tokens, keys)).
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        self._check_cache(cache)
        self._check_inputs(input_ids, inputs_embeds, attention_mask, cache)

        if inputs_embeds is None:
            if self.embed_tokens is None:
                raise ValueError(
                    "input_ids: this stack was built without token embeddings (add_token_embeddings=False, e.g. "
                    "inside QKVShareForImageClassification); pass inputs_embeds of shape (batch, sequence, "
                    f"{self.config.hidden_size}) instead."
                )
            inputs_embeds = self.embed_tokens(input_ids)

        if use_cache and cache is None:
            cache = QKVShareCache(config=self.config)

        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # Built before the cache is updated: the cache's current length sizes them. generate() may pass them ready.
        masks = attention_mask if isinstance(attention_mask, dict) else None
        if masks is None:
            masks = self.build_masks(inputs_embeds, attention_mask, cache, position_ids)

        hidden_states, position_inputs = self._positions(inputs_embeds, position_ids, cache)
        if self.config.position_embedding_type == "alibi":
            masks = dict(masks)
            for attention_type, inputs in position_inputs.items():
                bias = inputs.pop("alibi_bias").to(inputs_embeds.dtype)
                masks[attention_type] = add_bias_to_mask(masks[attention_type], bias)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=masks[decoder_layer.attention_type],
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **position_inputs[decoder_layer.attention_type],
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class QKVShareForCausalLM(QKVSharePreTrainedModel, GenerationMixin):
    """QKVShare language model. `generate()` uses a QKVShare cache for each usual `cache_implementation` (see
    `tied_cache_for_generation`): `QKVShareCache` by default, `QKVShareStaticCache` for "static", ...

    Other transformers caches (DynamicCache, StaticCache, ...) are exact but store K and V separately; the "+"
    variants and `attention_kernel="linear"` refuse them with a ValueError (see `QKVShareModel._check_cache`).
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: QKVShareConfig):
        super().__init__(config)
        self.model = QKVShareModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
    ) -> None:
        # transformers would build its own caches (K and V stored separately); ours store one tensor per tied layer.
        # An explicit cache, use_cache=False or a kind we have no tied form of ("paged") keep transformers' choice,
        # which the model's forward then checks.
        if model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            cache = self.tied_cache_for_generation(generation_config, max_cache_length)
            if cache is not None:
                if generation_config.is_assistant:
                    cache.activate_past_recording()
                model_kwargs["cache"] = cache
                return
        super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )

    def create_masks_for_generate(
        self,
        config: QKVShareConfig,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> dict[str, torch.Tensor | None]:
        """The masks generate() prepares ahead of each step with a static cache: the model's own, one per attention
        type (transformers' default would read `config.layer_types`, which may be None here)."""
        return self.model.build_masks(inputs_embeds, attention_mask, cache, position_ids)

    def tied_cache_for_generation(self, generation_config, max_cache_length: int) -> QKVShareCache | None:
        """The QKVShare cache `generate()` uses for `generation_config.cache_implementation`: None or "dynamic" ->
        `QKVShareCache`; "offloaded" -> the same with offloading; "static", "offloaded_static" (and transformers'
        deprecated static names) -> `QKVShareStaticCache`, sized as transformers sizes its `StaticCache` (this call's
        max length, or `max_cache_len` if larger); "quantized" -> `QKVShareQuantizedCache` with
        `generation_config.cache_config` (backend "quanto" unless given). None for other kinds ("paged")."""
        implementation = generation_config.cache_implementation
        if implementation in (None, "dynamic", "offloaded"):
            return QKVShareCache(config=self.config, offloading=implementation == "offloaded")
        if implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS:
            length = max(max_cache_length, generation_config.max_cache_len or 0)
            offloading = "offloaded" in implementation
            return QKVShareStaticCache(config=self.config, max_cache_len=length, offloading=offloading)
        if implementation == "quantized":
            options = dict(generation_config.cache_config or {})
            options.pop("config", None)  # transformers' own key for the model config: ours is self.config
            allowed = ("backend", "nbits", "axis_key", "axis_value", "q_group_size", "residual_length")
            unknown = sorted(set(options) - set(allowed))
            if unknown:
                raise ValueError(
                    f"cache_config has unknown keys {unknown} for cache_implementation='quantized'; allowed: "
                    f"{', '.join(allowed)}."
                )
            return QKVShareQuantizedCache(config=self.config, **options)
        return None

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""Causal LM forward. `labels` (B, T) give the shifted next-token loss (-100 ignored).

        Inputs are checked as in `QKVShareModel.forward` (a ValueError before any work for a cache built for another
        model, a non-QKVShare cache with "+" or the linear kernel, empty inputs, a mask that does not fit).
        """
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class QKVShareForSequenceClassification(GenericForSequenceClassification, QKVSharePreTrainedModel):
    """Sequence classification head (last non-pad token, or every token pooled by transformers' rules)."""


class QKVShareForTokenClassification(GenericForTokenClassification, QKVSharePreTrainedModel):
    """Per-token classification head; with `is_causal=False` a bidirectional encoder (the synthetic tasks)."""


def patch_sincos_2d(grid_height: int, grid_width: int, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """Fixed 2D sin-cos position embedding of a patch grid, (grid_height * grid_width, dim), row-major order.

    The first dim//2 channels encode the patch row, the others its column (the `sinusoid` of each axis), as in
    MAE (He et al. 2022) and "Better plain ViT baselines" (Beyer et al. 2022).
    """
    rows = torch.arange(grid_height, device=device).repeat_interleave(grid_width)  # (N,) 0,0,..,1,1,..
    cols = torch.arange(grid_width, device=device).repeat(grid_height)  # (N,) 0,1,..,0,1,..
    return torch.cat((sinusoid(rows, dim // 2), sinusoid(cols, dim - dim // 2)), dim=-1)


class QKVShareImageEmbeddings(nn.Module):
    """ViT's input (Dosovitskiy et al. 2021): patches through a conv with kernel = stride = patch size, a class
    token in front (`pooling="cls"`), plus position embeddings (learned 1D table or fixed 2D sin-cos).

    The class token takes no 2D position (a zero, as in MAE); the learned table has one row for it, as ViT's.
    """

    def __init__(self, config: QKVShareConfig):
        super().__init__()
        self.config = config
        self.patch_size, self.image_size = config.patch_size, config.image_size
        self.projection = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size)) if config.pooling == "cls" else None
        num_patches = (config.image_size // config.patch_size) ** 2
        num_positions = num_patches + (self.cls_token is not None)
        learned = config.patch_position_embedding_type == "learned"
        self.position_embeddings = nn.Parameter(torch.zeros(1, num_positions, config.hidden_size)) if learned else None

    def check_pixel_values(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool) -> None:
        """Refuse pixel_values the model cannot embed, with a ValueError naming the shape and the fix."""
        config, shape = self.config, tuple(pixel_values.shape)
        if len(shape) != 4 or shape[1] != config.num_channels:
            raise ValueError(
                f"pixel_values must have shape (batch, num_channels={config.num_channels}, height, width), got "
                f"{shape}; an image processor (e.g. ViTImageProcessor) saved with the model prepares them."
            )
        height, width = shape[2:]
        if height % self.patch_size or width % self.patch_size or 0 in shape:
            raise ValueError(
                f"pixel_values of shape {shape}: height and width must be positive multiples of patch_size="
                f"{self.patch_size}; resize the images (image_size={self.image_size})."
            )
        fixed = self.position_embeddings is not None and not interpolate_pos_encoding
        if fixed and (height, width) != (self.image_size, self.image_size):
            raise ValueError(
                f"pixel_values are {height}x{width} but the learned position table is for image_size="
                f"{self.image_size}; resize the images, or pass interpolate_pos_encoding=True."
            )

    def positions(self, grid_height: int, grid_width: int, device: torch.device) -> torch.Tensor:
        """(1, tokens, hidden) position embeddings for a grid_height x grid_width patch grid."""
        hidden, cls = self.config.hidden_size, self.cls_token is not None
        if self.position_embeddings is None:  # fixed 2D sin-cos: any grid
            patches = patch_sincos_2d(grid_height, grid_width, hidden, device)[None]
            return torch.cat((patches.new_zeros(1, 1, hidden), patches), dim=1) if cls else patches
        table = self.position_embeddings
        side = self.image_size // self.patch_size
        if (grid_height, grid_width) == (side, side):
            return table
        # interpolate_pos_encoding: the learned grid resized bicubically, as ViTEmbeddings does (from DINO)
        head, grid = table[:, : int(cls)], table[:, int(cls) :]
        grid = grid.reshape(1, side, side, hidden).permute(0, 3, 1, 2)  # (1, hidden, side, side)
        grid = nn.functional.interpolate(grid, size=(grid_height, grid_width), mode="bicubic", align_corners=False)
        return torch.cat((head, grid.permute(0, 2, 3, 1).reshape(1, -1, hidden)), dim=1)

    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
        """(B, C, H, W) -> (B, tokens, hidden): [cls] + one token per patch, row-major, with positions added."""
        self.check_pixel_values(pixel_values, interpolate_pos_encoding)
        patches = self.projection(pixel_values.to(self.projection.weight.dtype))  # (B, hidden, H/p, W/p)
        grid_height, grid_width = patches.shape[-2:]
        embeddings = patches.flatten(2).transpose(1, 2)  # (B, N, hidden)
        if self.cls_token is not None:
            embeddings = torch.cat((self.cls_token.expand(len(embeddings), -1, -1), embeddings), dim=1)
        return embeddings + self.positions(grid_height, grid_width, embeddings.device).to(embeddings.dtype)


class QKVShareForImageClassification(QKVSharePreTrainedModel):
    """A ViT whose blocks are `QKVShareModel`'s (every projection- and head-sharing mode, and "+"), for
    `AutoModelForImageClassification`, `pipeline("image-classification")` and `Trainer`.

    Takes `pixel_values` (B, num_channels, H, W) and `labels` like `ViTForImageClassification`; the loss is
    transformers' (cross-entropy for single-label classification). Needs `is_causal=False`: a causal stack would
    let the class token, first in the sequence, see only itself. With the block stack's sharing off, learned
    positions and `position_embedding_type="none"`, it computes exactly ViTForImageClassification (tested).
    """

    main_input_name = "pixel_values"
    input_modalities = ("image",)

    def __init__(self, config: QKVShareConfig):
        super().__init__(config)
        if config.is_causal:
            raise ValueError(
                "is_causal=True: QKVShareForImageClassification is a bidirectional encoder (a causal stack would let "
                "the class token see only itself); build the config with is_causal=False (the vit-* presets do)."
            )
        self.num_labels = config.num_labels
        self.embeddings = QKVShareImageEmbeddings(config)
        self.model = QKVShareModel(config, add_token_embeddings=False)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels) if config.num_labels > 0 else nn.Identity()
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.projection

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> ImageClassifierOutput:
        r"""Classify images. `labels` (B,) give transformers' classification loss (cross-entropy for integer labels).

        `interpolate_pos_encoding=True` resizes a learned position table to another image size (the 2D sin-cos
        embedding takes any size multiple of the patch). Bad pixel_values raise a ValueError before any work.
        """
        if pixel_values is None:
            raise ValueError("pixel_values is required: (batch, num_channels, height, width) images.")
        embeddings = self.embeddings(pixel_values, interpolate_pos_encoding=bool(interpolate_pos_encoding))
        outputs: BaseModelOutputWithPast = self.model(inputs_embeds=embeddings, use_cache=False, **kwargs)
        sequence_output = outputs.last_hidden_state  # (B, tokens, hidden)
        pooled = sequence_output[:, 0] if self.config.pooling == "cls" else sequence_output.mean(dim=1)
        logits = self.classifier(pooled)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels, logits, self.config, **kwargs)
        return ImageClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


__all__ = [
    "QKVShareAttention",
    "QKVShareDecoderLayer",
    "QKVSharePreTrainedModel",
    "QKVShareModel",
    "QKVShareForCausalLM",
    "QKVShareForSequenceClassification",
    "QKVShareForTokenClassification",
    "QKVShareForImageClassification",
]
