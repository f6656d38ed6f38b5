"""Checks of a QKVShare model's forward inputs: each raises a ValueError naming the input, what is wrong and how to
fix it, before any work. `QKVShareModel.forward` calls `check_inputs` once, first.

Design notes
- Cheap Python checks on shapes and metadata: no tensor is read on the host, except the largest position of a learned
  position table in eager mode (under torch.compile/export only what the host knows is checked, so a decode step
  still traces to one graph).
- The cache itself is checked where caches live (`cache_qkvshare.cache_for_model`, `CacheLayout`); config fields where
  the config is built (`configuration_qkvshare`).
- This file imports only torch/transformers and package files with single-dot imports: `save_pretrained` copies it
  into checkpoints.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.utils import is_torchdynamo_compiling

from .cache_qkvshare import QKVShareCacheMixin
from .configuration_qkvshare import QKVShareConfig

# Backends that accept an arbitrary additive float mask (needed by the "+" encoding and ALiBi).
BIAS_CAPABLE_BACKENDS = ("eager", "sdpa", "paged|eager")  # "paged|eager": eager under continuous batching


def check_inputs(
    config: QKVShareConfig,
    input_ids: torch.LongTensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | dict | None,
    cache: Cache | None,
    has_token_embeddings: bool,
    attention_types: tuple[str, ...],
) -> None:
    """Refuse malformed inputs: exactly one of input_ids/inputs_embeds, of the right shape and not empty; a backend
    that can take the score bias; a cache filled for another batch size; an attention mask that does not fit."""
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if input_ids is not None and not has_token_embeddings:
        raise ValueError(
            "input_ids: this stack was built without token embeddings (add_token_embeddings=False, e.g. "
            "inside QKVShareForImageClassification); pass inputs_embeds of shape (batch, sequence, "
            f"{config.hidden_size}) instead."
        )
    check_backend(config)
    if input_ids is not None:
        name, shape, expected = "input_ids", tuple(input_ids.shape), "(batch, sequence)"
        well_formed = len(shape) == 2
    else:
        name, shape = "inputs_embeds", tuple(inputs_embeds.shape)
        expected = f"(batch, sequence, {config.hidden_size})"
        well_formed = len(shape) == 3 and shape[-1] == config.hidden_size
    if not well_formed:
        raise ValueError(f"{name} must have shape {expected}, got {shape}.")
    if 0 in shape[:2]:
        raise ValueError(
            f"{name} has shape {shape}: no tokens to run; pass at least one sequence of at least one token."
        )
    if isinstance(cache, QKVShareCacheMixin):  # a cache filled for another batch would fail deep inside torch
        cache.check_batch_size(shape[0])
    if isinstance(attention_mask, dict):  # masks per attention type, as `build_masks` (or generate()) makes them
        if set(attention_mask) != set(attention_types):
            raise ValueError(
                f"attention_mask is a dict with keys {sorted(attention_mask)}, but this model's layers need masks "
                f"for {sorted(attention_types)}; pass a 2D padding mask, or the dict that "
                "model.model.build_masks(...) returns."
            )
    elif attention_mask is not None and not isinstance(cache, PagedAttentionCache):
        # (continuous batching's masks are its own, sized by the batch's page indices; the paged cache checks those)
        check_attention_mask(attention_mask, name, shape, cache)


def check_backend(config: QKVShareConfig) -> None:
    """A score bias ("+", ALiBi) is added to a float mask, which only the eager and sdpa backends take."""
    implementation = config._attn_implementation
    if not config.adds_score_bias or implementation in BIAS_CAPABLE_BACKENDS:
        return
    if config.attention_map_pe_dim:
        what = f"attention_map_pe_dim={config.attention_map_pe_dim} (the '+' variants) adds a score bias"
    else:
        what = "position_embedding_type='alibi' adds a per-head score bias"
    raise ValueError(
        f"{what}, which the {implementation!r} attention backend cannot take; load the model with "
        "attn_implementation='sdpa' or 'eager'."
    )


def check_attention_mask(attention_mask: torch.Tensor, name: str, shape: tuple[int, ...], cache: Cache | None) -> None:
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


def check_learned_positions(config: QKVShareConfig, position_ids: torch.LongTensor, cache: Cache | None) -> None:
    """Refuse positions beyond the learned position table (the embedding lookup would fail or read garbage).

    Eager: the largest position is read back. Under torch.compile / torch.export that read would be a host sync
    (a graph break, or an export error), so only what the host knows is checked: a static cache's slots bound
    the positions of the tokens written into it, so `max_cache_len` must fit the table.
    """
    limit = config.max_position_embeddings
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
