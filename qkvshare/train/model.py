"""Model construction for pretraining, the arithmetic behind MFU, and the Llama twin of a config.

Design notes
- The config comes from a preset, a paper variant and `--config_overrides`; the vocabulary follows the
  tokenizer (rounded up to a multiple of 64) unless an override fixes it, which must then hold the tokenizer.
- FLOPs per token use the PaLM appendix-B count: 6 x (non-embedding parameters + the LM head) for the matmuls
  of forward and backward, plus 12 x layers x heads x head_dim x T for attention scores and values. Shared
  projections lower the first term; the attention term is the same for every variant.
- `llama_twin_config` is the one mapping of a QKVShare config onto `LlamaConfig` (benchmarks import it).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

from qkvshare import QKVShareConfig
from qkvshare_settings.train import TrainingSetupError, config_overrides

# Dense bf16 peak TFLOP/s per device (vendor datasheets), matched against torch.cuda.get_device_name().
PEAK_TFLOPS_BF16 = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def parse_config_overrides(text: str | None) -> dict[str, Any]:
    """`'hidden_size=128,tie_word_embeddings=false'` -> `{'hidden_size': 128, 'tie_word_embeddings': False}`.

    The syntax is `qkvshare_settings.overrides.parse_overrides` (shared by every command); keys must be config fields.
    """
    overrides = config_overrides(text)
    try:
        QKVShareConfig.check_field_names(overrides, "--config_overrides")
    except ValueError as err:
        raise TrainingSetupError(str(err)) from None
    return overrides


def check_flash_attention(name: str | None) -> None:
    """A flash-attention `--attn_implementation` needs its package (`qkvshare_settings.train.check_args` checked the
    name); a `TrainingSetupError` otherwise."""
    flash = {"flash_attention_2": is_flash_attn_2_available, "flash_attention_3": is_flash_attn_3_available}
    if name in flash and not flash[name]():
        package = "flash-attn" if name == "flash_attention_2" else "flash-attn 3 (flash_attn_interface)"
        raise TrainingSetupError(
            f"--attn_implementation {name} needs the package {package} (and a CUDA GPU), which is not installed; "
            "install it or use sdpa (the default)."
        )


def build_config(preset: str, variant: str | None, overrides: dict[str, Any]) -> QKVShareConfig:
    """`QKVShareConfig.from_preset` with errors rephrased as setup errors (they name the field and the choices)."""
    try:
        return QKVShareConfig.from_preset(preset, variant=variant, **overrides)
    except (ValueError, TypeError) as err:
        raise TrainingSetupError(f"model config: {err} (check --preset, --variant and --config_overrides)") from err


def fit_vocab(config: QKVShareConfig, tokenizer_size: int, padded_size: int, vocab_overridden: bool) -> None:
    """Make the model's vocabulary hold the tokenizer; EOS/BOS/PAD ids are set by the caller."""
    if vocab_overridden:
        if config.vocab_size < tokenizer_size:
            raise TrainingSetupError(
                f"the tokenizer has {tokenizer_size} tokens but vocab_size={config.vocab_size} was set in "
                f"--config_overrides; raise it to at least {tokenizer_size} (e.g. {padded_size}) or drop the override "
                "so the vocabulary follows the tokenizer."
            )
    else:
        config.vocab_size = padded_size


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def flops_per_token(model: torch.nn.Module, config: Any, block_size: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM's formula; embeddings tables are lookups, not matmuls."""
    n = count_parameters(model)
    inner = getattr(model, "model", model)
    for name in ("embed_tokens", "embed_positions"):
        table = getattr(inner, name, None)
        if table is not None:
            n -= table.weight.numel()
    if config.tie_word_embeddings:  # the tied LM head is a matmul all the same
        n += config.vocab_size * config.hidden_size
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * block_size
    return 6 * n + attention


def peak_flops_per_device(device: torch.device, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device for MFU: the flag, else a known GPU's bf16 peak, else None (CPU: no MFU)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_TFLOPS_BF16.items():
            if key in name:
                return tflops * 1e12
    return None
