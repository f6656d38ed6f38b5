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
from transformers import AutoModel
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
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_qkvshare import (
    CacheLayout,
    ForeignCache,
    QKVShareCache,
    QKVShareCacheMixin,
    QKVShareQuantizedCache,
    QKVShareStaticCache,
    Rotation,
    attended_states,
    cache_for_model,
    rotate,
)
from .configuration_qkvshare import QKVShareConfig
from .linear_attention_qkvshare import QKVShareLinearAttention
from .paged_cache_qkvshare import ContinuousBatchingMixin
from .validation_qkvshare import check_inputs, check_learned_positions

# The mask builder of each attention type (config `layer_types`).
MASK_BUILDERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


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
    whole cache to every query head in every layer and step (docs/results.md, section 9.6).
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
        # What this layer is, decided once: its projections (a shared one is not created) and, for QV-Ka, its keys.
        mode = config.layer_mode(layer_idx)
        self.query_from, self.value_from = mode.query_from, mode.value_from
        hidden, bias = config.hidden_size, config.attention_bias
        kv_width = config.num_key_value_heads * self.head_dim
        widths = {"q_proj": config.num_attention_heads * self.head_dim, "k_proj": kv_width, "v_proj": kv_width}
        if config.key_context_dim:  # QV-Ka: the keys come from a shared context and the values, not from k_proj
            self.q_proj = nn.Linear(hidden, widths["q_proj"], bias=bias)
            self.ctx_proj = nn.Linear(hidden, config.key_context_dim, bias=bias)
            self.k_mix = KeyMix(config.num_key_value_heads, config.key_context_dim, self.head_dim)
            self.v_proj = nn.Linear(hidden, widths["v_proj"], bias=bias)
            self.input_projections = ()
        else:  # the mode's own q/k/v projections; query and value are read from them (`project`)
            self.input_projections = tuple(name for name in mode.projections if name != "o_proj")
            for name in self.input_projections:
                setattr(self, name, nn.Linear(hidden, widths[name], bias=bias))
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, hidden, bias=bias)
        # The "+" variants: the paper's 1x1 conv over m channels of the attention map, shared across heads.
        self.attention_map_pe = AttentionMapPE(config.attention_map_pe_dim) if config.attention_map_pe_dim else None

    def _heads(self, projection: nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, hidden) -> (B, heads, T, D)."""
        return projection(hidden_states).view(*hidden_states.shape[:-1], -1, self.head_dim).transpose(1, 2)

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query (B, H, T, D), key and value (B, H_kv, T, D) of the new tokens, before RoPE; shared ones are the same
        tensor. QV-Ka layers return the shared context G (B, 1, T, d_ctx) as the key (their keys are `k_mix` of G and
        the values, made by the cache that stores G and V)."""
        if self.config.key_context_dim:
            context = self.ctx_proj(hidden_states).unsqueeze(1)  # (B, 1, T, d_ctx)
            return self._heads(self.q_proj, hidden_states), context, self._heads(self.v_proj, hidden_states)
        states = {name: self._heads(getattr(self, name), hidden_states) for name in self.input_projections}
        return states[self.query_from], states["k_proj"], states[self.value_from]

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
        cache: QKVShareCacheMixin | ForeignCache | None = None,
        key_position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        map_encoding: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states (B, T, hidden) -> (output (B, T, hidden), attention weights or None).

        `position_embeddings`: RoPE cos/sin of the new tokens (Llama's argument); `key_position_embeddings`: of every
        key attended, for caches that rotate cached keys on read; `map_encoding`: the "+" map's row/column encodings.
        `cache` is what `QKVShareModel` hands its layers (`cache_for_model`, or a QKVShare cache): it stores the new
        states as this layer's kind keeps them and returns every key and value to attend to.
        """
        input_shape = hidden_states.shape[:-1]
        rotation = Rotation(position_embeddings, key_position_embeddings) if position_embeddings is not None else None
        query, key, value = self.project(hidden_states)
        query = rotate(query, position_embeddings)
        make_key = self.k_mix if self.config.key_context_dim else None
        if cache is not None:
            key, value = cache.attend(self.layer_idx, key, value, rotation, make_key)  # (B, H_kv, T_keys, D)
        else:
            key, value = attended_states(self.config.kv_tie_point, key, value, rotation, make_key)

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
            )  # (B, T, H, D)
        if self.config.adds_score_bias:
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
        cache: QKVShareCacheMixin | ForeignCache | None = None,
        use_cache: bool | None = False,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """One block; `kwargs` carry the attention's per-forward inputs (`position_embeddings`, ...)."""
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
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
        # Decided once: what a QKVShare cache passed to forward must hold, and whether a QKVShare cache rotates cached
        # keys on read (pre-RoPE tied layers store the unrotated tensor; QV-Ka layers recompute their keys), which
        # needs cos/sin at every cached position.
        self.cache_layout = CacheLayout.for_config(config)
        rope = config.position_embedding_type == "rope"
        self.rotates_cached_keys = rope and (self.cache_layout.kv_tie_point == "pre_rope" or config.key_context_dim > 0)
        self.gradient_checkpointing = False
        self.post_init()

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
            # A score bias ("+", ALiBi) is folded into the mask, so it must be materialized (no is_causal shortcut).
            mask = MASK_BUILDERS[attention_type](
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
                allow_is_causal_skip=not self.config.adds_score_bias,
            )
            eager = self.config._attn_implementation == "eager"
            if eager and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
                # A boolean 4D mask (True = attend) is passed through as is, and eager attention adds the mask to the
                # scores: it would add 1/0 (silently wrong logits; LlamaForCausalLM does this). Make it additive.
                mask = add_bias_to_mask(mask, mask.new_zeros(mask.shape, dtype=inputs_embeds.dtype))
            masks[attention_type] = mask
        return masks

    def layer_inputs(
        self, hidden_states: torch.Tensor, query_positions: torch.Tensor, key_positions: dict[str, torch.Tensor]
    ) -> dict[str, dict[str, Any]]:
        """What the attention layers of each attention type take besides the mask, once per forward:
        `position_embeddings` (RoPE of the new tokens), `key_position_embeddings` (of every key, when a cache rotates
        cached keys on read) and `map_encoding` (the "+" map's row/column encodings). `query_positions` (B, T) are the new tokens', `key_positions` those of
        every key each type attends to."""
        rope = self.rotary_emb(hidden_states, position_ids=query_positions) if self.rotary_emb is not None else None
        inputs = {}
        for attention_type, keys in key_positions.items():
            keys_rope = None
            if rope is not None and self.rotates_cached_keys:  # of every key (the new ones when none are recorded)
                keys_rope = rope if keys is query_positions else self.rotary_emb(hidden_states, position_ids=keys)
            map_encoding = None
            if self.config.attention_map_pe_dim:
                map_encoding = attention_map_encoding(
                    query_positions, keys, self.config.attention_map_pe_dim, self.config.attention_map_pe_layout
                )
            inputs[attention_type] = {
                "position_embeddings": rope,
                "key_position_embeddings": keys_rope,
                "map_encoding": map_encoding,
            }
        return inputs

    def add_alibi(
        self,
        masks: dict[str, torch.Tensor | None],
        query_positions: torch.Tensor,
        key_positions: dict[str, torch.Tensor],
        dtype: torch.dtype,
    ) -> dict[str, torch.Tensor]:
        """Fold ALiBi's per-head bias (B, H, q, kv) into the mask of each attention type, once for all layers."""
        slopes = torch.tensor(alibi_slopes(self.config.num_attention_heads), device=query_positions.device)
        return {
            attention_type: add_bias_to_mask(
                mask,
                alibi_bias(query_positions, key_positions[attention_type], slopes, self.config.is_causal).to(dtype),
            )
            for attention_type, mask in masks.items()
        }

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

        Raises a ValueError before any work for: a `cache` built for another model (a QKVShare cache whose layout
        differs, or a transformers cache with another number of layers), a non-QKVShare cache with the "+"
        variants, ALiBi or the linear kernel, empty or malformed `input_ids`/`inputs_embeds`, and an `attention_mask`
        whose shape does not fit (2D: (batch, cached + new tokens); 4D: (batch or 1, heads or 1, new tokens, keys)).
        """
        types = self.cache_layout.present_attention_types
        store = cache_for_model(cache, self.config, self.cache_layout, kwargs)  # what the layers write through
        check_inputs(self.config, input_ids, inputs_embeds, attention_mask, cache, self.embed_tokens is not None, types)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = store = QKVShareCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # Built before the cache is updated: the cache's current length sizes them. generate() may pass them ready.
        masks = attention_mask if isinstance(attention_mask, dict) else None
        if masks is None:
            masks = self.build_masks(inputs_embeds, attention_mask, cache, position_ids)
        hidden_states = inputs_embeds
        if self.config.position_embedding_type == "learned":
            check_learned_positions(self.config, position_ids, cache)
            hidden_states = hidden_states + self.embed_positions(position_ids)
        # Positions of every key each attention type attends to: those the cache records (windowed for sliding
        # layers) and the new ones.
        query_positions = position_ids.expand(inputs_embeds.shape[0], -1)
        key_positions = (
            store.update_positions(query_positions) if store is not None else dict.fromkeys(types, query_positions)
        )
        if self.config.position_embedding_type == "alibi":
            masks = self.add_alibi(masks, query_positions, key_positions, inputs_embeds.dtype)
        layer_inputs = self.layer_inputs(hidden_states, query_positions, key_positions)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=masks[decoder_layer.attention_type],
                position_ids=position_ids,
                cache=store,
                use_cache=use_cache,
                **layer_inputs[decoder_layer.attention_type],
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class QKVShareForCausalLM(QKVSharePreTrainedModel, ContinuousBatchingMixin, GenerationMixin):
    """QKVShare language model. `generate()` uses a QKVShare cache for each usual `cache_implementation` (see
    `tied_cache_for_generation`): `QKVShareCache` by default, `QKVShareStaticCache` for "static", ...

    Other transformers caches (DynamicCache, StaticCache, ...) are exact but store K and V separately; the "+"
    variants and `attention_kernel="linear"` refuse them with a ValueError (see `cache_qkvshare.cache_for_model`).
    transformers' continuous batching (`generate_batch`, `init_continuous_batching`,
    `generate(cache_implementation="paged")`) runs on a `QKVSharePagedCache` (`ContinuousBatchingMixin`).
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
        # The static kinds take transformers' own route (its length rules: a later, shorter generation reuses the
        # length, so a compiled forward does not recompile) to `_prepare_static_cache` below. An explicit cache,
        # use_cache=False or a kind we have no tied form of keep transformers' choice, which the model's forward then
        # checks. ("paged" never comes here: generate() hands it to generate_batch, see `ContinuousBatchingMixin`.)
        static = generation_config.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS
        if not static and model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            cache = self.tied_cache_for_generation(generation_config, max_cache_length)
            if cache is not None:
                if generation_config.is_assistant:
                    # As transformers marks an assistant's new cache; 5.25 also passes `recurrent_states_to_keep`,
                    # which only its own linear-attention layers read (a QKVShare cache has none of them).
                    cache.activate_past_recording()
                model_kwargs["cache"] = cache
                return
        super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )

    def _prepare_static_cache(
        self,
        cache_implementation: str,
        batch_size: int,
        max_cache_len: int,
        prefill_chunk_size: int | None,
        model_kwargs,
    ) -> QKVShareStaticCache:
        """transformers' `_prepare_static_cache` with a `QKVShareStaticCache`: as long as the longest one this model
        made before (a shorter generation reuses the length, so a compiled forward sees the same shapes)."""
        length = max(max_cache_len, getattr(self, "_previous_max_cache_length", -1))
        cache = QKVShareStaticCache(
            config=self.config, max_cache_len=length, offloading="offloaded" in cache_implementation
        )
        init_shape = self._get_static_cache_init_shape() if prefill_chunk_size is not None else None
        if init_shape is not None and not self.config.key_context_dim:  # chunked prefill: allocate now, as transformers
            cache.early_initialization(batch_size, *init_shape, dtype=self.dtype, device=self.device)
        self._previous_max_cache_length = length
        return cache

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
        `generation_config.cache_config` (backend "quanto" unless given). None for other kinds."""
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


class _BaseModelFromConfig:
    """transformers' generic heads build their base model with `AutoModel.from_config(config)`, which passes no
    trust_remote_code. Where this file runs as a checkpoint's own code (the package not installed), the config's class
    is one transformers made from that code, unknown to AutoModel, so a head loaded first in a process would be
    refused as untrusted remote code. Registering the config class in use makes the lookup local."""

    def __init__(self, config: QKVShareConfig):
        AutoModel.register(type(config), QKVShareModel, exist_ok=True)
        super().__init__(config)


class QKVShareForSequenceClassification(
    _BaseModelFromConfig, GenericForSequenceClassification, QKVSharePreTrainedModel
):
    """Sequence classification head (last non-pad token, or every token pooled by transformers' rules)."""


class QKVShareForTokenClassification(_BaseModelFromConfig, GenericForTokenClassification, QKVSharePreTrainedModel):
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
