"""Every cache kind has a tied form: sliding-window (dynamic and static) and quantized (quanto, fp8) caches decode like
the full forward, `generate(cache_implementation=...)` picks the tied caches and gives the dynamic-cache tokens, tied
layers hold one tensor (one buffer, one windowed tensor, one quantized tensor), `nbytes()` equals theory, and bad
windows, layouts and options are refused. Tiny configs (2 layers), fp32, CPU."""

import pytest
import torch
from test_core import VOCAB, model_for, tiny
from transformers import DynamicCache, GenerationConfig, QuantizedCache
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    Fp8QuantizedLayer,
    QuantoQuantizedLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from qkvshare import (
    QKVShareCache,
    QKVShareQuantizedCache,
    QKVShareStaticCache,
    TiedFp8QuantizedLayer,
    TiedKVLayer,
    TiedQuantoQuantizedLayer,
    TiedSlidingWindowLayer,
    TiedStaticLayer,
    TiedStaticSlidingWindowLayer,
)
from qkvshare.cache_qkvshare import cache_layer_nbytes

WINDOW = 4
HYBRID = ["sliding_attention", "full_attention"]  # layer 0 slides, layer 1 sees everything
# One tiny model per mode: a per-layer mix, both tie points, "+", GQA and MQA.
MODES = {
    "mix/pre": dict(variant="QKV", layer_projection_sharing=["none", "kv"], kv_tie_point="pre_rope"),
    "Q=K=V/post": dict(variant="Q=K=V"),
    "(Q=K=V)+/pre": dict(variant="(Q=K=V)+", kv_tie_point="pre_rope"),
    "Q-GQA-2/pre": dict(variant="Q-GQA-2", kv_tie_point="pre_rope"),
    "Q-MQA/post": dict(variant="Q-MQA"),
}
# cache kind -> (tied class, untied class) of layer 0 (sliding) and layer 1 (full attention)
LAYER_CLASSES = {
    "dynamic": [(TiedSlidingWindowLayer, DynamicSlidingWindowLayer), (TiedKVLayer, DynamicLayer)],
    "static": [(TiedStaticSlidingWindowLayer, StaticSlidingWindowLayer), (TiedStaticLayer, StaticLayer)],
}


def config_for(mode: str, **overrides):
    fields = dict(MODES[mode])
    return tiny(fields.pop("variant"), **fields, **overrides)


def sliding_model(mode: str, layer_types: list[str] | None = HYBRID):
    return model_for(config_for(mode, sliding_window=WINDOW, layer_types=layer_types))


def held_tokens(layer) -> int:
    return layer.keys.shape[-2]


# ---------------------------------------------------------------- sliding window: attention and cache
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", ["mix/pre", "(Q=K=V)+/pre"])
def test_sliding_attention_equals_a_full_forward_with_a_banded_mask(mode, attn):
    """Every layer slides (Mistral style): logits equal the same weights without a window under a hand-built mask
    that lets query i see keys i - WINDOW + 1 .. i."""
    sliding = model_for(config_for(mode, sliding_window=WINDOW), attn)
    full = model_for(config_for(mode), attn)
    full.load_state_dict(sliding.state_dict())
    ids = torch.randint(3, VOCAB, (2, 10))
    i, j = torch.arange(10)[:, None], torch.arange(10)[None, :]
    banded = ((j <= i) & (j > i - WINDOW))[None, None].expand(2, 1, 10, 10)  # (B, 1, q, kv), True = attend
    with torch.no_grad():
        expected = full(ids, attention_mask=banded).logits
        torch.testing.assert_close(sliding(ids).logits, expected, rtol=0, atol=2e-6)
        # the window matters: without it the logits differ
        assert (full(ids).logits - expected).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("mode", MODES)
def test_sliding_decoding_equals_full_forward_and_keeps_only_the_window(mode, kind):
    model = sliding_model(mode)
    config = model.config
    ids = torch.randint(3, VOCAB, (2, 12))

    def new_cache():
        return QKVShareCache(config) if kind == "dynamic" else QKVShareStaticCache(config, max_cache_len=16)

    with torch.no_grad():
        full = model(ids).logits
        cache, steps = new_cache(), []
        for t in range(12):
            steps.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
            # The sliding layer never holds more than the window: the dynamic form keeps WINDOW - 1 tokens between
            # forwards, the static form a WINDOW-slot buffer; its positions follow the same window.
            limit = min(t + 1, WINDOW - 1) if kind == "dynamic" else WINDOW
            assert held_tokens(cache.layers[0]) == limit
            if config.needs_key_positions:
                positions = cache.position_layers["sliding_attention"].keys[:, 0, :, 0]
                if kind == "dynamic" or t + 1 >= WINDOW:
                    kept = torch.arange(t + 1)[-limit:] if kind == "dynamic" else torch.arange(t + 1 - WINDOW, t + 1)
                    assert torch.equal(positions, kept.expand(2, -1))
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=2e-6)
        cache = new_cache()  # prefill longer than the window, then several tokens at once
        chunks = [model(ids[:, :5], cache=cache, use_cache=True).logits, model(ids[:, 5:], cache=cache).logits]
        torch.testing.assert_close(torch.cat(chunks, 1), full, rtol=0, atol=2e-6)
    # layer 0 (sliding) holds one windowed tensor when tied, layer 1 (full attention) one tensor / one buffer
    for layer_idx, layer in enumerate(cache.layers):
        tied = config.is_kv_tied(layer_idx)
        tied_class, untied_class = LAYER_CLASSES[kind][layer_idx]
        assert type(layer) is (tied_class if tied else untied_class)
        # one tensor: a dynamic tied layer has no values, a static one exposes its one buffer as both
        assert (layer.values is (None if kind == "dynamic" else layer.keys)) == tied
    assert held_tokens(cache.layers[1]) == (12 if kind == "dynamic" else 16)


# ---------------------------------------------------------------- generate() picks the tied caches
def test_cache_implementation_names_pick_the_tied_caches():
    model = model_for(tiny("Q-K=V", sliding_window=WINDOW, layer_types=HYBRID))
    expected = {
        None: QKVShareCache,
        "dynamic": QKVShareCache,
        "static": QKVShareStaticCache,
        "hybrid": QKVShareStaticCache,  # transformers' deprecated static names: the structure comes from the config
    }
    for name, cache_class in expected.items():
        cache = model.tied_cache_for_generation(GenerationConfig(cache_implementation=name, max_cache_len=20), 12)
        assert type(cache) is cache_class and not cache.offloading
        assert type(cache.layers[0]) is (
            TiedSlidingWindowLayer if cache_class is QKVShareCache else TiedStaticSlidingWindowLayer
        )
        assert getattr(cache, "max_cache_len", 20) == 20  # sized for max(this call, max_cache_len)
    quantized = model_for(tiny("Q-K=V")).tied_cache_for_generation(
        GenerationConfig(cache_implementation="quantized", cache_config={"backend": "fp8"}), 12
    )
    assert type(quantized) is QKVShareQuantizedCache and quantized.backend == "fp8"
    assert model.tied_cache_for_generation(GenerationConfig(cache_implementation="paged"), 12) is None  # transformers'


@pytest.mark.parametrize("mode", MODES)
def test_generate_static_equals_the_dynamic_cache_past_the_window(mode):
    """A left-padded batch whose prompt and generation go past the window: "static" (and transformers' own sliding
    DynamicCache where the model accepts it) give the tokens of the default (dynamic) cache."""
    model = sliding_model(mode)
    model.generation_config.pad_token_id = 0
    ids = torch.randint(3, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    default = model.generate(ids, **kwargs)
    static = model.generate(ids, cache_implementation="static", **kwargs)
    assert (type(default.cache), type(static.cache)) == (QKVShareCache, QKVShareStaticCache)
    assert torch.equal(static.sequences, default.sequences)
    if not model.config.attention_map_pe_dim:  # "+" refuses foreign caches
        theirs = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
        assert torch.equal(theirs.sequences, default.sequences)


def test_beam_search_and_prompt_lookup_with_sliding_caches():
    """Beam search reorders the windowed tensors and their positions alike (static equals dynamic); prompt-lookup
    decoding gives the greedy tokens."""
    model = sliding_model("(Q=K=V)+/pre")
    ids = torch.randint(3, VOCAB, (1, 7))
    ids = torch.cat([ids, ids], 1)  # a repeated prompt: prompt lookup finds candidates
    kwargs = dict(max_new_tokens=6, do_sample=False)
    beams = model.generate(ids, num_beams=3, **kwargs)
    assert torch.equal(model.generate(ids, num_beams=3, cache_implementation="static", **kwargs), beams)
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=3, **kwargs), model.generate(ids, **kwargs))


@pytest.mark.parametrize("implementation", ["offloaded", "offloaded_static"])
def test_offloaded_caches_are_tied_and_need_cuda(implementation):
    model = model_for(tiny("Q-K=V"))
    if torch.cuda.is_available():  # the real offloading path: equal tokens, tied layers
        model = model.cuda()
        ids = torch.randint(3, VOCAB, (1, 6), device="cuda")
        out = model.generate(ids, cache_implementation=implementation, max_new_tokens=4, return_dict_in_generate=True)
        assert out.cache.offloading and out.cache.layers[0].values is None
        assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=4, do_sample=False))
        return
    with pytest.raises(ValueError, match="offloading=True .* CUDA is not available"):
        model.generate(torch.randint(3, VOCAB, (1, 6)), cache_implementation=implementation, max_new_tokens=4)


# ---------------------------------------------------------------- quantized caches
@pytest.mark.parametrize(
    "mode,backend", [(mode, "fp8") for mode in MODES] + [("mix/pre", "quanto"), ("(Q=K=V)+/pre", "quanto")]
)
def test_quantized_decoding_is_within_quantization_error(mode, backend):
    model = model_for(config_for(mode))
    options = dict(q_group_size=16, residual_length=4) if backend == "quanto" else {}
    ids = torch.randint(3, VOCAB, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        cache = QKVShareQuantizedCache(model.config, backend=backend, **options)
        logits = [model(ids[:, :5], cache=cache, use_cache=True).logits]
        logits += [model(ids[:, t : t + 1], cache=cache).logits for t in range(5, 12)]
    error = (torch.cat(logits, 1) - full).abs().max().item()
    assert 0 < error < (0.05 if backend == "quanto" else 0.02), error  # quantized (not exact), yet close
    tied_class, untied_class = {
        "quanto": (TiedQuantoQuantizedLayer, QuantoQuantizedLayer),
        "fp8": (TiedFp8QuantizedLayer, Fp8QuantizedLayer),
    }[backend]
    for layer_idx, layer in enumerate(cache.layers):
        tied = model.config.is_kv_tied(layer_idx)
        assert type(layer) is (tied_class if tied else untied_class)
        # a tied layer holds one quantized tensor (and one residual buffer), an untied one two of each
        assert layer._quantized_keys is not None and (layer._quantized_values is None) == tied
        assert (layer.values is None) == tied


@pytest.mark.parametrize("backend", ["quanto", "fp8"])
def test_tied_quantized_cache_equals_transformers_quantized_cache(backend):
    """For a post-RoPE tie, transformers' QuantizedCache quantizes K and V, which are the same tensor, exactly as the
    tied layer quantizes its one tensor: the logits are equal, at every flush of the residual buffer."""
    model = model_for(tiny("Q=K=V"))
    options = dict(q_group_size=16, residual_length=3) if backend == "quanto" else {}
    ours = QKVShareQuantizedCache(model.config, backend=backend, **options)
    theirs = QuantizedCache(backend=backend, config=model.config, **options)
    ids = torch.randint(3, VOCAB, (2, 11))
    with torch.no_grad():
        for start, end in [(0, 4)] + [(t, t + 1) for t in range(4, 11)]:
            torch.testing.assert_close(
                model(ids[:, start:end], cache=ours, use_cache=True).logits,
                model(ids[:, start:end], cache=theirs, use_cache=True).logits,
                rtol=0,
                atol=0,
            )
    # one quantized tensor and one residual buffer per layer against transformers' two: exactly half the bytes
    assert ours.nbytes() * 2 == sum(cache_layer_nbytes(layer) for layer in theirs.layers)


def test_generate_quantized_picks_the_tied_quantized_cache():
    model = model_for(tiny("Q-K=V"))
    out = model.generate(
        torch.randint(3, VOCAB, (1, 5)),
        cache_implementation="quantized",
        cache_config={"backend": "quanto", "nbits": 4, "q_group_size": 16, "residual_length": 2},
        max_new_tokens=4,
        return_dict_in_generate=True,
    )
    assert type(out.cache) is QKVShareQuantizedCache and out.sequences.shape == (1, 9)
    assert all(type(layer) is TiedQuantoQuantizedLayer for layer in out.cache.layers)
    with pytest.raises(ValueError, match=r"cache_config has unknown keys \['bits'\]"):
        model.generate(torch.tensor([[5, 6]]), cache_implementation="quantized", cache_config={"bits": 4})


# ---------------------------------------------------------------- bytes held, per kind
def test_nbytes_equals_theory_for_every_kind():
    config = tiny("Q-K=V", kv_tie_point="pre_rope", sliding_window=WINDOW, layer_types=HYBRID)
    model = model_for(config)
    batch, heads, dim, fp32, int64 = 3, config.num_key_value_heads, config.head_dim, 4, 8
    per_token = batch * heads * dim * fp32  # one (B, H_kv, 1, D) fp32 slice
    ids = torch.randint(3, VOCAB, (batch, 10))

    def run(cache, chunks=(5, 1, 1, 1, 1, 1)):
        with torch.no_grad():
            start = 0
            for length in chunks:
                model(ids[:, start : start + length], cache=cache, use_cache=True)
                start += length
        return cache

    # dynamic, 10 tokens: layer 0 keeps WINDOW - 1 tokens, layer 1 all 10; positions of both
    dynamic = run(QKVShareCache(config))
    assert dynamic.nbytes() == (WINDOW - 1 + 10) * (per_token + batch * int64)
    # static, 16 slots: layer 0 a WINDOW-slot buffer, layer 1 a 16-slot one, whatever was written
    static = run(QKVShareStaticCache(config, max_cache_len=16))
    assert static.nbytes() == (WINDOW + 16) * (per_token + batch * int64)

    flat = tiny("Q-K=V", kv_tie_point="pre_rope")
    model = model_for(flat)
    # quanto int4, groups of 16 (= D), residual 4: the 5-token prompt is quantized, then 3 decoded tokens wait in the
    # residual buffer and the 4th flushes all 9. Packed data: 4 bits per element; scale and zero-point: fp32 per group.
    quanto = run(QKVShareQuantizedCache(flat, backend="quanto", q_group_size=16, residual_length=4), (5, 1, 1, 1))
    quantized = batch * heads * 5 * dim
    per_layer = quantized // 2 + 2 * (quantized // 16) * fp32 + 3 * per_token
    assert quanto.nbytes() == 2 * per_layer + batch * 8 * int64
    assert quanto.layer_nbytes(0) == per_layer
    # fp8: one byte per element plus the fp32 scale of the tensor
    fp8 = run(QKVShareQuantizedCache(flat, backend="fp8"), (5, 1, 1, 1))
    assert fp8.layer_nbytes(1) == batch * heads * 8 * dim + fp32
    assert fp8.nbytes() == 2 * fp8.layer_nbytes(1) + batch * 8 * int64


# ---------------------------------------------------------------- refusals
def test_cache_built_for_another_window_is_refused():
    model = sliding_model("Q=K=V/post")
    for other, message in [
        (config_for("Q=K=V/post", sliding_window=8, layer_types=HYBRID), "sliding_window: 8 vs 4"),
        (config_for("Q=K=V/post", sliding_window=WINDOW), "attention types: layer 1 'sliding_attention' vs 'full"),
        (config_for("Q=K=V/post"), "layer 0 'full_attention' vs 'sliding_attention'"),
    ]:
        with pytest.raises(ValueError, match="was built for a different model") as err:
            model(torch.randint(3, VOCAB, (1, 4)), cache=QKVShareStaticCache(other, max_cache_len=8), use_cache=True)
        assert message in str(err.value)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(sliding_window=1), "sliding_window=1 must be None .* or an int >= 2"),
        (dict(sliding_window=4, layer_types=["full_attention"]), "layer_types has 1 entries but num_hidden_layers=2"),
        (dict(layer_types=["sliding_attention", "full_attention"]), r"layer_types\[0\]='sliding_attention' needs a"),
        (dict(sliding_window=4, layer_types=["chunked_attention"] * 2), r"layer_types\[0\]='chunked_attention' is not"),
    ],
    ids=["window-1", "short-layer-types", "no-window", "unknown-type"],
)
def test_bad_window_fields_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny("Q-K=V", **overrides)


@pytest.mark.parametrize(
    "config,options,message",
    [
        (tiny("Q-K=V"), dict(backend="int8"), "backend='int8' is not supported; allowed: 'quanto', 'hqq', 'fp8'"),
        (
            tiny("Q-K=V"),
            dict(backend="fp8", nbits=4),
            r"backend='fp8' quantizes per tensor and takes none of \['nbits'\]",
        ),
        (tiny("Q-K=V", sliding_window=4), dict(), "every layer must be a full-attention softmax layer"),
    ],
    ids=["unknown-backend", "fp8-with-bits", "sliding"],
)
def test_bad_quantized_cache_arguments_are_refused(config, options, message):
    with pytest.raises(ValueError, match=message):
        QKVShareQuantizedCache(config, **options)
