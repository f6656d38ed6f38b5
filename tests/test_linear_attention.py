"""The Q=K=V linear-attention recurrence (paper appendix A.1): parallel form == recurrent decode, constant cache."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import Cache

from qkvshare.cache_qkvshare import LinearAttentionStateLayer
from qkvshare.configuration_qkvshare import QKVShareConfig
from qkvshare.linear_attention_qkvshare import FEATURE_MAPS, QKVShareLinearAttention


def make_config(**overrides) -> QKVShareConfig:
    fields = dict(attention_kernel="linear", position_embedding_type="learned", attention_bias=True)
    fields.update(overrides)
    return QKVShareConfig.from_preset("tiny", variant="Q=K=V", **fields)


def make_attention(seed: int = 0, **kwargs) -> QKVShareLinearAttention:
    config_fields = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith("linear_attention")}
    torch.manual_seed(seed)
    attention = QKVShareLinearAttention(make_config(**config_fields), layer_idx=0, **kwargs)
    return attention.eval()


def make_cache() -> Cache:
    return Cache(layers=[LinearAttentionStateLayer()])


def reference_loop(attention: QKVShareLinearAttention, x: torch.Tensor) -> torch.Tensor:
    """The appendix recurrence written out token by token, independently of the module's chunked code."""
    B, T, _ = x.shape
    H, D = attention.num_heads, attention.head_dim
    z = attention.k_proj(x).view(B, T, H, D).float()
    phi = attention.feature_map
    S = torch.zeros(B, H, D, D)
    n = torch.zeros(B, H, D)
    ys = []
    for t in range(T):
        zt = z[:, t]  # (B, H, D)
        S = attention.decay * S + phi(zt)[..., :, None] * zt[..., None, :]  # S_t = lambda S_{t-1} + phi(z_t) z_t^T
        n = attention.decay * n + phi(zt)
        y = (phi(zt)[..., None, :] @ S)[..., 0, :]  # y_t = phi(z_t)^T S_t
        if attention.normalize:
            y = y / ((phi(zt) * n).sum(-1, keepdim=True) + attention.eps)
        ys.append(y)
    y = torch.stack(ys, dim=1).reshape(B, T, H * D)
    return attention.o_proj(y)


@pytest.mark.parametrize(
    "feature_map,decay,normalize,chunk_size",
    [("elu_plus_one", 1.0, True, 64), ("elu_plus_one", 0.9, True, 4), ("relu", 0.8, False, 5), ("relu", 1.0, True, 3)],
)
def test_parallel_form_equals_reference_recurrence(feature_map, decay, normalize, chunk_size):
    attention = make_attention(
        linear_attention_feature_map=feature_map,
        linear_attention_decay=decay,
        normalize=normalize,
        chunk_size=chunk_size,
    )
    x = torch.randn(2, 13, attention.config.hidden_size)
    with torch.no_grad():
        out, weights = attention(x)
        expected = reference_loop(attention, x)
    assert weights is None
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.parametrize("decay,normalize", [(1.0, True), (0.7, True), (0.9, False)])
def test_recurrent_decode_equals_parallel_forward(decay, normalize):
    attention = make_attention(linear_attention_decay=decay, normalize=normalize, chunk_size=4)
    x = torch.randn(2, 11, attention.config.hidden_size)
    with torch.no_grad():
        full, _ = attention(x)
        # prefill 5 tokens, then one token at a time from the cache: the recurrent form
        cache = make_cache()
        steps = [attention(x[:, :5], cache=cache)[0]]
        for t in range(5, 11):
            steps.append(attention(x[:, t : t + 1], cache=cache)[0])
    # fp32 summation order differs between the forms: tolerance relative to the output scale (the unnormalized
    # readout grows with t)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-6 * float(full.abs().max()))
    assert cache.get_seq_length() == 11


def test_cache_size_constant_in_sequence_length():
    attention = make_attention()
    H, D = attention.num_heads, attention.head_dim
    x = torch.randn(3, 50, attention.config.hidden_size)
    sizes, lengths = {}, {}
    with torch.no_grad():
        cache = make_cache()
        for t in range(50):
            attention(x[:, t : t + 1], cache=cache)
            if t + 1 in (5, 50):
                sizes[t + 1] = cache.layers[0].nbytes()
                lengths[t + 1] = cache.get_seq_length()
    assert sizes[5] == sizes[50] == 3 * H * (D * D + D) * 4  # fp32 state S (D x D) + normalizer n (D) per head
    assert lengths == {5: 5, 50: 50}
    assert cache.get_mask_sizes(1, 0) == (51, 0)
    unnormalized = make_attention(normalize=False)
    cache = make_cache()
    with torch.no_grad():
        unnormalized(x[:, :7], cache=cache)
    assert cache.layers[0].nbytes() == 3 * H * D * D * 4 and cache.layers[0].normalizer is None


def test_decay_is_honored_in_the_state():
    attention = make_attention(linear_attention_decay=0.5, normalize=False)
    x = torch.randn(1, 3, attention.config.hidden_size)
    with torch.no_grad():
        cache = make_cache()
        attention(x, cache=cache)
        z = attention.k_proj(x).view(1, 3, attention.num_heads, attention.head_dim).float()
    phi = attention.feature_map
    outer = [phi(z[:, t])[..., :, None] * z[:, t][..., None, :] for t in range(3)]
    expected = 0.25 * outer[0] + 0.5 * outer[1] + outer[2]
    torch.testing.assert_close(cache.layers[0].state, expected, rtol=1e-5, atol=1e-6)
    # lambda changes the output beyond the first token, not on it
    no_decay = make_attention(linear_attention_decay=1.0, normalize=False)
    with torch.no_grad():
        a, b = attention(x)[0], no_decay(x)[0]
    torch.testing.assert_close(a[:, 0], b[:, 0])
    assert (a[:, 2] - b[:, 2]).abs().max() > 1e-3


def test_padding_does_not_enter_the_state():
    attention = make_attention(linear_attention_decay=0.9)
    x = torch.randn(1, 6, attention.config.hidden_size)
    padded = torch.cat([torch.randn(1, 3, attention.config.hidden_size), x], dim=1)  # 3 left-padding tokens
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        plain, _ = attention(x)
        out, _ = attention(padded, attention_mask=mask)
        # the same padding as a 4D additive mask (the eager path of the model)
        mask4 = torch.zeros(1, 1, 9, 9).masked_fill(~mask.bool()[:, None, None, :], torch.finfo(torch.float32).min)
        out4, _ = attention(padded, attention_mask=mask4)
    torch.testing.assert_close(out[:, 3:], plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out4, out)


def test_cache_operations():
    attention = make_attention()
    x = torch.randn(3, 4, attention.config.hidden_size)
    cache = make_cache()
    with torch.no_grad():
        attention(x, cache=cache)
    layer = cache.layers[0]
    before = layer.state.clone()
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    torch.testing.assert_close(layer.state, before[[2, 2, 0]])
    cache.crop(0)  # a no-op is allowed
    with pytest.raises(ValueError, match="cannot be rolled back"):
        cache.crop(-1)
    cache.batch_repeat_interleave(2)
    assert layer.state.shape[0] == 6 and layer.normalizer.shape[0] == 6
    cache.reset()
    assert layer.nbytes() == 0 and cache.get_seq_length() == 0


def test_errors_are_clear():
    attention = make_attention()
    from transformers.cache_utils import DynamicCache

    with pytest.raises(ValueError, match="needs a LinearAttentionStateLayer in cache slot 0, got DynamicLayer"):
        attention(torch.randn(1, 2, attention.config.hidden_size), cache=DynamicCache(config=attention.config))
    with pytest.raises(ValueError, match="projection_sharing='qkv'"):
        QKVShareConfig.from_preset(
            "tiny", variant="Q-K=V", attention_kernel="linear", position_embedding_type="learned"
        )
    # parameters: k_proj and o_proj only (Q=K=V), Llama names
    assert sorted(name.split(".")[0] for name, _ in attention.named_parameters()) == ["k_proj"] * 2 + ["o_proj"] * 2
    assert set(FEATURE_MAPS) == {"elu_plus_one", "relu"}


def test_causal_lm_with_linear_kernel_decodes_exactly_with_constant_cache():
    from qkvshare import QKVShareCache, QKVShareForCausalLM

    torch.manual_seed(0)
    config = make_config(linear_attention_decay=0.95, vocab_size=50)
    assert config.kv_cache_bytes_per_token() == 0  # no per-token cache: the state is constant-size
    model = QKVShareForCausalLM(config).eval()
    assert all(isinstance(layer.self_attn, QKVShareLinearAttention) for layer in model.model.layers)
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        cache = QKVShareCache(config=config)
        steps = [model(ids[:, :4], cache=cache, use_cache=True).logits]
        sizes = [cache.nbytes()]
        for t in range(4, 12):
            steps.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
            sizes.append(cache.nbytes())
        generated = model.generate(
            ids[:, :5], attention_mask=torch.ones(2, 5, dtype=torch.long), max_new_tokens=6, do_sample=False
        )
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
    assert isinstance(cache.layers[0], LinearAttentionStateLayer) and cache.get_seq_length() == 12
    assert len(set(sizes)) == 1  # constant in the sequence length
    # greedy generation from the recurrent cache equals greedy argmax over full forwards
    expected = ids[:, :5]
    with torch.no_grad():
        for _ in range(6):
            expected = torch.cat([expected, model(expected).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, expected)
