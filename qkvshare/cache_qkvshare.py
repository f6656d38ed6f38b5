"""`QKVShareCache`: a transformers `Cache` that stores ONE tensor for layers whose key and value are tied.

Design notes
- Layers in mode "kv" (Q-K=V) and "qkv" (Q=K=V) get a `TiedKVLayer`, which keeps a single tensor
  `keys` of shape (B, H_kv, T, D) and returns it as both key and value. Untied layers get transformers'
  ordinary `DynamicLayer`. So the memory the paper promises (half the cache for Q-K=V) is really freed.
- With RoPE and `kv_tie_point="pre_rope"`, the stored tensor is the key projection's output before rotation
  (it is the value); the model rotates it on read. That needs the positions of the cached tokens, so the
  cache also keeps `positions` (B, T) when the config needs them (pre-RoPE ties, or the "+" attention-map
  encoding, whose column term depends on the key position). Storing positions instead of assuming 0..T-1
  keeps left-padded batches, beam search and assisted decoding exact.
- Every transformers cache operation (beam reorder, crop for assisted decoding, batch repeat/select,
  offload, reset) is implemented for both the tied layers and the positions.
- This file imports only torch/transformers (and package files with single-dot imports): `save_pretrained`
  copies it into checkpoints.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.configuration_utils import PreTrainedConfig

from .linear_attention_qkvshare import LinearAttentionStateLayer


class TiedKVLayer(DynamicLayer):
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
        if value_states is not None and value_states is not key_states:
            raise ValueError(
                "TiedKVLayer stores one tensor: pass the tied state as `key_states` and None (or the same tensor) "
                "as `value_states`."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        return self.keys, self.keys

    def offload(self) -> None:
        if self.is_initialized:
            self.keys = self.keys.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        if self.is_initialized and self.keys.device != self.device:
            self.keys = self.keys.to(self.device, non_blocking=True)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))

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


def _layer_nbytes(layer: CacheLayerMixin) -> int:
    if hasattr(layer, "nbytes"):  # layers that know their own size (the linear-attention state)
        return layer.nbytes()
    return sum(t.nbytes for t in (layer.keys, layer.values) if t is not None)


class QKVShareCache(Cache):
    """Dynamic KV cache for QKVShare models: one tensor per tied layer, key and value per untied layer.

    Args:
        config: the model's `QKVShareConfig` (decides per layer what is stored).

    State:
        layers: one cache layer per decoder layer: `TiedKVLayer` (one tensor (B, H_kv, T, D)) for modes "kv"
            and "qkv", `DynamicLayer` (keys and values, each (B, H_kv, T, D)) otherwise, and a constant-size
            `LinearAttentionStateLayer` with `attention_kernel="linear"`.
        positions: (B, T) int64 position ids of the cached tokens, kept only when `config.needs_key_positions`
            (pre-RoPE ties, "+" attention-map encoding); None otherwise.

    `generate()` and a forward with `use_cache=True` create one by default. `nbytes()` gives the bytes held.
    """

    def __init__(self, config: PreTrainedConfig, offloading: bool = False):
        layers = [self._make_layer(config, i) for i in range(config.num_hidden_layers)]
        super().__init__(layers=layers, offloading=offloading)
        self.track_positions: bool = bool(getattr(config, "needs_key_positions", False))
        self.positions: torch.Tensor | None = None

    @staticmethod
    def _make_layer(config: PreTrainedConfig, layer_idx: int) -> CacheLayerMixin:
        # attention_kernel: "linear" layers (the paper's appendix recurrence) keep a constant-size state instead.
        if config.attention_kernel == "linear":
            return LinearAttentionStateLayer()
        return TiedKVLayer() if config.is_kv_tied(layer_idx) else DynamicLayer()

    def update_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Append the position ids (B, T_new) of the tokens being added; return those of all cached tokens (B, T).

        Called once per forward by the model, before the layers update. Without position tracking it only
        returns what it was given.
        """
        if not self.track_positions:
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


__all__ = ["QKVShareCache", "TiedKVLayer"]
