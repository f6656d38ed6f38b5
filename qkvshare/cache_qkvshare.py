"""`QKVShareCache` and `QKVShareStaticCache`: transformers caches that store ONE tensor for layers whose key and
value are tied.

Design notes
- Layers in mode "kv" (Q-K=V) and "qkv" (Q=K=V) get a `TiedKVLayer`, which keeps a single tensor
  `keys` of shape (B, H_kv, T, D) and returns it as both key and value. Untied layers get transformers'
  ordinary `DynamicLayer`. So the memory the paper promises (half the cache for Q-K=V) is really freed.
- With RoPE and `kv_tie_point="pre_rope"`, the stored tensor is the key projection's output before rotation
  (it is the value); the model rotates it on read. That needs the positions of the cached tokens, so the
  cache also keeps `positions` (B, T) when the config needs them (pre-RoPE ties, or the "+" attention-map
  encoding, whose column term depends on the key position). Storing positions instead of assuming 0..T-1
  keeps left-padded batches, beam search and assisted decoding exact.
- `QKVShareStaticCache` is the preallocated form (`generate(cache_implementation="static")` builds it): a tied
  layer gets a `TiedStaticLayer`, ONE (B, H_kv, max_cache_len, D) buffer written in place and returned as key and
  value; untied layers get transformers' `StaticLayer` (two buffers). Positions, when tracked, live in a
  (B, max_cache_len) int64 buffer written at the same slots, so pre-RoPE rotation on read and the "+" column term
  are exact; unwritten slots hold zeros (finite after rotation and in the "+" bias) and the mask, as wide as the
  buffer, hides them. `nbytes()` counts the whole buffers. For a tiny Q-K=V model (2 layers, 4 heads, D=16, fp32,
  batch 2, 16 slots) it is 16,384 bytes against 32,768 for transformers' `StaticCache`: one half.
- `attention_kernel="linear"` layers (the paper's appendix recurrence) get a `LinearAttentionStateLayer`: a
  constant-size state instead of per-token keys and values.
- Every transformers cache operation (beam reorder, crop for assisted decoding, batch repeat/select,
  offload, reset) is implemented for both the tied layers and the positions; the static cache, like transformers'
  `StaticCache`, has no batch repeat/select.
- A cache records what it was built for (`CacheLayout`: per-layer kinds, tie point, head shape, whether positions
  are tracked). The model compares it with its own layout once per forward and refuses a cache built for another
  model: a post-RoPE cache read by a pre-RoPE model would give wrong logits, other mismatches crash deep inside.
- This file imports only torch/transformers (and package files with single-dot imports): `save_pretrained`
  copies it into checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, StaticLayer
from transformers.utils import is_torchdynamo_compiling

from .configuration_qkvshare import QKVShareConfig


def _check_tied(layer: CacheLayerMixin, key_states: torch.Tensor, value_states: torch.Tensor | None) -> None:
    if value_states is not None and value_states is not key_states:
        raise ValueError(
            f"{type(layer).__name__} stores one tensor: pass the tied state as `key_states` and None (or the same "
            "tensor) as `value_states`."
        )


class OneTensorLayerMixin:
    """Moves of a layer whose only state is `keys` (the tied K/V tensor): offload, prefetch and beam reorder."""

    def offload(self) -> None:
        if self.is_initialized:
            self.keys = self.keys.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        if self.is_initialized and self.keys.device != self.device:
            self.keys = self.keys.to(self.device, non_blocking=True)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))


class TiedKVLayer(OneTensorLayerMixin, DynamicLayer):
    """Cache layer for a tied-K/V attention layer.

    State: `keys` (B, H_kv, T, D), the one cached tensor, returned as both key and value; `values` stays
    None. `update(key_states, None)` appends along T.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.device = key_states.device
        self.keys = key_states.new_empty((*key_states.shape[:-2], 0, key_states.shape[-1]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tied states (B, H_kv, T_new, D) and return the whole tensor twice (key, value)."""
        _check_tied(self, key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        return self.keys, self.keys

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove.")
        if tokens_to_remove < 0 and self.is_initialized:
            self.keys = self.keys[..., :tokens_to_remove, :]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self.keys = self.keys[indices, ...]


class TiedStaticLayer(OneTensorLayerMixin, StaticLayer):
    """Static cache layer for a tied-K/V attention layer: one preallocated buffer instead of transformers' two.

    State: `keys` (B, H_kv, max_cache_len, D), allocated (zeros) on the first update and written in place at the
    slots of the new tokens; returned as both key and value. `values` stays None. `cumulative_length` (a 0-d tensor,
    as in `StaticLayer`) counts the tokens written; slots beyond it are hidden by the mask (its key length is
    `max_cache_len`, see `StaticLayer.get_mask_sizes`).
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        # StaticLayer's own initialization would allocate a second (value) buffer: same steps, one buffer.
        self.device = key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim = self.v_head_dim = key_states.shape[-1]
        self.keys = torch.zeros(
            (self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim),
            dtype=key_states.dtype,
            device=self.device,
        )  # (B, H_kv, max_cache_len, D)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not is_torchdynamo_compiling():  # fixed addresses for cudagraphs, as StaticLayer does
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.cumulative_length)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tied states (B, H_kv, T_new, D) after the cached ones; return the whole buffer twice."""
        _check_tied(self, key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        slots = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        self.cumulative_length.add_(key_states.shape[-2])  # in place: the address stays fixed
        self.keys.index_copy_(2, slots, key_states)
        return self.keys, self.keys

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
        self.cumulative_length.zero_()


class LinearAttentionStateLayer(CacheLayerMixin):
    """Cache layer of a Q=K=V linear-attention layer: a constant-size state instead of per-token keys and values.

    State (all float32, created on the first update):
        state: (B, H, D, D), S_t = sum_s lambda^(t-s) phi(z_s) z_s^T.
        normalizer: (B, H, D), n_t = sum_s lambda^(t-s) phi(z_s); None when the attention is unnormalized.
        seen_tokens: number of tokens folded in (padding included), so `get_seq_length()` gives the position offset
            of the next token and `get_mask_sizes` the key length of the mask the model builds.

    `keys`/`values` of the base class stay None. `crop` raises (a recurrence cannot be rolled back), so assisted
    decoding is not available; `reorder_cache` (beam search), `batch_repeat_interleave` and `batch_select_indices`
    act on the batch dimension.
    """

    is_croppable = False
    supports_early_init = False

    def __init__(self, **kwargs):
        super().__init__()
        self.state: torch.Tensor | None = None
        self.normalizer: torch.Tensor | None = None
        self.seen_tokens: int = 0
        self.device: torch.device | None = None

    def lazy_initialization(self, state: torch.Tensor, normalizer: torch.Tensor | None = None) -> None:
        self.device = state.device
        self.is_initialized = True

    def get_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The current (state, normalizer), or (None, None) before the first token."""
        return self.state, self.normalizer

    def update(
        self, state: torch.Tensor, normalizer: torch.Tensor | None = None, *args, num_new_tokens: int = 0, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replace the state with the one after `num_new_tokens` more tokens; return (state, normalizer).

        Called through `Cache.update(state, normalizer, layer_idx, num_new_tokens=T)` by the attention layer, which
        computes the new state from the old one (`get_state`).
        """
        if state.dim() != 4 or state.shape[-1] != state.shape[-2]:
            raise ValueError(f"state must have shape (B, H, D, D); got {tuple(state.shape)}.")
        if not self.is_initialized:
            self.lazy_initialization(state, normalizer)
        self.state, self.normalizer = state, normalizer
        self.seen_tokens += int(num_new_tokens)
        return self.state, self.normalizer

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask: all seen tokens plus the new ones, as for a dynamic layer."""
        return self.seen_tokens + query_length, 0

    def get_seq_length(self) -> int:
        """Number of tokens folded into the state (the position of the next token)."""
        return self.seen_tokens

    def get_max_length(self) -> int:
        """-1: no maximum length (the state does not grow)."""
        return -1

    def nbytes(self) -> int:
        """Bytes held: the state plus the normalizer; independent of the number of tokens seen."""
        return sum(t.nbytes for t in (self.state, self.normalizer) if t is not None)

    def _map(self, fn) -> None:
        self.state = fn(self.state) if self.state is not None else None
        self.normalizer = fn(self.normalizer) if self.normalizer is not None else None

    def offload(self) -> None:
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.state is not None and self.state.device != self.device:
            self._map(lambda t: t.to(self.device, non_blocking=True))

    def reset(self) -> None:
        """Forget everything (state dropped, token count 0)."""
        self.state = self.normalizer = None
        self.seen_tokens = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: pick the batch rows `beam_idx` of the state."""
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        """Only `crop(0)` is possible: the recurrence folds tokens into S irreversibly (lambda may be 1)."""
        if tokens_to_remove == 0:
            return
        raise ValueError(
            f"crop({tokens_to_remove}): a linear-attention state cannot be rolled back (tokens are summed into "
            "S_t = lambda S_(t-1) + phi(z_t) z_t^T), so assisted/speculative decoding is not supported with "
            "attention_kernel='linear'. Re-run the prefix instead, or copy the cache before the tokens to discard."
        )


# The kinds of cache layer, by what they store; `CacheLayout.layer_kinds` names one per decoder layer.
LAYER_CLASSES: dict[str, type[CacheLayerMixin]] = {
    "key_value": DynamicLayer,  # untied layer: key and value, each (B, H_kv, T, D)
    "tied": TiedKVLayer,  # tied K/V: one tensor (B, H_kv, T, D)
    "linear_state": LinearAttentionStateLayer,  # attention_kernel="linear": a constant-size state
}
# The same kinds preallocated to a fixed length (`QKVShareStaticCache`); a linear-attention state has no length.
STATIC_LAYER_CLASSES: dict[str, type[StaticLayer]] = {
    "key_value": StaticLayer,  # key and value, each (B, H_kv, max_cache_len, D)
    "tied": TiedStaticLayer,  # one buffer (B, H_kv, max_cache_len, D)
}


@dataclass(frozen=True)
class CacheLayout:
    """What a `QKVShareCache` holds, decided by the model config; a cache fits a model iff their layouts are equal.

    Fields:
        layer_kinds: one key of `LAYER_CLASSES` per decoder layer.
        kv_tie_point: "post_rope" (rotated keys cached) or "pre_rope" (unrotated, rotated on read) when a tied layer
            uses RoPE; None when the tie point does not change what is stored.
        num_key_value_heads, head_dim: the per-token shape (H_kv, D) of every cached tensor.
        track_positions: whether the cache keeps the position ids of its tokens (pre-RoPE ties, "+" encoding).
    """

    layer_kinds: tuple[str, ...]
    kv_tie_point: str | None
    num_key_value_heads: int
    head_dim: int
    track_positions: bool

    @classmethod
    def for_config(cls, config: QKVShareConfig) -> CacheLayout:
        """The layout a model with this config reads and writes."""
        if config.attention_kernel == "linear":
            kinds = ("linear_state",) * config.num_hidden_layers
        else:
            kinds = tuple("tied" if config.is_kv_tied(i) else "key_value" for i in range(config.num_hidden_layers))
        rope_ties = "tied" in kinds and config.position_embedding_type == "rope"
        return cls(
            layer_kinds=kinds,
            kv_tie_point=config.kv_tie_point if rope_ties else None,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            track_positions=config.needs_key_positions,
        )

    def differences(self, other: CacheLayout) -> list[str]:
        """One `field: self vs other` line per field that differs (differing layers listed by index)."""
        found = []
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine == theirs:
                continue
            if field.name != "layer_kinds":
                found.append(f"{field.name}: {mine!r} vs {theirs!r}")
            elif len(mine) != len(theirs):
                found.append(f"number of layers: {len(mine)} vs {len(theirs)}")
            else:
                layers = [f"layer {i} {a!r} vs {b!r}" for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
                found.append("layer kinds: " + ", ".join(layers))
        return found


def _layer_nbytes(layer: CacheLayerMixin) -> int:
    if hasattr(layer, "nbytes"):  # layers that know their own size (the linear-attention state)
        return layer.nbytes()
    return sum(t.nbytes for t in (layer.keys, layer.values) if t is not None)


class QKVShareCache(Cache):
    """Dynamic KV cache for QKVShare models: one tensor per tied layer, key and value per untied layer.

    Args:
        config: the model's `QKVShareConfig` (decides per layer what is stored).
        offloading: keep layers on the CPU between uses (transformers' `Cache` option).

    State:
        layout: the `CacheLayout` the cache was built for. A model refuses a cache whose layout is not its own
            (e.g. built from another config): build it with `QKVShareCache(config=model.config)`.
        layers: one cache layer per decoder layer: `TiedKVLayer` (one tensor (B, H_kv, T, D)) for modes "kv"
            and "qkv", `DynamicLayer` (keys and values, each (B, H_kv, T, D)) otherwise, and a constant-size
            `LinearAttentionStateLayer` with `attention_kernel="linear"`.
        positions: (B, T) int64 position ids of the cached tokens, kept only when `layout.track_positions`
            (pre-RoPE ties, "+" attention-map encoding); None otherwise.

    `generate()` and a forward with `use_cache=True` create one by default. `nbytes()` gives the bytes held.
    """

    _rebuild_arguments = ""  # what `check_layout`'s message adds after `config=` to build a fitting cache

    def __init__(self, config: QKVShareConfig, offloading: bool = False):
        self.layout: CacheLayout = CacheLayout.for_config(config)
        super().__init__(layers=[self.new_layer(kind) for kind in self.layout.layer_kinds], offloading=offloading)
        self.positions: torch.Tensor | None = None

    def new_layer(self, kind: str) -> CacheLayerMixin:
        """An empty cache layer of this kind (a key of `LAYER_CLASSES`)."""
        return LAYER_CLASSES[kind]()

    def check_layout(self, expected: CacheLayout) -> None:
        """Raise a ValueError naming what differs when this cache was built for a model with another layout."""
        if self.layout == expected:
            return
        name = type(self).__name__
        raise ValueError(
            f"cache: this {name} was built for a different model (cache vs model: "
            + "; ".join(self.layout.differences(expected))
            + f"). Build it with {name}(config=model.config{self._rebuild_arguments}), or pass no cache and let the "
            "model (or generate()) create one."
        )

    def check_batch_size(self, batch_size: int) -> None:
        """Raise a ValueError when the cache already holds states of another batch size (shape metadata only)."""
        for layer in self.layers:
            held = next(
                (t for t in (getattr(layer, "keys", None), getattr(layer, "state", None)) if t is not None), None
            )
            if held is not None and held.shape[0] != batch_size:
                raise ValueError(
                    f"cache: this {type(self).__name__} holds states for a batch of {held.shape[0]}, but the input has "
                    f"a batch of {batch_size}; pass inputs of the cached batch size, or a new cache (or none) for a "
                    "new batch."
                )
            return

    def update_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Append the position ids (B, T_new) of the tokens being added; return those of all cached tokens (B, T).

        Called once per forward by the model, before the layers update. Without position tracking it only
        returns what it was given.
        """
        if not self.layout.track_positions:
            return position_ids
        position_ids = position_ids.to(torch.long)
        if self.positions is None:
            self.positions = position_ids
        else:
            self.positions = torch.cat([self.positions, position_ids.to(self.positions.device)], dim=-1)
        return self.positions

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (cached states, plus `positions` when tracked)."""
        total = sum(_layer_nbytes(layer) for layer in self.layers)
        return total + (self.positions.nbytes if self.positions is not None else 0)

    def layer_nbytes(self, layer_idx: int) -> int:
        """Bytes held by one layer's cached states."""
        return _layer_nbytes(self.layers[layer_idx])

    # ----- transformers cache operations: apply them to the positions too -----
    def reset(self) -> None:
        super().reset()
        self.positions = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.positions is not None and tokens_to_remove < 0:
            self.positions = self.positions[:, :tokens_to_remove]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.positions is not None:
            self.positions = self.positions.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.positions is not None:
            self.positions = self.positions[indices, ...]


class QKVShareStaticCache(QKVShareCache):
    """Static (preallocated) KV cache for QKVShare models: one buffer per tied layer, two per untied layer.

    Args:
        config: the model's `QKVShareConfig` (decides per layer what is stored; `attention_kernel="linear"` has no
            static form).
        max_cache_len: number of token slots preallocated per layer (prompt + new tokens).
        offloading: keep layers on the CPU between uses (transformers' `Cache` option).

    State:
        layout: the `CacheLayout` the cache was built for, the same as the dynamic `QKVShareCache`'s.
        layers: `TiedStaticLayer` (one buffer (B, H_kv, max_cache_len, D)) for modes "kv" and "qkv", transformers'
            `StaticLayer` (keys and values, each (B, H_kv, max_cache_len, D)) otherwise; allocated on first use.
        positions: (B, max_cache_len) int64 position ids written at the slots of the cached tokens, kept only when
            `layout.track_positions`; slots not yet written hold 0 and are hidden by the mask.

    `generate(cache_implementation="static")` creates one. `nbytes()` gives the bytes allocated (whole buffers).
    """

    def __init__(self, config: QKVShareConfig, max_cache_len: int, offloading: bool = False):
        if config.attention_kernel == "linear":
            raise ValueError(
                "QKVShareStaticCache: attention_kernel='linear' keeps a constant-size state, which has no static form; "
                "use QKVShareCache(config=model.config) (generate() without cache_implementation)."
            )
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(
                f"QKVShareStaticCache: max_cache_len must be a positive int (the prompt plus the new tokens), got "
                f"{max_cache_len!r}."
            )
        self.max_cache_len: int = max_cache_len
        super().__init__(config, offloading=offloading)

    @property
    def _rebuild_arguments(self) -> str:
        return f", max_cache_len={self.max_cache_len}"

    def new_layer(self, kind: str) -> StaticLayer:
        """An empty static layer of this kind (a key of `STATIC_LAYER_CLASSES`), `max_cache_len` slots long."""
        return STATIC_LAYER_CLASSES[kind](max_cache_len=self.max_cache_len)

    def update_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Write the position ids (B, T_new) of the tokens being added at their slots (right after the cached tokens);
        return the whole (B, max_cache_len) buffer. Called once per forward by the model, before the layers update.
        """
        if not self.layout.track_positions:
            return position_ids
        position_ids = position_ids.to(torch.long)
        if self.positions is None:
            self.positions = position_ids.new_zeros((position_ids.shape[0], self.max_cache_len))
        # The layers have not written this forward's tokens yet: their length is the slot of the first new one.
        slots = torch.arange(position_ids.shape[-1], device=self.positions.device) + self.get_seq_length()
        self.positions.index_copy_(1, slots, position_ids.to(self.positions.device))
        return self.positions

    def reset(self) -> None:
        Cache.reset(self)  # the buffers keep their size and address
        if self.positions is not None:
            self.positions.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        # Only the layers' lengths shrink; the next update overwrites the slots of the removed tokens and positions.
        Cache.crop(self, tokens_to_remove)


# ----- torch.export: the QKVShare caches as pytree nodes -----
# torch.export takes only pytrees of tensors as inputs and outputs; a cache passed as `cache=` (or returned in the
# output) must say how it splits into tensors and how it is rebuilt from them. The tensors are each layer's state
# (None where a layer holds nothing: an empty layer, the `values` of a tied layer) and the positions buffer; the
# context is everything else, fixed for a traced program: the layout, `max_cache_len` of a static cache and the
# token count of linear-attention states. (transformers does the same for its DynamicCache in
# transformers/integrations/executorch.py, `register_dynamic_cache_export_support`.)
_LAYER_STATE: dict[type[CacheLayerMixin], tuple[str, ...]] = {
    DynamicLayer: ("keys", "values"),
    TiedKVLayer: ("keys", "values"),
    StaticLayer: ("keys", "values", "cumulative_length"),
    TiedStaticLayer: ("keys", "values", "cumulative_length"),
    LinearAttentionStateLayer: ("state", "normalizer"),
}


def _flatten_cache(cache: QKVShareCache) -> tuple[list, tuple]:
    for layer in cache.layers:
        if type(layer) not in _LAYER_STATE:
            raise TypeError(f"{type(cache).__name__}: cannot flatten a {type(layer).__name__} layer for torch.export.")
    layers = [{name: getattr(layer, name) for name in _LAYER_STATE[type(layer)]} for layer in cache.layers]
    seen = tuple(getattr(layer, "seen_tokens", 0) for layer in cache.layers)
    return [layers, cache.positions], (cache.layout, getattr(cache, "max_cache_len", None), seen)


def _flatten_cache_with_keys(cache: QKVShareCache) -> tuple[list, tuple]:
    children, context = _flatten_cache(cache)
    keys = (torch.utils._pytree.GetAttrKey("layers"), torch.utils._pytree.GetAttrKey("positions"))
    return list(zip(keys, children)), context


def _unflatten_cache(cls: type[QKVShareCache], children: list, context: tuple) -> QKVShareCache:
    """The cache `_flatten_cache` split, rebuilt around the given tensors (no config needed: the layout says it all)."""
    layout, max_cache_len, seen = context
    layers_state, positions = children
    cache = cls.__new__(cls)  # __init__ wants a config; set the same attributes it sets
    cache.layout = layout
    if max_cache_len is not None:
        cache.max_cache_len = max_cache_len
    Cache.__init__(cache, layers=[cache.new_layer(kind) for kind in layout.layer_kinds])
    cache.positions = positions
    for layer, state, seen_tokens in zip(cache.layers, layers_state, seen):
        for name, tensor in state.items():
            setattr(layer, name, tensor)
        held = state.get("keys", state.get("state"))
        if held is None:
            continue
        # What lazy_initialization records besides the tensors.
        layer.device, layer.is_initialized = held.device, True
        if isinstance(layer, StaticLayer):
            layer.batch_size, layer.num_heads = held.shape[:2]
            layer.k_head_dim = layer.v_head_dim = held.shape[-1]
        if isinstance(layer, LinearAttentionStateLayer):
            layer.seen_tokens = seen_tokens
    return cache


def _dumpable_context(context: tuple) -> str:
    import dataclasses
    import json

    layout, max_cache_len, seen = context
    return json.dumps({"layout": dataclasses.asdict(layout), "max_cache_len": max_cache_len, "seen_tokens": list(seen)})


def _context_from_dump(dumped: str) -> tuple:
    import json

    data = json.loads(dumped)
    layout = CacheLayout(**{**data["layout"], "layer_kinds": tuple(data["layout"]["layer_kinds"])})
    return layout, data["max_cache_len"], tuple(data["seen_tokens"])


def register_cache_pytree_nodes() -> None:
    """Register `QKVShareCache` and `QKVShareStaticCache` with torch's pytree (done on import; idempotent), so
    `torch.export` accepts them as inputs (`cache=`) and outputs, and `torch.export.save` can serialize the specs."""
    for cls in (QKVShareCache, QKVShareStaticCache):
        if cls in torch.utils._pytree.SUPPORTED_NODES:
            continue
        torch.utils._pytree.register_pytree_node(
            cls,
            _flatten_cache,
            lambda children, context, cls=cls: _unflatten_cache(cls, children, context),
            serialized_type_name=f"{cls.__module__}.{cls.__name__}",
            flatten_with_keys_fn=_flatten_cache_with_keys,
            to_dumpable_context=_dumpable_context,
            from_dumpable_context=_context_from_dump,
        )


register_cache_pytree_nodes()

__all__ = [
    "QKVShareCache",
    "QKVShareStaticCache",
    "TiedKVLayer",
    "TiedStaticLayer",
    "LinearAttentionStateLayer",
    "CacheLayout",
]
