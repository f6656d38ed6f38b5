"""QKVShare: transformers models that share attention projections, with a KV cache that stores one tensor
for layers whose key and value are tied.

Importing the package registers the config and models with transformers' Auto classes, and marks them for
`save_pretrained`/`push_to_hub` to copy their code into checkpoints (`auto_map`, listing every head), so a
checkpoint also loads with `trust_remote_code=True` where the package is not installed. When PEFT is installed,
it also gives PEFT a default LoRA target for the model type (see `register_peft_defaults`).
"""

import importlib.util

import transformers
from transformers.utils import logging

from . import modeling_qkvshare
from .cache_qkvshare import (
    CacheLayout,
    LinearAttentionStateLayer,
    QKVShareCache,
    QKVShareQuantizedCache,
    QKVShareStaticCache,
    TiedFp8QuantizedLayer,
    TiedHQQQuantizedLayer,
    TiedKVLayer,
    TiedQuantoQuantizedLayer,
    TiedSlidingWindowLayer,
    TiedStaticLayer,
    TiedStaticSlidingWindowLayer,
)
from .configuration_qkvshare import (
    ARCHITECTURE_STYLES,
    AUTO_MODEL_CLASSES,
    PAPER_NAMES,
    PRESETS,
    VARIANTS,
    QKVShareConfig,
    parse_variant,
)
from .modeling_qkvshare import (
    QKVShareForCausalLM,
    QKVShareForImageClassification,
    QKVShareForSequenceClassification,
    QKVShareForTokenClassification,
    QKVShareModel,
    QKVSharePreTrainedModel,
)
from .version import __version__

logger = logging.get_logger(__name__)

# PEFT's default LoRA targets for this model type: the attention projections, those a layer has (Q=K=V layers
# only have k_proj; QV-Ka layers q_proj, ctx_proj and v_proj, its per-head key maps `k_mix` being no Linear that LoRA
# wraps). Llama's default (q_proj, v_proj) would adapt only q_proj on Q-K=V and nothing on Q=K=V.
PEFT_LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "ctx_proj")


def register_peft_defaults() -> bool:
    """Make `LoraConfig()` without `target_modules` work on QKVShare models (every variant).

    PEFT looks the default targets up by `model_type` in `TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`
    (`LoraModel._prepare_adapter_config`); this adds `"qkvshare"` there unless PEFT already knows it. PEFT
    matches each name against module-name suffixes, so a projection a layer does not have is simply skipped.
    Returns whether the default was registered; PEFT is imported only when it is installed.
    """
    if importlib.util.find_spec("peft") is None:
        return False
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    except ImportError as error:  # a broken PEFT install must not break this package; say so and go on
        logger.warning(f"PEFT is installed but failed to import ({error}); LoraConfig() will need target_modules.")
        return False

    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.setdefault(
        QKVShareConfig.model_type, list(PEFT_LORA_TARGET_MODULES)
    )
    return True


transformers.AutoConfig.register(QKVShareConfig.model_type, QKVShareConfig, exist_ok=True)
QKVShareConfig.register_for_auto_class()
for _auto_name, _class_name in AUTO_MODEL_CLASSES.items():
    _auto, _model = getattr(transformers, _auto_name), getattr(modeling_qkvshare, _class_name)
    _auto.register(QKVShareConfig, _model, exist_ok=True)
    _model.register_for_auto_class(_auto_name)
register_peft_defaults()

__all__ = [
    "QKVShareConfig",
    "QKVShareModel",
    "QKVSharePreTrainedModel",
    "QKVShareForCausalLM",
    "QKVShareForSequenceClassification",
    "QKVShareForTokenClassification",
    "QKVShareForImageClassification",
    "QKVShareCache",
    "QKVShareStaticCache",
    "TiedStaticLayer",
    "TiedKVLayer",
    "LinearAttentionStateLayer",
    "CacheLayout",
    "QKVShareQuantizedCache",
    "TiedSlidingWindowLayer",
    "TiedStaticSlidingWindowLayer",
    "TiedQuantoQuantizedLayer",
    "TiedHQQQuantizedLayer",
    "TiedFp8QuantizedLayer",
    "PRESETS",
    "ARCHITECTURE_STYLES",
    "AUTO_MODEL_CLASSES",
    "VARIANTS",
    "PAPER_NAMES",
    "PEFT_LORA_TARGET_MODULES",
    "parse_variant",
    "register_peft_defaults",
    "__version__",
]
