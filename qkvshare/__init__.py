"""QKVShare: transformers models that share attention projections, with a KV cache that stores one tensor
for layers whose key and value are tied.

Importing the package registers the config and models with transformers' Auto classes, and marks them for
`save_pretrained`/`push_to_hub` to copy their code into checkpoints (`auto_map`), so a checkpoint also loads
with `trust_remote_code=True` where the package is not installed.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .cache_qkvshare import QKVShareCache, TiedKVLayer
from .configuration_qkvshare import (
    ARCHITECTURE_STYLES,
    PAPER_NAMES,
    PRESETS,
    VARIANTS,
    QKVShareConfig,
    parse_variant,
)
from .modeling_qkvshare import (
    QKVShareForCausalLM,
    QKVShareForSequenceClassification,
    QKVShareForTokenClassification,
    QKVShareModel,
    QKVSharePreTrainedModel,
)

__version__ = "0.1.0"

AutoConfig.register(QKVShareConfig.model_type, QKVShareConfig, exist_ok=True)
for _auto, _model in (
    (AutoModel, QKVShareModel),
    (AutoModelForCausalLM, QKVShareForCausalLM),
    (AutoModelForSequenceClassification, QKVShareForSequenceClassification),
    (AutoModelForTokenClassification, QKVShareForTokenClassification),
):
    _auto.register(QKVShareConfig, _model, exist_ok=True)
    _model.register_for_auto_class(_auto.__name__)
QKVShareConfig.register_for_auto_class()

__all__ = [
    "QKVShareConfig",
    "QKVShareModel",
    "QKVSharePreTrainedModel",
    "QKVShareForCausalLM",
    "QKVShareForSequenceClassification",
    "QKVShareForTokenClassification",
    "QKVShareCache",
    "TiedKVLayer",
    "PRESETS",
    "ARCHITECTURE_STYLES",
    "VARIANTS",
    "PAPER_NAMES",
    "parse_variant",
]
