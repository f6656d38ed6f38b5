"""`qkvshare convert`: turn a pretrained Llama-architecture checkpoint into a QKVShare model of any variant.

    qkvshare convert path/to/llama-dir --variant Q-K=V --output_dir smollm2-qkv          # calibrated K=V
    qkvshare convert SmolLM2-135M-Instruct.Q4_1.gguf --variant MQA --output_dir smollm2-mqa

The source is a model directory, a `.gguf` file (needs the `gguf` package) or, from Python, a `LlamaForCausalLM`
(Mistral, Qwen2) object: `convert(model, "Q-MQA", calibration_ids=ids)`. Everything outside attention (embeddings,
norms, MLPs, LM head) is copied unchanged; attention changes as follows (W_q, W_k, W_v, W_o per head h, d_h wide).

Head sharing (fewer key/value heads: GQA-g, MQA, Q-GQA-g, Q-MQA)
    Mean-pooling, as in the GQA paper (Ainslie et al. 2023, section 2.2): each new key/value head is the mean of
    the source key (and value) heads that served its query heads, weighted by how many of them each served. With
    g dividing the source's head count that is the plain mean of whole source heads. Query and o_proj are kept.

K=V ("kv" Q-K=V, "qkv" Q=K=V): `--method`
    - `key`: keep W_k as the shared projection (the cached tensor is the key; the source's values are lost).
    - `value`: keep W_v as the shared projection (the source's keys are lost, so every attention map changes).
    - `calibrated` (default, the best measured: README "Converting a pretrained model"): `key` plus a new o_proj.
      For source head h with attention weights P_h, the source's attention output is a_h = P_h V_g(h) (rows are
      tokens). The converted layer computes f_h = P'_h U with U its one cached tensor (P' = P for Q-K=V with the
      source's key heads). Because o_proj is linear, a map M_h (d_h x d_h) applied to each row of f_h folds into
      it: the layer outputs sum_h W_o,h (M_h^T f_h) = sum_h (W_o,h M_h^T) f_h per token, so the new o_proj block
      of head h is W_o,h M_h^T and inference costs nothing extra. M_h is ridge least squares over calibration tokens,
          M_h = argmin_M ||F_h M - A_h||^2 + lambda ||M||^2 = (F_h^T F_h + lambda I)^-1 F_h^T A_h,
      with F_h, A_h the converted and the source attention outputs of head h on the same layer inputs,
      lambda = ridge x trace(F_h^T F_h) / d_h. With attention biases (Qwen2) F_h gets a column of ones; its row
      of M_h is a constant c_h added to every value, which passes through softmax's convex combination unchanged
      and folds into o_proj's bias (b_o += W_o,h c_h). Fitting attention outputs rather than the values (U M ~ V,
      the P = I special case) weighs each token as attention actually mixes it and fits one map per query head,
      so a pooled key/value head (Q-MQA) still gives each query head a value close to its own source head's.
    - Which layer inputs the fit uses (`--calibration`):
        `sequential` (default): the converted model's own hidden states, layers below l already converted, with
        A_h the SOURCE layer's attention on those same inputs. Each fit sees the inputs the layer gets at
        inference (with the drift the layers below leave), as GPTQ quantizes layer l on the outputs of the
        already-quantized layers. One pass: the converted stream advances layer by layer as each is fitted.
        `independent`: the source's hidden states for every layer; each layer is fitted on inputs it no longer
        sees once the layers below are converted, so the errors compound.
      Measured on SmolLM2-135M (2,048 calibration tokens, held-out perplexity at 0 steps, README table):
      Q-K=V independent 63.98, sequential 62.49; Q-MQA 26.9M and 1.05M. Tried and not kept: the converted
      path's features against the source path's attention outputs (65.4), and a whole new o_proj fitted to
      bring the converted stream back to the source's, (h_src - h') + y_src (81.8 at ridge 1e-4, 77.6 at 1e-2:
      6x lower drift on the calibration tokens, but 576 x 577 unknowns overfit).
    - Which tie point: with the pre-RoPE tie (`kv_tie_point="pre_rope"`) the cached tensor is U = X W_k, and the
      source's values X W_v are then a fixed linear function of the layer input, so "best linear map from U"
      is well posed. With the post-RoPE tie U = R(t) X W_k depends on the position t, and no position-free M can
      undo the rotation; the fit still runs (on the rotated features) but reconstructs worse. So `calibrated`
      sets `kv_tie_point="pre_rope"` unless you pass `kv_tie_point` yourself; `key` and `value` keep the
      config default (`post_rope`). Each conversion records its errors (`conversion.json`).

Q=K ("qk" Q=K-V, "qkv" Q=K=V; needs as many key/value heads as query heads): `--query_method`
    `key` (default: keep W_k, so the cached keys are the source's) or `query` (keep W_q). A symmetric score can
    only approximate W_q W_k^T; we measured no better choice (the available real model is GQA, which Q=K cannot
    take), so none is offered.

`none` (QKV, or the source's own GQA): an exact copy; logits equal the source's.

The error recorded per layer (`conversion.json`, `layer_errors`): ||y' - y|| / ||y|| over the calibration tokens,
with y the source layer's attention output (after o_proj) and y' the converted layer's, both from the source's
hidden states, so every method is measured in the same terms; and `drift`, ||h' - h|| / ||h|| of the residual stream
after each layer, the converted model's own against the source's (what compounds over the layers). The output
directory is a normal model directory (safetensors, config with auto_map, the model code, the tokenizer) plus
`conversion.json`, the record of how it was made. Bad input (an unsupported architecture, a variant the source
cannot take, a missing or too small calibration set, an output directory holding files) fails before the weights are
read.

Layout: `weights` (pooled heads, the converted attention weights, the head-map fit and its fold into o_proj),
`calibration` (calibration text, the source's hidden states, `calibrate`), `conversion` (the plan and every check
before any weight is read, `convert` and its record), `io` (sources: directories, .gguf files, tokenizers; saving),
`cli` (the command). Every public name is importable from `qkvshare.convert`. Light at import (standard library
only; torch and transformers are imported by the functions that need them), so `qkvshare convert --help` and
argument errors answer at once.
"""

from __future__ import annotations

from qkvshare.convert.calibration import (
    CALIBRATIONS,
    DEFAULT_CALIBRATION,
    DEFAULT_CALIBRATION_BLOCK,
    DEFAULT_CALIBRATION_TOKENS,
    DEFAULT_RIDGE,
    MIN_TOKENS_PER_HEAD_DIM,
    calibrate,
    calibration_ids,
    calibration_texts,
    check_calibration_ids,
    min_calibration_tokens,
    source_streams,
)
from qkvshare.convert.cli import main, parse_args, run
from qkvshare.convert.conversion import (
    CONVERT_OVERRIDES,
    DEFAULT_METHOD,
    RECORD_FILE,
    ConversionRecord,
    check_architecture,
    convert,
    plan_conversion,
)
from qkvshare.convert.io import load_source, load_source_tokenizer, read_source_config, save_converted
from qkvshare.convert.weights import (
    KV_METHODS,
    QUERY_METHODS,
    attention_state,
    build_converted,
    fit_head_maps,
    fold_into_o_proj,
    pooling_matrix,
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
    "parse_args",
    "pooling_matrix",
    "read_source_config",
    "run",
    "source_streams",
]
