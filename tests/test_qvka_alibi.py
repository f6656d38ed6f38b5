"""QV-Ka (the second source's key-after-value-and-context attention) and ALiBi positions: shapes, parameter counts,
cache bytes, exact cached decoding, backends, and the sweep/compare plumbing that runs them."""

import copy
import math

import pytest
import torch
from transformers import DynamicCache

from qkvshare import QKVShareCache, QKVShareConfig, QKVShareForCausalLM, QKVShareForTokenClassification
from qkvshare.analysis import compare, costs
from qkvshare.analysis.common import base_config
from qkvshare.cache_qkvshare import ContextValueLayer, ContextValueStaticLayer, QKVShareStaticCache
from qkvshare.configuration_qkvshare import ARCHITECTURE_STYLES
from qkvshare.modeling_qkvshare import alibi_slopes
from qkvshare.synthetic.sweep import SweepArgs, results_table, validate
from qkvshare_settings import compare as compare_cli

VOCAB = 128


def tiny(variant: str = "QKV", **overrides) -> QKVShareConfig:
    return QKVShareConfig.from_preset("tiny", variant, **overrides)


def model_for(config: QKVShareConfig, attn: str = "sdpa", cls=QKVShareForCausalLM):
    torch.manual_seed(0)
    return cls._from_config(copy.deepcopy(config), attn_implementation=attn).eval()


def decode_token_by_token(model, ids: torch.Tensor, cache) -> torch.Tensor:
    return torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(ids.shape[1])], 1)


# ---------------------------------------------------------------- QV-Ka: config, shapes, parameters
def test_qv_ka_variant_names_and_validation():
    assert (tiny("QV-Ka").key_context_dim, tiny("QV-Ka-2").key_context_dim) == (16, 32)  # tiny: head_dim 16
    assert [tiny(v).variant for v in ("QV-Ka", "QV-Ka-2", "(QV-Ka)+")] == ["QV-Ka", "QV-Ka-2", "(QV-Ka)+"]
    assert tiny(key_context_dim=24).variant == "QV-Ka(d_ctx=24)"
    assert tiny("QV-Ka", hidden_size=96).key_context_dim == 24  # follows the overridden head width
    with pytest.raises(ValueError, match="key_context_dim=-1 must be 0"):
        tiny(key_context_dim=-1)
    with pytest.raises(ValueError, match=r"key_context_dim=16 \(QV-Ka\).*projection_sharing='kv'"):
        tiny("QV-Ka", projection_sharing="kv")
    with pytest.raises(ValueError, match="num_key_value_heads=2 .*needs num_attention_heads=4"):
        tiny("QV-Ka", num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"sliding_window=4 \(the cache of G and V has no sliding form\)"):
        tiny("QV-Ka", sliding_window=4)


@pytest.mark.parametrize("style", ["llama", "gpt2"])  # without and with biases
def test_qv_ka_shapes_keys_and_parameter_count(style):
    config = tiny("QV-Ka-2", **ARCHITECTURE_STYLES[style])
    d, heads, head_dim, d_ctx = config.hidden_size, config.num_attention_heads, config.head_dim, 32
    attn = model_for(config).model.layers[0].self_attn
    names = {n.split(".")[0] for n, _ in attn.named_parameters()}
    assert names == {"q_proj", "ctx_proj", "v_proj", "k_mix", "o_proj"}  # no k_proj
    assert attn.ctx_proj.weight.shape == (d_ctx, d) and attn.k_mix.weight.shape == (heads, d_ctx + head_dim, head_dim)
    # K_i = [G ; V_i] W_i^K, written out head by head with the concatenation
    x = torch.randn(2, 5, d)
    value = attn._heads(attn.v_proj, x)
    context = attn.ctx_proj(x)
    keys = attn.k_mix(context.unsqueeze(1), value)
    for i in range(heads):
        expected = torch.cat([context, value[:, i]], dim=-1) @ attn.k_mix.weight[i]
        torch.testing.assert_close(keys[:, i], expected, rtol=1e-5, atol=1e-6)
    # the parameter formula: q, v, o as QKV; ctx_proj d x d_ctx (+ bias); k_mix H (d_ctx + D) D (no bias)
    bias = config.attention_bias
    per_layer = 3 * (d * heads * head_dim) + d * d_ctx + heads * (d_ctx + head_dim) * head_dim
    per_layer += (3 * heads * head_dim - heads * head_dim + d + d_ctx) if bias else 0  # q, v, o and ctx biases
    counts = costs.parameter_counts(config)
    assert counts["attention"] == config.num_hidden_layers * per_layer
    meta = costs.meta_parameter_counts(config)
    assert (meta["attention"], meta["total"]) == (counts["attention"], counts["total"])


def test_costs_report_qv_ka_cache_bytes_and_parameters():
    report = costs.cost_report(base_config("paper-300m"), ["QKV", "QV-Ka", "QV-Ka-2"], [2048], [32000], ["fp16"])
    rows = {r["variant"]: r for r in report["variants"]}
    # 20 layers x (16 heads x 64 + d_ctx) x 2 bytes
    assert rows["QV-Ka"]["kv_cache_bytes_per_token"]["fp16"] == 20 * (1024 + 64) * 2 == 43_520
    assert rows["QV-Ka-2"]["kv_cache_bytes_per_token"]["fp16"] == 20 * (1024 + 128) * 2 == 46_080
    # per layer: q, v, o with biases; ctx_proj 1024 x 64 + 64; k_mix 16 x 128 x 64
    assert rows["QV-Ka"]["parameters"]["attention"] == 20 * (3 * (1024 * 1024 + 1024) + 1024 * 64 + 64 + 16 * 128 * 64)
    assert all(r["meta_check"] for r in rows.values())


# ---------------------------------------------------------------- QV-Ka: cache
@pytest.mark.parametrize("variant, positions", [("QV-Ka", "rope"), ("QV-Ka-2", "learned"), ("(QV-Ka)+", "alibi")])
def test_qv_ka_cached_decoding_is_exact_and_holds_context_and_values(variant, positions):
    config = tiny(variant, position_embedding_type=positions)
    model = model_for(config)
    ids = torch.randint(3, VOCAB, (2, 7))
    full = model(ids).logits
    cache = QKVShareCache(config)
    torch.testing.assert_close(decode_token_by_token(model, ids, cache), full, rtol=0, atol=2e-6)
    assert all(isinstance(layer, ContextValueLayer) for layer in cache.layers)
    layer = cache.layers[0]
    assert layer.keys.shape == (2, 1, 7, config.key_context_dim) and layer.values.shape == (2, 4, 7, 16)
    # the bytes it claims: (H x D + d_ctx) fp32 per token and layer, plus int64 positions where tracked
    position_bytes = 8 * 2 * 7 if config.needs_key_positions else 0
    assert cache.nbytes() == config.kv_cache_bytes_per_token(4) * 2 * 7 + position_bytes
    assert cache.nbytes() == 2 * (4 * 16 + config.key_context_dim) * 4 * 2 * 7 + position_bytes
    assert config.needs_key_positions == (positions != "learned")
    # the static cache (G and V buffers; prefill then decode) and a transformers cache (K and V) give the same logits
    if positions == "rope":
        static = QKVShareStaticCache(config, max_cache_len=9)
        steps = [model(ids[:, :4], cache=static, use_cache=True).logits, model(ids[:, 4:], cache=static).logits]
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=2e-6)
        assert isinstance(static.layers[0], ContextValueStaticLayer) and static.layers[0].values.shape == (2, 4, 9, 16)
    if positions != "alibi":
        dynamic = DynamicCache()
        torch.testing.assert_close(decode_token_by_token(model, ids, dynamic), full, rtol=0, atol=2e-6)
        assert dynamic.layers[0].keys.shape == dynamic.layers[0].values.shape == (2, 4, 7, 16)


def test_qv_ka_generate_and_save_load(tmp_path):
    model = model_for(tiny("QV-Ka"))
    ids = torch.randint(3, VOCAB, (1, 5))
    out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.cache, QKVShareCache)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False))
    model.save_pretrained(tmp_path)
    loaded = QKVShareForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.key_context_dim == 16
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    # The quantized cache quantizes keys and values; a QV-Ka layer caches G and V: refused, naming what works.
    with pytest.raises(ValueError, match=r"QV-Ka \(key_context_dim\) or sliding-window layers; use QKVShareCache"):
        model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="quantized")


# ---------------------------------------------------------------- ALiBi
def test_alibi_slopes_match_hand_computed_values():
    assert alibi_slopes(8) == [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625]
    # 6 heads: the 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then every other slope of 8 heads: 2^-1, 2^-3
    assert alibi_slopes(6) == [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_scores_are_the_distance_bias(causal):
    """Layer 0's attention weights equal softmax(Q K^T / sqrt(d) - slope_h * distance) computed by hand."""
    config = tiny("QKV", position_embedding_type="alibi", is_causal=causal)
    model = model_for(config, "eager")
    ids = torch.randint(3, VOCAB, (1, 7))
    seen = {}
    attn = model.model.layers[0].self_attn
    attn.register_forward_pre_hook(lambda m, a, kw: seen.update(x=kw["hidden_states"]), with_kwargs=True)
    weights = model(ids, output_attentions=True).attentions[0]  # (1, H, 7, 7)
    query, key = attn._heads(attn.q_proj, seen["x"]), attn._heads(attn.k_proj, seen["x"])
    i = torch.arange(7)
    distance = (i[:, None] - i[None, :]).float()
    distance = distance if causal else distance.abs()
    slopes = torch.tensor([2 ** (-8 * h / 4) for h in range(1, 5)])  # 4 heads: 1/4, 1/16, 1/64, 1/256
    scores = query @ key.transpose(-1, -2) / math.sqrt(16) - slopes[:, None, None] * distance
    if causal:
        scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
    torch.testing.assert_close(weights, scores.softmax(-1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("variant", ["QKV", "Q-MQA"])  # 8 heads; 4 query heads sharing one cached tensor
def test_alibi_causal_cached_decoding_equals_full_forward_and_eager_equals_sdpa(variant):
    config = tiny(variant, position_embedding_type="alibi", num_attention_heads=8 if variant == "QKV" else 4)
    model = model_for(config)
    ids = torch.randint(3, VOCAB, (2, 7))
    full = model(ids).logits
    torch.testing.assert_close(decode_token_by_token(model, ids, QKVShareCache(config)), full, rtol=0, atol=2e-6)
    torch.testing.assert_close(model_for(config, "eager")(ids).logits, full, rtol=0, atol=2e-6)


def test_alibi_left_padded_batch_equals_single_prompts():
    """Generate's position ids for a left-padded row start after the padding; the cached key positions follow them."""
    model = model_for(tiny("Q-K=V", position_embedding_type="alibi", pad_token_id=0))
    prompt = torch.randint(3, VOCAB, (1, 5))
    single = model.generate(prompt, max_new_tokens=4, do_sample=False)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)], 1)
    batched = model.generate(padded, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(batched[:, 3:], single)


def test_alibi_bidirectional_cached_chunk_equals_full_forward_and_eager_equals_sdpa():
    """Bidirectional: with one layer the cached prefix keys do not depend on later tokens, so a chunk run after the
    cached prefix must give the full forward's outputs at its positions (the symmetric |i - j| bias included)."""
    config = tiny("Q-K=V", position_embedding_type="alibi", is_causal=False, num_labels=5, num_hidden_layers=1)
    model = model_for(config, cls=QKVShareForTokenClassification)
    ids = torch.randint(3, VOCAB, (2, 9))
    full = model(ids).logits
    cache = QKVShareCache(config)
    model.model(ids[:, :6], cache=cache, use_cache=True)
    chunk = model.score(model.model(ids[:, 6:], cache=cache, use_cache=True).last_hidden_state)
    torch.testing.assert_close(chunk, full[:, 6:], rtol=0, atol=2e-6)
    deep = tiny("Q-K=V", position_embedding_type="alibi", is_causal=False, num_labels=5)
    sdpa = model_for(deep, cls=QKVShareForTokenClassification)
    eager = model_for(deep, "eager", cls=QKVShareForTokenClassification)
    torch.testing.assert_close(eager(ids).logits, sdpa(ids).logits, rtol=0, atol=2e-6)
    # reversing the tokens reverses the outputs: the bias depends on |i - j| only (no other position signal)
    torch.testing.assert_close(sdpa(ids.flip(1)).logits, sdpa(ids).logits.flip(1), rtol=0, atol=2e-6)


def test_alibi_refuses_backends_and_caches_without_bias_or_positions():
    config = tiny("Q-K=V", position_embedding_type="alibi")
    with pytest.raises(
        ValueError,
        match="position_embedding_type='alibi' adds a per-head score bias, which the "
        "'flex_attention' attention backend cannot take; .*attn_implementation='sdpa' or 'eager'",
    ):
        model_for(config, "flex_attention")(torch.randint(3, VOCAB, (1, 4)))
    with pytest.raises(ValueError, match="position_embedding_type='alibi' needs the position of every cached key"):
        model_for(config)(torch.randint(3, VOCAB, (1, 4)), cache=DynamicCache(), use_cache=True)
    with pytest.raises(ValueError, match="attention_kernel='linear' needs"):
        tiny("Q=K=V", position_embedding_type="alibi", attention_kernel="linear")


# ---------------------------------------------------------------- the commands that compare position types
def test_sweep_and_compare_grids_over_position_types():
    args = SweepArgs(variants=["Q-K=V", "QV-Ka"], tasks=["copy"], seeds=[0], position_types=["learned", "alibi"])
    cells = validate(args)
    assert [(c.label, c.position_type) for c in cells] == [
        ("Q-K=V", "learned"),
        ("QV-Ka", "learned"),
        ("Q-K=V [alibi]", "alibi"),
        ("QV-Ka [alibi]", "alibi"),
    ]
    assert "|pos-" not in cells[0].key and cells[2].key.endswith("|pos-alibi")  # learned keys as before
    rows = [
        {"variant": "Q-K=V", "task": "copy", "token_accuracy": "0.9", "position_type": "learned"},
        {"variant": "Q-K=V", "task": "copy", "token_accuracy": "0.5", "position_type": "alibi"},
    ]
    table = results_table(rows, ["Q-K=V"], ["copy"], ["learned", "alibi"])
    assert "| Q-K=V | 0.900 ± 0.000 (1.000) | 0.900 | 1.000 |" in table
    assert "| Q-K=V [alibi] | 0.500 ± 0.000 | 0.500 | - |" in table  # the paper's numbers are learned-only
    with pytest.raises(ValueError, match="position type 'sinusoid' is not known"):
        validate(SweepArgs(position_types=["sinusoid"]))

    plan = compare.run_plan("tiny", ["QKV", "Q-K=V"], ["rope", "alibi"])
    assert plan[1] == ("Q-K=V [rope]", "Q-K=V", "rope") and len(plan) == 4
    argv = compare.with_position_type(["--config_overrides", "num_hidden_layers=1"], "alibi")
    assert argv == ["--config_overrides", "num_hidden_layers=1,position_embedding_type=alibi"]
    assert compare.with_position_type(["--seed", "0"], "rope")[-2:] == [
        "--config_overrides",
        "position_embedding_type=rope",
    ]
    with pytest.raises(ValueError, match="--position_types sets position_embedding_type"):
        compare_cli.parse_args(["--position_types", "rope", "--config_overrides", "position_embedding_type=learned"])


def test_qv_ka_refuses_a_sliding_window_and_the_quantized_cache():
    with pytest.raises(ValueError, match=r"sliding_window=4 \(the cache of G and V has no sliding form\)"):
        QKVShareConfig.from_preset("tiny", "QV-Ka", sliding_window=4)
    from qkvshare.cache_qkvshare import QKVShareQuantizedCache

    with pytest.raises(ValueError, match=r"QKVShareQuantizedCache: .*QV-Ka \(key_context_dim\)"):
        QKVShareQuantizedCache(QKVShareConfig.from_preset("tiny", "QV-Ka"), backend="fp8")
