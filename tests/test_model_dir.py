"""A model directory whose config.json no longer matches its weights is refused by every command that loads one.

The checkpoints are tiny QKV models saved with save_pretrained, then config.json edited by hand as a user might
(one layer declared Q-K=V, or fewer key/value heads). Without the check, `perplexity` printed a number computed
without layer 0's v_proj (exit 0) and the shape change ended in transformers' size-mismatch traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, LlamaModel

from qkvshare import QKVShareConfig, QKVShareForCausalLM, QKVShareForTokenClassification
from qkvshare.configuration_qkvshare import VARIANTS
from qkvshare.evaluation.tasks import FIXTURES_DIR
from qkvshare.model_dir import check_weights_fit_config, saved_shapes, weight_mismatches
from qkvshare.train.tokenizer import train_bpe_tokenizer
from qkvshare_cli import main as cli

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun."
KV_SHAPES = "(weights [64, 64], config.json [32, 64])"  # tiny: 4 heads of 16; 2 key/value heads in the edited config
EDITS = {
    "layer0_kv": (
        {"layer_projection_sharing": ["kv", "none"]},
        "1 tensor(s) in the weights are not in config.json's model: model.layers.0.self_attn.v_proj.weight.",
    ),
    "kv_heads": (
        {"num_key_value_heads": 2},
        "4 tensor(s) have another shape in config.json's model: "
        f"model.layers.{{0-1}}.self_attn.k_proj.weight {KV_SHAPES}; model.layers.{{0-1}}.self_attn.v_proj.weight "
        f"{KV_SHAPES}.",
    ),
}
FIX = "The config and the weights come from different models (config.json edited, or copied from another run)"


def _edit_config(model_dir: Path, changes: dict) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | changes, indent=2))


@pytest.fixture(scope="module")
def qkv_dir(tmp_path_factory) -> Path:
    """A saved tiny QKV causal LM with a tokenizer (so that every command would run to the end on it)."""
    tokenizer = train_bpe_tokenizer([TEXT] * 20, 300, model_max_length=128)
    config = QKVShareConfig.from_preset(
        "tiny", variant="QKV", vocab_size=len(tokenizer), max_position_embeddings=128, eos_token_id=0, bos_token_id=0
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qkv") / "model"
    QKVShareForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(params=list(EDITS))
def edited(request, qkv_dir, tmp_path) -> tuple[Path, str]:
    """(a copy of the QKV checkpoint with an edited config.json, what the message must say about its tensors)."""
    changes, says = EDITS[request.param]
    path = tmp_path / "edited"
    path.mkdir()
    for f in qkv_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    _edit_config(path, changes)
    return path, says


@pytest.mark.parametrize("command", ["perplexity", "eval", "analyze", "export", "train"])
def test_every_command_refuses_a_config_that_does_not_match_the_weights(command, edited, tmp_path, capsys):
    path, says = edited
    text = tmp_path / "text.txt"
    text.write_text(f"{TEXT}\n\n{TEXT}\n")
    out = tmp_path / "out"
    argv = {
        "perplexity": ["perplexity", str(path), "--validation_file", str(text), "--device", "cpu"],
        "eval": ["eval", str(path), "--data_dir", str(FIXTURES_DIR), "--limit", "1", "--output_dir", str(out)],
        "analyze": ["analyze", str(path)],
        "export": ["export", str(path), "--format", "onnx", "--output", str(tmp_path / "model.onnx")],
        "train": ["train", "--init_from", str(path), "--train_file", str(text), "--output_dir", str(out)],
    }[command]
    assert cli(argv + (["--max_steps", "1", "--use_cpu", "true"] if command == "train" else [])) == 2
    captured = capsys.readouterr()
    name = f"--init_from {str(path)!r}" if command == "train" else repr(str(path))
    assert f"{name}: config.json does not match the weights (model.safetensors): {says} {FIX}" in captured.err
    assert "Traceback" not in captured.err and "perplexity" not in captured.out
    assert not (tmp_path / "model.onnx").exists() and not list(out.rglob("*.json"))


def test_convert_refuses_a_llama_source_whose_config_does_not_match(tmp_path, capsys):
    source = tmp_path / "llama"
    llama = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    LlamaForCausalLM(llama).save_pretrained(source)
    _edit_config(source, {"num_key_value_heads": 2})
    assert cli(["convert", str(source), "--variant", "QKV", "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"SRC {str(source)!r}: config.json does not match the weights" in err and KV_SHAPES in err
    assert not (tmp_path / "out").exists()


def test_missing_tensors_are_named(qkv_dir, tmp_path):
    # the opposite edit: a Q-K=V checkpoint (no v_proj) whose config says QKV
    path = tmp_path / "qkev"
    QKVShareForCausalLM(QKVShareConfig.from_preset("tiny", variant="Q-K=V")).save_pretrained(path)
    _edit_config(path, {"projection_sharing": "none"})
    with pytest.raises(ValueError, match=r"2 tensor\(s\) of config.json's model are missing from the weights: "):
        check_weights_fit_config(path)
    with pytest.raises(ValueError, match=r"model\.layers\.\{0-1\}\.self_attn\.v_proj\.weight\. The config"):
        check_weights_fit_config(path)


def _variants() -> list[str]:
    return [v.replace("<g>", "2") for v in VARIANTS]


@pytest.mark.parametrize("variant", _variants())
def test_every_variant_as_saved_fits_its_config(variant, tmp_path):
    config = QKVShareConfig.from_preset("tiny", variant=variant)
    QKVShareForCausalLM(config).save_pretrained(tmp_path)
    check_weights_fit_config(tmp_path)
    assert weight_mismatches(saved_shapes(tmp_path.glob("*.safetensors")), config) == ([], [], {})


def test_what_transformers_accepts_is_accepted(tmp_path):
    """A base model's checkpoint (no `model.` prefix) with tied embeddings, an untied Llama, a classification head
    (by its architecture), and a saved copy of a recomputed buffer are all loadable, so none is refused."""
    tied = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        tie_word_embeddings=True,
    )  # fmt: skip
    LlamaModel(tied).save_pretrained(tmp_path / "base")
    check_weights_fit_config(tmp_path / "base", model_class=AutoModelForCausalLM)
    untied = LlamaForCausalLM(LlamaConfig(**(tied.to_dict() | {"tie_word_embeddings": False})))
    untied.save_pretrained(tmp_path / "untied")
    check_weights_fit_config(tmp_path / "untied", model_class=AutoModelForCausalLM)
    # ... but a base model without its untied head is not a language model: lm_head.weight is missing
    LlamaModel(untied.config).save_pretrained(tmp_path / "headless")
    with pytest.raises(ValueError, match=r"1 tensor\(s\) of config.json's model are missing .*: lm_head\.weight\."):
        check_weights_fit_config(tmp_path / "headless", model_class=AutoModelForCausalLM)
    encoder = QKVShareConfig.from_preset("tiny", variant="Q-K=V", is_causal=False, num_labels=3)
    QKVShareForTokenClassification(encoder).save_pretrained(tmp_path / "tokens")
    check_weights_fit_config(tmp_path / "tokens")  # checked as the token classifier its config.json names
    saved = saved_shapes((tmp_path / "untied").glob("*.safetensors"))
    saved["model.rotary_emb.inv_freq"] = (8,)  # older checkpoints saved the RoPE frequencies
    assert weight_mismatches(saved, untied.config, AutoModelForCausalLM) == ([], [], {})
    # other safetensors files beside model.safetensors are not the model's weights (transformers loads only it):
    # a training run's centring means, a PEFT adapter
    from safetensors.torch import save_file

    save_file({"model.layers.0.self_attn.o_proj": torch.zeros(32)}, tmp_path / "untied" / "means.safetensors")
    save_file(
        {"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 32)},
        tmp_path / "untied" / "adapter_model.safetensors",
    )
    check_weights_fit_config(tmp_path / "untied", model_class=AutoModelForCausalLM)
