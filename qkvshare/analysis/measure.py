"""What `bench` and `bench --decode` measure with: the bytes a cache holds, a device's clock, and the parity check of
a QKVShare model against its Llama twin."""

from __future__ import annotations

import torch

from qkvshare.cache_qkvshare import cache_layer_nbytes


def held_nbytes(cache) -> int:
    """Bytes a cache holds: `nbytes()` when it has one (QKVShare caches), else the sum over its layers (keys,
    values, and a quantized layer's quantized states), counted as the QKVShare caches count theirs."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    return sum(cache_layer_nbytes(layer) for layer in cache.layers)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a clock read after it measures that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_twin_weights(llama, twin, vocab_size: int, device) -> float:
    """Load the weights of ``twin`` (QKVShare, nothing shared, no `llama_differences`) into ``llama``; return the max
    |logit difference| of the two on 16 random tokens (0 up to float rounding: the same computation)."""
    llama.load_state_dict(twin.state_dict(), strict=True)
    ids = torch.randint(0, vocab_size, (1, 16), device=device)
    with torch.inference_mode():
        return (llama(ids).logits.float() - twin(ids).logits.float()).abs().max().item()
