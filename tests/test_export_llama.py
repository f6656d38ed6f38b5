"""`qkvshare export --format llama|gguf`: the variants that are exactly Llama become a plain `LlamaForCausalLM` with
the model's logits, and a GGUF file that transformers' GGUF reader loads with the same logits (llama.cpp itself is
checked by benchmarks/export_llama_cpp.py, not here: it builds for minutes); every other variant is refused with the
reason before its weights are read. Tiny models (hidden 32, fp32, CPU)."""

import json
import shutil
import sys
from pathlib import Path

import gguf
import pytest
import torch
from safetensors import SafetensorError
from test_core import tiny
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast

import qkvshare_cli
from qkvshare import QKVShareForCausalLM
from qkvshare.configuration_qkvshare import ARCHITECTURE_STYLES, llama_differences
from qkvshare.export import write_beside
from qkvshare.export_llama import (
    gguf_pre_tokenizer,
    gguf_problems,
    permute_for_llama_cpp,
    to_llama,
)
from qkvshare.train.tokenizer import train_bpe_tokenizer
from qkvshare_settings.export import check_output

WIDE = dict(hidden_size=32, initializer_range=0.3)  # large weights: logits far apart, greedy tokens vary
PRE = dict(kv_tie_point="pre_rope")
# Exactly Llama: Q=K, pre-RoPE K=V (GQA, MQA), pre-RoPE Q=K=V, plain GQA, a per-layer mix with biases, tied
# embeddings and another activation.
LLAMA_VARIANTS = {
    "Q=K-V": tiny("Q=K-V", **WIDE),
    "Q-K=V/pre": tiny("Q-K=V", **PRE, **WIDE),
    "Q-GQA-2/pre": tiny("Q-GQA-2", **PRE, **WIDE),
    "Q-MQA/pre": tiny("Q-MQA", **PRE, **WIDE),
    "Q=K=V/pre": tiny("Q=K=V", **PRE, **WIDE),
    "GQA-2": tiny("GQA-2", **WIDE),
    "mixed/bias/tied/gelu": tiny(
        layer_projection_sharing=["qkv", "none"],
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        hidden_act="gelu",
        **PRE,
        **WIDE,
    ),
}
# Not Llama, and the reason each is refused with.
NOT_LLAMA = {
    "Q-K=V/post": (tiny("Q-K=V", **WIDE), "kv_tie_point='post_rope' with K=V layers 0, 1 (the value is the rotated"),
    "(Q=K-V)+": (tiny("(Q=K-V)+", **WIDE), "attention_map_pe_dim=10 (the '+' map adds a score bias)"),
    "ALiBi": (tiny(position_embedding_type="alibi", **WIDE), "position_embedding_type='alibi' (a score bias by"),
    "QV-Ka": (tiny("QV-Ka", **WIDE), "key_context_dim=8 (QV-Ka: keys made from the values and a context)"),
    "GPT-2 style": (
        tiny(**ARCHITECTURE_STYLES["gpt2"], **WIDE),
        "position_embedding_type='learned' (no RoPE; Llama has RoPE); norm_type='layernorm', mlp_type='plain'",
    ),
    "linear": (
        tiny("Q=K=V", attention_kernel="linear", position_embedding_type="none", **WIDE),
        "attention_kernel='linear' (a recurrence",
    ),
    "window": (tiny(sliding_window=4, **WIDE), "sliding_window=4 in layers 0, 1 (Llama attends to every token"),
    "encoder": (tiny(is_causal=False, **WIDE), "is_causal=False (an encoder"),
}


def build(config) -> QKVShareForCausalLM:
    torch.manual_seed(0)
    return QKVShareForCausalLM._from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained here (GPT-2's scheme, as `qkvshare train` trains it), 320 tokens."""
    texts = [json.dumps(LLAMA_VARIANTS["Q-K=V/pre"].to_dict(), indent=1)] * 4
    return train_bpe_tokenizer(texts, 320, model_max_length=128)


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory, tokenizer):
    """A saved pre-RoPE Q=K=V / Q-K=V model with its tokenizer (vocabulary padded to 384, as training pads it)."""
    path = tmp_path_factory.mktemp("model") / "qkv"
    config = tiny(vocab_size=384, layer_projection_sharing=["qkv", "kv"], bos_token_id=0, eos_token_id=0, **PRE, **WIDE)
    build(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def ids(config, length: int = 7) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(LLAMA_VARIANTS))
def test_llama_variants_become_a_llama_model_with_equal_logits(name):
    config = LLAMA_VARIANTS[name]
    assert llama_differences(config) == []
    model = build(config)
    llama = to_llama(model)
    assert type(llama) is LlamaForCausalLM and llama.config.num_key_value_heads == config.num_key_value_heads
    for i in range(config.num_hidden_layers):  # every projection exists, the shared ones equal to k_proj
        attention = llama.model.layers[i].self_attn
        mode = config.layer_mode(i)
        assert torch.equal(attention.q_proj.weight, attention.k_proj.weight) == mode.query_is_key
        assert torch.equal(attention.v_proj.weight, attention.k_proj.weight) == mode.kv_tied
    tokens = ids(config)
    with torch.no_grad():
        torch.testing.assert_close(llama(tokens).logits, model(tokens).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(NOT_LLAMA))
def test_variants_that_are_not_llama_are_refused_with_the_reason(name):
    config, reason = NOT_LLAMA[name]
    problems = "; ".join(llama_differences(config))
    assert reason in problems, problems


def test_gguf_refuses_what_llama_cpp_s_llama_graph_lacks():
    assert gguf_problems(LLAMA_VARIANTS["Q-K=V/pre"]) == []
    assert gguf_problems(LLAMA_VARIANTS["mixed/bias/tied/gelu"]) == [
        "hidden_act='gelu' (llama.cpp's Llama MLP is SiLU-gated)"
    ]
    scaled = tiny(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, **WIDE)
    assert gguf_problems(scaled) == ["rope_type='linear' (this GGUF export writes plain RoPE only)"]


def test_export_llama_command_writes_a_llama_checkpoint(tied_model_dir, tmp_path, capsys, monkeypatch):
    for package in ("executorch", "onnx", "onnxruntime", "gguf"):  # a Llama checkpoint needs none of the extra
        monkeypatch.setitem(sys.modules, package, None)
    output = tmp_path / "llama"
    assert qkvshare_cli.main(["export", str(tied_model_dir), "--format", "llama", "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {output} (a LlamaForCausalLM checkpoint with its tokenizer, float32)" in out
    # a tied layer: K and V cached apart in Llama engines, one tensor here (2 layers, 4 heads of 8 channels, fp32)
    assert (
        "cache in the engines that run it: 512 bytes per token (K and V of every layer), against 256 in this mixed"
        in out
    )
    assert "greedy tokens of the written model (read by LlamaForCausalLM; prompt logits within 0.0e+00)" in out
    assert out.rstrip().endswith("(8 after a 4-token prompt): identical")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]  # no temporary folder left beside it
    config = json.loads((output / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "auto_map" not in config and not list(output.glob("*.py"))  # plain Llama: no remote code
    assert (output / "tokenizer.json").is_file() and (output / "generation_config.json").is_file()
    model = QKVShareForCausalLM.from_pretrained(tied_model_dir).eval()
    llama = LlamaForCausalLM.from_pretrained(output).eval()
    tokens = ids(model.config)
    with torch.no_grad():
        torch.testing.assert_close(llama(tokens).logits, model(tokens).logits, rtol=0, atol=1e-5)


def test_export_gguf_command_writes_llama_cpp_metadata_and_equal_weights(tied_model_dir, tokenizer, tmp_path, capsys):
    output = tmp_path / "model.gguf"
    assert qkvshare_cli.main(["export", str(tied_model_dir), "--format", "gguf", "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {output} (GGUF, architecture llama, tokenizer pre-type 'gpt-2', float32)" in out
    assert out.rstrip().endswith("(8 after a 4-token prompt): identical")
    reader = gguf.GGUFReader(output)

    def field(name):
        return reader.fields[name].contents()

    assert field("general.architecture") == "llama" and field("tokenizer.ggml.pre") == "gpt-2"
    assert (field("llama.attention.head_count"), field("llama.attention.head_count_kv")) == (4, 4)
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == 384 and tokens[:320] == tokenizer.convert_ids_to_tokens(list(range(320)))
    assert tokens[320] == "[PAD320]" and field("tokenizer.ggml.eos_token_id") == 0
    # q and k rows permuted for llama.cpp's RoPE; v stored as is, so a tied layer's v is its unpermuted k
    model = QKVShareForCausalLM.from_pretrained(tied_model_dir)
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    key = model.model.layers[0].self_attn.k_proj.weight.detach()
    assert torch.equal(tensors["blk.0.attn_v.weight"], key) and torch.equal(
        tensors["blk.0.attn_q.weight"], tensors["blk.0.attn_k.weight"]
    )
    assert torch.equal(tensors["blk.0.attn_k.weight"], permute_for_llama_cpp(key, 4))
    assert not torch.equal(tensors["blk.0.attn_k.weight"], key)
    # transformers' GGUF reader undoes llama.cpp's layout on its own: the logits are the model's
    read = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=output.name, dtype=torch.float32).eval()
    tokens = ids(model.config)
    with torch.no_grad():
        torch.testing.assert_close(read(tokens).logits, model(tokens).logits, rtol=0, atol=1e-5)


def test_gguf_pre_tokenizer_is_found_by_structure(tmp_path):
    def save(pre_tokenizer) -> str:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizer
        tokenizer.decoder = __import__("tokenizers").decoders.ByteLevel()
        PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(tmp_path)
        return gguf_pre_tokenizer(tmp_path)

    assert save(pre_tokenizers.ByteLevel(add_prefix_space=False)) == "gpt-2"
    digits = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert save(digits) == "smollm"  # SmolLM2's
    with pytest.raises(ValueError, match="pre-tokenizer .*Whitespace.* is not one this GGUF export can describe"):
        save(pre_tokenizers.Whitespace())
    with pytest.raises(ValueError, match="run llama.cpp's convert_hf_to_gguf.py on that folder"):
        save(pre_tokenizers.ByteLevel(add_prefix_space=True))  # llama.cpp's GPT-2 split adds no space


def test_export_llama_and_gguf_refuse_before_reading_weights(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr(QKVShareForCausalLM, "from_pretrained", refuse)
    post, plain = tmp_path / "post", tmp_path / "plain"
    build(NOT_LLAMA["Q-K=V/post"][0]).save_pretrained(post)
    build(LLAMA_VARIANTS["Q-K=V/pre"]).save_pretrained(plain)  # no tokenizer
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("kept")
    cases = [
        ([post, "--format", "llama"], "(Q-K=V) is not exactly a Llama model, so --format llama cannot hold it: "),
        ([post, "--format", "gguf"], "kv_tie_point='post_rope' with K=V layers 0, 1"),
        ([plain, "--format", "gguf"], "has no tokenizer.json: a GGUF file carries its tokenizer"),
        ([plain, "--format", "llama", "--output", plain], "is the model directory"),
        ([plain, "--format", "llama", "--output", tmp_path], "is the model directory"),  # a folder holding it
        ([plain, "--format", "llama", "--output", tmp_path / "taken"], "already exists and is not an empty folder"),
        ([plain, "--format", "llama", "--output", plain / "config.json"], "is one of the files of the model directory"),
        ([plain, "--format", "llama", "--max_cache_len", "16"], "--max_cache_len applies to --format executorch"),
    ]
    for argv, message in cases:
        assert qkvshare_cli.main(["export", *map(str, argv)]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "plain-llama").exists() and (tmp_path / "taken" / "x").read_text() == "kept"
    monkeypatch.chdir(plain)
    assert check_output(Path("."), "llama", None) == tmp_path / "plain-llama"  # beside the model, never inside
    assert check_output(Path("."), "gguf", None) == Path("model.gguf")
    assert json.loads((plain / "config.json").read_text())["model_type"] == "qkvshare"


def test_write_beside_moves_a_complete_output_into_place_only(tmp_path):
    target = tmp_path / "model.onnx"
    target.write_bytes(b"previous export")

    def interrupted(path):
        path.write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_beside(target, interrupted)
    assert target.read_bytes() == b"previous export" and list(tmp_path.iterdir()) == [target]

    def folder(path):
        path.mkdir()
        (path / "config.json").write_text("{}")

    write_beside(tmp_path / "llama", folder)
    assert (tmp_path / "llama" / "config.json").read_text() == "{}"
    with pytest.raises(OSError):  # a folder never replaces one that holds files
        write_beside(tmp_path / "llama", folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "model.onnx"]
    shutil.rmtree(tmp_path / "llama")


def test_an_existing_output_is_kept_unless_overwrite_and_then_replaced_only_when_complete(
    tied_model_dir, tmp_path, capsys
):
    """`export --format gguf --output EXISTING_FILE` replaced a file that was not ours, silently (rc 0)."""
    output = tmp_path / "notes.gguf"
    output.write_bytes(b"somebody's file")
    argv = ["export", str(tied_model_dir), "--format", "gguf", "--output", str(output), "--check_tokens", "0"]
    assert qkvshare_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--output {output} already exists (15 bytes); pass --overwrite to replace it" in err
    assert output.read_bytes() == b"somebody's file"
    assert qkvshare_cli.main([*argv, "--overwrite"]) == 0
    assert output.read_bytes()[:4] == b"GGUF" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.gguf"]


def test_a_full_disk_is_named_with_the_space_before_and_during_the_write(tied_model_dir, tmp_path, monkeypatch, capsys):
    """A full disk during `export --format llama` ended in a raw SafetensorError traceback."""
    import qkvshare.runtime as runtime

    output = tmp_path / "llama"
    argv = ["export", str(tied_model_dir), "--format", "llama", "--output", str(output), "--check_tokens", "0"]
    monkeypatch.setattr(runtime, "free_bytes", lambda path: 1000)  # before: refused with both sizes, nothing written
    assert qkvshare_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"the export {output} needs about " in err and "MiB free; free space there or write elsewhere" in err
    assert "Traceback" not in err and not output.exists()
    monkeypatch.undo()

    def full(*args, **kwargs):  # during: the disk fills up while safetensors writes (its error wraps the OSError)
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", full)
    assert qkvshare_cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"qkvshare export: stopped: the disk holding {output} is full (" in err and "nothing was written" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []
