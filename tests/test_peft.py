"""PEFT: `LoraConfig()` with PEFT's defaults adapts exactly the attention projections each variant has, trains,
and merges back into a plain QKVShare model with the adapted model's logits. Tiny configs, fp32, CPU."""

import pytest
import torch

peft = pytest.importorskip("peft")
from peft.tuners.lora import LoraLayer  # noqa: E402

from qkvshare import QKVShareConfig, QKVShareForCausalLM  # noqa: E402

# The attention projections each variant has (the paper's Table 1), written out rather than derived.
PROJECTIONS = {
    "QKV": ("q_proj", "k_proj", "v_proj"),
    "Q=K-V": ("k_proj", "v_proj"),
    "Q-K=V": ("q_proj", "k_proj"),
    "Q=K=V": ("k_proj",),
    "QV-Ka": ("q_proj", "ctx_proj", "v_proj"),  # its per-head key maps (k_mix) are no Linear for LoRA
}
IDS = torch.tensor([[3, 17, 42, 9, 88, 5, 61, 23]])


def tiny_lm(variant: str, **overrides) -> QKVShareForCausalLM:
    torch.manual_seed(0)
    return QKVShareForCausalLM(QKVShareConfig.from_preset("tiny", variant, **overrides)).eval()


def get_lora(variant: str):
    """The tiny model wrapped with PEFT's default LoRA config (no target_modules)."""
    return peft.get_peft_model(tiny_lm(variant), peft.LoraConfig())


def adapted_modules(peft_model) -> set[str]:
    """Names (relative to the wrapped model) of the modules that carry a LoRA adapter."""
    return {
        name.removeprefix("base_model.model.")
        for name, module in peft_model.named_modules()
        if isinstance(module, LoraLayer)
    }


@pytest.mark.parametrize("variant", list(PROJECTIONS))
def test_default_lora_config_adapts_every_existing_qkv_projection(variant):
    model = get_lora(variant)
    expected = {f"model.layers.{i}.self_attn.{name}" for i in range(2) for name in PROJECTIONS[variant]}
    assert adapted_modules(model) == expected


def test_default_lora_config_on_mixed_layers_adapts_what_each_layer_has():
    model = peft.get_peft_model(tiny_lm("QKV", layer_projection_sharing=["qkv", "kv"]), peft.LoraConfig())
    assert adapted_modules(model) == {
        "model.layers.0.self_attn.k_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj",
    }


@pytest.mark.parametrize("variant", list(PROJECTIONS))
def test_lora_training_step_changes_output_and_merges_exactly(variant):
    model = get_lora(variant)
    adapted = getattr(model.base_model.model.model.layers[0].self_attn, PROJECTIONS[variant][-1])
    base_weight = adapted.base_layer.weight.detach().clone()
    with torch.no_grad():
        before = model(IDS).logits
    # LoRA starts as the identity (B = 0): the wrapped model gives the base model's logits.
    torch.testing.assert_close(before, tiny_lm(variant)(IDS).logits)

    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    loss = model(IDS, labels=IDS).loss
    loss.backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        after = model(IDS).logits
    assert (after - before).abs().max() > 1e-4  # the adapters changed the output
    torch.testing.assert_close(adapted.base_layer.weight, base_weight)  # only the adapters train

    merged = model.merge_and_unload()
    assert type(merged) is QKVShareForCausalLM
    assert not any(isinstance(module, LoraLayer) for module in merged.modules())
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, after, rtol=1e-5, atol=1e-5)
