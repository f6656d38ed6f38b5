"""What the model accepts, and what it refuses before any work: the deprecated `past_key_values=` keyword, caches
(QKVShareCache built for another model, foreign transformers caches), attention-mask and input shapes, and the cache
check of transformers' generation test mixin. Tiny configs, fp32, CPU."""

import copy
import unittest
import warnings

import pytest
import torch
from test_core import VOCAB, tiny
from transformers import DynamicCache, StaticCache

from qkvshare import (
    QKVShareCache,
    QKVShareConfig,
    QKVShareForCausalLM,
    QKVShareForSequenceClassification,
    QKVShareModel,
)


def build(model_class, config: QKVShareConfig, attn: str = "sdpa"):
    torch.manual_seed(0)
    return model_class._from_config(copy.deepcopy(config), attn_implementation=attn).eval()


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 7 and 4 tokens, the short one left-padded with 0: (input_ids, attention_mask), each (2, 7)."""
    ids = torch.randint(3, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


# ---------------------------------------------------------------- past_key_values= (deprecated name of cache=)
@pytest.mark.parametrize("model_class", [QKVShareForCausalLM, QKVShareModel])
def test_past_key_values_keyword_equals_cache(model_class):
    model = build(model_class, tiny("Q-K=V", kv_tie_point="pre_rope"))
    ids = torch.randint(3, VOCAB, (2, 7))
    outputs = {}
    for keyword in ("cache", "past_key_values"):
        cache = QKVShareCache(config=model.config)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prefill = model(ids[:, :5], use_cache=True, **{keyword: cache})
            step = model(ids[:, 5:], use_cache=True, **{keyword: cache})
        deprecations = [w for w in caught if "`past_key_values` is deprecated" in str(w.message)]
        assert len(deprecations) == (2 if keyword == "past_key_values" else 0)  # Llama's warning, once per call
        assert prefill.cache is cache and step.cache is cache and cache.get_seq_length() == 7
        outputs[keyword] = torch.cat([prefill[0], step[0]], dim=1)  # logits, or last hidden states
    assert torch.equal(outputs["past_key_values"], outputs["cache"])
    with torch.no_grad():  # and both are the full forward's: the cache was read, not dropped
        torch.testing.assert_close(outputs["cache"], model(ids)[0], rtol=0, atol=2e-6)


def test_past_key_values_keyword_reaches_the_layers():
    model = build(QKVShareForCausalLM, tiny("Q-K=V"))
    cache = QKVShareCache(config=model.config)
    hidden = torch.randn(1, 3, model.config.hidden_size)
    rope = model.model.rotary_emb(hidden, torch.arange(3)[None])
    with torch.no_grad(), pytest.warns(FutureWarning, match="past_key_values"):
        model.model.layers[0](hidden, position_embeddings=rope, past_key_values=cache)
        model.model.layers[1].self_attn(hidden, position_embeddings=rope, past_key_values=cache)
    assert [layer.get_seq_length() for layer in cache.layers] == [3, 3]


def test_sequence_classification_head_reads_past_key_values():
    config = tiny("Q-K=V", pad_token_id=0, num_labels=3)
    head = build(QKVShareForSequenceClassification, config)
    ids = torch.randint(3, VOCAB, (2, 8))
    cache = QKVShareCache(config=head.config)
    with torch.no_grad(), pytest.warns(FutureWarning, match="past_key_values"):
        head(ids[:, :5], past_key_values=cache, use_cache=True)
        continued = head(ids[:, 5:], past_key_values=cache, use_cache=True).logits
        full, suffix_only = head(ids).logits, head(ids[:, 5:]).logits
    assert cache.get_seq_length() == 8
    torch.testing.assert_close(continued, full, rtol=0, atol=2e-6)  # the last token saw the cached prefix
    assert (continued - suffix_only).abs().max() > 1e-3


# ---------------------------------------------------------------- foreign transformers caches
def _foreign_caches(config: QKVShareConfig) -> dict:
    return {
        "DynamicCache": DynamicCache(config=config),
        "StaticCache": StaticCache(config=config, max_cache_len=16),
    }


@pytest.mark.parametrize("variant", ["(Q=K-V)+", "(Q=K=V)+"])
def test_plus_model_refuses_foreign_caches(variant):
    # They would make the model assume cached keys at positions 0..past-1 (wrong logits for left-padded batches), and
    # a static cache's mask is as wide as its buffer (the "+" bias crashed).
    model = build(QKVShareForCausalLM, tiny(variant, kv_tie_point="pre_rope"))
    model.generation_config.pad_token_id = 0
    ids, mask = left_padded_batch()
    for name, cache in _foreign_caches(model.config).items():
        message = f"attention_map_pe_dim=10 .* needs the position of every cached key, .* a {name} does not"
        with pytest.raises(ValueError, match=message):
            model(ids, attention_mask=mask, cache=cache, use_cache=True)
        assert cache.get_seq_length() == 0  # refused before any layer ran
        with pytest.raises(ValueError, match=message):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, cache=cache)
    # cache_implementation="static" builds a QKVShareStaticCache, which records the positions.
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    static = model.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(static, model.generate(ids, use_cache=False, **kwargs))


def test_plus_model_beam_search_equals_uncached():
    model = build(QKVShareForCausalLM, tiny("(Q=K-V)+"))
    ids = torch.randint(3, VOCAB, (2, 4))
    kwargs = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False)
    assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, use_cache=False, **kwargs))


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(kv_tie_point="pre_rope"), dict(projection_sharing="qkv", kv_tie_point="pre_rope")],
    ids=["Q-K=V/post", "Q-K=V/pre", "Q=K=V/pre"],
)
def test_tied_model_is_exact_with_foreign_caches(overrides):
    # Foreign caches store the (rotated) key and the value separately: two copies, the same tokens.
    model = build(QKVShareForCausalLM, tiny("Q-K=V", **overrides))
    model.generation_config.pad_token_id = 0
    ids, mask = left_padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    default = model.generate(ids, **kwargs)
    static = model.generate(ids, cache=StaticCache(config=model.config, max_cache_len=12), **kwargs)
    dynamic = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
    assert (type(default.cache), type(static.cache), type(dynamic.cache)) == (QKVShareCache, StaticCache, DynamicCache)
    assert torch.equal(static.sequences, default.sequences) and torch.equal(dynamic.sequences, default.sequences)


# ---------------------------------------------------------------- a cache built for another model
@pytest.mark.parametrize(
    "cache_config,model_config,message",
    [
        (tiny("Q-K=V"), tiny("Q-K=V", kv_tie_point="pre_rope"), "kv_tie_point: 'post_rope' vs 'pre_rope'"),
        (tiny("QKV"), tiny("Q-K=V"), "layer kinds: layer 0 'key_value' vs 'tied', layer 1 'key_value' vs 'tied'"),
        (tiny("Q-K=V"), tiny("Q-K=V", num_hidden_layers=3), "number of layers: 2 vs 3"),
        (tiny("Q-GQA-2"), tiny("Q-K=V"), "num_key_value_heads: 2 vs 4"),
        (tiny("Q-K=V"), tiny("(Q-K=V)+"), "track_positions: False vs True"),
        (
            tiny("Q=K=V", position_embedding_type="learned"),
            tiny("Q=K=V", position_embedding_type="learned", attention_kernel="linear"),
            "layer 0 'tied' vs 'linear_state'",
        ),
    ],
    ids=["post-in-pre", "QKV-in-Q-K=V", "2-in-3-layers", "GQA-in-MHA", "no-positions-in-plus", "softmax-in-linear"],
)
def test_cache_built_for_another_model_is_refused(cache_config, model_config, message):
    model = build(QKVShareForCausalLM, model_config)
    cache = QKVShareCache(config=cache_config)
    with pytest.raises(ValueError, match=r"QKVShareCache was built for a different model \(cache vs model: .*") as err:
        model(torch.randint(3, VOCAB, (1, 4)), cache=cache, use_cache=True)
    assert message in str(err.value) and "QKVShareCache(config=model.config)" in str(err.value)
    assert cache.get_seq_length() == 0 and cache.positions is None  # refused before anything was written


def test_cache_from_an_equal_config_is_accepted():
    model = build(QKVShareForCausalLM, tiny("Q-K=V", kv_tie_point="pre_rope"))
    ids = torch.randint(3, VOCAB, (1, 6))
    cache = QKVShareCache(config=tiny("Q-K=V", kv_tie_point="pre_rope"))  # a separate but equal config
    with torch.no_grad():
        steps = [model(ids[:, :4], cache=cache, use_cache=True).logits, model(ids[:, 4:], cache=cache).logits]
        torch.testing.assert_close(torch.cat(steps, 1), model(ids).logits, rtol=0, atol=2e-6)


def test_foreign_cache_with_another_layer_count_is_refused():
    ids = torch.randint(3, VOCAB, (1, 4))
    filled = DynamicCache()  # no config: layers are created on first use, here by a 2-layer model
    with torch.no_grad():
        build(QKVShareForCausalLM, tiny("Q-K=V"))(ids, cache=filled, use_cache=True)
    three_layers = build(QKVShareForCausalLM, tiny("Q-K=V", num_hidden_layers=3))
    for cache in (filled, DynamicCache(config=tiny("Q-K=V"))):
        with pytest.raises(ValueError, match="the DynamicCache has 2 layers but this model has 3"):
            three_layers(ids, cache=cache, use_cache=True)
    assert filled.get_seq_length() == 4
    with pytest.raises(ValueError, match="cache must be a transformers Cache, got a tuple"):
        three_layers(ids, cache=((ids, ids),), use_cache=True)
    # An empty DynamicCache() (its layers appear on first use) fits any model.
    with torch.no_grad():
        assert three_layers(ids, cache=DynamicCache(), use_cache=True).cache.get_seq_length() == 4


def test_linear_kernel_refuses_foreign_cache():
    model = build(QKVShareForCausalLM, tiny("Q=K=V", position_embedding_type="learned", attention_kernel="linear"))
    with pytest.raises(ValueError, match="attention_kernel='linear' keeps a constant-size state .* got a DynamicCache"):
        model(torch.randint(3, VOCAB, (1, 4)), cache=DynamicCache(config=model.config), use_cache=True)


# ---------------------------------------------------------------- attention_mask and input shapes
def test_attention_mask_of_the_wrong_shape_is_refused():
    model = build(QKVShareForCausalLM, tiny("Q-K=V"))
    ids = torch.randint(3, VOCAB, (1, 3))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 3\) but input_ids has shape \(1, 3\)"):
        model(ids, attention_mask=torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 5\) but input_ids has shape \(1, 3\)"):
        model(ids, attention_mask=torch.ones(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask must be 2D .* or 4D .* got shape \(1, 1, 3\)"):
        model(ids, attention_mask=torch.ones(1, 1, 3))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 1, 3, 2\) .* = \(1 or 1, heads or 1, 3, 3\)"):
        model(ids, attention_mask=torch.zeros(1, 1, 3, 2))
    # With a cache the 2D mask covers cached + new tokens.
    cache = QKVShareCache(config=model.config)
    model(ids, cache=cache, use_cache=True)
    message = (
        r"attention_mask has shape \(1, 1\) but input_ids has shape \(1, 1\) and the cache holds 3 tokens: .*\(1, 4\)"
    )
    with pytest.raises(ValueError, match=message):
        model(ids[:, :1], cache=cache, attention_mask=torch.ones(1, 1, dtype=torch.long))
    assert cache.get_seq_length() == 3


def _as_4d(mask: torch.Tensor, boolean: bool) -> torch.Tensor:
    """Causal + padding (B, T) -> (B, 1, T, T); the diagonal stays open so that no padded row is fully masked."""
    length = mask.shape[1]
    allowed = torch.ones(length, length, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
    allowed = allowed | torch.eye(length, dtype=torch.bool)
    if boolean:
        return allowed
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", ["Q-K=V", "(Q=K=V)+"])
def test_4d_custom_masks_keep_working(variant, attn):
    model = build(QKVShareForCausalLM, tiny(variant, kv_tie_point="pre_rope"), attn)
    ids, mask = left_padded_batch()
    real = mask.bool()
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        for boolean in (False, True):
            logits = model(ids, attention_mask=_as_4d(mask, boolean)).logits
            torch.testing.assert_close(logits[real], reference[real], rtol=0, atol=1e-5)
        # a 4D mask for one decoding step after a cached prefix: (B, 1, 1, cached + 1)
        cache = QKVShareCache(config=model.config)
        model(ids[:, :6], attention_mask=mask[:, :6], cache=cache, use_cache=True)
        step = model(ids[:, 6:], attention_mask=_as_4d(mask, False)[:, :, 6:], cache=cache).logits
    torch.testing.assert_close(step[:, 0], reference[:, 6], rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 0), (0, 3)])
def test_empty_inputs_are_refused(shape):
    model = build(QKVShareForCausalLM, tiny("Q-K=V"))
    with pytest.raises(ValueError, match=rf"input_ids has shape \({shape[0]}, {shape[1]}\): no tokens to run"):
        model(torch.zeros(shape, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"inputs_embeds has shape \({shape[0]}, {shape[1]}, 64\): no tokens"):
        model(inputs_embeds=torch.zeros(*shape, 64))
    with pytest.raises(ValueError, match=r"input_ids must have shape \(batch, sequence\), got \(5,\)"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"inputs_embeds must have shape \(batch, sequence, 64\), got \(1, 3, 7\)"):
        model(inputs_embeds=torch.zeros(1, 3, 7))


# ---------------------------------------------------------------- transformers' generation test mixin
class QKVShareGenerationChecks(unittest.TestCase):
    """The cache check of transformers' `GenerationTesterMixin` (tests/generation/test_utils.py), for QKVShare.

    transformers' generic `_check_past_key_values_for_generate(batch_size, past_key_values, seq_length, config)`
    asserts that every cache layer holds `keys` and `values` of shape (batch, kv_heads, seq_length, head_dim); a
    tied layer holds one tensor (`values` is None), so a QKVShare test class built on the mixin overrides it so.
    """

    def _check_past_key_values_for_generate(self, batch_size, past_key_values, seq_length, config):
        self.assertIsInstance(past_key_values, QKVShareCache)
        self.assertEqual(len(past_key_values.layers), config.num_hidden_layers)
        shape = (batch_size, config.num_key_value_heads, seq_length, config.head_dim)
        for layer_idx, layer in enumerate(past_key_values.layers):
            self.assertEqual(layer.keys.shape, shape)
            if config.is_kv_tied(layer_idx):
                self.assertIsNone(layer.values)  # the one cached tensor is read as both key and value
            else:
                self.assertEqual(layer.values.shape, shape)
        if config.needs_key_positions:
            self.assertEqual(past_key_values.positions.shape, (batch_size, seq_length))
        else:
            self.assertIsNone(past_key_values.positions)


@pytest.mark.parametrize(
    "config",
    [tiny("QKV"), tiny(layer_projection_sharing=["none", "kv"], kv_tie_point="pre_rope"), tiny("(Q=K=V)+")],
    ids=["untied", "mixed-tied-pre-rope", "tied-plus"],
)
@pytest.mark.parametrize("num_beams", [1, 2])
def test_generation_mixin_cache_check(config, num_beams):
    # As transformers' `_check_generate_outputs` calls it: internal batch = batch * beams, cache length = output - 1.
    model = build(QKVShareForCausalLM, config)
    ids = torch.randint(3, VOCAB, (2, 5))
    output = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=3,
        num_beams=num_beams,
        do_sample=False,
        return_dict_in_generate=True,
        use_cache=True,
    )
    checks = QKVShareGenerationChecks()
    kwargs = dict(batch_size=2 * num_beams, past_key_values=output.past_key_values, config=model.config)
    checks._check_past_key_values_for_generate(seq_length=output.sequences.shape[1] - 1, **kwargs)
    with pytest.raises(AssertionError):  # the check can fail
        checks._check_past_key_values_for_generate(seq_length=output.sequences.shape[1], **kwargs)
