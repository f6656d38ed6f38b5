"""Q=K=V linear attention: the paper's appendix recurrence, with a constant-size cache.

With one projection for query, key and value (z_t = W x_t) and a positive feature map phi, kernelized attention
collapses into a recurrence (paper, appendix A.1):

    S_t = lambda * S_{t-1} + phi(z_t) z_t^T          (state, D x D per head)
    y_t = phi(z_t)^T S_t                              (input-dependent readout)

Design notes
- Normalization. The paper writes the numerator only. Unnormalized, |y_t| grows linearly with t (for lambda=1),
  which a pre-norm residual stream does not survive at LM lengths. So by default the readout is divided by
  phi(z_t)^T n_t with n_t = lambda * n_{t-1} + phi(z_t) (Katharopoulos et al. 2020, eq. 5: kernelized attention is
  normalized, y_t is then a weighted mean of the z_s). ``normalize=False`` gives exactly the paper's formula.
  Either way the state stays constant-size: S (B, H, D, D) and, when normalized, n (B, H, D).
- Two forms, one result. Full sequences use the chunked parallel form: inside a chunk of C tokens a masked matmul
  with decay powers lambda^(i-j); across chunks the carried state (inter-chunk term lambda^(i+1) phi(z_i)^T S).
  Decoding one token from a cache is the same code with C=1, which is the recurrence itself. Tests check the
  chunked form against a token-by-token loop written independently.
- The state is kept and computed in float32 whatever the model dtype (accumulating sums in bf16 drifts).
- Heads split like softmax attention (H heads of head_dim); parameters are Llama's names, `k_proj` and `o_proj`
  only (Q=K=V has no q_proj/v_proj). No 1/sqrt(d) scale: the normalized readout is scale-free in S, and phi is
  applied to the raw projection as in Katharopoulos et al.
- Padding: tokens marked as padding by the attention mask do not enter the state (their phi(z) and z are zeroed).
  The mask may be 2D (B, T_total) with 1 = keep, or a 4D (B, 1, T_q, T_total) boolean (True = attend) or additive
  float mask (0 = attend): the last query row tells which keys are real.
- The cache layer is `LinearAttentionStateLayer` in cache_qkvshare.py, next to the other cache layers (a transformers
  `CacheLayerMixin`, so `Cache.get_seq_length` works and the model's position ids advance). `crop` cannot undo a
  recurrence and raises; beam reordering and batch repeat/select act on the batch dimension of the state.
- This file imports only torch/transformers and package files with single-dot imports: `save_pretrained` copies it
  into checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.utils.deprecation import deprecate_kwarg

from .cache_qkvshare import LinearAttentionStateLayer
from .configuration_qkvshare import QKVShareConfig

FEATURE_MAPS = {
    # elu(x) + 1 > 0 everywhere (Katharopoulos et al. 2020): the normalizer never vanishes.
    "elu_plus_one": lambda x: F.elu(x) + 1.0,
    # relu(x) >= 0: can be exactly 0, hence the eps in the normalized readout.
    "relu": F.relu,
}


def _kept_tokens(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """(B, length) bool, True for real tokens among the `length` newest ones; None when nothing is masked."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:  # (B, T_total), 1 = real token
        keep = attention_mask[:, -length:].bool()
    elif attention_mask.dim() == 4:  # (B, 1, T_q, T_total); the last query row sees every real key
        row = attention_mask[:, 0, -1, -length:]
        keep = row if row.dtype == torch.bool else row == 0
    else:
        raise ValueError(
            f"attention_mask must be 2D (B, T) or 4D (B, 1, T_q, T_kv); got shape {tuple(attention_mask.shape)}."
        )
    return None if bool(keep.all()) else keep


def linear_attention_chunked(
    features: torch.Tensor,
    values: torch.Tensor,
    query_features: torch.Tensor,
    state: torch.Tensor | None,
    normalizer: torch.Tensor | None,
    decay: float,
    chunk_size: int,
    normalize: bool,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The recurrence over T tokens in chunks (all float32).

    Args:
        features: phi(z) of the tokens written into the state, (B, H, T, D) (zero for padding).
        values: z of the same tokens, (B, H, T, D) (zero for padding).
        query_features: phi(z) used for the readout, (B, H, T, D).
        state, normalizer: the carried (B, H, D, D) and (B, H, D), or None for an empty state.
    Returns:
        y (B, H, T, D), the new state, the new normalizer (None when `normalize` is False).
    """
    B, H, T, D = features.shape
    if state is None:
        state = features.new_zeros(B, H, D, D)
    if normalize and normalizer is None:
        normalizer = features.new_zeros(B, H, D)
    outputs = []
    for start in range(0, T, chunk_size):
        f = features[:, :, start : start + chunk_size]  # (B, H, C, D)
        v = values[:, :, start : start + chunk_size]  # (B, H, C, D)
        q = query_features[:, :, start : start + chunk_size]  # (B, H, C, D)
        C = f.shape[2]
        idx = torch.arange(C, device=f.device)
        # decay[i, j] = lambda^(i - j) for j <= i, else 0 (causal within the chunk)
        gaps = (idx[:, None] - idx[None, :]).to(f.dtype)
        intra = torch.where(gaps >= 0, decay**gaps, torch.zeros_like(gaps))  # (C, C)
        carry = (decay ** (idx + 1).to(f.dtype))[:, None]  # (C, 1): lambda^(i+1) on the carried state
        scores = (q @ f.transpose(-1, -2)) * intra  # (B, H, C, C)
        numerator = scores @ v + carry * (q @ state)  # (B, H, C, D)
        if normalize:
            denominator = scores.sum(-1) + carry[:, 0] * (q @ normalizer[..., None])[..., 0]  # (B, H, C)
            outputs.append(numerator / (denominator[..., None] + eps))
        else:
            outputs.append(numerator)
        # state after the chunk: lambda^C S + sum_j lambda^(C-1-j) phi(z_j) z_j^T
        tail = decay ** (C - 1 - idx).to(f.dtype)  # (C,)
        weighted = f * tail[:, None]  # (B, H, C, D)
        state = decay**C * state + weighted.transpose(-1, -2) @ v
        if normalize:
            normalizer = decay**C * normalizer + weighted.sum(2)
    return torch.cat(outputs, dim=2), state, normalizer


class QKVShareLinearAttention(nn.Module):
    """Causal Q=K=V linear attention (paper appendix A.1) for `attention_kernel="linear"`.

    Args:
        config: `QKVShareConfig` with `linear_attention_feature_map` ("elu_plus_one" | "relu") and
            `linear_attention_decay` (lambda in (0, 1]).
        layer_idx: index of the layer (its slot in the cache).
        normalize: divide the readout by phi(z_t)^T n_t (see the module docstring); False = the paper's formula
            y_t = phi(z_t)^T S_t exactly. None (default) takes `config.linear_attention_normalize`.
        chunk_size: tokens per chunk of the parallel form (memory O(C^2) per head and chunk).
        eps: added to the normalizer (relu features can give 0).

    Parameters: `k_proj` (hidden -> H * D) and `o_proj` (H * D -> hidden), Llama's names.
    """

    def __init__(
        self,
        config: QKVShareConfig,
        layer_idx: int,
        normalize: bool | None = None,
        chunk_size: int = 64,
        eps: float = 1e-6,
    ):
        super().__init__()
        if config.linear_attention_feature_map not in FEATURE_MAPS:
            raise ValueError(
                f"linear_attention_feature_map={config.linear_attention_feature_map!r} is not supported; "
                f"allowed: {', '.join(map(repr, FEATURE_MAPS))}."
            )
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be a positive integer.")
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.decay = float(config.linear_attention_decay)
        self.feature_map = FEATURE_MAPS[config.linear_attention_feature_map]
        self.normalize = config.linear_attention_normalize if normalize is None else normalize
        self.chunk_size = chunk_size
        self.eps = eps
        self.is_causal = True
        self.k_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """hidden_states (B, T, hidden) -> (output (B, T, hidden), None). The other attention inputs (RoPE, "+"
        encodings) do not apply to this kernel and are ignored.

        With a cache, the layer's state is read, advanced by the T new tokens and written back; T=1 is the
        recurrent decode step.
        """
        batch, length, _ = hidden_states.shape
        z = (
            self.k_proj(hidden_states).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        )  # (B, H, T, D)
        z = z.float()
        features = self.feature_map(z)  # (B, H, T, D), phi(z) >= 0
        written_features, written_values = features, z
        keep = _kept_tokens(attention_mask, length)
        if keep is not None:  # padding never enters the state
            keep = keep[:, None, :, None].to(z.dtype)  # (B, 1, T, 1)
            written_features, written_values = features * keep, z * keep

        state = normalizer = None
        if cache is not None:
            layer = cache.layers[self.layer_idx]
            if not isinstance(layer, LinearAttentionStateLayer):
                raise ValueError(
                    f"cache: attention_kernel='linear' needs a LinearAttentionStateLayer in cache slot {self.layer_idx}, "
                    f"got {type(layer).__name__}; pass QKVShareCache(config=model.config) (or let the model create one)."
                )
            state, normalizer = layer.get_state()
        y, state, normalizer = linear_attention_chunked(
            written_features,
            written_values,
            features,
            state,
            normalizer,
            self.decay,
            self.chunk_size,
            self.normalize,
            self.eps,
        )
        if cache is not None:
            cache.update(state, normalizer, self.layer_idx, num_new_tokens=length)

        y = y.to(hidden_states.dtype).transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        return self.o_proj(y), None


__all__ = ["QKVShareLinearAttention", "linear_attention_chunked", "FEATURE_MAPS"]
