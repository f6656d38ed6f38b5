"""`qkvshare convert`: turn a pretrained Llama-architecture checkpoint into a QKVShare model of any variant.

The method (head pooling, the K=V methods and their calibrated fit, Q=K, the recorded errors) is written with the
command's settings in `qkvshare_settings.convert`, and `qkvshare convert --help` prints it. From Python, the whole
command is `convert_checkpoint(ConvertArgs(SRC, OUT, "Q-K=V", method="transfer"))`, which returns the record; the
conversion of a model object alone is `convert(model, "Q-MQA", calibration_ids=ids)` on a `LlamaForCausalLM`
(Mistral, Qwen2), or `convert(model, "Q-K=V", "transfer", calibration_ids=ids, validation_ids=held_out,
cache_budget=0.75)`.

Layout: `weights` (pooled heads, the converted attention weights, the head-map fit and its fold into o_proj),
`calibration` (calibration text, the source's hidden states, `calibrate`), `conversion` (the plan and every check
before any weight is read, `convert` and its record), `io` (sources: directories, .gguf files, tokenizers; saving
all or nothing), `data` (the embedded mixed prose + code calibration text and its splits), `transfer` (stages (a)
closed-form o_proj and (b) attention transfer of `--method transfer`), `budget` (`--cache_budget`'s layer choice),
`distill` (stage (c) through `qkvshare.train.distill`), `pipeline` (`convert_checkpoint`, the whole command).
Sources are read by `qkvshare.model_dir` (`load_source`, `read_source_config`, ...). Every public name is
importable from `qkvshare.convert`.
"""

from __future__ import annotations

from qkvshare.convert.budget import (
    BudgetChoice,
    check_cache_budget,
    choose_tied_layers,
    every_layer_needed,
    keeps_untied_layers,
    tie_layers,
)
from qkvshare.convert.calibration import (
    MIN_TOKENS_PER_HEAD_DIM,
    calibrate,
    calibration_ids,
    calibration_texts,
    check_calibration_ids,
    min_calibration_tokens,
    source_streams,
)
from qkvshare.convert.conversion import (
    ConversionRecord,
    budget_model,
    convert,
    layer_kl_scores,
    mixed_model,
    plan_conversion,
)
from qkvshare.convert.distill import run_distillation
from qkvshare.convert.io import ConversionWriteError, publish, save_converted
from qkvshare.convert.pipeline import DistillationStopped, convert_checkpoint
from qkvshare.convert.transfer import TransferSettings, run_stages
from qkvshare.convert.weights import (
    attention_state,
    build_converted,
    fit_head_maps,
    fold_into_o_proj,
    pooling_matrix,
)
from qkvshare.model_dir import check_architecture, load_source, load_source_tokenizer, read_source_config
from qkvshare_settings.convert import (
    CALIBRATIONS,
    CONVERT_OVERRIDES,
    DEFAULT_CALIBRATION,
    DEFAULT_CALIBRATION_BLOCK,
    DEFAULT_CALIBRATION_TOKENS,
    DEFAULT_METHOD,
    DEFAULT_RIDGE,
    KV_METHODS,
    QUERY_METHODS,
    RECORD_FILE,
    ConvertArgs,
)
from qkvshare_settings.train import DistillSettings

__all__ = [
    "ConvertArgs",
    "convert_checkpoint",
    "DistillationStopped",
    "ConversionRecord",
    "TransferSettings",
    "run_stages",
    "DistillSettings",
    "run_distillation",
    "BudgetChoice",
    "check_cache_budget",
    "choose_tied_layers",
    "every_layer_needed",
    "keeps_untied_layers",
    "budget_model",
    "mixed_model",
    "layer_kl_scores",
    "tie_layers",
    "publish",
    "ConversionWriteError",
    "KV_METHODS",
    "CALIBRATIONS",
    "QUERY_METHODS",
    "DEFAULT_METHOD",
    "plan_conversion",
    "convert",
    "calibrate",
    "save_converted",
    "load_source",
    "load_source_tokenizer",
    "calibration_ids",
    "calibration_texts",
    # also importable as before the split into modules
    "CONVERT_OVERRIDES",
    "DEFAULT_CALIBRATION",
    "DEFAULT_CALIBRATION_BLOCK",
    "DEFAULT_CALIBRATION_TOKENS",
    "DEFAULT_RIDGE",
    "MIN_TOKENS_PER_HEAD_DIM",
    "RECORD_FILE",
    "attention_state",
    "build_converted",
    "check_architecture",
    "check_calibration_ids",
    "fit_head_maps",
    "fold_into_o_proj",
    "min_calibration_tokens",
    "pooling_matrix",
    "read_source_config",
    "source_streams",
]
