"""Configuration of QKVShare models: which attention projections each layer shares, and presets.

Design notes
- Every variant of the paper ("Do Transformers Need Three Projections?", ICML 2026) is expressed by a few
  data fields with small sets of named values, checked once when the config is built:
  ``projection_sharing`` (per model, optionally per layer), ``num_key_value_heads`` (MHA/GQA/MQA),
  ``attention_map_pe_dim`` (the "+" 2D positional encoding of the attention map) and ``kv_tie_point``.
- Architecture switches (norm, MLP, biases, position embedding type, tied embeddings) express both the
  paper's GPT-2-style model and the Llama style, so one code path serves both.
- This file imports nothing else from the package: ``save_pretrained`` copies it into checkpoints.
"""

from __future__ import annotations

import re
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

# Field values. Names are the public API (configs on the hub store them).
PROJECTION_SHARING_MODES = ("none", "qk", "kv", "qkv")
POSITION_EMBEDDING_TYPES = ("rope", "learned", "none")
KV_TIE_POINTS = ("post_rope", "pre_rope")
NORM_TYPES = ("rmsnorm", "layernorm")
MLP_TYPES = ("gated", "plain")
ATTENTION_MAP_PE_LAYOUTS = ("original", "reproduction")
ATTENTION_MAP_PE_INITS = ("unit_scale", "xavier", "normal")
ATTENTION_KERNELS = ("softmax", "linear")
LINEAR_ATTENTION_FEATURE_MAPS = ("elu_plus_one", "relu")

# Paper name of each projection-sharing mode (Table 1 of the paper).
PAPER_NAMES = {"none": "QKV", "qk": "Q=K-V", "kv": "Q-K=V", "qkv": "Q=K=V"}
_MODE_BY_PAPER_NAME = {name: mode for mode, name in PAPER_NAMES.items()} | {"QV": "kv"}

# The paper's variant names; GQA-<g> and Q-GQA-<g> take any divisor g of the head count.
VARIANTS = (
    "QKV", "Q=K-V", "Q-K=V", "QV", "Q=K=V", "(Q=K-V)+", "(Q=K=V)+",
    "GQA-<g>", "MQA", "Q-GQA-<g>", "Q-MQA",
)  # fmt: skip

# m of the "+" variants when a preset does not set it: the paper uses m=10 for synthetic and set tasks.
DEFAULT_ATTENTION_MAP_PE_DIM = 10


def _choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not supported; allowed values: {', '.join(map(repr, allowed))}.")


def parse_variant(variant: str, num_attention_heads: int) -> dict[str, Any]:
    """Translate a paper variant name into config fields.

    Accepts ``QKV``, ``Q=K-V``, ``Q-K=V`` (alias ``QV``), ``Q=K=V``, ``(Q=K-V)+``, ``(Q=K=V)+`` (any of the
    projection names in parentheses followed by ``+``), ``GQA-<g>``, ``MQA``, ``Q-GQA-<g>`` and ``Q-MQA``.
    ``≠`` and ``!=`` are accepted for ``-``. Returns the fields ``projection_sharing``,
    ``num_key_value_heads`` and ``attention_map_pe_dim`` (``None`` when the variant has no "+").
    """
    name = variant.strip().replace("≠", "-").replace("!=", "-").upper()
    plus = False
    match = re.fullmatch(r"\((.+)\)\+", name)
    if match:
        name, plus = match.group(1), True
    if name in _MODE_BY_PAPER_NAME:
        fields = {"projection_sharing": _MODE_BY_PAPER_NAME[name], "num_key_value_heads": num_attention_heads}
    else:
        match = re.fullmatch(r"(Q-)?(?:GQA-(\d+)|(MQA))", name)
        if match is None or (plus and match):
            raise ValueError(
                f"variant={variant!r} is not a known variant; allowed: {', '.join(VARIANTS)} "
                "(with <g> the number of key/value heads, and '+' only on QKV, Q=K-V, Q-K=V, Q=K=V)."
            )
        groups = 1 if match.group(3) else int(match.group(2))
        if groups < 1 or num_attention_heads % groups:
            raise ValueError(
                f"variant={variant!r}: {groups} key/value heads must divide num_attention_heads={num_attention_heads}."
            )
        fields = {"projection_sharing": "kv" if match.group(1) else "none", "num_key_value_heads": groups}
    fields["attention_map_pe_dim"] = DEFAULT_ATTENTION_MAP_PE_DIM if plus else 0
    return fields


def variant_name(config: QKVShareConfig) -> str:
    """The paper's name for a config's attention variant (``"mixed"`` for per-layer mixes)."""
    modes = set(config.layer_projection_sharing or [config.projection_sharing])
    if len(modes) > 1:
        return "mixed"
    mode = modes.pop()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if kv_heads == heads:
        name = PAPER_NAMES[mode]
        return f"({name})+" if config.attention_map_pe_dim else name
    head_part = "MQA" if kv_heads == 1 else f"GQA-{kv_heads}"
    return f"Q-{head_part}" if mode == "kv" else head_part


# Named presets (see README). The paper's models are GPT-2 style; the llama-* presets are the same shapes in
# the Llama style (RMSNorm, SwiGLU with the usual 8/3 ratio rounded to a multiple of 256, RoPE, no biases).
# The two block styles as config fields; `from_preset(..., **ARCHITECTURE_STYLES["gpt2"])` switches a preset.
ARCHITECTURE_STYLES: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        norm_type="layernorm", norm_eps=1e-5, mlp_type="plain", hidden_act="gelu_new", attention_bias=True,
        mlp_bias=True, position_embedding_type="learned",
    ),
    "llama": dict(
        norm_type="rmsnorm", norm_eps=1e-5, mlp_type="gated", hidden_act="silu", attention_bias=False,
        mlp_bias=False, position_embedding_type="rope",
    ),
}  # fmt: skip
# GPT-2 tokenizer padded to a multiple of 64, 2048 positions, tied head: the paper's LM setup.
_PAPER_LM = dict(tie_word_embeddings=True, max_position_embeddings=2048, vocab_size=50304, bos_token_id=50256,
                 eos_token_id=50256)  # fmt: skip
_GPT2_STYLE = ARCHITECTURE_STYLES["gpt2"] | _PAPER_LM
_LLAMA_STYLE = ARCHITECTURE_STYLES["llama"] | _PAPER_LM
PRESETS: dict[str, dict[str, Any]] = {
    # A few thousand parameters: tests and CPU smoke runs.
    "tiny": dict(
        _LLAMA_STYLE, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
    ),
    # About 5M parameters: the CPU pretraining recipe (README main job).
    "small": dict(
        _LLAMA_STYLE, vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
    ),
    "paper-300m": dict(
        _GPT2_STYLE, hidden_size=1024, intermediate_size=4096, num_hidden_layers=20, num_attention_heads=16
    ),
    "paper-1.2b": dict(
        _GPT2_STYLE, hidden_size=2048, intermediate_size=8192, num_hidden_layers=22, num_attention_heads=32
    ),
    "llama-300m": dict(
        _LLAMA_STYLE, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20, num_attention_heads=16
    ),
    "llama-1.2b": dict(
        _LLAMA_STYLE, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32
    ),
}  # fmt: skip


@strict
class QKVShareConfig(PreTrainedConfig):
    r"""Configuration of a QKVShare model.

    Sharing fields (the paper's variants):
        projection_sharing (`str`, defaults to `"none"`): which projections a layer shares. `"none"`: Q, K, V
            (QKV); `"qk"`: query = key (Q=K-V, symmetric scores); `"kv"`: value = key (Q-K=V, the "QV" model;
            the cache holds one tensor); `"qkv"`: one projection for all three (Q=K=V; one cached tensor).
        layer_projection_sharing (`list[str]`, *optional*): one mode per layer, overriding `projection_sharing`.
        num_key_value_heads (`int`, *optional*): key/value heads (GQA); 1 is MQA; combines with `"kv"` and `"qkv"`.
        attention_map_pe_dim (`int`, defaults to 0): m of the "+" variants: a fixed 2D sinusoidal encoding
            P[i, j] of the attention map, mixed into the scores by a learned 1x1 map (m weights, one bias) per
            attention module. 0 turns it off.
        attention_map_pe_layout (`str`, defaults to `"original"`): `"original"` (Borji 2023, the paper's code) or
            `"reproduction"` (first m//2 channels encode the row, the rest the column).
        attention_map_pe_init (`str`, defaults to `"xavier"`): init of the 1x1 map. `"xavier"` is the original
            code's and the one under which "+" measurably helps on the synthetic tasks (see README); `"unit_scale"`
            sets every weight to 1/m so the score scale starts at exactly 1; `"normal"` is the reproduction's
            N(0, initializer_range). Xavier and normal can shrink or flip the score scale sum(w) at init.
        kv_tie_point (`str`, defaults to `"post_rope"`): with RoPE and tied K/V, whether V is the rotated key
            (`"post_rope"`) or the key projection's output before rotation (`"pre_rope"`, the exact tie; the cache
            stores the unrotated tensor and rotates it on read). Both cache one tensor per tied layer.

    Architecture fields:
        position_embedding_type (`str`, defaults to `"rope"`): `"rope"`, `"learned"` (absolute) or `"none"`.
        norm_type (`str`): `"rmsnorm"` or `"layernorm"`; mlp_type (`str`): `"gated"` (SwiGLU) or `"plain"` (GELU).
        is_causal (`bool`, defaults to True): False gives a bidirectional encoder.
        attention_kernel (`str`, defaults to `"softmax"`): `"linear"` selects the paper's appendix recurrence
            (Q=K=V kernelized attention with a constant-size state), with `linear_attention_feature_map`,
            `linear_attention_decay` (lambda) and `linear_attention_normalize` (divide the readout by
            phi(z)^T n_t, default True; False is the paper's formula exactly).

    The remaining fields follow `LlamaConfig`. Use `QKVShareConfig.from_preset(name, variant, **overrides)`.
    """

    model_type = "qkvshare"
    keys_to_ignore_at_inference = ["cache"]
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False
    norm_type: str = "rmsnorm"
    mlp_type: str = "gated"
    position_embedding_type: str = "rope"
    is_causal: bool = True
    projection_sharing: str = "none"
    layer_projection_sharing: list[str] | None = None
    attention_map_pe_dim: int = 0
    attention_map_pe_layout: str = "original"
    attention_map_pe_init: str = "xavier"
    kv_tie_point: str = "post_rope"
    attention_kernel: str = "softmax"
    linear_attention_feature_map: str = "elu_plus_one"
    linear_attention_decay: float = 1.0
    linear_attention_normalize: bool = True

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            if self.num_attention_heads <= 0 or self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; choose a head count that divides it, or set head_dim explicitly."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.rope_parameters is None and self.position_embedding_type == "rope":
            self.rope_parameters = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta", 10000.0)}
        # Llama checkpoints name the norm epsilon `rms_norm_eps`.
        if "rms_norm_eps" in kwargs:
            self.norm_eps = kwargs.pop("rms_norm_eps")
        # Checked here too (not only in the `@strict` validator, which wraps errors in a non-ValueError) so that
        # a bad config raises a plain ValueError naming the field.
        self.check_sharing_fields()
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of `@strict` validation (also run by `config.validate()` after edits)."""
        self.check_sharing_fields()
        super().validate_architecture()

    def check_sharing_fields(self) -> None:
        """Checks run when the config is built; each raises a ValueError naming the field, value and what is allowed."""
        _choice("projection_sharing", self.projection_sharing, PROJECTION_SHARING_MODES)
        _choice("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDING_TYPES)
        _choice("kv_tie_point", self.kv_tie_point, KV_TIE_POINTS)
        _choice("norm_type", self.norm_type, NORM_TYPES)
        _choice("mlp_type", self.mlp_type, MLP_TYPES)
        _choice("attention_map_pe_layout", self.attention_map_pe_layout, ATTENTION_MAP_PE_LAYOUTS)
        _choice("attention_map_pe_init", self.attention_map_pe_init, ATTENTION_MAP_PE_INITS)
        _choice("attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
        _choice("linear_attention_feature_map", self.linear_attention_feature_map, LINEAR_ATTENTION_FEATURE_MAPS)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide num_attention_heads="
                f"{self.num_attention_heads} (each key/value head serves a whole group of query heads)."
            )
        if self.layer_projection_sharing is not None:
            if len(self.layer_projection_sharing) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_projection_sharing has {len(self.layer_projection_sharing)} entries but "
                    f"num_hidden_layers={self.num_hidden_layers}; give exactly one mode per layer."
                )
            for i, mode in enumerate(self.layer_projection_sharing):
                _choice(f"layer_projection_sharing[{i}]", mode, PROJECTION_SHARING_MODES)
        for i in range(self.num_hidden_layers):
            mode = self.layer_sharing(i)
            if mode in ("qk", "qkv") and self.num_key_value_heads != self.num_attention_heads:
                raise ValueError(
                    f"projection_sharing={mode!r} (layer {i}) ties the query to the key, so it needs "
                    f"num_key_value_heads == num_attention_heads ({self.num_attention_heads}), got "
                    f"{self.num_key_value_heads}. Use 'kv' (Q-K=V) with GQA/MQA instead."
                )
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for position_embedding_type='rope'.")
        if self.attention_map_pe_dim < 0 or self.attention_map_pe_dim == 1:
            raise ValueError(
                f"attention_map_pe_dim={self.attention_map_pe_dim} must be 0 (off) or at least 2 (the paper uses 10)."
            )
        if self.attention_kernel == "linear":
            if any(self.layer_sharing(i) != "qkv" for i in range(self.num_hidden_layers)):
                raise ValueError(
                    "attention_kernel='linear' is the Q=K=V recurrence of the paper's appendix: it needs "
                    "projection_sharing='qkv' in every layer."
                )
            if self.attention_map_pe_dim or self.position_embedding_type == "rope" or not self.is_causal:
                raise ValueError(
                    "attention_kernel='linear' needs attention_map_pe_dim=0, position_embedding_type "
                    "'learned' or 'none', and is_causal=True."
                )
            if not 0.0 < self.linear_attention_decay <= 1.0:
                raise ValueError(f"linear_attention_decay={self.linear_attention_decay} must be in (0, 1].")

    # ----- per-layer decisions, used by the model, the cache and the tools -----
    def layer_sharing(self, layer_idx: int) -> str:
        """The projection-sharing mode of layer `layer_idx`."""
        if self.layer_projection_sharing is not None:
            return self.layer_projection_sharing[layer_idx]
        return self.projection_sharing

    def is_kv_tied(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` caches one tensor (its key and value are tied)."""
        return self.layer_sharing(layer_idx) in ("kv", "qkv")

    @property
    def needs_key_positions(self) -> bool:
        """Whether attention needs the positions of cached keys (the "+" map, or pre-RoPE tied layers)."""
        pre_rope = self.position_embedding_type == "rope" and self.kv_tie_point == "pre_rope"
        tied = any(self.is_kv_tied(i) for i in range(self.num_hidden_layers))
        return self.attention_map_pe_dim > 0 or (pre_rope and tied)

    def kv_cache_elements_per_token(self) -> int:
        """Elements the KV cache holds per token (all layers): tied layers hold one tensor, others two.

        0 with `attention_kernel="linear"`: that cache is a constant-size state, not a per-token one.
        """
        if self.attention_kernel == "linear":
            return 0
        per_tensor = self.num_key_value_heads * self.head_dim
        return sum(per_tensor * (1 if self.is_kv_tied(i) else 2) for i in range(self.num_hidden_layers))

    def kv_cache_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """KV-cache bytes per token (default fp16/bf16), e.g. 81,920 for `paper-300m` QKV."""
        return self.kv_cache_elements_per_token() * bytes_per_element

    def qkv_cache_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """KV-cache bytes per token of the plain QKV model of this shape (K and V of every head, every layer):
        the reference of the "cache cut" figures."""
        return 2 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * bytes_per_element

    @property
    def variant(self) -> str:
        """The paper's name of this config's attention variant."""
        return variant_name(self)

    @classmethod
    def from_preset(cls, name: str, variant: str | None = None, **overrides: Any) -> QKVShareConfig:
        """Build a config from a named preset, an optional paper variant and field overrides.

        Presets: ``tiny`` (tests), ``small`` (CPU pretraining), ``paper-300m``, ``paper-1.2b`` (the paper's
        GPT-2-style models, exact parameter counts), ``llama-300m``, ``llama-1.2b``. ``variant`` takes the paper's
        names (see `parse_variant`); explicit overrides win over both.
        """
        if name not in PRESETS:
            raise ValueError(f"preset={name!r} is not a known preset; allowed: {', '.join(PRESETS)}.")
        fields = dict(PRESETS[name])
        if variant is not None:
            heads = overrides.get("num_attention_heads", fields["num_attention_heads"])
            parsed = parse_variant(variant, heads)
            if not parsed["attention_map_pe_dim"]:
                parsed.pop("attention_map_pe_dim")
            fields.update(parsed)
        fields.update(overrides)
        return cls(**fields)


__all__ = [
    "QKVShareConfig",
    "ARCHITECTURE_STYLES",
    "PRESETS",
    "VARIANTS",
    "PAPER_NAMES",
    "parse_variant",
    "variant_name",
]
