"""Configuration of QKVShare models: which attention projections each layer shares, and presets.

Design notes
- Every variant of the paper ("Do Transformers Need Three Projections?", ICML 2026) is expressed by a few
  data fields with small sets of named values, checked once when the config is built:
  ``projection_sharing`` (per model, optionally per layer), ``num_key_value_heads`` (MHA/GQA/MQA),
  ``attention_map_pe_dim`` (the "+" 2D positional encoding of the attention map) and ``kv_tie_point``.
- Architecture switches (norm, MLP, biases, position embedding type, tied embeddings) express both the
  paper's GPT-2-style model and the Llama style, so one code path serves both.
- Field types are checked by `@strict` (huggingface_hub) and every bad value raises a plain `ValueError` naming the
  field, the value and what is allowed (`_value_errors` re-raises `@strict`'s own exceptions as ValueError). No
  ``from __future__ import annotations`` here: `@strict` skips the type check of annotations kept as strings.
- ``from_preset`` is the strict entry point (unknown keys are errors, token ids must fit the vocabulary); a plain
  ``QKVShareConfig(...)`` / ``from_pretrained`` keeps transformers' leniency for extra keys (hub configs carry some).
- The tensor-parallel plan is derived from the layers the config describes (`base_model_tp_plan`), never stored.
- This file imports nothing else from the package: ``save_pretrained`` copies it into checkpoints.
"""

import dataclasses
import difflib
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Field values. Names are the public API (configs on the hub store them).
POSITION_EMBEDDING_TYPES = ("rope", "learned", "none", "alibi")
KV_TIE_POINTS = ("post_rope", "pre_rope")
NORM_TYPES = ("rmsnorm", "layernorm")
MLP_TYPES = ("gated", "plain")
ATTENTION_MAP_PE_LAYOUTS = ("original", "reproduction")
ATTENTION_MAP_PE_INITS = ("unit_scale", "xavier", "normal")
ATTENTION_KERNELS = ("softmax", "linear")
LINEAR_ATTENTION_FEATURE_MAPS = ("elu_plus_one", "relu")
# Per-layer attention types (`layer_types`), transformers' names: all tokens, or the last `sliding_window` ones.
LAYER_TYPES = ("full_attention", "sliding_attention")

# `model_type`s whose checkpoints are this library's Llama style with sharing off (`QKVShareConfig.from_llama`).
LLAMA_ARCHITECTURES = ("llama", "mistral", "qwen2")
IMAGE_POOLINGS = ("cls", "mean")
PATCH_POSITION_EMBEDDING_TYPES = ("learned", "sincos2d")


@dataclasses.dataclass(frozen=True)
class SharingMode:
    """One value of `projection_sharing`: what a layer in this mode is. The single definition every part of the
    library reads (model layers, caches, cost model, weight analysis, conversion).

    Fields:
        name: the config value ("none", "qk", "kv", "qkv").
        paper_name: the paper's name (Table 1): QKV, Q=K-V, Q-K=V, Q=K=V.
        query_from: the projection whose output is the query: "q_proj" (its own), "k_proj" (Q=K: symmetric scores)
            or "v_proj". A query taken from another projection has no `q_proj` and needs one key/value head per head.
        value_from: the projection whose output is the value: "v_proj" (its own) or "k_proj" (K=V: no `v_proj`, the
            cache holds one tensor).
    Every reader (the attention layer, the Llama export, `analyze`, `convert`) takes the query and the value from
    these two fields, so a mode is one row.
    """

    name: str
    paper_name: str
    query_from: str = "q_proj"
    value_from: str = "v_proj"

    def __post_init__(self) -> None:
        if self.query_from not in ("q_proj", "k_proj", "v_proj") or self.value_from not in ("v_proj", "k_proj"):
            raise ValueError(
                f"SharingMode {self.name!r}: query_from={self.query_from!r} must be 'q_proj', 'k_proj' or 'v_proj', "
                f"value_from={self.value_from!r} 'v_proj' or 'k_proj'."
            )

    @property
    def query_is_key(self) -> bool:
        """The query is the key (Q=K: no `q_proj`, symmetric scores)."""
        return self.query_from == "k_proj"

    @property
    def query_is_shared(self) -> bool:
        """The query is another projection's output (no `q_proj`): one key/value head per query head."""
        return self.query_from != "q_proj"

    @property
    def kv_tied(self) -> bool:
        """The value is the key (no `v_proj`; the cache holds one tensor)."""
        return self.value_from == "k_proj"

    @property
    def projections(self) -> tuple[str, ...]:
        """The attention projections a layer in this mode has, by Llama's names (a shared one does not exist)."""
        present = {self.query_from, "k_proj", self.value_from, "o_proj"}
        return tuple(name for name in ("q_proj", "k_proj", "v_proj", "o_proj") if name in present)

    @property
    def cached_tensors(self) -> int:
        """Tensors the KV cache keeps per token for a layer in this mode: 1 when K and V are tied, else 2."""
        return 1 if self.kv_tied else 2


SHARING_MODES: dict[str, SharingMode] = {
    mode.name: mode
    for mode in (
        SharingMode("none", "QKV"),
        SharingMode("qk", "Q=K-V", query_from="k_proj"),
        SharingMode("kv", "Q-K=V", value_from="k_proj"),
        SharingMode("qkv", "Q=K=V", query_from="k_proj", value_from="k_proj"),
    )
}
PROJECTION_SHARING_MODES = tuple(SHARING_MODES)
# The role of a projection's output, for messages ("the query is the key").
PROJECTION_ROLES = {"q_proj": "query", "k_proj": "key", "v_proj": "value"}
# Paper name of each projection-sharing mode (Table 1 of the paper).
PAPER_NAMES = {mode.name: mode.paper_name for mode in SHARING_MODES.values()}
_MODE_BY_PAPER_NAME = {mode.paper_name: mode.name for mode in SHARING_MODES.values()} | {"QV": "kv"}


def mode_for_projections(present: Iterable[str]) -> SharingMode:
    """The mode whose layers have exactly these of q_proj/k_proj/v_proj (`o_proj` and other names are ignored), the
    inverse of `SharingMode.projections`; a ValueError when no mode has that set (e.g. q without k), or when several
    do (a query taken from the key and one taken from the value have the same projections): a checkpoint's config,
    not its tensors, says what its layers are (`QKVShareConfig.layer_mode`)."""
    wanted = {name for name in present if name in ("q_proj", "k_proj", "v_proj")}
    found = [mode for mode in SHARING_MODES.values() if wanted == set(mode.projections) - {"o_proj"}]
    if len(found) > 1:
        names = ", ".join(mode.paper_name for mode in found)
        raise ValueError(f"projections {sorted(wanted)} are those of several modes ({names}); read the config instead.")
    if found:
        return found[0]
    allowed = "; ".join(
        f"{m.paper_name}: {', '.join(p for p in m.projections if p != 'o_proj')}" for m in SHARING_MODES.values()
    )
    raise ValueError(f"projections {sorted(wanted)} are no sharing mode's ({allowed}).")


# The paper's variant names; GQA-<g> and Q-GQA-<g> take any divisor g of the head count.
VARIANTS = (
    "QKV",
    "Q=K-V",
    "Q-K=V",
    "QV",
    "Q=K=V",
    "(Q=K-V)+",
    "(Q=K=V)+",
    "GQA-<g>",
    "MQA",
    "Q-GQA-<g>",
    "Q-MQA",
    "QV-Ka",
    "QV-Ka-2",
)
# The second source's QV-Ka ("key after value and context"): d_ctx as a multiple of head_dim, by variant name.
QV_KA_CONTEXT_MULTIPLES = {"QV-KA": 1, "QV-KA-2": 2}

# m of the "+" variants when a preset does not set it: the paper uses m=10 for synthetic and set tasks.
DEFAULT_ATTENTION_MAP_PE_DIM = 10
# ... and presets whose "+" variants use another m: the paper's ViT uses m=50 (section 4.2).
PRESET_ATTENTION_MAP_PE_DIMS = {"vit-paper": 50, "vit-small": 50}

# The model class of each Auto class, in modeling_qkvshare.py. `__init__` registers them, and a checkpoint's
# `auto_map` lists them all, so `trust_remote_code=True` loads any head where the package is not installed.
AUTO_MODEL_CLASSES = {
    "AutoModel": "QKVShareModel",
    "AutoModelForCausalLM": "QKVShareForCausalLM",
    "AutoModelForSequenceClassification": "QKVShareForSequenceClassification",
    "AutoModelForTokenClassification": "QKVShareForTokenClassification",
    "AutoModelForImageClassification": "QKVShareForImageClassification",
}

# Keywords that are not dataclass fields but that `__post_init__` (ours or transformers') consumes: Llama's names
# (`rope_theta`, `rms_norm_eps`), transformers' legacy and run-time switches. With the fields, the valid names.
_POST_INIT_KEYWORDS = (
    "rope_theta",
    "rms_norm_eps",
    "rope_scaling",
    "torch_dtype",
    "num_labels",
    "output_attentions",
    "attn_implementation",
)
_TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not supported; allowed values: {', '.join(map(repr, allowed))}.")


def llama_config_dict(config: Mapping[str, Any], where: str = "the config") -> dict[str, Any]:
    """A Llama-architecture config.json dict (`LLAMA_ARCHITECTURES`, checked by the caller) read through transformers'
    config class of its model_type: the fields the file leaves out get that class's defaults (32 attention heads for
    Llama), as the model `from_pretrained` builds gets them. A `ValueError` naming ``where`` when the class refuses it.
    """
    try:
        return CONFIG_MAPPING[config["model_type"]].from_dict(dict(config)).to_dict()
    except Exception as err:  # its validators raise huggingface_hub's StrictDataclassError, ZeroDivisionError, ...
        reason = " ".join(str(err).split())
        raise ValueError(f"{where} is not a valid {config['model_type']} config: {reason}") from None


def _base_value(base: Any, name: str) -> Any:
    return base.get(name) if isinstance(base, Mapping) else getattr(base, name, None)


def resolve_variant(
    variant: str, base: "QKVShareConfig | Mapping[str, Any]", attention_map_pe_dim: int = DEFAULT_ATTENTION_MAP_PE_DIM
) -> dict[str, Any]:
    """The config fields that turn `base` (a config, or a config dict) into the paper variant `variant`.

    THE variant resolver: presets, `from_llama`, the command lines and the tools all go through it, so a name means
    the same config everywhere. Names: ``QKV``, ``Q=K-V``, ``Q-K=V`` (alias ``QV``), ``Q=K=V``, their "+" forms
    ``(Q=K-V)+`` etc., ``GQA-<g>``, ``MQA``, ``Q-GQA-<g>``, ``Q-MQA``, and the second source's ``QV-Ka`` (d_ctx =
    head_dim) and ``QV-Ka-2`` (2 x head_dim); ``≠`` and ``!=`` are accepted for ``-``, case is ignored.

    Key/value heads: a name with a head count (GQA-g, MQA, Q-GQA-g, Q-MQA) sets g; a name without one keeps the
    base's (``Q-K=V`` of a GQA-3 model is Q-GQA-3), except the modes whose query is the key (Q=K-V, Q=K=V) and QV-Ka,
    which need one key/value head per query head and get ``num_attention_heads``. "+" names get
    ``attention_map_pe_dim`` (10 by default, the paper's synthetic and set tasks; its ViT uses 50).

    Returns ``projection_sharing``, ``layer_projection_sharing`` (None: the name applies to every layer),
    ``num_key_value_heads``, ``key_context_dim`` (0 except QV-Ka) and ``attention_map_pe_dim`` (0 without "+").
    Raises a ValueError naming the variant for an unknown name or a head count that does not divide the heads.
    """
    heads = _base_value(base, "num_attention_heads")
    base_kv_heads = _base_value(base, "num_key_value_heads") or heads
    name = variant.strip().replace("≠", "-").replace("!=", "-").upper()
    plus = False
    match = re.fullmatch(r"\((.+)\)\+", name)
    if match:
        name, plus = match.group(1), True
    key_context_dim = 0
    if name in QV_KA_CONTEXT_MULTIPLES:
        head_dim = _base_value(base, "head_dim")
        if head_dim is None:  # as `__post_init__` derives it
            head_dim = _base_value(base, "hidden_size") // heads
        key_context_dim = QV_KA_CONTEXT_MULTIPLES[name] * head_dim
        mode, kv_heads = "none", heads
    elif name in _MODE_BY_PAPER_NAME:
        mode = _MODE_BY_PAPER_NAME[name]
        kv_heads = heads if SHARING_MODES[mode].query_is_shared else base_kv_heads
    else:
        match = re.fullmatch(r"(Q-)?(?:GQA-(\d+)|(MQA))", name)
        if match is None or (plus and match):
            raise ValueError(
                f"variant={variant!r} is not a known variant; allowed: {', '.join(VARIANTS)} "
                "(with <g> the number of key/value heads, and '+' only on QKV, Q=K-V, Q-K=V, Q=K=V, QV-Ka)."
            )
        kv_heads = 1 if match.group(3) else int(match.group(2))
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(
                f"variant={variant!r}: {kv_heads} key/value heads must divide num_attention_heads={heads}."
            )
        mode = "kv" if match.group(1) else "none"
    return {
        "projection_sharing": mode,
        "layer_projection_sharing": None,
        "num_key_value_heads": kv_heads,
        "key_context_dim": key_context_dim,
        "attention_map_pe_dim": attention_map_pe_dim if plus else 0,
    }


def parse_variant(variant: str, num_attention_heads: int, head_dim: int | None = None) -> dict[str, Any]:
    """`resolve_variant` against a multi-head base of `num_attention_heads` heads (key/value heads = heads), without
    the ``layer_projection_sharing`` entry. QV-Ka names need ``head_dim``."""
    if head_dim is None and variant.strip().upper().removeprefix("(").startswith("QV-KA"):
        raise ValueError(f"variant={variant!r}: QV-Ka sets key_context_dim from head_dim; pass head_dim.")
    base = {"num_attention_heads": num_attention_heads, "head_dim": head_dim}
    fields = resolve_variant(variant, base)
    fields.pop("layer_projection_sharing")
    return fields


def variant_name(config: "QKVShareConfig") -> str:
    """The paper's name for a config's attention variant (``"mixed"`` for per-layer mixes)."""
    modes = set(config.layer_projection_sharing or [config.projection_sharing])
    if len(modes) > 1:
        return "mixed"
    mode = modes.pop()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if config.key_context_dim:  # QV-Ka (validated: every layer "none", as many key/value heads as heads)
        multiple = {config.head_dim: "QV-Ka", 2 * config.head_dim: "QV-Ka-2"}
        name = multiple.get(config.key_context_dim, f"QV-Ka(d_ctx={config.key_context_dim})")
        return f"({name})+" if config.attention_map_pe_dim else name
    if kv_heads == heads:
        name = SHARING_MODES[mode].paper_name
        return f"({name})+" if config.attention_map_pe_dim else name
    head_part = "MQA" if kv_heads == 1 else f"GQA-{kv_heads}"
    return f"Q-{head_part}" if SHARING_MODES[mode].kv_tied else head_part


# Named presets (docs/design.md, section 2.4). The paper's models are GPT-2 style; the llama-* presets are the same shapes in
# the Llama style (RMSNorm, SwiGLU with the usual 8/3 ratio rounded to a multiple of 256, RoPE, no biases).
# The two block styles as config fields; `from_preset(..., **ARCHITECTURE_STYLES["gpt2"])` switches a preset.
_STYLE_FIELDS = (
    "norm_type",
    "norm_eps",
    "mlp_type",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "position_embedding_type",
)
ARCHITECTURE_STYLES: dict[str, dict[str, Any]] = {
    "gpt2": dict(zip(_STYLE_FIELDS, ("layernorm", 1e-5, "plain", "gelu_new", True, True, "learned"), strict=True)),
    "llama": dict(zip(_STYLE_FIELDS, ("rmsnorm", 1e-5, "gated", "silu", False, False, "rope"), strict=True)),
}
# GPT-2 tokenizer padded to a multiple of 64, 2048 positions, tied head: the paper's LM setup.
_PAPER_LM = dict(
    tie_word_embeddings=True, max_position_embeddings=2048, vocab_size=50304, bos_token_id=50256, eos_token_id=50256
)
_GPT2_STYLE = ARCHITECTURE_STYLES["gpt2"] | _PAPER_LM
_LLAMA_STYLE = ARCHITECTURE_STYLES["llama"] | _PAPER_LM
_VIT_STYLE = ARCHITECTURE_STYLES["gpt2"] | dict(
    hidden_act="gelu",
    norm_eps=1e-12,
    position_embedding_type="none",
    is_causal=False,
    vocab_size=1,
    bos_token_id=None,
    eos_token_id=None,
)
PRESETS: dict[str, dict[str, Any]] = {
    # A few thousand parameters: tests and CPU smoke runs.
    "tiny": dict(
        _LLAMA_STYLE,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # About 4M parameters: the CPU pretraining recipe (the README's main job).
    "small": dict(
        _LLAMA_STYLE,
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=0,
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
    # The paper's ViT (section 4.2; ViT-Base/16 shapes, transformers' ViTConfig defaults: exact GELU, LayerNorm eps
    # 1e-12): positions are the patch embeddings' own (`patch_position_embedding_type`), none in the block stack.
    # No token vocabulary: `QKVShareForImageClassification` builds no token embedding (vocab_size is unused).
    "vit-paper": dict(
        _VIT_STYLE,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=16,
        num_channels=3,
        num_labels=1000,
    ),
    # About 100k parameters: scikit-learn's 8x8 digits on a CPU (`qkvshare vision`). RGB input, as transformers'
    # image-classification pipeline converts every image to RGB (grey digits included).
    "vit-small": dict(
        _VIT_STYLE,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=8,
        patch_size=2,
        num_channels=3,
        num_labels=10,
    ),
}


def _type_name(annotation: Any) -> str:
    """`int`, `int | float | None`, `list[str] | None`: a field's annotation as a reader writes it."""
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", text)  # drop module paths (typing.Literal -> Literal)


def _value_type_name(value: Any) -> str:
    """`str`, `list[int | str]`, `dict[str, float]`: the type of a value, with the types of its items."""
    if isinstance(value, list | tuple | set):
        return f"{type(value).__name__}[{' | '.join(sorted({type(item).__name__ for item in value}))}]"
    if isinstance(value, dict):
        keys = " | ".join(sorted({type(key).__name__ for key in value}))
        values = " | ".join(sorted({type(item).__name__ for item in value.values()}))
        return f"dict[{keys}, {values}]"
    return type(value).__name__


def _value_errors(cls: type) -> type:
    """Make the checks of `@strict` raise a plain ValueError naming the field, the value and what is allowed.

    `@strict` (huggingface_hub.dataclasses) type-checks each field on assignment and runs the `validate_*`
    methods after `__init__`, but raises `StrictDataclassFieldValidationError` / `...ClassValidationError`: not
    ValueErrors, so code that catches ValueError for bad input (the command lines, user code) would not see them.
    Applied above `@strict`, this wraps the two entry points it installs.
    """
    strict_setattr, strict_validate = cls.__setattr__, cls.validate

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            strict_setattr(self, name, value)
        except StrictDataclassFieldValidationError as error:
            cause = error.__cause__
            if isinstance(cause, TypeError):
                allowed = _type_name(type(self).__dataclass_fields__[name].type)
                message = f"{name}={value!r} has type {_value_type_name(value)}, but {name} must be {allowed}."
            else:
                message = f"{name}={value!r}: {cause}"
            raise ValueError(message) from None

    def validate(self) -> None:
        try:
            strict_validate(self)
        except StrictDataclassClassValidationError as error:
            raise ValueError(str(error.__cause__)) from None

    validate.__is_defined_by_strict_decorator__ = True  # a subclass may apply `@strict` again
    cls.__setattr__, cls.validate = __setattr__, validate
    return cls


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fit_token_ids(preset: str, fields: dict[str, Any], given: Iterable[str]) -> None:
    """Keep `fields`' token ids inside the vocabulary (see `QKVShareConfig.from_preset`); edits `fields`."""
    vocab_size = fields["vocab_size"]
    if not _is_int(vocab_size) or vocab_size <= 0:
        return  # the config's own checks report a bad vocab_size
    for key in _TOKEN_ID_FIELDS:
        value = fields.get(key)
        ids = value if isinstance(value, list) else [value]
        if all(not _is_int(token) or 0 <= token < vocab_size for token in ids):
            continue  # fits (a wrong type is reported by the config's type check)
        if key in given:
            raise ValueError(
                f"{key}={value!r} does not fit vocab_size={vocab_size}: token ids must be in [0, {vocab_size - 1}]; "
                f"pass your tokenizer's id, or None for no {key.removesuffix('_token_id')} token."
            )
        logger.warning(
            f"preset {preset!r} has {key}={value!r}, outside vocab_size={vocab_size}: set to None. Pass your "
            f"tokenizer's id ({key}=...) to keep one."
        )
        fields[key] = None


@_value_errors
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
            code's and the one under which "+" measurably helps on the synthetic tasks (docs/results.md, section 4); `"unit_scale"`
            sets every weight to 1/m so the score scale starts at exactly 1; `"normal"` is the reproduction's
            N(0, initializer_range). Xavier and normal can shrink or flip the score scale sum(w) at init.
        kv_tie_point (`str`, defaults to `"post_rope"`): with RoPE and tied K/V, whether V is the rotated key
            (`"post_rope"`) or the key projection's output before rotation (`"pre_rope"`, the exact tie; the cache
            stores the unrotated tensor and rotates it on read). Both cache one tensor per tied layer.
        key_context_dim (`int`, defaults to 0): d_ctx of the second source's QV-Ka ("key after value and
            context"): a context projection G = X W_ctx (`ctx_proj`, hidden -> d_ctx) shared by all heads, and per
            head K_i = [G ; V_i] W_i^K (`k_mix`, (d_ctx + head_dim) x head_dim per head) instead of `k_proj`; Q_i
            and V_i are QKV's. The `QKVShareCache` stores V and G and recomputes the keys on read (docs/design.md,
            section 9). Needs `projection_sharing="none"` in every layer and as many key/value heads as heads.
            Variant names `QV-Ka` (d_ctx = head_dim) and `QV-Ka-2` (2 x head_dim). 0 turns it off.

    Architecture fields:
        position_embedding_type (`str`, defaults to `"rope"`): `"rope"`, `"learned"` (absolute), `"none"`, or
            `"alibi"` (Press et al. 2022: a fixed per-head bias -slope_h * (i - j) on the scores, -slope_h * |i - j|
            when `is_causal=False`; slopes 2^(-8h/H), eager and sdpa backends only).
        norm_type (`str`): `"rmsnorm"` or `"layernorm"`; mlp_type (`str`): `"gated"` (SwiGLU) or `"plain"` (GELU).
        is_causal (`bool`, defaults to True): False gives a bidirectional encoder.
        attention_kernel (`str`, defaults to `"softmax"`): `"linear"` selects the paper's appendix recurrence
            (Q=K=V kernelized attention with a constant-size state), with `linear_attention_feature_map`,
            `linear_attention_decay` (lambda) and `linear_attention_normalize` (divide the readout by
            phi(z)^T n_t, default True; False is the paper's formula exactly).
        sliding_window (`int`, *optional*): as in Mistral, each token attends to the last `sliding_window` tokens
            (itself included) and the cache keeps only those (one windowed tensor per tied layer). None (default):
            full attention. With `is_causal=False`, transformers' bidirectional window |i - j| <= sliding_window.
        layer_types (`list[str]`, *optional*): one of `"full_attention"`, `"sliding_attention"` per layer (as in
            Gemma/Qwen2); None: every layer slides when `sliding_window` is set, none otherwise.

    Image fields (`QKVShareForImageClassification`, ViTConfig's names; `num_labels` as for every head):
        image_size (`int`, defaults to 224), patch_size (`int`, defaults to 16), num_channels (`int`, defaults
            to 3): square images cut into a (image_size / patch_size)^2 grid of patches by a strided conv.
        pooling (`str`, defaults to `"cls"`): `"cls"` classifies a learned class token (ViT); `"mean"` the mean of
            the patch tokens (no class token is built).
        patch_position_embedding_type (`str`, defaults to `"learned"`): `"learned"` (ViT's learned 1D table) or
            `"sincos2d"` (fixed 2D sin-cos of the patch row and column, no parameters, any grid size).
        The block stack's `position_embedding_type` still applies on top (the vit-* presets set `"none"`).

    The remaining fields follow `LlamaConfig`. Use `QKVShareConfig.from_preset(name, variant, **overrides)`.
    Every bad value raises a `ValueError` naming the field, the value and what is allowed.
    """

    model_type = "qkvshare"
    keys_to_ignore_at_inference = ["cache"]

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
    attention_dropout: int | float = 0.0
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
    key_context_dim: int = 0
    attention_kernel: str = "softmax"
    linear_attention_feature_map: str = "elu_plus_one"
    linear_attention_decay: int | float = 1.0
    linear_attention_normalize: bool = True
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    pooling: str = "cls"
    patch_position_embedding_type: str = "learned"

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
        """Checks run when the config is built, one per concern; each raises a ValueError naming the field, the
        value and what is allowed."""
        self._check_choices()
        self._check_sizes()
        self._check_heads()
        self._check_attention_map_pe()
        self._check_qv_ka()
        self._check_linear_kernel()
        self.check_window_fields()

    def _check_choices(self) -> None:
        """Every named-value field holds one of its names."""
        _choice("projection_sharing", self.projection_sharing, PROJECTION_SHARING_MODES)
        _choice("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDING_TYPES)
        _choice("kv_tie_point", self.kv_tie_point, KV_TIE_POINTS)
        _choice("norm_type", self.norm_type, NORM_TYPES)
        _choice("mlp_type", self.mlp_type, MLP_TYPES)
        _choice("attention_map_pe_layout", self.attention_map_pe_layout, ATTENTION_MAP_PE_LAYOUTS)
        _choice("attention_map_pe_init", self.attention_map_pe_init, ATTENTION_MAP_PE_INITS)
        _choice("attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
        _choice("linear_attention_feature_map", self.linear_attention_feature_map, LINEAR_ATTENTION_FEATURE_MAPS)
        _choice("pooling", self.pooling, IMAGE_POOLINGS)
        _choice("patch_position_embedding_type", self.patch_position_embedding_type, PATCH_POSITION_EMBEDDING_TYPES)
        _choice("hidden_act", self.hidden_act, tuple(ACT2FN))  # transformers' activations, as the MLPs look them up
        if self.layer_projection_sharing is not None:
            if len(self.layer_projection_sharing) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_projection_sharing has {len(self.layer_projection_sharing)} entries but "
                    f"num_hidden_layers={self.num_hidden_layers}; give exactly one mode per layer."
                )
            for i, mode in enumerate(self.layer_projection_sharing):
                _choice(f"layer_projection_sharing[{i}]", mode, PROJECTION_SHARING_MODES)

    def _check_sizes(self) -> None:
        """Sizes are positive, probabilities and scales in their ranges, the patch grid tiles the image."""
        sizes = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "image_size",
            "patch_size",
            "num_channels",
        )
        for name in sizes:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer.")
        if not 0 <= self.attention_dropout < 1:
            raise ValueError(
                f"attention_dropout={self.attention_dropout} must be in [0, 1): the probability of dropping an "
                "attention weight in training (0 turns dropout off)."
            )
        if not self.norm_eps > 0:
            raise ValueError(
                f"norm_eps={self.norm_eps} must be > 0: it keeps the norm's division finite (1e-5 or 1e-6 are usual)."
            )
        if not self.initializer_range >= 0:
            raise ValueError(
                f"initializer_range={self.initializer_range} must be >= 0: the standard deviation of the initial "
                "weights (0.02 is usual)."
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}: the patch grid must "
                "tile the image; choose a patch size that divides the image size."
            )

    def _check_heads(self) -> None:
        """Key/value heads divide the heads; Q=K layers need one per head; RoPE needs an even head_dim."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide num_attention_heads="
                f"{self.num_attention_heads} (each key/value head serves a whole group of query heads)."
            )
        for i in range(self.num_hidden_layers):
            mode = self.layer_sharing(i)
            shared = SHARING_MODES[mode]
            if shared.query_is_shared and self.num_key_value_heads != self.num_attention_heads:
                raise ValueError(
                    f"projection_sharing={mode!r} (layer {i}) ties the query to the "
                    f"{PROJECTION_ROLES[shared.query_from]}, so it needs "
                    f"num_key_value_heads == num_attention_heads ({self.num_attention_heads}), got "
                    f"{self.num_key_value_heads}. Use 'kv' (Q-K=V) with GQA/MQA instead."
                )
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for position_embedding_type='rope'.")

    def _check_attention_map_pe(self) -> None:
        """The "+" map: m = 0 (off) or at least 2."""
        if self.attention_map_pe_dim < 0 or self.attention_map_pe_dim == 1:
            raise ValueError(
                f"attention_map_pe_dim={self.attention_map_pe_dim} must be 0 (off) or at least 2 (the paper uses 10)."
            )

    def _check_qv_ka(self) -> None:
        """QV-Ka (`key_context_dim`) combines with no other sharing, no GQA, the softmax kernel and no window."""
        if self.key_context_dim < 0:
            raise ValueError(
                f"key_context_dim={self.key_context_dim} must be 0 (off) or a positive d_ctx (QV-Ka: head_dim or "
                "2 x head_dim)."
            )
        if not self.key_context_dim:
            return
        modes = sorted({self.layer_sharing(i) for i in range(self.num_hidden_layers)} - {"none"})
        problems = [f"projection_sharing={mode!r} (needs 'none' in every layer)" for mode in modes]
        if self.num_key_value_heads != self.num_attention_heads:
            problems.append(
                f"num_key_value_heads={self.num_key_value_heads} (needs num_attention_heads="
                f"{self.num_attention_heads}: one key per head, built from that head's value)"
            )
        if self.attention_kernel != "softmax":
            problems.append(f"attention_kernel={self.attention_kernel!r} (needs 'softmax')")
        if self.sliding_window is not None:
            problems.append(f"sliding_window={self.sliding_window} (the cache of G and V has no sliding form)")
        if problems:
            raise ValueError(
                f"key_context_dim={self.key_context_dim} (QV-Ka) builds each head's key from its own value and a "
                f"shared context, which does not combine with {'; '.join(problems)}. Set key_context_dim=0 for "
                "the other variants."
            )

    def _check_linear_kernel(self) -> None:
        """`attention_kernel="linear"` is the paper's Q=K=V recurrence: causal, no RoPE/ALiBi/"+", decay in (0, 1]."""
        if self.attention_kernel != "linear":
            return
        if any(
            not self.layer_mode(i).query_is_key or not self.layer_mode(i).kv_tied for i in range(self.num_hidden_layers)
        ):
            raise ValueError(
                "attention_kernel='linear' is the Q=K=V recurrence of the paper's appendix: it needs "
                "projection_sharing='qkv' in every layer."
            )
        if self.attention_map_pe_dim or self.position_embedding_type in ("rope", "alibi") or not self.is_causal:
            raise ValueError(
                "attention_kernel='linear' needs attention_map_pe_dim=0, position_embedding_type "
                "'learned' or 'none', and is_causal=True."
            )
        if not 0.0 < self.linear_attention_decay <= 1.0:
            raise ValueError(f"linear_attention_decay={self.linear_attention_decay} must be in (0, 1].")

    def check_window_fields(self) -> None:
        """Checks of `sliding_window` and `layer_types` (part of `check_sharing_fields`)."""
        if self.sliding_window is not None:
            if self.sliding_window < 2:
                raise ValueError(
                    f"sliding_window={self.sliding_window} must be None (full attention) or an int >= 2: the number of "
                    "most recent tokens, the current one included, that each token attends to (Mistral uses 4096)."
                )
            if self.attention_kernel == "linear":
                raise ValueError(
                    f"sliding_window={self.sliding_window} does not apply to attention_kernel='linear' (a recurrence "
                    "over all tokens); set sliding_window=None."
                )
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}; give "
                "exactly one attention type per layer (or None)."
            )
        for i, layer_type in enumerate(self.layer_types):
            _choice(f"layer_types[{i}]", layer_type, LAYER_TYPES)
            if layer_type == "sliding_attention" and self.sliding_window is None:
                raise ValueError(
                    f"layer_types[{i}]='sliding_attention' needs a window: set sliding_window (an int >= 2), or make "
                    "the layer 'full_attention'."
                )

    # ----- per-layer decisions, used by the model, the cache and the tools -----
    def layer_sharing(self, layer_idx: int) -> str:
        """The projection-sharing mode of layer `layer_idx`."""
        if self.layer_projection_sharing is not None:
            return self.layer_projection_sharing[layer_idx]
        return self.projection_sharing

    def layer_attention_type(self, layer_idx: int) -> str:
        """`"sliding_attention"` or `"full_attention"` for layer `layer_idx` (see `sliding_window`, `layer_types`)."""
        if self.layer_types is not None:
            return self.layer_types[layer_idx]
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def layer_mode(self, layer_idx: int) -> SharingMode:
        """The `SharingMode` of layer `layer_idx` (which projections it has, what its cache keeps)."""
        return SHARING_MODES[self.layer_sharing(layer_idx)]

    def is_kv_tied(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` caches one tensor (its key and value are tied)."""
        return self.layer_mode(layer_idx).kv_tied

    def is_query_key_tied(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s query is its key (Q=K: no `q_proj`, symmetric scores)."""
        return self.layer_mode(layer_idx).query_is_key

    def is_query_shared(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s query is another projection's output (no `q_proj`, one key/value head per
        head)."""
        return self.layer_mode(layer_idx).query_is_shared

    def layer_projections(self, layer_idx: int) -> tuple[str, ...]:
        """The attention projections layer `layer_idx` has, by Llama's names (`SharingMode.projections`; QV-Ka
        layers have `ctx_proj` and `k_mix` instead of `k_proj`)."""
        if self.key_context_dim:  # QV-Ka: keys from the context projection and the values (`k_mix`)
            return ("q_proj", "ctx_proj", "v_proj", "k_mix", "o_proj")
        return self.layer_mode(layer_idx).projections

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """Tensor-parallel plan of the base model (transformers reads it in `post_init`), built from the layers
        this config has; derived, never serialized, so it always matches the model.

        Llama's styles: q/k/v and gate/up column-wise, o/down row-wise. transformers matches a key against a
        module name with its layer numbers replaced by ``*``, so a key cannot name one layer: a projection that
        some layers lack (`layer_projection_sharing`) gets the ``layers.*`` key and the other layers simply do
        not match it. The "+" map (m weights shared by all heads) stays replicated. The linear-attention kernel
        keeps its attention replicated: it reshapes with the full head count, which a sharded `k_proj` breaks.
        So does QV-Ka (`key_context_dim`): `k_mix` holds every head's key map in one tensor, which no style shards.
        """
        plan = {}
        if self.attention_kernel == "softmax" and not self.key_context_dim:
            present = {name for i in range(self.num_hidden_layers) for name in self.layer_projections(i)}
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                if name in present:
                    plan[f"layers.*.self_attn.{name}"] = "rowwise" if name == "o_proj" else "colwise"
        mlp = ("gate_proj", "up_proj", "down_proj") if self.mlp_type == "gated" else ("up_proj", "down_proj")
        for name in mlp:
            plan[f"layers.*.mlp.{name}"] = "rowwise" if name == "down_proj" else "colwise"
        return plan

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, plan: Any) -> None:
        raise ValueError(
            f"base_model_tp_plan={plan!r} cannot be set: the plan is derived from the config's layers. To change "
            "rules, pass from_pretrained(..., distributed_config=DistributedConfig(tp_plan={...})) or set model.tp_plan."
        )

    @property
    def adds_score_bias(self) -> bool:
        """Whether attention adds a float bias to its scores, folded into the attention mask: the "+" map's P.w + b,
        or ALiBi's -slope * distance. Such a mask must be materialized (no is_causal shortcut), needs a backend that
        takes a float mask (eager, sdpa), and scores each cached key by its position."""
        return self.attention_map_pe_dim > 0 or self.position_embedding_type == "alibi"

    @property
    def needs_key_positions(self) -> bool:
        """Whether attention needs the positions of cached keys (the "+" map, pre-RoPE tied layers, ALiBi's
        distance bias, or QV-Ka with RoPE, whose keys are recomputed and rotated on read)."""
        pre_rope = self.position_embedding_type == "rope" and self.kv_tie_point == "pre_rope"
        tied = any(self.is_kv_tied(i) for i in range(self.num_hidden_layers))
        rope_qv_ka = self.position_embedding_type == "rope" and self.key_context_dim > 0
        return (
            self.attention_map_pe_dim > 0
            or (pre_rope and tied)
            or self.position_embedding_type == "alibi"
            or rope_qv_ka
        )

    def kv_cache_elements_per_token(self) -> int:
        """Elements the KV cache holds per token (all layers): tied layers hold one tensor, others two; QV-Ka layers
        (`key_context_dim`) the values and the shared context G; 0 with `attention_kernel="linear"` (a
        constant-size state, not a per-token one). See `kv_cache_bytes_per_layer`."""
        return sum(kv_cache_bytes_per_layer(self, 1))

    def kv_cache_bytes_per_token(self, bytes_per_element: int = 2, positions: bool = False) -> int:
        """KV-cache bytes per token (default fp16/bf16), e.g. 81,920 for `paper-300m` QKV; with `positions`, plus
        the int64 position a QKVShare cache keeps per token when the model needs it (see `kv_cache_bytes_per_token`,
        the module function, for any config)."""
        return kv_cache_bytes_per_token(self, bytes_per_element, positions)

    def qkv_cache_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """KV-cache bytes per token of the plain QKV model of this shape (K and V of every head, every layer):
        the reference of the "cache cut" figures."""
        return 2 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * bytes_per_element

    @property
    def variant(self) -> str:
        """The paper's name of this config's attention variant."""
        return variant_name(self)

    @classmethod
    def from_preset(cls, name: str, variant: str | None = None, **overrides: Any) -> "QKVShareConfig":
        """Build a config from a named preset, an optional paper variant and field overrides.

        Presets: ``tiny`` (tests), ``small`` (CPU pretraining), ``paper-300m``, ``paper-1.2b`` (the paper's
        GPT-2-style models, exact parameter counts), ``llama-300m``, ``llama-1.2b``, ``vit-paper`` (the paper's ViT,
        ViT-Base/16 shapes) and ``vit-small`` (8x8 grey digits, CPU). ``variant`` takes the paper's
        names (see `resolve_variant`); explicit overrides win over both. Its "+" variants take m =
        `PRESET_ATTENTION_MAP_PE_DIMS` of the preset (50 for the vit-* presets, as the paper's ViT) or 10.

        Unlike a plain ``QKVShareConfig(...)``, an override that is not a config field (a typo such as
        ``projection_shareing``) is a ValueError naming the closest field (see `check_field_names`).

        Token ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) must lie in ``[0, vocab_size)``:
        - a preset's own ids that do not fit an overridden ``vocab_size`` (the paper presets carry GPT-2's 50256)
          are dropped (set to None, with a warning): they belong to another tokenizer; pass your tokenizer's ids;
        - an id given explicitly that does not fit (or a negative one) is a ValueError.
        """
        if name not in PRESETS:
            raise ValueError(f"preset={name!r} is not a known preset; allowed: {', '.join(PRESETS)}.")
        cls.check_field_names(overrides, f"QKVShareConfig.from_preset({name!r})")
        fields = dict(PRESETS[name])
        if variant is not None:  # resolved against the preset as overridden (its head count, head_dim)
            m = PRESET_ATTENTION_MAP_PE_DIMS.get(name, DEFAULT_ATTENTION_MAP_PE_DIM)
            fields.update(resolve_variant(variant, fields | overrides, attention_map_pe_dim=m))
        fields.update(overrides)
        _fit_token_ids(name, fields, given=overrides.keys())
        return cls(**fields)

    @classmethod
    def from_llama(cls, config_or_dict: Any, variant: str | None = None, **overrides: Any) -> "QKVShareConfig":
        """The Llama-style QKVShare config with the shape of a Llama-architecture config (`LLAMA_ARCHITECTURES`).

        `config_or_dict` is a `LlamaConfig` / `MistralConfig` / `Qwen2Config` (any object with `to_dict()`) or a
        ``config.json`` dict. Copied: vocabulary, widths, layers, heads, head_dim, positions, norm epsilon, RoPE
        (theta and scaling), biases (Qwen2's q/k/v biases become ``attention_bias=True``; its missing ``o_proj`` bias
        is then a zero bias), activation, tied embeddings, token ids. With ``variant=None`` the result is the
        source's own attention (QKV, or GQA with its key/value heads), so the source's weights load unchanged.

        ``variant`` takes the paper's names, resolved against the source's shape by `resolve_variant`: a name
        without a head count keeps the source's key/value heads (``Q-K=V`` of a GQA-3 model is Q-GQA-3), Q=K names
        and QV-Ka take one per head, ``GQA-<g>``, ``MQA``, ``Q-GQA-<g>``, ``Q-MQA`` set g. Overrides win over both and are checked
        like `from_preset`'s (a misspelt field names the closest one).

        A sliding attention window shorter than the positions (Mistral v0.1, Qwen2 with ``use_sliding_window``)
        has no QKVShare field: ``max_position_embeddings`` is lowered to the window, below which the two attend
        identically, with a warning. Raises `ValueError` for another ``model_type`` (naming the supported ones).
        """
        d = config_or_dict.to_dict() if hasattr(config_or_dict, "to_dict") else dict(config_or_dict)
        model_type = d.get("model_type")
        if model_type not in LLAMA_ARCHITECTURES:
            raise ValueError(
                f"model_type={model_type!r} is not a Llama-architecture model; QKVShareConfig.from_llama supports "
                f"{', '.join(map(repr, LLAMA_ARCHITECTURES))} (same attention, RMSNorm, SwiGLU and RoPE)."
            )
        cls.check_field_names(overrides, "QKVShareConfig.from_llama")
        rope = d.get("rope_parameters")
        if not rope:  # config.json of transformers < 5: rope_theta and rope_scaling
            rope = dict(d.get("rope_scaling") or {}, rope_theta=d.get("rope_theta", 10000.0))
            rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
        if not hasattr(config_or_dict, "to_dict"):  # a config.json: fields it leaves out take transformers' defaults
            d = llama_config_dict(d)
        heads = d["num_attention_heads"]
        fields = dict(
            ARCHITECTURE_STYLES["llama"],
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            norm_eps=d.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            attention_dropout=d.get("attention_dropout", 0.0),
            mlp_bias=bool(d.get("mlp_bias", False)),
            hidden_act=d.get("hidden_act", "silu"),
            initializer_range=d.get("initializer_range", 0.02),
            rope_parameters=rope,
        )
        for key in _TOKEN_ID_FIELDS:
            if key in d:
                fields[key] = d[key]
        window = d.get("sliding_window") if model_type != "qwen2" or d.get("use_sliding_window") else None
        if window and window < fields["max_position_embeddings"]:
            logger.warning(
                f"{model_type} sliding_window={window} is shorter than max_position_embeddings="
                f"{fields['max_position_embeddings']}: QKVShare has no sliding window, so max_position_embeddings is "
                f"set to {window} (up to that length both attend to the same keys)."
            )
            fields["max_position_embeddings"] = window
        if variant is not None:
            fields.update(resolve_variant(variant, fields))
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def check_field_names(cls, names: Iterable[str], source: str) -> None:
        """Raise a ValueError naming each of `names` that is not a config field, with the closest valid name.

        `source` says where the names come from and opens the message (e.g. ``"--config_overrides"``), so the
        command lines can reject a misspelt override before any work. Valid names: the fields of this class and
        of transformers' `PreTrainedConfig` (``pad_token_id``, ``dtype``, ``id2label``, ...) and the keywords
        their ``__post_init__`` accepts (``rope_theta``, ``rms_norm_eps``, ``torch_dtype``, ``num_labels``, ...).
        """
        valid = sorted({field.name for field in dataclasses.fields(cls)} | set(_POST_INIT_KEYWORDS))
        unknown = [name for name in names if name not in valid]
        if not unknown:
            return
        described, unmatched = [], False
        for name in unknown:
            closest = difflib.get_close_matches(name, valid, n=1)
            unmatched |= not closest
            described.append(f"{name!r} (did you mean {closest[0]!r}?)" if closest else repr(name))
        plural = "s" if len(unknown) > 1 else ""
        message = f"{source}: unknown config field{plural} {', '.join(described)}; fix the spelling"
        if unmatched:
            message += f" (valid fields: {', '.join(valid)})"
        raise ValueError(message + ".")

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs: Any) -> None:
        """transformers' `save_pretrained`; when a model saves its code with it, `auto_map` lists every head.

        A model's `save_pretrained` writes only its own class into `auto_map`; listing all of
        `AUTO_MODEL_CLASSES` (same module) lets `trust_remote_code=True` load the checkpoint as any head.
        """
        auto_map = getattr(self, "auto_map", None) or {}
        for auto_class, reference in list(auto_map.items()):
            module, _, class_name = reference.rpartition(".")
            if AUTO_MODEL_CLASSES.get(auto_class) == class_name:  # our modeling file is in the checkpoint
                for other_auto_class, other_class_name in AUTO_MODEL_CLASSES.items():
                    auto_map.setdefault(other_auto_class, f"{module}.{other_class_name}")
                break
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# What a cache holds per token, and whether a config is exactly Llama: one home each, for any command or log line.
# ----------------------------------------------------------------------------------------------------------------
POSITION_BYTES_PER_TOKEN = 8  # the int64 position a QKVShare cache keeps per token when `needs_key_positions`


def kv_cache_bytes_per_layer(config: Any, bytes_per_element: int = 2, tied: bool = True) -> list[int]:
    """Per-token cache bytes of each decoder layer of `config` (a `QKVShareConfig` or any transformers decoder config):
    a key and a value of H_kv x head_dim, one tensor for a K=V tied layer, QV-Ka's values and context G (H_kv x
    head_dim + d_ctx), 0 for the linear kernel's constant-size state. `tied=False` gives what an engine that caches
    K and V in every layer holds for the same model (transformers' Llama, vLLM, llama.cpp). A config without
    QKVShare's fields caches K and V in every layer."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, heads = text.num_hidden_layers, text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    per_tensor = kv_heads * (getattr(text, "head_dim", None) or text.hidden_size // heads) * bytes_per_element
    if getattr(text, "attention_kernel", "softmax") == "linear":
        return [0] * layers
    context = getattr(text, "key_context_dim", 0) or 0
    if context and tied:
        return [per_tensor + context * bytes_per_element] * layers
    is_tied = getattr(text, "is_kv_tied", None) if tied else None
    return [per_tensor * (1 if is_tied is not None and is_tied(i) else 2) for i in range(layers)]


def kv_cache_bytes_per_token(
    config: Any, bytes_per_element: int = 2, positions: bool = False, tied: bool = True
) -> int:
    """KV-cache bytes per token of one sequence, all layers (`kv_cache_bytes_per_layer` summed); with `positions`,
    plus `POSITION_BYTES_PER_TOKEN` when the model keeps the positions of its cached keys (`needs_key_positions`:
    pre-RoPE ties, "+", ALiBi, QV-Ka with RoPE), which is what a QKVShare cache's `nbytes()` counts."""
    total = sum(kv_cache_bytes_per_layer(config, bytes_per_element, tied))
    keeps_positions = positions and tied and getattr(config, "needs_key_positions", False)
    return total + (POSITION_BYTES_PER_TOKEN if keeps_positions else 0)


def llama_differences(config: QKVShareConfig) -> list[str]:
    """Why a model with `config` is not exactly a Llama model, one entry per difference (empty when it is one).

    Exactly Llama, layer by layer: QKV, GQA, MQA; Q=K (q_proj = k_proj: both are rotated by the same RoPE); a K=V
    layer tied before RoPE (v_proj = k_proj); Q=K=V pre-RoPE; and per-layer mixes of these, with Llama's block
    (RMSNorm, gated MLP, RoPE, causal softmax attention over every token). Not Llama: a post-RoPE K=V tie (the value
    is the rotated key), the "+" map and ALiBi (score biases), QV-Ka, learned or no positions, LayerNorm or the
    plain MLP, the linear kernel, a sliding window, an encoder. Used by `qkvshare export --format llama/gguf` and by
    the benchmarks that copy a model's weights into its Llama twin."""
    problems = []
    if config.attention_kernel != "softmax":
        problems.append(f"attention_kernel={config.attention_kernel!r} (a recurrence; Llama has softmax attention)")
    if config.position_embedding_type != "rope":
        what = "a score bias by distance" if config.position_embedding_type == "alibi" else "no RoPE"
        problems.append(f"position_embedding_type={config.position_embedding_type!r} ({what}; Llama has RoPE)")
    if config.norm_type != "rmsnorm" or config.mlp_type != "gated":
        problems.append(
            f"norm_type={config.norm_type!r}, mlp_type={config.mlp_type!r} (Llama has RMSNorm and a gated MLP)"
        )
    if not config.is_causal:
        problems.append("is_causal=False (an encoder; Llama is a causal decoder)")
    if config.attention_map_pe_dim:
        problems.append(f"attention_map_pe_dim={config.attention_map_pe_dim} (the '+' map adds a score bias)")
    if config.key_context_dim:
        problems.append(f"key_context_dim={config.key_context_dim} (QV-Ka: keys made from the values and a context)")
    layers = range(config.num_hidden_layers)
    sliding = [str(i) for i in layers if config.layer_attention_type(i) == "sliding_attention"]
    if sliding:
        problems.append(
            f"sliding_window={config.sliding_window} in layers {', '.join(sliding)} (Llama attends to every token; "
            "Mistral's config could hold the window, which Llama's does not)"
        )
    post_rope = config.kv_tie_point == "post_rope" and config.position_embedding_type == "rope"
    rotated_values = [str(i) for i in layers if post_rope and config.layer_mode(i).kv_tied]
    if rotated_values:
        problems.append(
            f"kv_tie_point='post_rope' with K=V layers {', '.join(rotated_values)} (the value is the rotated key; "
            "Llama's values are never rotated; a pre_rope tie is Llama with v_proj = k_proj)"
        )
    if config.hidden_size % config.num_attention_heads:
        problems.append(
            f"hidden_size={config.hidden_size} is not a multiple of num_attention_heads="
            f"{config.num_attention_heads} (LlamaConfig requires it)"
        )
    return problems


def llama_twin_config(
    config: QKVShareConfig,
    *,
    num_key_value_heads: int | None = None,
    attn_implementation: str | None = None,
    **fields: Any,
) -> PreTrainedConfig:
    """The `LlamaConfig` of the same shape as `config`: the one mapping of a QKVShare config onto Llama's, for the
    reference `LlamaForCausalLM` of benchmarks and for `qkvshare export --format llama`.

    Same vocabulary, widths, layers, heads (`num_key_value_heads` overrides the key/value heads, e.g. a GQA
    reference for a shared variant), positions, norm epsilon, RoPE, biases, activation, tied embeddings and special
    token ids. Only the shape is copied: for a config with `llama_differences` the twin has the same sizes but
    computes something else. `fields` are further `LlamaConfig` fields.
    """
    return CONFIG_MAPPING["llama"](
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads if num_key_value_heads is None else num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        # learned/no positions leave rope_parameters empty; Llama always rotates, with its default theta
        rope_parameters=config.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=config.attention_bias,
        mlp_bias=config.mlp_bias,
        hidden_act=config.hidden_act,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        attn_implementation=attn_implementation,
        **fields,
    )


__all__ = [
    "QKVShareConfig",
    "ARCHITECTURE_STYLES",
    "AUTO_MODEL_CLASSES",
    "PRESETS",
    "VARIANTS",
    "LLAMA_ARCHITECTURES",
    "PAPER_NAMES",
    "IMAGE_POOLINGS",
    "PATCH_POSITION_EMBEDDING_TYPES",
    "SHARING_MODES",
    "SharingMode",
    "mode_for_projections",
    "parse_variant",
    "resolve_variant",
    "variant_name",
    "kv_cache_bytes_per_layer",
    "kv_cache_bytes_per_token",
    "llama_differences",
    "llama_twin_config",
    "POSITION_BYTES_PER_TOKEN",
]
