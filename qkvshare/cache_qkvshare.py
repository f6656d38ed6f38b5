"""QKVShare caches: transformers caches that store ONE tensor for layers whose key and value are tied, for every
cache kind transformers offers through `generate(cache_implementation=...)`.

Design notes
- Layers in mode "kv" (Q-K=V) and "qkv" (Q=K=V) get a tied layer, which keeps a single tensor `keys` of shape
  (B, H_kv, T, D) and returns it as both key and value (`values` stays None); untied layers get transformers' own
  layer of the same kind. So the memory the paper promises (half the cache for Q-K=V) is really freed. Each tied
  layer subclasses the transformers layer it replaces and changes only what touches the second tensor:
      kind (cache_implementation)      untied layer (transformers)   tied layer (here)
      dynamic, offloaded               DynamicLayer                  TiedKVLayer
      static, offloaded_static         StaticLayer                   TiedStaticLayer (one preallocated buffer)
      sliding window, dynamic          DynamicSlidingWindowLayer     TiedSlidingWindowLayer (one windowed tensor)
      sliding window, static           StaticSlidingWindowLayer      TiedStaticSlidingWindowLayer
      quantized, backend quanto / hqq  Quanto/HQQQuantizedLayer      TiedQuanto/TiedHQQQuantizedLayer (one quantized
                                                                     tensor plus one residual buffer)
      quantized, backend fp8           Fp8QuantizedLayer             TiedFp8QuantizedLayer
  Continuous batching's paged cache has its tied form in paged_cache_qkvshare.py (`QKVSharePagedCache`).
- With RoPE and `kv_tie_point="pre_rope"`, the stored tensor is the key projection's output before rotation
  (it is the value); the model rotates it on read. That needs the positions of the cached tokens, so the
  cache also keeps them when the config needs them (pre-RoPE ties, or the "+" attention-map encoding, whose
  column term depends on the key position). Storing positions instead of assuming 0..T-1 keeps left-padded
  batches, beam search and assisted decoding exact.
- The positions live in `position_layers`: one tied layer per attention type ("full_attention",
  "sliding_attention"), of the same class as that type's tied layers, holding the (B, 1, T, 1) int64 position ids.
  Every cache operation (window roll, static slot writes, crop, beam reorder, reset) therefore applies to the
  positions exactly as to the keys, by the same code. Quantized caches keep their positions unquantized (a
  `TiedKVLayer`).
- `QKVShareStaticCache` is the preallocated form (`cache_implementation="static"` or `"offloaded_static"`): a
  tied layer holds ONE (B, H_kv, max_cache_len, D) buffer written in place; sliding layers hold
  min(max_cache_len, sliding_window) slots. Unwritten slots hold zeros (finite after rotation and in the "+" bias)
  and the mask, as wide as the buffer, hides them. For a tiny Q-K=V model (2 layers, 4 heads, D=16, fp32, batch 2,
  16 slots) it is 16,384 bytes against 32,768 for transformers' `StaticCache`: one half.
- `QKVShareQuantizedCache` (`cache_implementation="quantized"`, transformers' KIVI-style `QuantizedCache`): a tied
  layer quantizes one tensor and keeps one residual buffer of recent full-precision tokens.
- Sliding-window layers (config `sliding_window`, `layer_types`) keep only the tokens the window can still see, as
  transformers' sliding layers do: the dynamic form at most sliding_window - 1 between forwards, the static form
  sliding_window slots.
- `attention_kernel="linear"` layers (the paper's appendix recurrence) get a `LinearAttentionStateLayer`: a
  constant-size state instead of per-token keys and values (dynamic cache only).
- QV-Ka layers (`key_context_dim`, the second source) get a `ContextValueLayer` (`ContextValueStaticLayer` in the
  static cache): the shared context G (B, 1, T, d_ctx) in `keys` and the values (B, H, T, D) in `values`; the
  attention layer recomputes its keys [G ; V_i] W_i^K from them on read (docs/design.md, section 9, has the
  measurements behind storing G and V rather than K and V).
- `nbytes()` counts every tensor the cache holds, positions included: whole buffers for static caches, packed
  data plus scales and zero-points plus the residual buffers for quantized ones; offloaded caches count all the
  layers' bytes wherever they live (CPU memory for the offloaded ones).
- A cache records what it was built for (`CacheLayout`: per-layer kinds and attention types, window, tie point,
  head shape, whether positions are tracked). The model compares it with its own layout once per forward and
  refuses a cache built for another model: a post-RoPE cache read by a pre-RoPE model would give wrong logits,
  other mismatches crash deep inside.
- This file imports only torch/transformers (and package files with single-dot imports): `save_pretrained`
  copies it into checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Protocol

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    Fp8QuantizedLayer,
    HQQQuantizedLayer,
    QuantizedCache,
    QuantoQuantizedLayer,
    StaticCache,
    StaticLayer,
    StaticSlidingWindowLayer,
)
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.models.llama.modeling_llama import rotate_half
from transformers.utils import is_hqq_available, is_optimum_quanto_available, is_torchdynamo_compiling

from .configuration_qkvshare import QKVShareConfig


class OneTensorLayerMixin:
    """What every tied layer shares (its only state is `keys`, the tied K/V tensor): the start of `update`, and
    offload, prefetch and beam reorder."""

    def _start_update(self, key_states: torch.Tensor, value_states: torch.Tensor | None) -> bool:
        """Refuse a separate value tensor and initialize the layer on its first update; True when this update did."""
        if value_states is not None and value_states is not key_states:
            raise ValueError(
                f"{type(self).__name__} stores one tensor: pass the tied state as `key_states` and None (or the same "
                "tensor) as `value_states`."
            )
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states)
        return first

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
        self._start_update(key_states, value_states)
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


class TiedSlidingWindowLayer(TiedKVLayer, DynamicSlidingWindowLayer):
    """Sliding-window cache layer for a tied-K/V attention layer: one windowed tensor instead of transformers' two.

    State: `keys` (B, H_kv, min(T, sliding_window - 1), D), the tokens the window can still see from the next one
    (all of them while `activate_past_recording` keeps them for a rollback); `cumulative_length` counts every token
    seen. `update` returns the cached tokens plus the new ones, as `DynamicSlidingWindowLayer` does; the mask
    (`get_mask_sizes`, inherited) limits each query to the last `sliding_window` of them.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        super().lazy_initialization(key_states)
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tied states (B, H_kv, T_new, D); keep the last sliding_window - 1, return cached + new."""
        self._start_update(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        full = torch.cat([self.keys, key_states], dim=-2)  # (B, H_kv, cached + T_new, D)
        if not self.record_past:
            self.keys = full[:, :, -self.sliding_window + 1 :, :]
            return full, full
        # Recording for assisted decoding: keep everything until `crop`; show only what the mask covers.
        self.keys = full
        visible = full[:, :, -(self.sliding_window - 1 + key_states.shape[-2]) :, :]
        return visible, visible

    def crop(self, tokens_to_remove: int) -> None:
        # DynamicSlidingWindowLayer.crop slices `keys` and `values` alike: run it with `values` a view of `keys`.
        self.values = self.keys
        try:
            DynamicSlidingWindowLayer.crop(self, tokens_to_remove)
        finally:
            self.values = None


class TiedStaticLayer(OneTensorLayerMixin, StaticLayer):
    """Static cache layer for a tied-K/V attention layer: one preallocated buffer instead of transformers' two.

    State: `keys` (B, H_kv, max_cache_len, D), allocated (zeros) on the first update and written in place at the
    slots of the new tokens; returned as both key and value. `values` is that same buffer (the value is the key), so
    code that reads a static layer's `values`, as transformers' does, sees the cached values without a second
    buffer. `cumulative_length` (a 0-d tensor, as in `StaticLayer`) counts the tokens written; slots beyond it are
    hidden by the mask (its key length is `max_cache_len`, see `StaticLayer.get_mask_sizes`).
    """

    @property
    def values(self) -> torch.Tensor | None:
        """The one buffer, read as the values (None before the first update)."""
        return self.keys

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None and value is not self.keys:
            raise ValueError(f"{type(self).__name__} stores one tensor: its values are its keys, not a second tensor.")

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
        self._start_update(key_states, value_states)
        slots = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        self.cumulative_length.add_(key_states.shape[-2])  # in place: the address stays fixed
        self.keys.index_copy_(2, slots, key_states)
        return self.keys, self.keys

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
        self.cumulative_length.zero_()


class TiedStaticSlidingWindowLayer(TiedStaticLayer, StaticSlidingWindowLayer):
    """Static sliding-window cache layer for a tied-K/V attention layer: one buffer of the window's length.

    State: `keys` (B, H_kv, min(max_cache_len, sliding_window), D), allocated on the first update (`max_cache_len`
    here is that window length, as in `StaticSlidingWindowLayer`); filled in place until full, then rolled left by
    one slot per decoded token. `cumulative_length_int` counts every token seen (a Python int, as in transformers:
    the branch taken depends on it). `update` follows `StaticSlidingWindowLayer.update` branch by branch with one
    tensor.
    """

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tied states (B, H_kv, T_new, D) into the window; return what the mask covers, twice."""
        self._start_update(key_states, value_states)
        new_tokens, current = key_states.shape[-2], self.cumulative_length_int
        self.cumulative_length_int += new_tokens
        if current >= self.max_cache_len:  # the window is full
            if new_tokens == 1:  # decoding: drop the oldest slot, write the new token last, in place
                rolled = self.keys.roll(-1, dims=-2)
                rolled[:, :, torch.tensor([-1], dtype=torch.long, device=self.device)] = key_states
                self.keys.copy_(rolled)
                return self.keys, self.keys
            full = torch.cat((self.keys[:, :, 1:, :], key_states), dim=-2)
        elif current + new_tokens > self.max_cache_len:  # becoming full in this update
            full = key_states if current == 0 else torch.cat((self.keys[:, :, :current, :], key_states), dim=-2)
        else:  # still room: write at the next slots (the tensor length, so cudagraphs replay it correctly)
            slots = torch.arange(new_tokens, device=self.device) + self.cumulative_length
            self.keys.index_copy_(2, slots, key_states)
            self.cumulative_length.add_(new_tokens)
            return self.keys, self.keys
        self.keys.copy_(full[:, :, -self.max_cache_len :, :])
        return full, full  # every key the new queries may see, not only the window kept

    def reset(self) -> None:
        TiedStaticLayer.reset(self)
        self.cumulative_length_int = 0


class _TiedQuantizedLayerMixin(OneTensorLayerMixin):
    """What the tied quantized layers share: one (empty) residual tensor at initialization, a token counter that
    every update advances, no batch edits."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.device = key_states.device
        self.keys = key_states.new_empty((*key_states.shape[:-2], 0, key_states.shape[-1]))  # (B, H_kv, 0, D)
        self.is_initialized = True

    def _start_update(self, key_states: torch.Tensor, value_states: torch.Tensor | None) -> bool:
        first = super()._start_update(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]  # the length of a quantized layer is this count
        return first

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError(
            f"{type(self).__name__}: a quantized cache cannot repeat its batch (requantizing would change it); use a "
            "dynamic or static cache for this generation mode."
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError(
            f"{type(self).__name__}: a quantized cache cannot select batch rows (requantizing would change it); use a "
            "dynamic or static cache for this generation mode."
        )


class TiedQuantizedLayerMixin(_TiedQuantizedLayerMixin):
    """`QuantizedLayer.update` (KIVI-style: a quantized part plus a full-precision residual of recent tokens) with
    one tensor. Mixed into transformers' backend layers (quanto, HQQ), which provide `_quantize`/`_dequantize`.

    State: `_quantized_keys`, the one quantized tensor (all tokens up to the last flush); `keys`, the one residual
    buffer (B, H_kv, r, D) with r < residual_length; `values` and `_quantized_values` stay None. As in transformers,
    the first update quantizes the whole prompt, and the residual is flushed into the quantized tensor when it
    reaches `residual_length` tokens.
    """

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new tied states (B, H_kv, T_new, D); return every token (dequantized + residual + new) twice."""
        if self._start_update(key_states, value_states):
            self._quantized_keys = self._quantize(key_states.contiguous(), axis=self.axis_key)
            return key_states, key_states
        dequantized = self._dequantize(self._quantized_keys)
        if self._pending_beam_idx is not None:  # beam reorders are applied here, after dequantization (lossless)
            dequantized = dequantized.index_select(0, self._pending_beam_idx.to(dequantized.device))
        stored = torch.cat([dequantized, self.keys, key_states], dim=-2)  # (B, H_kv, T, D)
        if self.keys.shape[-2] + key_states.shape[-2] >= self.residual_length:
            self._quantized_keys = self._quantize(stored.contiguous(), axis=self.axis_key)
            self.keys = key_states.new_empty((*key_states.shape[:-2], 0, key_states.shape[-1]))
            self._pending_beam_idx = None
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
        return stored, stored

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # As `QuantizedLayer.reorder_cache`: the quantized tensor is reordered at the next update, the residual now.
        if not self.is_initialized:
            return
        beam_idx = beam_idx.to(self.device)
        pending = self._pending_beam_idx
        self._pending_beam_idx = beam_idx.clone() if pending is None else pending.index_select(0, beam_idx)
        if self.keys.numel() > 0:
            self.keys = self.keys.index_select(0, beam_idx)


class TiedQuantoQuantizedLayer(TiedQuantizedLayerMixin, QuantoQuantizedLayer):
    """Quantized (optimum-quanto, int2/int4) cache layer for a tied-K/V attention layer: one quantized tensor."""


class TiedHQQQuantizedLayer(TiedQuantizedLayerMixin, HQQQuantizedLayer):
    """Quantized (HQQ, int1-4 and int8) cache layer for a tied-K/V attention layer: one quantized tensor. Not in the
    test suite (hqq is not a test dependency: installed, transformers imports it in every process); checked by
    `qkvshare bench --decode` (int8 cells: bytes equal theory; docs/results.md, sections 8.2 and 9)."""


class TiedFp8QuantizedLayer(_TiedQuantizedLayerMixin, Fp8QuantizedLayer):
    """FP8 (e4m3, per-tensor scale frozen at the first update) cache layer for a tied-K/V attention layer.

    State: `_quantized_keys` = (fp8 tensor (B, H_kv, T, D), scale), the one quantized tensor; `keys` is an empty
    (B, H_kv, 0, D) tensor that records the dtype states are returned in.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        super().lazy_initialization(key_states)
        self._quantized_keys = self._quantize(key_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tied states in FP8; return every token dequantized, twice."""
        if self._start_update(key_states, value_states):
            return key_states, key_states
        quantized, scale = self._quantized_keys
        new, _ = self._quantize(key_states, scale=scale)
        self._quantized_keys = (torch.cat([quantized, new], dim=-2), scale)
        stored = self._dequantize(self._quantized_keys)
        return stored, stored

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            quantized, scale = self._quantized_keys
            self._quantized_keys = (quantized.index_select(0, beam_idx.to(quantized.device)), scale)


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


class ContextValueLayer(DynamicLayer):
    """Cache layer of a QV-Ka attention layer (`key_context_dim` > 0): what its keys are computed from.

    State: `keys` holds the shared context G (B, 1, T, d_ctx) (one per layer, not per head), `values` the values
    (B, H, T, D). `update(context, values)` appends both along T and returns them whole; the attention layer
    recomputes K_i = [G ; V_i] W_i^K from them. Every `DynamicLayer` operation (crop, beam reorder, batch
    repeat/select, offload) acts on both tensors along the same axes, so it is inherited unchanged.
    """


class ContextValueStaticLayer(StaticLayer):
    """Static form of `ContextValueLayer`: G in a (B, 1, max_cache_len, d_ctx) buffer, the values in a
    (B, H, max_cache_len, D) one (transformers' `StaticLayer` would give the values G's single head)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.values = torch.zeros(
            (self.batch_size, value_states.shape[1], self.max_cache_len, self.v_head_dim),
            dtype=value_states.dtype,
            device=self.device,
        )  # (B, H, max_cache_len, D)
        if not is_torchdynamo_compiling():
            torch._dynamo.mark_static_address(self.values)


# The kinds of cache layer, by what they store; `CacheLayout.layer_kinds` names one per decoder layer.
LAYER_CLASSES: dict[str, type[CacheLayerMixin]] = {
    "key_value": DynamicLayer,  # untied layer: key and value, each (B, H_kv, T, D)
    "tied": TiedKVLayer,  # tied K/V: one tensor (B, H_kv, T, D)
    "linear_state": LinearAttentionStateLayer,  # attention_kernel="linear": a constant-size state
    "context_value": ContextValueLayer,  # QV-Ka: context G (B, 1, T, d_ctx) and values (B, H, T, D)
}
# The same kinds preallocated to a fixed length (`QKVShareStaticCache`); a linear-attention state has no length.
STATIC_LAYER_CLASSES: dict[str, type[StaticLayer]] = {
    "key_value": StaticLayer,  # key and value, each (B, H_kv, max_cache_len, D)
    "tied": TiedStaticLayer,  # one buffer (B, H_kv, max_cache_len, D)
    "context_value": ContextValueStaticLayer,  # G (B, 1, max_cache_len, d_ctx) and values (B, H, max_cache_len, D)
}
# Layers of attention type "sliding_attention" (config `sliding_window`/`layer_types`), dynamic and static.
SLIDING_LAYER_CLASSES: dict[str, type[DynamicSlidingWindowLayer]] = {
    "key_value": DynamicSlidingWindowLayer,  # key and value, each (B, H_kv, <= sliding_window - 1, D) between forwards
    "tied": TiedSlidingWindowLayer,  # one tensor (B, H_kv, <= sliding_window - 1, D)
}
STATIC_SLIDING_LAYER_CLASSES: dict[str, type[StaticSlidingWindowLayer]] = {
    "key_value": StaticSlidingWindowLayer,  # key and value, each (B, H_kv, min(max_cache_len, sliding_window), D)
    "tied": TiedStaticSlidingWindowLayer,  # one buffer (B, H_kv, min(max_cache_len, sliding_window), D)
}
# `QKVShareQuantizedCache`: backend -> layer kind -> class (transformers' `QuantizedCache` backends).
QUANTIZED_LAYER_CLASSES: dict[str, dict[str, type[DynamicLayer]]] = {
    "quanto": {"key_value": QuantoQuantizedLayer, "tied": TiedQuantoQuantizedLayer},
    "hqq": {"key_value": HQQQuantizedLayer, "tied": TiedHQQQuantizedLayer},
    "fp8": {"key_value": Fp8QuantizedLayer, "tied": TiedFp8QuantizedLayer},
}


@dataclass(frozen=True)
class CacheLayout:
    """What a `QKVShareCache` holds, decided by the model config; a cache fits a model iff their layouts are equal.

    Fields:
        layer_kinds: one key of `LAYER_CLASSES` per decoder layer.
        kv_tie_point: "post_rope" (rotated keys cached) or "pre_rope" (unrotated, rotated on read) when a tied layer
            uses RoPE; None when the tie point does not change what is stored.
        num_key_value_heads, head_dim: the per-token shape (H_kv, D) of every cached tensor.
        track_positions: whether the cache keeps the position ids of its tokens (pre-RoPE ties, "+" encoding,
            ALiBi, QV-Ka with RoPE).
        attention_types: "full_attention" or "sliding_attention" per decoder layer.
        sliding_window: the window of the sliding layers; None when no layer slides.
        key_context_dim: d_ctx of the QV-Ka context G the "context_value" layers hold (0 without them).
    """

    layer_kinds: tuple[str, ...]
    kv_tie_point: str | None
    num_key_value_heads: int
    head_dim: int
    track_positions: bool
    attention_types: tuple[str, ...]
    sliding_window: int | None
    key_context_dim: int = 0  # d_ctx of QV-Ka layers (the width of their cached context G); 0 without them

    @classmethod
    def for_config(cls, config: QKVShareConfig) -> CacheLayout:
        """The layout a model with this config reads and writes."""
        if config.attention_kernel == "linear":
            kinds = ("linear_state",) * config.num_hidden_layers
        elif config.key_context_dim:
            kinds = ("context_value",) * config.num_hidden_layers
        else:
            kinds = tuple("tied" if config.is_kv_tied(i) else "key_value" for i in range(config.num_hidden_layers))
        rope_ties = "tied" in kinds and config.position_embedding_type == "rope"
        attention_types = tuple(config.layer_attention_type(i) for i in range(config.num_hidden_layers))
        return cls(
            layer_kinds=kinds,
            kv_tie_point=config.kv_tie_point if rope_ties else None,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            track_positions=config.needs_key_positions,
            attention_types=attention_types,
            sliding_window=config.sliding_window if "sliding_attention" in attention_types else None,
            key_context_dim=config.key_context_dim,
        )

    @property
    def present_attention_types(self) -> tuple[str, ...]:
        """The attention types of the layers, each once, in layer order."""
        return tuple(dict.fromkeys(self.attention_types))

    def differences(self, other: CacheLayout) -> list[str]:
        """One `field: self vs other` line per field that differs (per-layer fields list the differing layers)."""
        found = []
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine == theirs:
                continue
            if not isinstance(mine, tuple):
                found.append(f"{field.name}: {mine!r} vs {theirs!r}")
            elif len(mine) != len(theirs):
                line = f"number of layers: {len(mine)} vs {len(theirs)}"
                found += [line] if line not in found else []
            else:
                layers = [f"layer {i} {a!r} vs {b!r}" for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
                found.append(f"{field.name.replace('_', ' ')}: " + ", ".join(layers))
        return found


def _tensor_nbytes(value: object) -> int:
    """Bytes of the storage behind a cached value: a tensor; a tensor subclass (e.g. a quanto quantized tensor) as the
    sum of its inner tensors (packed data, scales, zero-points), found through `__tensor_flatten__`; or a backend's
    container of tensors (HQQ's (tensor, metadata), FP8's (tensor, scale))."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            return sum(_tensor_nbytes(getattr(value, name)) for name in names)
        return value.nbytes
    if isinstance(value, tuple | list):
        return sum(_tensor_nbytes(item) for item in value)
    if isinstance(value, dict):
        return sum(_tensor_nbytes(item) for item in value.values())
    return 0


def cache_layer_nbytes(layer: CacheLayerMixin) -> int:
    """Bytes a cache layer holds, ours or transformers' (dynamic, static, sliding, quantized); a tensor held under two
    names (a static tied layer's keys and values) counts once."""
    if hasattr(layer, "nbytes"):  # layers that know their own size (the linear-attention state)
        return layer.nbytes()
    # Full-precision tensors (for quantized layers: the residual buffers) and, for quantized layers, quantized ones.
    held = ("keys", "values", "_quantized_keys", "_quantized_values")
    unique = {id(value): value for value in (getattr(layer, name, None) for name in held) if value is not None}
    return sum(_tensor_nbytes(value) for value in unique.values())


class Rotation(NamedTuple):
    """RoPE of one forward for the layers of one attention type (None where the model has no RoPE).

    new: cos/sin (B, T_new, D) of the new tokens' positions.
    keys: cos/sin (B, T_keys, D) of every key those layers attend to (cached + new), computed only when some layer
        rotates cached keys on read (pre-RoPE ties and QV-Ka with a QKVShare cache); None otherwise.
    """

    new: tuple[torch.Tensor, torch.Tensor]
    keys: tuple[torch.Tensor, torch.Tensor] | None = None


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """RoPE on one tensor (B, H, T, D) with cos/sin (B, T, D) (Llama's `apply_rotary_pos_emb` on one tensor); the
    identity when `rope` is None (models without RoPE)."""
    if rope is None:
        return x
    cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


KeyMaker = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def attended_states(
    kv_tie_point: str | None,
    key: torch.Tensor,
    value: torch.Tensor,
    rotation: Rotation | None,
    make_key: KeyMaker | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value attention reads for the new tokens alone, from what `QKVShareCacheMixin.attend` takes (see
    there): what a layer computes without a cache, and what a transformers cache stores (two tensors, whatever the
    layer ties). `kv_tie_point` says whether a tied value is the rotated key ("post_rope") or not ("pre_rope")."""
    rope = rotation.new if rotation is not None else None
    if make_key is not None:  # QV-Ka: the key from the context and the value
        return rotate(make_key(key, value), rope), value
    rotated = rotate(key, rope)
    if value is key and kv_tie_point != "pre_rope":  # a post-RoPE tie: the value is the rotated key
        return rotated, rotated
    return rotated, value


def attend_layer(
    kind: str,
    kv_tie_point: str | None,
    layer: CacheLayerMixin,
    key: torch.Tensor,
    value: torch.Tensor,
    rotation: Rotation | None,
    make_key: KeyMaker | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`QKVShareCacheMixin.attend` for one cache layer of this kind (a key of `LAYER_CLASSES`) under this tie point:
    what it stores and what attention reads back. Any layer with `update(key_states, value_states) -> (keys, values)` fits, so the paged
    cache of continuous batching (paged_cache_qkvshare.py) stores through the same rules."""
    if kind == "context_value":
        context, value = layer.update(key, value)  # (B, 1, T, d_ctx), (B, H, T, D)
        return rotate(make_key(context, value), rotation and rotation.keys), value
    if kind == "tied":
        if kv_tie_point == "pre_rope":  # the value is the unrotated key: store it, rotate on read
            stored, _ = layer.update(key, None)
            return rotate(stored, rotation.keys), stored
        stored, _ = layer.update(rotate(key, rotation and rotation.new), None)
        return stored, stored
    return layer.update(rotate(key, rotation and rotation.new), value)


class QKVShareCacheMixin:
    """What every QKVShare cache is, whatever its kind (dynamic, static, quantized): layers laid out by the model's
    config (`CacheLayout`), the positions of the cached tokens when the model needs them, and `attend`, the one
    method through which an attention layer stores its new states and reads every cached one.

    State:
        layout: the `CacheLayout` the cache was built for. A model refuses a cache whose layout is not its own
            (e.g. built from another config): build it with the cache class and `config=model.config`.
        layers: one cache layer per decoder layer, of the class the cache kind gives each layer kind (a tied kind
            keeps one tensor, see the module docstring).
        position_layers: attention type -> a tied layer of that type holding the (B, 1, T, 1) int64 position ids of
            the cached tokens, kept only when `layout.track_positions` (pre-RoPE ties, "+" encoding, ALiBi, QV-Ka
            with RoPE); empty otherwise. `positions` gives them as (B, T).

    The concrete classes put this first and a transformers cache class second (`QKVShareCache` is a `DynamicCache`,
    `QKVShareStaticCache` a `StaticCache`, `QKVShareQuantizedCache` a `QuantizedCache`), so `isinstance` checks that
    transformers and users make on the cache kind hold. Their layers are built here, not by those classes' own
    `__init__` (which would build K/V layers from the config).
    """

    _rebuild_arguments = ""  # what `check_layout`'s message adds after `config=` to build a fitting cache

    def __init__(self, config: QKVShareConfig, offloading: bool = False):
        if offloading and not torch.cuda.is_available():
            raise ValueError(
                f"{type(self).__name__}: offloading=True moves layers between a CUDA device and the CPU (transformers' "
                "offloading uses CUDA streams), but CUDA is not available here; use offloading=False "
                "(cache_implementation='dynamic' or 'static')."
            )
        self.layout: CacheLayout = CacheLayout.for_config(config)
        kinds, types = self.layout.layer_kinds, self.layout.attention_types
        layers = [self.new_layer(kind, attention_type) for kind, attention_type in zip(kinds, types)]
        Cache.__init__(self, layers=layers, offloading=offloading)
        self.position_layers: dict[str, CacheLayerMixin] = {}
        if self.layout.track_positions:
            self.position_layers = {t: self.new_position_layer(t) for t in self.layout.present_attention_types}

    def new_position_layer(self, attention_type: str) -> CacheLayerMixin:
        """The layer that keeps the position ids of the tokens cached by layers of this attention type: a tied layer
        of the same class as theirs, so that windowing, slot writes and every cache operation treat both alike."""
        return self.new_layer("tied", attention_type)

    @property
    def positions(self) -> torch.Tensor | None:
        """(B, T) int64 position ids of the tokens the full-attention layers hold (those of the sliding layers when
        every layer slides); None when positions are not tracked or nothing is cached yet."""
        types = self.layout.present_attention_types
        layer = self.position_layers.get("full_attention" if "full_attention" in types else types[0])
        return None if layer is None or layer.keys is None else layer.keys[:, 0, :, 0]

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
            if held is None or held.dim() < 2:  # nothing yet (a quantized layer's empty residual is 1-D)
                continue
            if held.shape[0] != batch_size:
                raise ValueError(
                    f"cache: this {type(self).__name__} holds states for a batch of {held.shape[0]}, but the input has "
                    f"a batch of {batch_size}; pass inputs of the cached batch size, or a new cache (or none) for a "
                    "new batch."
                )
            return

    def update_positions(self, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Add the position ids (B, T_new) of the tokens being added; return, per attention type, those of every key
        the layers of that type attend to in this forward (B, T_keys), in the order the layers return the keys.

        Called once per forward by the model, before the layers update. Without position tracking it returns the
        given ids for every type.
        """
        if not self.layout.track_positions:
            return dict.fromkeys(self.layout.present_attention_types, position_ids)
        ids = position_ids.to(torch.long)[:, None, :, None]  # (B, 1, T_new, 1): a one-head, one-channel state
        return {t: layer.update(ids, None)[0][:, 0, :, 0] for t, layer in self.position_layers.items()}

    def attend(
        self,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        rotation: Rotation | None,
        make_key: KeyMaker | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `layer_idx`'s new states as its layer kind keeps them; return the key and value it attends to.

        key: the key projection's output before RoPE (B, H_kv, T_new, D), or QV-Ka's context G (B, 1, T_new, d_ctx);
        value: the value (B, H_kv, T_new, D), the same tensor as `key` in a tied layer; rotation: this forward's RoPE
        for the layer's attention type; make_key: QV-Ka's key map (context, value) -> key.
        The cache decides what it keeps: a tied layer one tensor (the rotated key, or for pre-RoPE ties the unrotated
        one, rotated here on read at the cached positions), a QV-Ka layer G and V (the keys of every cached token
        are recomputed and rotated on read), any other layer the rotated key and the value.
        """
        kind, layer = self.layout.layer_kinds[layer_idx], self.layers[layer_idx]
        return attend_layer(kind, self.layout.kv_tie_point, layer, key, value, rotation, make_key)

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds: the cached states (see `layer_nbytes`) plus the positions."""
        states = sum(cache_layer_nbytes(layer) for layer in self.layers)
        return states + sum(cache_layer_nbytes(layer) for layer in self.position_layers.values())

    def layer_nbytes(self, layer_idx: int) -> int:
        """Bytes held by one layer's cached states (quantized layers: packed data, scales and zero-points, residual)."""
        return cache_layer_nbytes(self.layers[layer_idx])

    # ----- transformers cache operations: apply them to the positions too -----
    def reset(self) -> None:
        super().reset()
        for layer in self.position_layers.values():
            layer.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        for layer in self.position_layers.values():
            layer.reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        for layer in self.position_layers.values():
            layer.crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        for layer in self.position_layers.values():
            layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        for layer in self.position_layers.values():
            layer.batch_select_indices(indices)

    def activate_past_recording(self, **kwargs) -> None:
        # Follows transformers' `Cache.activate_past_recording`: since 5.25 generate() passes options
        # (`recurrent_states_to_keep`, for transformers' linear-attention layers), which go on to the layers as there;
        # 5.24 passes none.
        super().activate_past_recording(**kwargs)
        for layer in self.position_layers.values():
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording(**kwargs)

    def early_initialization(
        self,
        batch_size: int,
        num_heads: int | list[int],
        head_dim: int | list[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Allocate every layer ahead of the first update (transformers' export recipes need it), positions too.

        `num_heads` and `head_dim` give the shape of the keys and values (transformers' arguments); QV-Ka layers
        hold G of one head and d_ctx channels beside their values, so they are allocated from the layout."""
        layout = self.layout
        for kind, layer in zip(layout.layer_kinds, self.layers):
            if kind == "context_value" and not layer.is_initialized:  # skipped below: already initialized
                context = torch.zeros((batch_size, 1, 0, layout.key_context_dim), dtype=dtype, device=device)
                value = torch.zeros(
                    (batch_size, layout.num_key_value_heads, 0, layout.head_dim), dtype=dtype, device=device
                )
                layer.lazy_initialization(context, value)
        super().early_initialization(batch_size, num_heads, head_dim, dtype, device)
        for layer in self.position_layers.values():
            if not layer.is_initialized:
                layer.lazy_initialization(torch.zeros((batch_size, 1, 0, 1), dtype=torch.long, device=device))


class QKVShareCache(QKVShareCacheMixin, DynamicCache):
    """Dynamic KV cache for QKVShare models: one tensor per tied layer, key and value per untied layer.

    Args:
        config: the model's `QKVShareConfig` (decides per layer what is stored).
        offloading: keep layers in CPU memory between uses (transformers' `Cache` option, which needs CUDA);
            `generate(cache_implementation="offloaded")` sets it.

    State (see `QKVShareCacheMixin`): `layout`, `position_layers`, and `layers`: `TiedKVLayer` (one tensor
    (B, H_kv, T, D)) for modes "kv" and "qkv", `DynamicLayer` (keys and values, each (B, H_kv, T, D)) otherwise, their
    sliding-window forms (`TiedSlidingWindowLayer`, `DynamicSlidingWindowLayer`: at most sliding_window - 1 tokens
    kept) for "sliding_attention" layers, `ContextValueLayer` for QV-Ka and a constant-size
    `LinearAttentionStateLayer` with `attention_kernel="linear"`.

    `generate()` and a forward with `use_cache=True` create one by default. `nbytes()` gives the bytes held.
    """

    def new_layer(self, kind: str, attention_type: str = "full_attention") -> CacheLayerMixin:
        """An empty dynamic cache layer of this kind (a key of `LAYER_CLASSES`) and attention type."""
        if attention_type == "sliding_attention":
            return SLIDING_LAYER_CLASSES[kind](sliding_window=self.layout.sliding_window)
        return LAYER_CLASSES[kind]()


class QKVShareStaticCache(QKVShareCacheMixin, StaticCache):
    """Static (preallocated) KV cache for QKVShare models: one buffer per tied layer, two per untied layer.

    Args:
        config: the model's `QKVShareConfig` (decides per layer what is stored; `attention_kernel="linear"` has no
            static form).
        max_cache_len: number of token slots preallocated per layer (prompt + new tokens).
        offloading: keep layers in CPU memory between uses (transformers' `Cache` option, which needs CUDA);
            `generate(cache_implementation="offloaded_static")` sets it.

    State:
        layout: the `CacheLayout` the cache was built for, the same as the dynamic `QKVShareCache`'s.
        layers: `TiedStaticLayer` (one buffer (B, H_kv, max_cache_len, D)) for modes "kv" and "qkv", transformers'
            `StaticLayer` (keys and values, each (B, H_kv, max_cache_len, D)) otherwise; for "sliding_attention"
            layers `TiedStaticSlidingWindowLayer` / `StaticSlidingWindowLayer` with min(max_cache_len,
            sliding_window) slots. Allocated on first use.
        position_layers: as in `QKVShareCache`, of the static classes: (B, 1, slots, 1) int64 buffers written at the
            slots of the cached tokens; slots not yet written hold 0 and are hidden by the mask.

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

    def new_layer(self, kind: str, attention_type: str = "full_attention") -> StaticLayer:
        """An empty static layer of this kind (a key of `STATIC_LAYER_CLASSES`), `max_cache_len` slots long (a
        sliding one at most `sliding_window`)."""
        if attention_type == "sliding_attention":
            return STATIC_SLIDING_LAYER_CLASSES[kind](
                max_cache_len=self.max_cache_len, sliding_window=self.layout.sliding_window
            )
        return STATIC_LAYER_CLASSES[kind](max_cache_len=self.max_cache_len)


class QKVShareQuantizedCache(QKVShareCacheMixin, QuantizedCache):
    """Quantized KV cache for QKVShare models (transformers' KIVI-style `QuantizedCache`): one quantized tensor plus
    one residual buffer per tied layer, two of each per untied layer.

    Args:
        config: the model's `QKVShareConfig`; every layer must be a softmax, full-attention layer (as transformers'
            `QuantizedCache` requires).
        backend: "quanto" (optimum-quanto, int2/int4, runs on CPU), "hqq" (the hqq package; int1-4 and int8, runs
            on CPU) or "fp8" (float8 e4m3, one scale per tensor).
        nbits, axis_key, axis_value, q_group_size, residual_length: the group-wise options of the quanto and HQQ
            layers (None: transformers' defaults, 4 bits, axis 0, groups of 64, 128 residual tokens); fp8 takes none.

    State:
        layout: as in `QKVShareCache`.
        layers: `TiedQuantoQuantizedLayer` / `TiedHQQQuantizedLayer` / `TiedFp8QuantizedLayer` for modes "kv" and
            "qkv", transformers' layer of the backend otherwise.
        position_layers: as in `QKVShareCache`, unquantized (`TiedKVLayer`).

    `generate(cache_implementation="quantized", cache_config={"backend": ..., "nbits": ...})` creates one.
    `nbytes()` counts the packed data, scales and zero-points and the residual buffers.
    """

    def __init__(
        self,
        config: QKVShareConfig,
        backend: str = "quanto",
        nbits: int | None = None,
        axis_key: int | None = None,
        axis_value: int | None = None,
        q_group_size: int | None = None,
        residual_length: int | None = None,
    ):
        if backend not in QUANTIZED_LAYER_CLASSES:
            raise ValueError(
                f"QKVShareQuantizedCache: backend={backend!r} is not supported; allowed: "
                f"{', '.join(map(repr, QUANTIZED_LAYER_CLASSES))}."
            )
        options = dict(
            nbits=nbits,
            axis_key=axis_key,
            axis_value=axis_value,
            q_group_size=q_group_size,
            residual_length=residual_length,
        )
        given = {name: value for name, value in options.items() if value is not None}
        if backend == "fp8" and given:
            raise ValueError(
                f"QKVShareQuantizedCache: backend='fp8' quantizes per tensor and takes none of {sorted(given)}; drop "
                "them, or use backend='quanto' for group-wise options."
            )
        layout = CacheLayout.for_config(config)
        if {"linear_state", "context_value"} & set(layout.layer_kinds) or "sliding_attention" in layout.attention_types:
            raise ValueError(
                "QKVShareQuantizedCache: every layer must be a full-attention softmax layer with keys and values (as "
                "in transformers' QuantizedCache), but this config has attention_kernel='linear', QV-Ka "
                "(key_context_dim) or sliding-window layers; use "
                "QKVShareCache or QKVShareStaticCache (generate with cache_implementation='dynamic' or 'static')."
            )
        packages = {  # backend: (package, is it installed, how to install it); fp8 needs none
            "quanto": ("optimum-quanto", is_optimum_quanto_available, 'pip install "qkvshare[quantized]"'),
            # not in [quantized]: once installed, hqq is imported by every import of transformers (seconds)
            "hqq": ("hqq", is_hqq_available, "pip install hqq"),
        }
        package, installed, install = packages.get(backend, ("", None, ""))
        if installed is not None and not installed():
            raise ImportError(
                f"QKVShareQuantizedCache: backend={backend!r} needs the {package} package, which is not installed: "
                f"{install}."
            )
        self.backend: str = backend
        self.layer_options: dict[str, int] = given  # passed to every quantized layer
        super().__init__(config)

    def new_layer(self, kind: str, attention_type: str = "full_attention") -> CacheLayerMixin:
        """An empty quantized layer of this kind ("key_value" or "tied") for the cache's backend."""
        return QUANTIZED_LAYER_CLASSES[self.backend][kind](**self.layer_options)

    def new_position_layer(self, attention_type: str) -> CacheLayerMixin:
        """Positions are kept exactly: an unquantized `TiedKVLayer`."""
        return TiedKVLayer()


class CacheView(Protocol):
    """What a model's layers write through in one forward (`cache_for_model`'s answer): a QKVShare cache, a
    `ForeignCache`, or a continuous-batching forward's `PagedBatch` (paged_cache_qkvshare.py)."""

    def attend(self, layer_idx: int, *states: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def update_positions(self, position_ids: torch.Tensor) -> dict[str, torch.Tensor]: ...


class ForeignCache:
    """A transformers cache (`DynamicCache`, `StaticCache`, ...) given to a QKVShare model, behind the same `attend`
    and `update_positions` as the QKVShare caches. It stores what attention reads, two tensors per layer whatever the
    layer ties: exact, with no saving. It records no positions, so `cache_for_model` refuses it where they are needed.
    """

    def __init__(self, cache: Cache, layout: CacheLayout):
        self.cache = cache  # the user's cache, filled in place
        self.layout = layout

    def attend(self, layer_idx: int, *states: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`QKVShareCacheMixin.attend` (same arguments after `layer_idx`), storing the attended key and value of the
        new tokens."""
        return self.cache.update(*attended_states(self.layout.kv_tie_point, *states), layer_idx)

    def update_positions(self, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The new tokens' positions for every attention type: without recorded positions, that is all there is."""
        return dict.fromkeys(self.layout.present_attention_types, position_ids)


def cache_for_model(
    cache: Cache | PagedAttentionCache | None,
    config: QKVShareConfig,
    layout: CacheLayout,
    batch: Mapping[str, Any] | None = None,
) -> CacheView | None:
    """The cache a model's layers write through, from the `cache` given to its forward: a QKVShare cache itself (after
    checking it was built for this model), a transformers cache behind `ForeignCache`, this forward's `PagedBatch` of
    a `QKVSharePagedCache` (continuous batching; `batch` is the forward's other keyword arguments, which carry the
    batch's page indices), or None.

    Refuses, with a ValueError saying what to pass instead, a cache the model cannot use exactly: a QKVShare cache of
    another layout (paged or not); transformers' own `PagedAttentionCache` (K and V pages, no positions); anything
    else that is not a transformers `Cache`; any other cache with the linear kernel (its state lives only in QKVShare
    caches) or with a score bias that depends on key positions ("+", ALiBi: other caches do not record positions, and
    assuming 0..past-1 is wrong for left-padded batches); a transformers cache with another number of layers. Cheap
    Python checks: no tensor is read.
    """
    if cache is None:
        return None
    if isinstance(cache, QKVShareCacheMixin):
        cache.check_layout(layout)
        return cache
    if isinstance(cache, PagedAttentionCache):  # continuous batching (generate_batch, its manager, a server)
        # A QKVSharePagedCache (paged_cache_qkvshare.py, which builds on this module) hands out each forward's view
        # of its pages; transformers' own keeps a key and a value page for every layer and no positions.
        for_batch = getattr(cache, "for_batch", None)
        if for_batch is None:
            raise ValueError(
                f"cache: a {type(cache).__name__} keeps a key and a value page for every layer; QKVShare models run "
                "continuous batching on a QKVSharePagedCache (one page for a tied layer), which "
                "model.generate_batch(...), model.init_continuous_batching() and generate(cache_implementation='paged') "
                "create. Use those rather than transformers' ContinuousBatchingManager directly."
            )
        return for_batch(layout, batch or {})
    name = type(cache).__name__
    fix = (
        "pass no cache (forward with use_cache=True and generate() create a QKVShareCache; "
        "generate(cache_implementation='static') a QKVShareStaticCache) or cache=QKVShareCache(config=model.config)"
    )
    if not isinstance(cache, Cache):
        raise ValueError(f"cache must be a transformers Cache, got a {name}; {fix}.")
    if config.attention_kernel == "linear":
        raise ValueError(
            f"cache: attention_kernel='linear' keeps a constant-size state that only QKVShareCache holds, got a "
            f"{name}; {fix}."
        )
    if config.adds_score_bias:  # the "+" map and ALiBi score every cached key by its position
        if config.attention_map_pe_dim:
            setting, why = f"attention_map_pe_dim={config.attention_map_pe_dim} (a '+' variant)", ""
        else:
            setting, why = "position_embedding_type='alibi'", " (its bias is -slope * distance)"
        raise ValueError(
            f"cache: {setting} needs the position of every cached key{why}, which only QKVShare caches record; a "
            f"{name} does not (assuming positions 0..past-1 would be wrong for left-padded batches). To fix it, "
            f"{fix}."
        )
    expected, held = config.num_hidden_layers, len(cache.layers)
    grows = getattr(cache, "layer_class_to_replicate", None) is not None  # DynamicCache(): layers come on use
    if held != expected and not (grows and held == 0):
        raise ValueError(
            f"cache: the {name} has {held} layers but this model has {expected}: it was built or filled for "
            f"another model. Build it with {name}(config=model.config), or {fix}."
        )
    return ForeignCache(cache, layout)


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
    TiedStaticLayer: ("keys", "cumulative_length"),  # its values are its keys
    ContextValueLayer: ("keys", "values"),
    ContextValueStaticLayer: ("keys", "values", "cumulative_length"),
    LinearAttentionStateLayer: ("state", "normalizer"),
}


def _layer_state(cache: QKVShareCache, layer: CacheLayerMixin) -> dict[str, torch.Tensor | None]:
    if type(layer) not in _LAYER_STATE:
        raise TypeError(
            f"{type(cache).__name__}: cannot flatten a {type(layer).__name__} layer for torch.export (exportable: "
            f"{', '.join(cls.__name__ for cls in _LAYER_STATE)}; sliding-window and quantized layers are not)."
        )
    return {name: getattr(layer, name) for name in _LAYER_STATE[type(layer)]}


def _flatten_cache(cache: QKVShareCache) -> tuple[list, tuple]:
    layers = [_layer_state(cache, layer) for layer in cache.layers]
    positions = {kind: _layer_state(cache, layer) for kind, layer in cache.position_layers.items()}
    seen = tuple(getattr(layer, "seen_tokens", 0) for layer in cache.layers)
    return [layers, positions], (cache.layout, getattr(cache, "max_cache_len", None), seen)


def _flatten_cache_with_keys(cache: QKVShareCache) -> tuple[list, tuple]:
    children, context = _flatten_cache(cache)
    keys = (torch.utils._pytree.GetAttrKey("layers"), torch.utils._pytree.GetAttrKey("position_layers"))
    return list(zip(keys, children)), context


def _restore_layer(layer: CacheLayerMixin, state: dict[str, torch.Tensor | None], seen_tokens: int) -> None:
    for name, tensor in state.items():
        setattr(layer, name, tensor)
    held = state.get("keys", state.get("state"))
    if held is None:
        return
    # What lazy_initialization records besides the tensors.
    layer.device, layer.is_initialized = held.device, True
    if isinstance(layer, StaticLayer):
        layer.batch_size, layer.num_heads = held.shape[:2]
        layer.k_head_dim = held.shape[-1]
        values = state.get("values")
        layer.v_head_dim = (values if values is not None else held).shape[-1]
    if isinstance(layer, LinearAttentionStateLayer):
        layer.seen_tokens = seen_tokens


def _unflatten_cache(cls: type[QKVShareCache], children: list, context: tuple) -> QKVShareCache:
    """The cache `_flatten_cache` split, rebuilt around the given tensors (no config needed: the layout says it all)."""
    layout, max_cache_len, seen = context
    layers_state, positions_state = children
    cache = cls.__new__(cls)  # __init__ wants a config; set the same attributes it sets
    cache.layout = layout
    if max_cache_len is not None:
        cache.max_cache_len = max_cache_len
    kinds, types = layout.layer_kinds, layout.attention_types
    Cache.__init__(cache, layers=[cache.new_layer(kind, kind_type) for kind, kind_type in zip(kinds, types)])
    cache.position_layers = {kind: cache.new_position_layer(kind) for kind in positions_state}
    for layer, state, seen_tokens in zip(cache.layers, layers_state, seen):
        _restore_layer(layer, state, seen_tokens)
    for kind, state in positions_state.items():
        _restore_layer(cache.position_layers[kind], state, 0)
    return cache


def _dumpable_context(context: tuple) -> str:
    import dataclasses
    import json

    layout, max_cache_len, seen = context
    return json.dumps({"layout": dataclasses.asdict(layout), "max_cache_len": max_cache_len, "seen_tokens": list(seen)})


def _context_from_dump(dumped: str) -> tuple:
    import json

    data = json.loads(dumped)
    fields_ = data["layout"]
    layout = CacheLayout(
        **fields_ | {"layer_kinds": tuple(fields_["layer_kinds"]), "attention_types": tuple(fields_["attention_types"])}
    )
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
    "QKVShareCacheMixin",
    "ForeignCache",
    "Rotation",
    "cache_for_model",
    "QKVShareStaticCache",
    "cache_layer_nbytes",
    "QKVShareQuantizedCache",
    "TiedKVLayer",
    "TiedSlidingWindowLayer",
    "TiedStaticLayer",
    "TiedStaticSlidingWindowLayer",
    "TiedQuantoQuantizedLayer",
    "TiedHQQQuantizedLayer",
    "TiedFp8QuantizedLayer",
    "LinearAttentionStateLayer",
    "CacheLayout",
    "ContextValueLayer",
    "ContextValueStaticLayer",
]
