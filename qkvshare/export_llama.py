"""Checkpoints other engines run: a QKVShare model whose attention is exactly Llama's, written as a plain Llama
checkpoint (`qkvshare export --format llama`) or as a GGUF file for llama.cpp (`--format gguf`).

Design notes
- Which variants are exactly Llama, layer by layer (`SharingMode`): a layer whose query is its key (Q=K: no q_proj,
  one key/value head per head) is Llama with q_proj = k_proj, since both are rotated by the same RoPE; a K=V layer
  tied before RoPE (`kv_tie_point="pre_rope"`: the value is the key projection's unrotated output) is Llama with
  v_proj = k_proj, GQA/MQA included; Q=K=V pre-RoPE is both; QKV, GQA and MQA are Llama as they are. Per-layer mixes
  of these are Llama too. The rest of the block must be Llama's: RMSNorm, gated MLP, RoPE, causal softmax attention
  over every token, hidden_size a multiple of the heads (LlamaConfig checks it). Biases are Llama's
  (`attention_bias` on q/k/v/o, `mlp_bias`), as are tied embeddings and any activation (LlamaMLP looks it up).
- Not Llama, refused by `llama_differences` (configuration_qkvshare.py) with the reason, before any weight is read: a post-RoPE K=V tie (the value
  is the rotated key; Llama's values are never rotated), the "+" map and ALiBi (score biases Llama lacks), QV-Ka
  (keys made from the values and a context), learned or no positions, LayerNorm or the plain MLP (GPT-2 style), the
  linear kernel, a sliding window (Mistral's config could hold one; not written here), an encoder (is_causal=False).
  Q=K with grouped key/value heads cannot occur: the config refuses it (Llama's q_proj has one head per query head).
- The shared projections are written as copies of k_proj (`llama_state_dict`), so these engines hold K and V for
  every layer: the checkpoint runs there, but without the one-tensor cache (README, "Serving").
- GGUF is written with the `gguf` package (ggml-org's writer, which llama.cpp's convert_hf_to_gguf.py uses), with
  that script's Llama conventions (its `LlamaModel`): tensor names from gguf's tensor map, the q_proj/k_proj rows
  permuted from transformers' rotate-half RoPE layout to llama.cpp's adjacent pairs (`permute_for_llama_cpp`), 1-D
  tensors in F32, `output.weight` left out when the embeddings are tied. llama.cpp's Llama graph has SiLU and plain
  RoPE, so GGUF also refuses another activation or a RoPE scaling.
- The GGUF tokenizer comes from tokenizer.json. llama.cpp picks its pre-tokenizer by a name; convert_hf_to_gguf.py
  finds that name from a hash of a known tokenizer's output on a test text, which a tokenizer trained here never
  matches. `gguf_pre_tokenizer` finds it from the pre-tokenizer's structure instead, for the byte-level BPE forms
  whose llama.cpp regexes equal transformers' (`LLAMA_CPP_PRE_TOKENIZERS`: GPT-2's, which `qkvshare train`
  trains, and SmolLM's). Other tokenizers: `--format llama`, then convert_hf_to_gguf.py on that folder.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from .configuration_qkvshare import QKVShareConfig, llama_differences, llama_twin_config

# The byte-level BPE pre-tokenizers (tokenizer.json, step by step) whose llama.cpp counterpart splits text with the
# same regexes (llama.cpp src/llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_GPT2, LLAMA_VOCAB_PRE_TYPE_SMOLLM), by the name
# GGUF's `tokenizer.ggml.pre` gives them.
LLAMA_CPP_PRE_TOKENIZERS = {
    ("ByteLevel",): "gpt-2",
    ("Digits(individual)", "ByteLevel"): "smollm",
}
GGUF_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def gguf_problems(config: QKVShareConfig) -> list[str]:
    """What llama.cpp's Llama graph cannot run, beyond `llama_differences`: it has SiLU and plain RoPE only."""
    problems = []
    if config.hidden_act != "silu":
        problems.append(f"hidden_act={config.hidden_act!r} (llama.cpp's Llama MLP is SiLU-gated)")
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":
        problems.append(f"rope_type={rope_type!r} (this GGUF export writes plain RoPE only)")
    return problems


def _listed(layers: list[int]) -> str:
    return ", ".join(map(str, layers))


def check_llama_export(config: QKVShareConfig, model_dir: str | Path, format: str) -> str | None:
    """A `ValueError` naming every reason the model in `model_dir` cannot be written as `format` ("llama" or
    "gguf"); for gguf, returns llama.cpp's pre-tokenizer name of its tokenizer (`gguf_pre_tokenizer`)."""
    problems = llama_differences(config) + (gguf_problems(config) if format == "gguf" else [])
    if problems:
        raise ValueError(
            f"{model_dir} ({config.variant}) is not exactly a Llama model, so --format {format} cannot hold it: "
            + "; ".join(problems)
            + ". Exactly Llama are Q=K (q_proj = k_proj), pre-RoPE K=V (v_proj = k_proj; GQA, MQA too), pre-RoPE "
            "Q=K=V, QKV/GQA/MQA and per-layer mixes of them, with Llama's block; --format executorch or onnx "
            "exports the other softmax variants."
        )
    return gguf_pre_tokenizer(Path(model_dir)) if format == "gguf" else None


def gguf_pre_tokenizer(model_dir: Path) -> str:
    """llama.cpp's name (`tokenizer.ggml.pre`) of the pre-tokenizer in `model_dir`'s tokenizer.json; a `ValueError`
    saying why the tokenizer cannot go into a GGUF file otherwise."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"{model_dir} has no tokenizer.json: a GGUF file carries its tokenizer, and llama.cpp cannot run without "
            "one. Save the model's tokenizer in that directory (tokenizer.save_pretrained(MODEL_DIR)), or use "
            "--format llama (its tokenizer is optional)."
        )
    data = json.loads(path.read_text(encoding="utf-8"))
    model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    shape = tuple(_pre_tokenizer_step(step) for step in steps)
    name = LLAMA_CPP_PRE_TOKENIZERS.get(shape)
    byte_level = model.get("type") == "BPE" and (data.get("decoder") or {}).get("type") == "ByteLevel"
    plain = not model.get("byte_fallback") and not model.get("ignore_merges") and data.get("normalizer") is None
    if name is None or not byte_level or not plain:
        known = "; ".join(f"{' then '.join(s)} ({n!r})" for s, n in LLAMA_CPP_PRE_TOKENIZERS.items())
        raise ValueError(
            f"{path}: a {model.get('type')} tokenizer with pre-tokenizer {' then '.join(shape) or 'none'} is not one "
            f"this GGUF export can describe to llama.cpp (byte-level BPE without normalizer or byte fallback, "
            f"pre-tokenizer {known}). Export --format llama and run llama.cpp's convert_hf_to_gguf.py on that "
            "folder: it recognizes published tokenizers."
        )
    return name


def _pre_tokenizer_step(step: dict[str, Any]) -> str:
    """One step of a tokenizer.json pre-tokenizer, as `LLAMA_CPP_PRE_TOKENIZERS` names it (GPT-2's byte-level
    split, or digits one by one); anything else by its type and settings."""
    kind = step.get("type", "none")
    if kind == "ByteLevel" and step.get("use_regex", True) and not step.get("add_prefix_space"):
        return "ByteLevel"
    if kind == "Digits" and step.get("individual_digits"):
        return "Digits(individual)"
    return json.dumps(step, sort_keys=True)


# ----------------------------------------------------------------------------- the Llama checkpoint
def to_llama_config(config: QKVShareConfig, dtype: torch.dtype) -> LlamaConfig:
    """The `LlamaConfig` of the same model (`config` has no `llama_differences`): the shape's Llama twin, with the
    init scale, dropout, architecture name and dtype a saved checkpoint carries."""
    return llama_twin_config(
        config,
        initializer_range=config.initializer_range,
        attention_dropout=config.attention_dropout,
        architectures=["LlamaForCausalLM"],
        dtype=dtype,
    )


def llama_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under Llama's names, with the projections a layer shares filled in as copies (weight and
    bias) of the one it takes them from (`SharingMode.query_from`, `value_from`): q_proj = k_proj where the query is
    the key, v_proj = k_proj where the value is the (pre-RoPE) key."""
    config = model.config
    state = dict(model.state_dict())
    for i in range(config.num_hidden_layers):
        mode, prefix = config.layer_mode(i), f"model.layers.{i}.self_attn."
        for name, source in (("q_proj", mode.query_from), ("v_proj", mode.value_from)):
            for kind in ("weight", "bias") if config.attention_bias else ("weight",):
                if source != name:  # sources are projections the layer has, never a filled-in copy
                    state[f"{prefix}{name}.{kind}"] = state[f"{prefix}{source}.{kind}"].clone()
    return state


def to_llama(model: torch.nn.Module, dtype: torch.dtype | None = None) -> LlamaForCausalLM:
    """A `LlamaForCausalLM` with the same weights (in `dtype`, default the model's) as a QKVShare causal LM that
    is exactly Llama (see the module docstring): its logits equal the model's."""
    from transformers.initialization import no_init_weights

    dtype = dtype or model.dtype
    with no_init_weights():  # every weight is loaded below
        llama = LlamaForCausalLM(to_llama_config(model.config, dtype))
    llama.load_state_dict(llama_state_dict(model), strict=True)
    return llama.to(dtype).eval()


def save_llama(llama: LlamaForCausalLM, model_dir: Path, output: Path, tokenizer: Any = None) -> None:
    """Write `llama` as a model directory at `output` (safetensors, config, generation config of `model_dir` when it
    has one, the tokenizer when given)."""
    if (model_dir / "generation_config.json").is_file():
        llama.generation_config = GenerationConfig.from_pretrained(str(model_dir))
    llama.save_pretrained(output, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(output)


# ----------------------------------------------------------------------------- GGUF
def permute_for_llama_cpp(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q_proj/k_proj rows (weight or bias) from transformers' RoPE layout, which rotates channel j with j + D/2 of
    each head, to llama.cpp's, which rotates channels 2j and 2j + 1 (convert_hf_to_gguf.py `LlamaModel.permute`)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tokens(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """Token strings and GGUF token types for ids 0..vocab_size-1 (convert_hf_to_gguf.py `get_vocab_base`): the
    tokenizer's tokens (its added special tokens CONTROL, other added ones USER_DEFINED) and "[PAD<id>]" UNUSED for
    the ids the model's padded vocabulary has beyond the tokenizer's."""
    import gguf

    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if decoder[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def write_gguf(llama: LlamaForCausalLM, tokenizer: Any, tokenizer_dir: Path, pre_tokenizer: str, path: Path) -> None:
    """Write `llama` (its weights in float32, float16 or bfloat16) with its tokenizer as a GGUF file llama.cpp runs
    (architecture "llama"; hyperparameters as convert_hf_to_gguf.py writes them). `tokenizer_dir` holds the
    tokenizer's files (merges, special tokens, chat template: gguf's `SpecialVocab` reads them)."""
    import gguf

    config, dtype = llama.config, llama.dtype
    arch = gguf.MODEL_ARCH.LLAMA
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16}
    file_type["BF16"] = gguf.LlamaFileType.MOSTLY_BF16
    writer.add_name(path.stem)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(file_type[GGUF_TYPES[dtype]])
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(pre_tokenizer)
    tokens, types = gguf_tokens(tokenizer, config.vocab_size)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=config.vocab_size).add_to_gguf(writer, quiet=True)

    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in _gguf_tensors(llama):
        kind = gguf.GGMLQuantizationType[GGUF_TYPES[dtype] if tensor.dim() > 1 else "F32"]  # 1-D: F32
        data = gguf.quants.quantize(tensor.float().numpy(), kind)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_tensors(llama: LlamaForCausalLM) -> Iterable[tuple[str, torch.Tensor]]:
    """(transformers name, tensor) of what the GGUF file holds: the lm_head only when not tied to the embeddings,
    q_proj and k_proj permuted for llama.cpp's RoPE."""
    config = llama.config
    for name, tensor in llama.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp reads the embeddings as the output when output.weight is absent
        if ".q_proj." in name:
            tensor = permute_for_llama_cpp(tensor, config.num_attention_heads)
        elif ".k_proj." in name:
            tensor = permute_for_llama_cpp(tensor, config.num_key_value_heads)
        yield name, tensor
