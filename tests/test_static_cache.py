"""The static tied cache (`QKVShareStaticCache`): exact decoding for every mode, `generate(cache_implementation=
"static")` equal to the dynamic cache, one preallocated buffer per tied layer, its bytes, and refusals. Tiny configs,
fp32, CPU."""

import pytest
import torch
from test_core import COMBOS, VOCAB, model_for, tiny
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from qkvshare import QKVShareCache, QKVShareConfig, QKVShareForCausalLM, QKVShareStaticCache, TiedStaticLayer

MAX_LEN = 16  # longer than the 12 tokens decoded: the last slots stay unwritten (the mask must hide them)


def _decode(model, ids: torch.Tensor, cache: QKVShareStaticCache, chunks: list[int]) -> torch.Tensor:
    """Logits of `ids` fed through `cache` in pieces of the given lengths."""
    logits, start = [], 0
    with torch.no_grad():
        for length in chunks:
            logits.append(model(ids[:, start : start + length], cache=cache, use_cache=True).logits)
            start += length
    return torch.cat(logits, 1)


@pytest.mark.parametrize("name", COMBOS)
def test_static_decoding_equals_full_forward(name):
    model = model_for(COMBOS[name])
    config = model.config
    ids = torch.randint(3, VOCAB, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
    cache = QKVShareStaticCache(config, max_cache_len=MAX_LEN)
    torch.testing.assert_close(_decode(model, ids, cache, [1] * 12), full, rtol=0, atol=2e-6)
    cache = QKVShareStaticCache(config, max_cache_len=MAX_LEN)
    torch.testing.assert_close(_decode(model, ids, cache, [5, 7]), full, rtol=0, atol=2e-6)  # prefill, then more
    # A tied layer holds one (B, H_kv, max_len, D) buffer, returned (and exposed as `values`) as key and value.
    for layer_idx, layer in enumerate(cache.layers):
        tied = config.is_kv_tied(layer_idx)
        assert type(layer) is (TiedStaticLayer if tied else StaticLayer)
        assert layer.keys.shape == (2, config.num_key_value_heads, MAX_LEN, config.head_dim)
        assert (layer.values is layer.keys) == tied and layer.values is not None
    assert cache.get_seq_length() == 12
    if config.needs_key_positions:  # written where the tokens are, zeros in the unwritten slots
        assert torch.equal(
            cache.positions, torch.cat([torch.arange(12), torch.zeros(4, dtype=torch.long)]).expand(2, -1)
        )
    else:
        assert cache.positions is None


@pytest.mark.parametrize("name", COMBOS)
def test_generate_static_equals_dynamic_on_a_left_padded_batch(name):
    model = model_for(COMBOS[name])
    model.generation_config.pad_token_id = 0
    ids = torch.randint(3, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    dynamic = model.generate(ids, **kwargs)
    static = model.generate(ids, cache_implementation="static", **kwargs)
    assert type(dynamic.cache) is QKVShareCache and type(static.cache) is QKVShareStaticCache
    assert static.cache.max_cache_len == 7 + 5 - 1  # sized by transformers: the last token is never fed back
    assert torch.equal(static.sequences, dynamic.sequences)


@pytest.mark.parametrize(
    "name,tied_layers",
    [("QKV", 0), ("Q-K=V/post", 2), ("(Q=K=V)+/pre", 2), ("mix/pre", 2), ("GQA-2", 0), ("Q-GQA-2/pre", 2)],
)
def test_nbytes_counts_the_allocated_buffers(name, tied_layers):
    config = COMBOS[name]
    model = model_for(config)
    cache = QKVShareStaticCache(model.config, max_cache_len=MAX_LEN)
    _decode(model, torch.randint(3, VOCAB, (3, 5)), cache, [5])  # 5 of 16 slots written: all 16 are counted
    layers, heads, head_dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    buffer = 3 * heads * MAX_LEN * head_dim * 4  # (B, H_kv, max_len, D) fp32
    positions = 3 * MAX_LEN * 8 if config.needs_key_positions else 0  # (B, max_len) int64
    assert cache.nbytes() == (2 * layers - tied_layers) * buffer + positions
    assert sum(cache.layer_nbytes(i) for i in range(layers)) == (2 * layers - tied_layers) * buffer


def test_tied_static_cache_is_half_of_transformers_static_cache():
    model = model_for(COMBOS["Q-K=V/post"])
    ids = torch.randint(3, VOCAB, (2, 6))
    ours, theirs = QKVShareStaticCache(model.config, max_cache_len=MAX_LEN), StaticCache(model.config, MAX_LEN)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, cache=ours, use_cache=True).logits, model(ids, cache=theirs, use_cache=True).logits
        )
    held = sum(t.nbytes for layer in theirs.layers for t in (layer.keys, layer.values))
    assert ours.nbytes() * 2 == held == 2 * 2 * 2 * 4 * MAX_LEN * 16 * 4  # K and V, layers, B, H, len, D, fp32


@pytest.mark.parametrize("name", ["Q-K=V/pre", "(Q=K=V)+/pre", "mix+/learned", "QKV"])
def test_crop_and_reset_rewrite_the_slots(name):
    # Assisted decoding crops rejected tokens: the next tokens overwrite their slots (and positions).
    model = model_for(COMBOS[name])
    ids = torch.randint(3, VOCAB, (2, 10))
    other = torch.randint(3, VOCAB, (2, 3))
    with torch.no_grad():
        full = model(ids).logits
    cache = QKVShareStaticCache(model.config, max_cache_len=MAX_LEN)
    _decode(model, torch.cat([ids[:, :7], other], 1), cache, [7, 3])
    cache.crop(-3)
    assert cache.get_seq_length() == 7
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, 7:], cache=cache).logits, full[:, 7:], rtol=0, atol=2e-6)
    cache.reset()
    assert cache.get_seq_length() == 0
    torch.testing.assert_close(_decode(model, ids, cache, [4, 6]), full, rtol=0, atol=2e-6)


def test_static_cache_built_for_another_model_is_refused():
    model = model_for(COMBOS["Q-K=V/pre"])
    cache = QKVShareStaticCache(tiny("Q-K=V"), max_cache_len=MAX_LEN)
    with pytest.raises(ValueError, match="this QKVShareStaticCache was built for a different model") as err:
        model(torch.randint(3, VOCAB, (1, 4)), cache=cache, use_cache=True)
    assert "kv_tie_point: 'post_rope' vs 'pre_rope'" in str(err.value)
    assert f"QKVShareStaticCache(config=model.config, max_cache_len={MAX_LEN})" in str(err.value)
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0  # refused before anything was allocated


@pytest.mark.parametrize(
    "config,max_cache_len,message",
    [
        (tiny("Q-K=V"), 0, "max_cache_len must be a positive int .* got 0"),
        (tiny("Q-K=V"), 8.0, "max_cache_len must be a positive int .* got 8.0"),
        (
            tiny("Q=K=V", position_embedding_type="learned", attention_kernel="linear"),
            8,
            "attention_kernel='linear' keeps a constant-size state, which has no static form",
        ),
    ],
    ids=["zero-length", "float-length", "linear-kernel"],
)
def test_bad_static_cache_arguments_are_refused(config, max_cache_len, message):
    with pytest.raises(ValueError, match=message):
        QKVShareStaticCache(config, max_cache_len=max_cache_len)


@pytest.mark.parametrize("static", [False, True])
def test_cache_filled_for_another_batch_size_is_refused(static):
    """A cache holding states of batch 2 fed a batch of 1 raises a ValueError naming both sizes (it used to fail
    inside torch.cat / index_copy_)."""
    config = QKVShareConfig.from_preset("tiny", "Q-K=V")
    model = QKVShareForCausalLM(config).eval()
    cache = QKVShareStaticCache(config=config, max_cache_len=16) if static else QKVShareCache(config=config)
    model(torch.tensor([[1, 2, 3], [4, 5, 6]]), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="holds states for a batch of 2, but the input has a batch of 1"):
        model(torch.tensor([[7]]), cache=cache, use_cache=True)
    model(torch.tensor([[7], [8]]), cache=cache, use_cache=True)  # the cached batch size still works
    assert cache.get_seq_length() == 4


def test_generated_caches_are_the_transformers_kinds_they_stand_for():
    """transformers (and its generation tests) tell cache kinds apart with isinstance: a static generation's cache is
    a StaticCache (so `output_attentions` shapes follow the buffer length) and the default one a DynamicCache."""
    model = model_for(tiny("Q-K=V"))
    ids = torch.randint(3, VOCAB, (2, 5))
    static = model.generate(
        ids, max_new_tokens=3, do_sample=False, cache_implementation="static", return_dict_in_generate=True
    )
    dynamic = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert isinstance(static.cache, StaticCache) and isinstance(static.cache, QKVShareStaticCache)
    assert not isinstance(static.cache, DynamicCache)
    assert isinstance(dynamic.cache, DynamicCache) and isinstance(dynamic.cache, QKVShareCache)
    assert torch.equal(static.sequences, dynamic.sequences)


def test_a_shorter_static_generation_keeps_the_cache_length():
    """A second, shorter generation gets a cache as long as the first one's: a compiled forward then sees the same
    shapes and does not recompile (transformers' own rule for its StaticCache)."""
    model = model_for(tiny("Q-K=V"))
    ids = torch.randint(3, VOCAB, (1, 5))
    first = model.generate(
        ids, max_new_tokens=6, do_sample=False, cache_implementation="static", return_dict_in_generate=True
    )
    second = model.generate(
        ids, max_new_tokens=2, do_sample=False, cache_implementation="static", return_dict_in_generate=True
    )
    assert first.cache.max_cache_len == second.cache.max_cache_len == 10  # 5 + 6 tokens, the last one not cached
    assert second.cache.layers[0].keys.shape[2] == 10
    assert torch.equal(second.sequences, first.sequences[:, :7])
