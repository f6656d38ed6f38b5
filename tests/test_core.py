"""Core library: Llama parity, exact cached decoding for every mode, cache bytes, parameter counts, symmetry,
hub-style save/load, backends, and config validation. Tiny configs, fp32, CPU."""

import contextlib
import copy
import json
from unittest import mock

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.models.llama.modeling_llama import eager_attention_forward, repeat_kv

from qkvshare import QKVShareCache, QKVShareConfig, QKVShareForCausalLM, TiedKVLayer, modeling_qkvshare
from qkvshare.configuration_qkvshare import ARCHITECTURE_STYLES

VOCAB = 128


def tiny(variant: str = "QKV", **overrides) -> QKVShareConfig:
    return QKVShareConfig.from_preset("tiny", variant, **overrides)


def model_for(config: QKVShareConfig, attn: str = "sdpa") -> QKVShareForCausalLM:
    torch.manual_seed(0)
    return QKVShareForCausalLM._from_config(copy.deepcopy(config), attn_implementation=attn).eval()


# Every sharing mode and combination the issue lists: modes x head sharing x "+" x tie points x position types,
# and per-layer mixes.
COMBOS = {
    "QKV": tiny("QKV"),
    "Q=K-V": tiny("Q=K-V"),
    "Q-K=V/post": tiny("Q-K=V"),
    "Q-K=V/pre": tiny("Q-K=V", kv_tie_point="pre_rope"),
    "Q=K=V/post": tiny("Q=K=V"),
    "Q=K=V/pre": tiny("Q=K=V", kv_tie_point="pre_rope"),
    "(Q=K-V)+": tiny("(Q=K-V)+"),
    "(Q=K=V)+/pre": tiny("(Q=K=V)+", kv_tie_point="pre_rope"),
    "(Q=K=V)+/reproduction": tiny("(Q=K=V)+", attention_map_pe_layout="reproduction", attention_map_pe_dim=6),
    "GQA-2": tiny("GQA-2"),
    "MQA": tiny("MQA"),
    "Q-GQA-2/pre": tiny("Q-GQA-2", kv_tie_point="pre_rope"),
    "Q-MQA/post": tiny("Q-MQA"),
    "Q-K=V/learned": tiny("Q-K=V", position_embedding_type="learned"),
    "Q=K=V/learned/gpt2": tiny("Q=K=V", **ARCHITECTURE_STYLES["gpt2"]),
    "(Q=K-V)+/none": tiny("(Q=K-V)+", position_embedding_type="none"),
    "Q-MQA/none": tiny("Q-MQA", position_embedding_type="none"),
    "mix/pre": tiny(layer_projection_sharing=["none", "kv", "qkv"], num_hidden_layers=3, kv_tie_point="pre_rope"),
    "mix+/learned": tiny(
        "(QKV)+", layer_projection_sharing=["qk", "kv"], position_embedding_type="learned", attention_map_pe_dim=4
    ),
}


# ---------------------------------------------------------------- parity with Llama
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_logits_equal_llama(kv_heads, attn):
    llama_config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation=attn,
    )
    llama = LlamaForCausalLM(llama_config).eval()
    ours = model_for(tiny(num_key_value_heads=kv_heads, tie_word_embeddings=False), attn)
    ours.load_state_dict(llama.state_dict(), strict=True)
    ids = torch.randint(0, VOCAB, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    torch.testing.assert_close(ours(ids).logits, llama(ids).logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        ours(ids, attention_mask=mask).logits, llama(ids, attention_mask=mask).logits, rtol=0, atol=1e-6
    )
    assert llama.generate(ids[:1, :4], max_new_tokens=8, do_sample=False).tolist() == (
        ours.generate(ids[:1, :4], max_new_tokens=8, do_sample=False).tolist()
    )


def test_dropped_projections_do_not_exist():
    expected = {"none": {"q", "k", "v", "o"}, "qk": {"k", "v", "o"}, "kv": {"q", "k", "o"}, "qkv": {"k", "o"}}
    config = tiny(layer_projection_sharing=["none", "qk", "kv", "qkv"], num_hidden_layers=4)
    model = QKVShareForCausalLM(config)
    for layer_idx, mode in enumerate(["none", "qk", "kv", "qkv"]):
        names = {n.split(".")[-2][0] for n, _ in model.named_parameters() if f"layers.{layer_idx}.self_attn" in n}
        assert names == expected[mode], (mode, names)


# ---------------------------------------------------------------- exact cached decoding
@pytest.mark.parametrize("name", COMBOS)
def test_token_by_token_decoding_equals_full_forward(name):
    model = model_for(COMBOS[name])
    ids = torch.randint(3, VOCAB, (2, 12))
    full = model(ids).logits
    cache = QKVShareCache(model.config)
    steps = [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=2e-6)
    # chunked prefill then decode
    cache = QKVShareCache(model.config)
    chunks = [model(ids[:, :5], cache=cache, use_cache=True).logits, model(ids[:, 5:], cache=cache).logits]
    torch.testing.assert_close(torch.cat(chunks, 1), full, rtol=0, atol=2e-6)
    # tied layers hold one tensor, the others two
    for layer_idx, layer in enumerate(cache.layers):
        assert isinstance(layer, TiedKVLayer) == model.config.is_kv_tied(layer_idx)
        assert (layer.values is None) == model.config.is_kv_tied(layer_idx)


@pytest.mark.parametrize("name", COMBOS)
def test_generate_with_cache_equals_without(name):
    model = model_for(COMBOS[name])
    ids = torch.randint(3, VOCAB, (2, 5))
    out = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.cache, QKVShareCache)
    uncached = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(out.sequences, uncached)


@pytest.mark.parametrize("name", ["QKV", "Q-K=V/pre", "(Q=K=V)+/pre", "Q-MQA/post", "mix+/learned"])
def test_left_padded_batch_equals_single_prompts(name):
    model = model_for(COMBOS[name])
    model.generation_config.pad_token_id = 0
    long, short = torch.randint(3, VOCAB, (7,)), torch.randint(3, VOCAB, (4,))
    batch = torch.stack([long, torch.cat([torch.zeros(3, dtype=torch.long), short])])
    mask = torch.tensor([[1] * 7, [0] * 3 + [1] * 4])
    batched = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    single_long = model.generate(long[None], max_new_tokens=6, do_sample=False)
    single_short = model.generate(short[None], max_new_tokens=6, do_sample=False)
    assert torch.equal(batched[0, 7:], single_long[0, 7:])
    assert torch.equal(batched[1, 7:], single_short[0, 4:])
    assert torch.equal(batched, model.generate(batch, attention_mask=mask, max_new_tokens=6, use_cache=False))


# "+" models refuse DynamicCache (tests/test_model_inputs.py checks their beam search against uncached decoding).
@pytest.mark.parametrize("name", ["QKV", "Q-K=V/pre", "Q=K=V/post", "Q-GQA-2/pre", "mix/pre"])
def test_beam_search_matches_dynamic_cache(name):
    model = model_for(COMBOS[name])
    ids = torch.randint(3, VOCAB, (2, 4))
    kwargs = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False)
    ours = model.generate(ids, **kwargs)
    reference = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("name", ["Q-K=V/pre", "(Q=K=V)+/pre", "MQA"])
def test_assisted_decoding_and_sampling(name):
    model, assistant = model_for(COMBOS[name]), model_for(COMBOS[name])
    with torch.no_grad():  # a different assistant, so some drafts are rejected and the cache is cropped
        for p in assistant.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(3, VOCAB, (1, 4))
    greedy = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=assistant), greedy)
    torch.manual_seed(7)
    sampled = model.generate(ids, max_new_tokens=10, do_sample=True, top_k=8)
    torch.manual_seed(7)
    assert torch.equal(sampled, model.generate(ids, max_new_tokens=10, do_sample=True, top_k=8, use_cache=False))


def test_pre_and_post_rope_ties_differ():
    # Same weights, different tie point: V is the unrotated vs rotated key, so outputs must differ.
    post, pre = model_for(tiny("Q-K=V")), model_for(tiny("Q-K=V", kv_tie_point="pre_rope"))
    pre.load_state_dict(post.state_dict())
    ids = torch.randint(0, VOCAB, (1, 8))
    assert (post(ids).logits - pre(ids).logits).abs().max() > 1e-3


# ---------------------------------------------------------------- cache bytes
def _filled_cache(config: QKVShareConfig, batch: int, length: int, dtype=torch.float32) -> QKVShareCache:
    model = model_for(config).to(dtype)
    cache = QKVShareCache(config)
    model(torch.randint(0, VOCAB, (batch, length)), cache=cache, use_cache=True)
    return cache


def test_cache_nbytes_counts_the_tensors_it_holds():
    cache = _filled_cache(tiny(layer_projection_sharing=["none", "kv"]), batch=3, length=10)
    held = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
    assert cache.nbytes() == held == 3 * 10 * 4 * 16 * 4 * (2 + 1)  # B*T*H*D*fp32 * (2 tensors + 1 tensor)
    assert cache.layer_nbytes(1) * 2 == cache.layer_nbytes(0)


@pytest.mark.parametrize(
    "variant,fraction",
    [
        ("QKV", 1),
        ("Q=K-V", 1),
        ("Q-K=V", 1 / 2),
        ("Q=K=V", 1 / 2),
        ("GQA-2", 2 / 4),
        ("Q-GQA-2", 2 / 8),
        ("MQA", 1 / 4),
        ("Q-MQA", 1 / 8),
    ],
)
def test_cache_bytes_relative_to_qkv_match_theory(variant, fraction):
    qkv = _filled_cache(tiny("QKV"), batch=2, length=9).nbytes()
    cache = _filled_cache(tiny(variant), batch=2, length=9)
    assert cache.nbytes() == qkv * fraction
    assert cache.nbytes() == tiny(variant).kv_cache_bytes_per_token(4) * 2 * 9
    assert qkv == tiny(variant).qkv_cache_bytes_per_token(4) * 2 * 9  # the reference of every "cut" figure


def test_pre_rope_cache_adds_only_positions():
    post = _filled_cache(tiny("Q-K=V"), batch=2, length=9)
    pre = _filled_cache(tiny("Q-K=V", kv_tie_point="pre_rope"), batch=2, length=9)
    assert pre.positions.shape == (2, 9) and post.positions is None
    assert pre.nbytes() == post.nbytes() + 2 * 9 * 8


@pytest.mark.parametrize(
    "variant,per_token",
    [("QKV", 81_920), ("Q-K=V", 40_960), ("GQA-4", 20_480), ("Q-GQA-4", 10_240), ("MQA", 5_120), ("Q-MQA", 2_560)],
)
def test_paper_300m_fp16_bytes_per_token(variant, per_token):
    config = QKVShareConfig.from_preset("paper-300m", variant)
    assert config.kv_cache_bytes_per_token(2) == per_token
    assert config.qkv_cache_bytes_per_token(2) == 81_920
    # The real cache, fed one fp16 token per layer in the shapes the attention layers produce.
    cache = QKVShareCache(config)
    for layer_idx in range(config.num_hidden_layers):
        state = torch.zeros(1, config.num_key_value_heads, 1, config.head_dim, dtype=torch.float16)
        cache.update(state, None if config.is_kv_tied(layer_idx) else state.clone(), layer_idx)
    assert cache.nbytes() == per_token


# ---------------------------------------------------------------- parameter counts
@pytest.mark.parametrize(
    "variant,total,attention",
    [
        ("QKV", 305_534_976, 83_968_000),
        ("Q=K-V", 284_542_976, 62_976_000),
        ("Q-K=V", 284_542_976, 62_976_000),
        ("Q=K=V", 263_550_976, 41_984_000),
    ],
)
def test_paper_300m_parameter_counts(variant, total, attention):
    with torch.device("meta"):
        model = QKVShareForCausalLM(QKVShareConfig.from_preset("paper-300m", variant))
    assert sum(p.numel() for p in model.parameters()) == total
    assert sum(p.numel() for n, p in model.named_parameters() if ".self_attn." in n) == attention


# ---------------------------------------------------------------- symmetry of Q=K scores
@contextlib.contextmanager
def recorded_eager_scores():
    """Record, per attention call, the pre-softmax scores (B, H, q, kv) that the model's eager attention softmaxes:
    query @ key^T * scaling + mask, with the "+" query scale and map bias already applied by the model. The model
    dispatches "eager" to `modeling_qkvshare.eager_attention_forward`; this wraps it and checks that the recorded
    scores give exactly the probabilities eager returns."""
    recorded = []

    def recording(module, query, key, value, attention_mask, scaling, **kwargs):
        output, weights = eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        scores = query @ repeat_kv(key, module.num_key_value_groups).transpose(2, 3) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask
        torch.testing.assert_close(scores.softmax(-1), weights)
        recorded.append(scores)
        return output, weights

    with mock.patch.object(modeling_qkvshare, "eager_attention_forward", recording):
        yield recorded


def eager_scores(model: torch.nn.Module, input_ids: torch.Tensor, layer: int = 0) -> torch.Tensor:
    """Pre-softmax scores (B, H, T, T) of one layer in a forward of `model` (switched to eager attention)."""
    model.set_attn_implementation("eager")
    with torch.no_grad(), recorded_eager_scores() as recorded:
        model(input_ids)
    assert len(recorded) == model.config.num_hidden_layers
    return recorded[layer]


@pytest.mark.parametrize("position_type", ["rope", "learned", "none"])
def test_query_key_sharing_gives_symmetric_scores(position_type):
    # Bidirectional, so the eager path scores every (query, key) pair with no causal mask in the way.
    ids = torch.randint(0, VOCAB, (2, 10))
    for variant in ("Q=K-V", "Q=K=V"):
        scores = eager_scores(model_for(tiny(variant, position_embedding_type=position_type, is_causal=False)), ids)
        torch.testing.assert_close(scores, scores.transpose(-1, -2), rtol=0, atol=1e-5)
    for variant in ("QKV", "(Q=K-V)+", "(Q=K=V)+"):  # "+" (and separate Q, K) break the symmetry
        scores = eager_scores(model_for(tiny(variant, position_embedding_type=position_type, is_causal=False)), ids)
        assert (scores - scores.transpose(-1, -2)).abs().max() > 1e-3, variant


def test_plus_map_inits():
    model = model_for(tiny("(Q=K=V)+", attention_map_pe_init="unit_scale"))
    weight = model.model.layers[0].self_attn.attention_map_pe.weight
    torch.testing.assert_close(weight, torch.full((1, 10), 0.1))  # sum(w) = 1: the score scale starts at 1
    assert model.model.layers[0].self_attn.attention_map_pe.bias.item() == 0
    # default: xavier-uniform, bound sqrt(6 / (fan_in + fan_out)) = sqrt(6 / 11)
    weight = model_for(tiny("(Q=K=V)+")).model.layers[1].self_attn.attention_map_pe.weight
    assert weight.abs().max() <= (6 / 11) ** 0.5 and weight.std() > 0.1


def test_original_layout_splits_row_and_column_channels():
    from qkvshare.modeling_qkvshare import attention_map_encoding

    row, col = attention_map_encoding(torch.arange(5)[None], torch.arange(7)[None], 10, "original")
    assert row.shape == (1, 5, 6) and col.shape == (1, 7, 4)  # m=10: 6 row + 4 column channels
    # Reference: positional-encodings' PositionalEncoding2D(10): 6 channels per axis, interleaved sin/cos.
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 6, 2).float() / 6))
    expected = lambda p: torch.stack([(p * inv_freq).sin(), (p * inv_freq).cos()], -1).flatten()  # noqa: E731
    torch.testing.assert_close(row[0, 3], expected(3.0))
    torch.testing.assert_close(col[0, 5], expected(5.0)[:4])
    row, col = attention_map_encoding(torch.arange(5)[None], torch.arange(7)[None], 10, "reproduction")
    assert row.shape == (1, 5, 5) and col.shape == (1, 7, 5)


# ---------------------------------------------------------------- backends, training features
@pytest.mark.parametrize("variant", ["QKV", "Q=K=V", "(Q=K-V)+", "Q-GQA-2", "(Q=K=V)+"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_eager_and_sdpa_agree_on_outputs_and_gradients(variant, causal):
    config = tiny(variant, is_causal=causal)
    eager, sdpa = model_for(config, "eager"), model_for(config, "sdpa")
    sdpa.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    ids = torch.randint(0, VOCAB, (2, 10))
    out_e, out_s = eager(ids, labels=ids), sdpa(ids, labels=ids)
    torch.testing.assert_close(out_e.logits, out_s.logits, rtol=0, atol=1e-5)
    out_e.loss.backward()
    out_s.loss.backward()
    for (name, p_e), p_s in zip(eager.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(p_e.grad, p_s.grad, rtol=1e-4, atol=1e-6, msg=name)
    # padded rows agree on the real tokens too
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    real = mask.bool()
    torch.testing.assert_close(
        eager(ids, attention_mask=mask).logits[real], sdpa(ids, attention_mask=mask).logits[real], rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("variant", ["Q-MQA"])
def test_flex_attention_backend_matches_sdpa(variant):
    # transformers' flex backend: BlockMask from create_causal_mask, then flex_attention (forward-only on CPU; on GPU
    # it trains too). Run under torch.compile's "force_eager" stance: compiling the kernel and the block mask for each
    # shape took minutes on 2 CPU cores, and torch 2.13's compiled CPU kernel is itself wrong at some lengths (e.g. 8,
    # LlamaForCausalLM too); the eager stance runs flex_attention's reference implementation of the same masks.
    sdpa, flex = model_for(tiny(variant), "sdpa"), model_for(tiny(variant), "flex_attention")
    flex.load_state_dict(sdpa.state_dict())
    ids = torch.randint(3, VOCAB, (2, 12))
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        torch.testing.assert_close(flex(ids).logits, sdpa(ids).logits, rtol=0, atol=1e-5)
        kwargs = dict(max_new_tokens=6, do_sample=False)
        assert torch.equal(flex.generate(ids[:, :4], **kwargs), sdpa.generate(ids[:, :4], **kwargs))


def test_activation_checkpointing_gives_same_gradients():
    model = model_for(tiny("Q-K=V", kv_tie_point="pre_rope")).train()
    ids = torch.randint(0, VOCAB, (2, 10))
    model(ids, labels=ids).loss.backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.activation_checkpointing_enable()
    model(ids, labels=ids).loss.backward()
    for ref, p in zip(reference, model.parameters()):
        torch.testing.assert_close(p.grad, ref, rtol=0, atol=1e-7)


def test_output_attentions_on_eager():
    model = model_for(tiny("(Q=K-V)+"), "eager")
    out = model(torch.randint(0, VOCAB, (2, 9)), output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 4, 9, 9)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(2, 4, 9))
    assert out.attentions[0][0, 0].triu(1).abs().max() == 0  # causal


def test_bf16_decoding_close_to_full_forward():
    model = model_for(tiny("(Q=K=V)+", kv_tie_point="pre_rope")).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 10))
    full = model(ids).logits.float()
    cache = QKVShareCache(model.config)
    steps = torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(10)], 1)
    assert cache.layers[0].keys.dtype == torch.bfloat16
    torch.testing.assert_close(steps.float(), full, rtol=0, atol=0.1)


def test_plus_variant_refuses_backends_without_bias():
    model = model_for(tiny("(Q=K=V)+"), "flex_attention")
    with pytest.raises(ValueError, match="attn_implementation='sdpa' or 'eager'"):
        model(torch.randint(0, VOCAB, (1, 4)))


def test_learned_positions_beyond_table_raise():
    model = model_for(tiny("Q-K=V", position_embedding_type="learned", max_position_embeddings=16))
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        model(torch.randint(0, VOCAB, (1, 17)))


# ---------------------------------------------------------------- hub-style save / load
def test_auto_classes_and_save_load_roundtrip(tmp_path):
    config = tiny("(Q=K=V)+", kv_tie_point="pre_rope")
    assert type(AutoConfig.for_model("qkvshare")).__name__ == "QKVShareConfig"
    model = model_for(config)
    model.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"model.safetensors", "config.json", "modeling_qkvshare.py", "cache_qkvshare.py"} <= files
    assert not any(name.endswith((".bin", ".pt")) for name in files)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_qkvshare.QKVShareForCausalLM"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is QKVShareForCausalLM
    ids = torch.randint(0, VOCAB, (2, 8))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


# ---------------------------------------------------------------- config validation
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(projection_sharing="vk"), "projection_sharing='vk' is not supported; allowed values: 'none', 'qk'"),
        (dict(num_key_value_heads=3), "num_key_value_heads=3 must divide num_attention_heads=4"),
        (dict(hidden_size=66), "hidden_size=66 is not divisible by num_attention_heads=4"),
        (dict(projection_sharing="qk", num_key_value_heads=2), "needs num_key_value_heads == num_attention_heads"),
        (dict(projection_sharing="qkv", num_key_value_heads=1), "Use 'kv' \\(Q-K=V\\) with GQA/MQA instead"),
        (dict(layer_projection_sharing=["kv"]), "layer_projection_sharing has 1 entries but num_hidden_layers=2"),
        (dict(layer_projection_sharing=["kv", "q"]), "layer_projection_sharing\\[1\\]='q' is not supported"),
        (dict(position_embedding_type="sinusoidal"), "position_embedding_type='sinusoidal' is not supported"),
        (dict(kv_tie_point="middle"), "kv_tie_point='middle' is not supported"),
        (dict(norm_type="batchnorm"), "norm_type='batchnorm'"),
        (dict(mlp_type="moe"), "mlp_type='moe'"),
        (dict(attention_map_pe_dim=1), "attention_map_pe_dim=1 must be 0"),
        (dict(attention_map_pe_layout="diag"), "attention_map_pe_layout='diag'"),
        (dict(head_dim=15), "head_dim=15 must be even"),
        (dict(attention_kernel="linear"), "attention_kernel='linear' is the Q=K=V recurrence"),
    ],
)
def test_bad_config_raises_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kwargs)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: QKVShareConfig.from_preset("gpt-9"), "preset='gpt-9' is not a known preset; allowed: tiny"),
        (lambda: tiny("Q=V"), "variant='Q=V' is not a known variant"),
        (lambda: tiny("GQA-3"), "3 key/value heads must divide num_attention_heads=4"),
        (lambda: tiny("(MQA)+"), "'\\+' only on QKV"),
    ],
)
def test_bad_preset_or_variant_raises(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    "variant,fields",
    [
        ("QKV", ("none", 4, 0)),
        ("Q=K-V", ("qk", 4, 0)),
        ("Q≠K=V", ("kv", 4, 0)),
        ("QV", ("kv", 4, 0)),
        ("Q!=K=V", ("kv", 4, 0)),
        ("Q=K=V", ("qkv", 4, 0)),
        ("(Q=K-V)+", ("qk", 4, 10)),
        ("(Q=K=V)+", ("qkv", 4, 10)),
        ("GQA-2", ("none", 2, 0)),
        ("MQA", ("none", 1, 0)),
        ("Q-GQA-2", ("kv", 2, 0)),
        ("Q-MQA", ("kv", 1, 0)),
    ],
)
def test_variant_names(variant, fields):
    config = tiny(variant)
    assert (config.projection_sharing, config.num_key_value_heads, config.attention_map_pe_dim) == fields
    assert tiny(config.variant).to_diff_dict() == config.to_diff_dict()
