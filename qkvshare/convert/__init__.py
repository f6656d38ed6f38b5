"""`qkvshare convert`: turn a pretrained Llama-architecture checkpoint into a QKVShare model of any variant.

The method (head pooling, the K=V methods and their calibrated fit, Q=K, the recorded errors) is written with the
command's arguments in `qkvshare_cli.convert`, and `qkvshare convert --help` prints it. From Python:
`convert(model, "Q-MQA", calibration_ids=ids)` on a `LlamaForCausalLM` (Mistral, Qwen2) object.

Layout: `weights` (pooled heads, the converted attention weights, the head-map fit and its fold into o_proj),
`calibration` (calibration text, the source's hidden states, `calibrate`), `conversion` (the plan and every check
before any weight is read, `convert` and its record), `io` (sources: directories, .gguf files, tokenizers; saving),
`cli` (the command's run). Every public name is importable from `qkvshare.convert`.
"""

from __future__ import annotations

from qkvshare.convert.calibration import (
    MIN_TOKENS_PER_HEAD_DIM,
    calibrate,
    calibration_ids,
    calibration_texts,
    check_calibration_ids,
    min_calibration_tokens,
    source_streams,
)
from qkvshare.convert.cli import execute, main, run
from qkvshare.convert.conversion import ConversionRecord, check_architecture, convert, plan_conversion
from qkvshare.convert.io import load_source, load_source_tokenizer, read_source_config, save_converted
from qkvshare.convert.weights import (
    attention_state,
    build_converted,
    fit_head_maps,
    fold_into_o_proj,
    pooling_matrix,
)
from qkvshare_cli.convert import (
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
)

__all__ = [
    "ConversionRecord",
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
    "main",
    "execute",
    "run",
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
