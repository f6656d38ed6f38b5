"""QKVShare models: Llama-style decoders (or GPT-2-style, or bidirectional encoders) whose attention layers
share projections as in "Do Transformers Need Three Projections?" (ICML 2026).

Design notes
- Each attention layer decides in `__init__` which projections exist (Llama's names, so Llama checkpoints
  load unchanged): "none" q,k,v,o; "qk" (Q=K-V) k,v,o with query = key; "kv" (Q-K=V) q,k,o with
  value = key; "qkv" (Q=K=V) k,o. A dropped projection is not created: no dead weights.
- Tied layers hand ONE tensor to `QKVShareCache` or `QKVShareStaticCache` (see cache_qkvshare.py). With RoPE the tie is either
  after rotation (`kv_tie_point="post_rope"`, V is the rotated key) or before (`"pre_rope"`, V is the key
  projection's output; the cache stores it and keys are rotated on read from the cached positions).
- The "+" 2D positional encoding of the attention map (paper section 3, m channels, a 1x1 map with weight w
  and bias b) is exactly S' = S * sum(w) + P.w + b. P[i, j] concatenates a row encoding of i and a column
  encoding of j, so P.w = row(i).w_r + col(j).w_c: we never build the (n, n, m) tensor, we scale the query
  by sum(w) and add the (B, 1, q, kv) bias to the attention mask. That works on the eager and sdpa backends,
  causal or bidirectional, for any length up to max_position_embeddings.
- RoPE cos/sin, the key positions and the "+" encodings are computed once per forward in the base model.
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
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
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

from .cache_qkvshare import CacheLayout, QKVShareCache, QKVShareStaticCache
from .configuration_qkvshare import QKVShareConfig
from .linear_attention_qkvshare import QKVShareLinearAttention

# Backends that accept an arbitrary additive float mask (needed by the "+" encoding).
_BIAS_CAPABLE_BACKENDS = ("eager", "sdpa")


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


def add_bias_to_mask(mask: torch.Tensor | None, bias: torch.Tensor) -> torch.Tensor:
    """Fold an additive score bias (B, 1, q, kv) into a (boolean or additive float) attention mask."""
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, torch.finfo(bias.dtype).min)
    return bias + mask


class AttentionMapPE(nn.Linear):
    """The "+" variants' 1x1 map from m channels of the attention-map encoding to one score (weight w, bias b)."""

    def __init__(self, dim: int):
        super().__init__(dim, 1)


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
        # What this layer is, decided once.
        self.query_is_key = self.sharing in ("qk", "qkv")  # Q=K: symmetric scores
        self.kv_tied = self.sharing in ("kv", "qkv")  # K=V: one cached tensor
        self.pre_rope_tie = (
            self.kv_tied and config.position_embedding_type == "rope" and config.kv_tie_point == "pre_rope"
        )

        hidden, bias = config.hidden_size, config.attention_bias
        if not self.query_is_key:
            self.q_proj = nn.Linear(hidden, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        if not self.kv_tied:
            self.v_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, hidden, bias=bias)
        # The "+" variants: the paper's 1x1 conv over m channels of the attention map, shared across heads.
        self.attention_map_pe = AttentionMapPE(config.attention_map_pe_dim) if config.attention_map_pe_dim else None

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

    def map_bias(self, map_encoding: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The "+" term P.w + b as a (B, 1, q, kv) score bias."""
        row, col = map_encoding
        weight, rows = self.attention_map_pe.weight[0], row.shape[-1]
        row_term = row.to(weight.dtype) @ weight[:rows]  # (B, q)
        col_term = col.to(weight.dtype) @ weight[rows:]  # (B, kv)
        return (row_term[:, :, None] + col_term[:, None, :] + self.attention_map_pe.bias)[:, None]

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
        query, key, value = self.project(hidden_states, position_embeddings)

        if cache is not None:
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
            **kwargs,
        )
        if self.attention_map_pe is not None:
            # sdpa with a float mask (the "+" bias) traced with a dynamic length records the fused CPU kernel's output
            # layout, in which (B, T, H, D) is already contiguous, so the reshape below is traced as a view; exporters
            # that decompose sdpa into math ops (torch.onnx) then get a (B, H, T, D) output and that view fails. A
            # recorded copy makes the layout explicit (eager: one (B, T, H*D) copy per "+" layer).
            attn_output = attn_output.clone(memory_format=torch.contiguous_format)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class QKVShareDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: QKVShareConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
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
    """The decoder (or encoder, with `is_causal=False`) stack without a head."""

    def __init__(self, config: QKVShareConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(
            [QKVShareDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = make_norm(config)
        self.rotary_emb = LlamaRotaryEmbedding(config=config) if config.position_embedding_type == "rope" else None
        # Decided once: what a QKVShareCache passed to forward must hold, and whether pre-RoPE tied layers need
        # cos/sin at every cached position (they rotate their cached keys on read).
        self.cache_layout = CacheLayout.for_config(config)
        self.has_pre_rope_ties = any(getattr(layer.self_attn, "pre_rope_tie", False) for layer in self.layers)
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
        if self.config.attention_map_pe_dim:
            raise ValueError(
                f"cache: attention_map_pe_dim={self.config.attention_map_pe_dim} (a '+' variant) needs the position "
                f"of every cached key, which only QKVShare caches record; a {name} does not (assuming positions "
                f"0..past-1 would be wrong for left-padded batches). To fix it, {fix}."
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
        if attention_mask is not None:
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
                "learned position table; use shorter inputs (or a sliding window)."
            )

    def _positions(
        self, inputs_embeds: torch.Tensor, position_ids: torch.LongTensor, cache: Cache | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Everything about positions, once per forward: the learned absolute embeddings (added to `inputs_embeds`),
        and for the attention layers `position_embeddings` (RoPE cos/sin of the new tokens),
        `key_position_embeddings` (RoPE of every cached + new key, for pre-RoPE tied layers, which rotate their
        cached keys on read) and `map_encoding` (row/column encodings of the "+" attention map).
        """
        hidden_states = inputs_embeds
        if self.config.position_embedding_type == "learned":
            self._check_learned_positions(position_ids, cache)
            hidden_states = hidden_states + self.embed_positions(position_ids)

        # Positions of every key this forward attends to: the cached ones (a QKVShareCache records them when the
        # model needs them) and the new ones. Foreign caches never need them: `_check_cache` refuses them for "+",
        # and with them pre-RoPE tied layers store the rotated key and the value separately.
        batch_size = inputs_embeds.shape[0]
        key_position_ids = position_ids.expand(batch_size, -1)
        if isinstance(cache, QKVShareCache):
            key_position_ids = cache.update_positions(key_position_ids)

        layer_inputs = {"position_embeddings": None, "key_position_embeddings": None, "map_encoding": None}
        if self.rotary_emb is not None:
            layer_inputs["position_embeddings"] = self.rotary_emb(hidden_states, position_ids=position_ids)
            if self.has_pre_rope_ties and isinstance(cache, QKVShareCache):
                layer_inputs["key_position_embeddings"] = self.rotary_emb(hidden_states, position_ids=key_position_ids)
        if self.config.attention_map_pe_dim:
            layer_inputs["map_encoding"] = attention_map_encoding(
                position_ids.expand(batch_size, -1),
                key_position_ids,
                self.config.attention_map_pe_dim,
                self.config.attention_map_pe_layout,
            )
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
            inputs_embeds = self.embed_tokens(input_ids)

        if use_cache and cache is None:
            cache = QKVShareCache(config=self.config)

        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # The "+" bias is folded into the mask, so the mask must be materialized (no is_causal shortcut).
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
            allow_is_causal_skip=not self.config.attention_map_pe_dim,
        )
        eager = self.config._attn_implementation == "eager"
        if eager and isinstance(causal_mask, torch.Tensor) and causal_mask.dtype == torch.bool:
            # A boolean 4D mask (True = attend) is passed through as is, and eager attention adds the mask to the
            # scores: it would add 1/0 (silently wrong logits; LlamaForCausalLM does this). Make it additive.
            zeros = causal_mask.new_zeros(causal_mask.shape, dtype=inputs_embeds.dtype)
            causal_mask = add_bias_to_mask(causal_mask, zeros)

        hidden_states, position_inputs = self._positions(inputs_embeds, position_ids, cache)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **position_inputs,
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class QKVShareForCausalLM(QKVSharePreTrainedModel, GenerationMixin):
    """QKVShare language model. `generate()` uses `QKVShareCache`, or `QKVShareStaticCache` with
    `cache_implementation="static"`, unless a cache or another cache_implementation is given.

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
        # transformers would default to DynamicCache and build a StaticCache for "static" (K and V stored
        # separately); ours store one tensor per tied layer. An explicit cache or another cache_implementation
        # ("dynamic", "offloaded", ...) keeps transformers' choice, which the model's forward then checks.
        implementation = generation_config.cache_implementation
        if model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            if implementation is None:
                model_kwargs["cache"] = QKVShareCache(config=self.config)
            elif implementation == "static":
                # Sized as transformers sizes its StaticCache: this call's max length, or max_cache_len if larger.
                length = max(max_cache_length, generation_config.max_cache_len or 0)
                model_kwargs["cache"] = QKVShareStaticCache(config=self.config, max_cache_len=length)
            if model_kwargs.get("cache") is not None:
                if generation_config.is_assistant:
                    model_kwargs["cache"].activate_past_recording()
                return
        super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )

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


__all__ = [
    "QKVShareAttention",
    "QKVShareDecoderLayer",
    "QKVSharePreTrainedModel",
    "QKVShareModel",
    "QKVShareForCausalLM",
    "QKVShareForSequenceClassification",
    "QKVShareForTokenClassification",
]
