"""`qkvshare convert`: turn a pretrained Llama-architecture checkpoint into a QKVShare model of any variant.

    qkvshare convert path/to/llama-dir --variant Q-K=V --output_dir smollm2-qkv          # calibrated K=V
    qkvshare convert SmolLM2-135M-Instruct.Q4_1.gguf --variant MQA --output_dir smollm2-mqa
    qkvshare convert path/to/llama-dir --variant Q-K=V --method transfer --distill_tokens 262144 \
        --cache_budget 0.75 --output_dir smollm2-qkv-0.75                              # the recipe of issue 19

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

`--method transfer` (any variant that changes attention: K=V, Q=K, pooled heads): three resumable stages,
    `qkvshare.convert.transfer` has the details. (a) closed form: per converted layer, o_proj refitted by ridge
    regression (`--ridge`) in output space from the features it receives, concat_h(P'_h U_g(h)), to the source
    layer's attention-block output. (b) attention transfer (LoLCATs, ICLR 2025): each converted layer, fed the
    SOURCE's hidden states, trains its attention weights (q_proj, the shared k_proj, v_proj where it exists,
    o_proj) with Adam to match the source layer's output (normalised MSE): `--transfer_steps` steps of
    `--transfer_batch_size` blocks per layer, each layer keeping its state that is best on the validation split
    (measured every `--transfer_eval_steps` steps); the layers are independent, one source forward serves all. (c)
    distillation of the whole model against the source's logits (KL at `--distill_temperature`, mixed with the LM
    loss by `--distill_lm_weight`; `--distill_hidden_weight` adds a loss matching each layer's output to the
    source's) for `--distill_tokens` tokens, through `qkvshare train --teacher`. Stages (a)
    and (b) fit the calibration text's train split; each layer keeps a stage's result only if it lowers the
    layer's error on the validation split (`--validation_tokens`); the test split of the embedded text is never
    read. A stage's state is saved as it goes in a work folder beside the output (`.NAME.qkvshare-convert`): a
    conversion killed at any point continues from there when the same command is run again. `conversion.json`
    holds each layer's error before and after every stage and the KL divergence of the whole model to the source
    on the validation tokens after every stage. The tie point defaults to pre_rope, as for `calibrated`.

`--cache_budget F` (with `--method transfer`, variants that keep the source's key/value heads): keep at most F of
    the source's KV-cache bytes per token by tying only the layers that cost least and keeping the others exactly
    as the source has them (`layer_projection_sharing`; each tied layer halves its bytes). `--budget_choice kl`
    (the default) ranks a layer by the whole model's KL divergence to the source on the validation tokens with that
    layer alone tied, `error` by the layer's own error after stage (b). Stage (c) then distils that model. The
    record names the tied layers, each layer's score and the exact bytes per token.

Calibration text (`--calibration_text`, a `+`-joined mix of sources, each an equal share of the characters unless
    it is given a weight after a colon: `self+stdlib:2` reads twice as many characters of `stdlib` as of `self`):
    `self`: text the source model writes itself (`qkvshare.convert.self_text`: its answers, through its chat
    template, to a built-in list of everyday, science, history, writing and code instructions, and LLM-QAT-style
    continuations; generated once, cached and resumable in the work folder or `--self_text_dir`), so the stages fit
    the kind of text the source knows and produces; `stdlib`: the Python standard library's prose and code
    (`qkvshare.convert.data`, PSF License, with train / validation / test splits); `file`: `--calibration_file` or
    `--calibration_dataset` (a user's text is cut into pieces, every tenth of which validates). Stage (c)
    distils on the train split of the same mix. A source without a chat template writes plain continuations only,
    and says so.

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
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .conventions import DTYPE_NAMES, HelpFormatter, add_dtype_argument
from .overrides import parse_overrides
from .train import DistillSettings

KV_METHODS = ("key", "value", "calibrated", "transfer")
# Layers whose query is another projection's output (Q=K: k_proj): that projection keeps its own source weight (the
# default; named by its role, "key" for Q=K) or takes the source's W_q ("query").
QUERY_METHODS = ("key", "value", "query")
DEFAULT_METHOD = "calibrated"  # the lowest perplexity at 0 steps on SmolLM2-135M (README table)
DEFAULT_CALIBRATION_TOKENS = 8192
# The transfer method fits more weights per layer (stage (b) trains q/k/o_proj) and overfits 8,192 tokens: on
# SmolLM2-135M, 32,768 tokens and 300 steps gave 2.4x / 1.9x the source's held-out perplexity (code / prose) where
# 8,192 tokens and 100 steps gave 3.5x / 3.6x (docs/results.md section 11.2). Its memory: tokens x layers x hidden x 8
# bytes (5 GiB for SmolLM2 with the validation tokens), checked before any work.
DEFAULT_TRANSFER_CALIBRATION_TOKENS = 32768
DEFAULT_CALIBRATION_BLOCK = 512
DEFAULT_RIDGE = 1e-4
# The transfer method's o_proj refit maps all heads at once (hidden x hidden unknowns, not head_dim^2 per head), so
# it needs more shrinkage: on SmolLM2-135M with 8,192 calibration tokens, 1e-2 gave held-out errors 0.589 and 0.458
# (layers 3 and 15) against 0.623 and 0.459 at 1e-4.
DEFAULT_TRANSFER_RIDGE = 1e-2
# --distill_trainable_modules' word for "every parameter" (the training run's trainable_modules=None)
ALL_PARAMETERS = ["all"]
# --distill_trainable_modules' word for the recipe's choice, its default: every parameter when every layer is tied,
# the attention only (`BUDGET_TRAINABLE_MODULES`) when --cache_budget leaves layers as the source has them
# (docs/results.md section 11.3: at budget 0.75 1% worse on SmolLM2-135M, 3% better on Qwen2.5-Coder-0.5B, faster)
AUTO_MODULES = ["auto"]
BUDGET_TRAINABLE_MODULES = ["self_attn"]
# the transfer method's flags and their defaults (set to anything else, they need --method transfer)
TRANSFER_DEFAULTS = {
    "validation_tokens": 4096,
    "transfer_steps": 300,  # x 30 layers x 2 blocks of 512: about 8 minutes for SmolLM2-135M on 2 CPU cores
    "transfer_batch_size": 2,
    "transfer_learning_rate": 1e-3,
    "transfer_eval_steps": 25,
    "distill_tokens": 262144,  # 128 steps of 4 x 512: about 35 minutes for SmolLM2-135M on 2 CPU cores
    "distill_batch_size": 4,
    "distill_learning_rate": 3e-5,  # 1e-4 helps SmolLM2 all tied, but hurts Qwen2 all tied (docs/results.md 11.3)
    "distill_warmup_steps": 2,  # steps of linear warmup to the peak, then cosine down to a tenth of it
    "distill_temperature": 1.0,
    "distill_lm_weight": 0.0,
    "distill_hidden_weight": 0.0,
    "distill_bf16": None,  # auto: bf16 mixed precision where the device computes bf16 natively (section 11.3)
    "distill_trainable_modules": AUTO_MODULES,
    "distill_centre_output_projections": False,
    "distill_relative_learning_rates": False,
    "cache_budget": None,
    "budget_choice": "kl",  # docs/results.md section 11.3: the layers whose KL is lowest keep more of the answers
}
BUDGET_CHOICES = ("kl", "error")  # how --cache_budget ranks the layers (qkvshare.convert.budget)
DEFAULT_BUDGET_CHOICE = TRANSFER_DEFAULTS["budget_choice"]
CALIBRATIONS = ("sequential", "independent")
TEXT_SOURCES = ("self", "stdlib", "file")  # --calibration_text: a "+"-joined mix of these
# The default text: the transfer recipe's, chosen by docs/results.md section 11.3 (SmolLM2-135M, stages (a)+(b), every
# layer tied: 3.9x the source's perplexity on held-out English and 14% of its correct Factbook answers kept, against
# 10.5x and none with "stdlib"; budget 0.75: 1.5x and 63% against 2.2x and 34%); the one-shot methods keep the
# embedded text, which needs no generation (key and value only measure their errors on it).
DEFAULT_CALIBRATION_TEXT = {"transfer": "self+stdlib"}
DEFAULT_ONE_SHOT_TEXT = "stdlib"
KV_TIE_POINTS = ("post_rope", "pre_rope")  # the values of QKVShareConfig.kv_tie_point
DEFAULT_CALIBRATION = "sequential"  # lower perplexity at 0 steps than "independent" on SmolLM2-135M (README)
RECORD_FILE = "conversion.json"
# Config fields `convert` accepts as overrides: those that change sharing, not the shapes of the copied weights.
CONVERT_OVERRIDES = (
    "projection_sharing",
    "layer_projection_sharing",
    "num_key_value_heads",
    "kv_tie_point",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


@dataclass
class ConvertArgs:
    """What `qkvshare convert` (and `qkvshare.convert.convert_checkpoint`) converts, how, and where to.

    Every field is a flag of the command, with its default; building one checks it (a `ValueError` naming the field,
    the value and what is allowed). `None` fields take the method's default: `calibration_tokens` 8,192 (32,768 with
    `transfer`), `ridge` 1e-4 (1e-2 with `transfer`). The `transfer` method's fields (`TRANSFER_DEFAULTS`) can only
    be changed with `method="transfer"`.
    """

    source: str  # SRC: a Llama-architecture model directory or .gguf file
    output_dir: str  # where the converted model directory is written
    variant: str  # paper variant: Q-K=V, Q=K-V, Q=K=V, GQA-<g>, MQA, Q-GQA-<g>, Q-MQA, QKV
    method: str | None = None  # K=V layers: key, value, calibrated (the default), transfer
    query_method: str | None = None  # Q=K layers: key (the default), query
    kv_tie_point: str | None = None  # pre_rope (calibrated's default) or post_rope (the config default otherwise)
    calibration_file: str | None = None  # .txt or .jsonl (text column); default: the embedded prose + code
    calibration_dataset: str | None = None  # a datasets name, data folder or save_to_disk folder (text column)
    calibration_text: str | None = None  # "+"-joined of self, stdlib, file (default: file if given, else by method)
    self_text_tokens: int | None = None  # tokens the source writes for `self` (default: its share of all stages read)
    self_text_dir: str | None = None  # where the source's text is kept and reused (default: the work folder)
    # the source writes its text with its weights in bf16; None: as the text folder started, else where the device
    # computes bf16 natively
    self_text_bf16: bool | None = None
    calibration_tokens: int | None = None  # tokens to calibrate on
    calibration_block_size: int = DEFAULT_CALIBRATION_BLOCK  # tokens per sequence
    ridge: float | None = None  # relative ridge of the o_proj fit
    calibration: str = DEFAULT_CALIBRATION  # fit layer l on the converted model's hidden states, or the source's
    validation_tokens: int = TRANSFER_DEFAULTS["validation_tokens"]  # transfer: held-out tokens
    transfer_steps: int = TRANSFER_DEFAULTS["transfer_steps"]  # stage (b) steps per layer (0: none)
    transfer_batch_size: int = TRANSFER_DEFAULTS["transfer_batch_size"]  # stage (b) blocks per step
    transfer_learning_rate: float = TRANSFER_DEFAULTS["transfer_learning_rate"]  # stage (b) peak learning rate
    transfer_eval_steps: int = TRANSFER_DEFAULTS["transfer_eval_steps"]  # stage (b) measures its best state so often
    distill_tokens: int = TRANSFER_DEFAULTS["distill_tokens"]  # stage (c) tokens (0: no stage (c))
    distill_batch_size: int = TRANSFER_DEFAULTS["distill_batch_size"]  # stage (c) blocks per step
    distill_learning_rate: float = TRANSFER_DEFAULTS["distill_learning_rate"]  # stage (c) peak learning rate
    distill_warmup_steps: int = TRANSFER_DEFAULTS["distill_warmup_steps"]  # stage (c) steps up to the peak
    distill_temperature: float = TRANSFER_DEFAULTS["distill_temperature"]  # stage (c) KL temperature
    distill_lm_weight: float = TRANSFER_DEFAULTS["distill_lm_weight"]  # stage (c) LM loss weight
    distill_hidden_weight: float = TRANSFER_DEFAULTS["distill_hidden_weight"]  # stage (c) hidden-state loss weight
    # stage (c) in bf16 mixed precision (float32 weights); None: where the device computes bf16 natively
    distill_bf16: bool | None = TRANSFER_DEFAULTS["distill_bf16"]
    # stage (c) trains the parameters whose names contain one of these (["all"]: every parameter)
    distill_trainable_modules: list[str] = field(
        default_factory=lambda: list(TRANSFER_DEFAULTS["distill_trainable_modules"])
    )
    # stage (c)'s steps on the biased output projections centred (qkvshare.train.centring)
    distill_centre_output_projections: bool = TRANSFER_DEFAULTS["distill_centre_output_projections"]
    # stage (c)'s learning rate of each parameter scaled by its size (qkvshare.train.pretrain.relative_lr_scales)
    distill_relative_learning_rates: bool = TRANSFER_DEFAULTS["distill_relative_learning_rates"]
    cache_budget: float | None = TRANSFER_DEFAULTS["cache_budget"]  # transfer: at most this share of the KV bytes
    budget_choice: str = TRANSFER_DEFAULTS["budget_choice"]  # cache_budget ties the layers of lowest KL (or error)
    seed: int = 0  # order of the calibration text, stage (b)'s batches
    dtype: str = "float32"  # dtype of the saved weights (conversion runs in float32)
    overrides: dict[str, Any] = field(default_factory=dict)  # config fields of CONVERT_OVERRIDES
    overwrite_output_dir: bool = False  # replace a previous conversion in output_dir

    def __post_init__(self) -> None:
        transfer = self.method == "transfer"
        if self.calibration_tokens is None:
            self.calibration_tokens = DEFAULT_TRANSFER_CALIBRATION_TOKENS if transfer else DEFAULT_CALIBRATION_TOKENS
        if self.ridge is None:
            self.ridge = DEFAULT_TRANSFER_RIDGE if transfer else DEFAULT_RIDGE
        if self.calibration_text is None:
            given = self.calibration_file is not None or self.calibration_dataset is not None
            default = DEFAULT_CALIBRATION_TEXT.get(self.method or DEFAULT_METHOD, DEFAULT_ONE_SHOT_TEXT)
            self.calibration_text = "file" if given else default
        self.overrides = dict(self.overrides)
        self.distill_trainable_modules = list(self.distill_trainable_modules)
        if self.kv_tie_point is not None:
            self.overrides["kv_tie_point"] = self.kv_tie_point
        self.check()

    def check(self) -> None:
        """Every check that needs no weights (a `ValueError` naming the flag)."""
        for flag, value, allowed in (
            ("method", self.method, KV_METHODS),
            ("query_method", self.query_method, QUERY_METHODS),
            ("kv_tie_point", self.kv_tie_point, KV_TIE_POINTS),
            ("calibration", self.calibration, CALIBRATIONS),
            ("budget_choice", self.budget_choice, BUDGET_CHOICES),
        ):
            if value is not None and value not in allowed:
                raise ValueError(f"--{flag} {value!r} is not one of {', '.join(allowed)}.")
        check_source_path(self.source)
        if DTYPE_NAMES.get(self.dtype) in (None, "auto"):
            raise ValueError(f"--dtype {self.dtype!r} is not a dtype to save in; use float32, bfloat16 or float16.")
        for flag in ("calibration_tokens", "calibration_block_size"):
            if getattr(self, flag) < 2:
                raise ValueError(f"--{flag} {getattr(self, flag)} must be at least 2.")
        if not self.ridge >= 0:
            raise ValueError(f"--ridge {self.ridge} must be >= 0 (a small value such as {DEFAULT_RIDGE}).")
        if self.calibration_file is not None and not Path(self.calibration_file).expanduser().is_file():
            raise ValueError(
                f"--calibration_file {self.calibration_file!r} does not exist; pass a .txt or .jsonl file."
            )
        if self.calibration_file is not None and self.calibration_dataset is not None:
            raise ValueError("give either --calibration_file or --calibration_dataset, not both.")
        check_calibration_text(self)
        check_transfer_args(self)
        check_output_dir(Path(self.output_dir), self.overwrite_output_dir)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qkvshare convert", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("source", metavar="SRC", help="Llama-architecture model directory or .gguf file")
    p.add_argument(
        "--variant", required=True, help="paper variant: Q-K=V, Q=K-V, Q=K=V, GQA-<g>, MQA, Q-GQA-<g>, Q-MQA, QKV"
    )
    p.add_argument("--output_dir", required=True, help="where the converted model directory is written")
    p.add_argument("--method", choices=KV_METHODS, default=None, help=f"K=V layers (default: {DEFAULT_METHOD})")
    p.add_argument("--query_method", choices=QUERY_METHODS, default=None, help="Q=K layers (default: key)")
    p.add_argument(
        "--kv_tie_point",
        choices=KV_TIE_POINTS,
        default=None,
        help="tie point of K=V layers (default: pre_rope for calibrated, else the config default post_rope)",
    )
    p.add_argument(
        "--calibration_file", default=None, help=".txt or .jsonl (text column); default: the embedded prose + code"
    )
    p.add_argument(
        "--calibration_tokens",
        type=int,
        default=None,
        help=f"tokens to calibrate on (default: {DEFAULT_CALIBRATION_TOKENS}, {DEFAULT_TRANSFER_CALIBRATION_TOKENS} transfer)",
    )
    p.add_argument("--calibration_block_size", type=int, default=DEFAULT_CALIBRATION_BLOCK, help="tokens per sequence")
    p.add_argument(
        "--ridge",
        type=float,
        default=None,
        help=f"relative ridge of the o_proj fit (default: {DEFAULT_RIDGE} calibrated, {DEFAULT_TRANSFER_RIDGE} transfer)",
    )
    p.add_argument(
        "--calibration",
        choices=CALIBRATIONS,
        default=DEFAULT_CALIBRATION,
        help="calibrated fit of layer l on the converted model's own hidden states (sequential) or the source's",
    )
    p.add_argument(
        "--calibration_dataset",
        default=None,
        help="a datasets name, data folder or save_to_disk folder (text column) instead of --calibration_file",
    )
    p.add_argument(
        "--calibration_text",
        default=None,
        help=f"the text the stages fit and distil on: '+'-joined sources, equal shares unless weighted as "
        f"name:weight (self+stdlib:2): {', '.join(TEXT_SOURCES)} "
        f"(default: file when --calibration_file/--calibration_dataset is given, else "
        f"{DEFAULT_CALIBRATION_TEXT['transfer']} for transfer and {DEFAULT_ONE_SHOT_TEXT} for the other methods)",
    )
    p.add_argument(
        "--self_text_tokens",
        type=int,
        default=None,
        help="tokens the source writes for 'self' (default: its share of the calibration, validation and distillation "
        "tokens)",
    )
    p.add_argument(
        "--self_text_dir",
        default=None,
        help="keep the source's text here and reuse it in later conversions (default: the work folder, removed "
        "when the conversion is done)",
    )
    p.add_argument(
        "--self_text_bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the source writes its text with a bf16 copy of its weights (1.45x as fast on a CPU with AVX512-BF16 "
        "and AMX; the text of the source rounded to bf16), or with --no-self_text_bf16 with its weights as loaded "
        "(default: as the text already in the folder was written, else bf16 where the source's device computes it "
        "natively: GPUs, CPUs with AVX512-BF16, AMX or Arm BF16)",
    )
    t = TRANSFER_DEFAULTS
    p.add_argument("--validation_tokens", type=int, default=t["validation_tokens"], help="transfer: held-out tokens")
    p.add_argument(
        "--transfer_steps", type=int, default=t["transfer_steps"], help="stage (b) steps per layer (0: none)"
    )
    p.add_argument("--transfer_batch_size", type=int, default=t["transfer_batch_size"], help="stage (b) blocks/step")
    p.add_argument("--transfer_learning_rate", type=float, default=t["transfer_learning_rate"], help="stage (b) peak")
    p.add_argument(
        "--transfer_eval_steps",
        type=int,
        default=t["transfer_eval_steps"],
        help="stage (b) keeps each layer's best state on the validation tokens, measured every this many steps",
    )
    p.add_argument("--distill_tokens", type=int, default=t["distill_tokens"], help="stage (c) tokens (0: no stage (c))")
    p.add_argument("--distill_batch_size", type=int, default=t["distill_batch_size"], help="stage (c) blocks per step")
    p.add_argument("--distill_learning_rate", type=float, default=t["distill_learning_rate"], help="stage (c) peak")
    p.add_argument(
        "--distill_warmup_steps",
        type=int,
        default=t["distill_warmup_steps"],
        help="stage (c) steps of linear warmup to the peak (then cosine down to a tenth of it)",
    )
    p.add_argument(
        "--distill_temperature", type=float, default=t["distill_temperature"], help="stage (c) KL temperature"
    )
    p.add_argument("--distill_lm_weight", type=float, default=t["distill_lm_weight"], help="stage (c) LM loss weight")
    p.add_argument(
        "--distill_hidden_weight",
        type=float,
        default=t["distill_hidden_weight"],
        help="stage (c): weight of a loss matching each layer's output to the source's, added to the KL (0: off)",
    )
    p.add_argument(
        "--distill_bf16",
        action=argparse.BooleanOptionalAction,
        default=t["distill_bf16"],
        help="stage (c) in bf16 mixed precision (weights and optimizer in float32), or with --no-distill_bf16 in "
        "float32 (default: bf16 where the device computes it natively: GPUs, CPUs with AVX512-BF16, AMX or Arm BF16)",
    )
    p.add_argument(
        "--distill_trainable_modules",
        nargs="+",
        default=list(t["distill_trainable_modules"]),
        metavar="PATTERN",
        help="stage (c) trains only the parameters whose names contain one of these (e.g. self_attn: the attention "
        "projections; all: every parameter; auto, the default: every parameter when every layer is tied, self_attn "
        "when --cache_budget leaves layers untied)",
    )
    p.add_argument(
        "--distill_centre_output_projections",
        action="store_true",
        default=t["distill_centre_output_projections"],
        help="stage (c) takes its steps on the attention output projections as if their inputs were centred (the "
        "constant moved into their biases): for sources whose keys carry large biases, e.g. Qwen2 with every layer "
        "tied; needs o_proj biases",
    )
    p.add_argument(
        "--distill_relative_learning_rates",
        action=argparse.BooleanOptionalAction,
        default=t["distill_relative_learning_rates"],
        help="stage (c) scales each parameter's learning rate by its RMS over the median of the weight matrices' "
        "(between 0.1 and 1), so small weights take proportionally small first steps",
    )
    p.add_argument(
        "--cache_budget",
        type=float,
        default=t["cache_budget"],
        help="transfer: keep at most this fraction of the source's KV bytes (e.g. 0.75)",
    )
    p.add_argument(
        "--budget_choice",
        choices=BUDGET_CHOICES,
        default=t["budget_choice"],
        help="--cache_budget ties the layers whose tying alone costs the least KL to the source (kl), or whose "
        "stage (b) error is lowest (error)",
    )
    p.add_argument("--seed", type=int, default=0, help="order of the calibration text, stage (b)'s batches")
    add_dtype_argument(p, "float32", "dtype of the saved weights (conversion runs in float32)")
    p.add_argument("--override", nargs="*", default=None, help="config fields: " + ", ".join(CONVERT_OVERRIDES))
    p.add_argument("--overwrite_output_dir", action="store_true", help="replace a previous conversion there")
    return p


def parse_args(argv: list[str] | None) -> ConvertArgs:
    """Parse and check `qkvshare convert` arguments: `ValueError` for a bad value."""
    namespace = vars(build_parser().parse_args(argv))
    namespace["overrides"] = parse_overrides(namespace.pop("override"), "--override")
    return ConvertArgs(**namespace)


def text_shares(args: ConvertArgs) -> dict[str, float]:
    """Each source of `--calibration_text` with its share of the characters, in the order given: a source's weight
    (`name:weight`, 1 when not given) over the sum of the weights ("self+stdlib:2" -> self 1/3, stdlib 2/3). A
    `ValueError` names a source that is unknown or given twice, or a weight that is not a positive number."""
    weights: dict[str, float] = {}
    for part in args.calibration_text.split("+"):
        name, _, weight = (piece.strip() for piece in part.partition(":"))
        if name not in TEXT_SOURCES or name in weights:
            raise ValueError(
                f"--calibration_text {args.calibration_text!r}: give one or more of {', '.join(TEXT_SOURCES)}, joined "
                "by '+' and each once, with a weight after a colon where a source should have more than an equal "
                "share (e.g. self, self+stdlib, self+file, self+stdlib:2)."
            )
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            value = math.nan
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(
                f"--calibration_text {args.calibration_text!r}: the weight of {name} ({weight!r}) is not a positive "
                "number; write a source's weight after a colon, e.g. self+stdlib:2."
            )
        weights[name] = value
    total = sum(weights.values())
    return {name: weight / total for name, weight in weights.items()}


def check_calibration_text(args: ConvertArgs) -> None:
    """`--calibration_text` names known sources once each, with positive weights (`text_shares`); `file` exactly
    when a file or dataset is given."""
    sources = list(text_shares(args))
    given = args.calibration_file is not None or args.calibration_dataset is not None
    if ("file" in sources) != given:
        raise ValueError(
            f"--calibration_text {args.calibration_text} "
            + (
                "reads no file, but --calibration_file/--calibration_dataset is given: add +file to the mix, or "
                "drop the file."
                if given
                else "names file: give --calibration_file or --calibration_dataset too."
            )
        )
    if args.self_text_tokens is not None and (args.self_text_tokens < 1 or "self" not in sources):
        raise ValueError(
            f"--self_text_tokens {args.self_text_tokens}: a positive count, with self in --calibration_text."
        )
    if args.self_text_bf16 is not None and "self" not in sources:
        raise ValueError(
            f"{flag_as_typed('self_text_bf16', args.self_text_bf16)} says how the source writes its text, but "
            f"--calibration_text is {'+'.join(sources)}: add self to it, or drop the flag."
        )


def flag_as_typed(name: str, value: Any) -> str:
    """Flag `name` with its value as typed on the command line: a list's items separated by spaces, a switch alone
    (`--name` on, `--no-name` off)."""
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no-{name}"
    return f"--{name} " + (" ".join(map(str, value)) if isinstance(value, list) else str(value))


def check_transfer_args(args: ConvertArgs) -> None:
    """The transfer method's numbers in range, and set only with --method transfer; a `ValueError` otherwise."""
    if args.method != "transfer":
        given = [
            flag_as_typed(name, getattr(args, name))
            for name, d in TRANSFER_DEFAULTS.items()
            if getattr(args, name) != d
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)} set(s) a stage of --method transfer, but the method is "
                f"{args.method or DEFAULT_METHOD}; add --method transfer or drop the flag."
            )
        return
    for name in ("validation_tokens", "transfer_batch_size", "distill_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} {getattr(args, name)} must be at least 1.")
    for name in ("transfer_steps", "distill_tokens"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} {getattr(args, name)} must be >= 0 (0 skips the stage).")
    if args.transfer_eval_steps < 0:
        raise ValueError(
            f"--transfer_eval_steps {args.transfer_eval_steps} must be >= 0 (0: measure each layer only after its last "
            "step)."
        )
    for name in ("transfer_learning_rate", "distill_learning_rate", "distill_temperature"):
        if not getattr(args, name) > 0:  # also catches nan
            raise ValueError(f"--{name} {getattr(args, name)} must be a number > 0.")
    if args.distill_warmup_steps < 0:
        raise ValueError(
            f"--distill_warmup_steps {args.distill_warmup_steps} must be >= 0 (0: stage (c) starts at its peak)."
        )
    steps = DistillSettings(
        tokens=args.distill_tokens, batch_size=args.distill_batch_size, block_size=args.calibration_block_size
    ).steps
    # the warmup's last step is at the peak; a default longer than a short run's steps is cut by the run, as before
    if args.distill_tokens and args.distill_warmup_steps > max(steps, TRANSFER_DEFAULTS["distill_warmup_steps"]):
        raise ValueError(
            f"--distill_warmup_steps {args.distill_warmup_steps} is more than stage (c)'s {steps} steps "
            f"(--distill_tokens {args.distill_tokens} / (--distill_batch_size {args.distill_batch_size} x "
            f"{args.calibration_block_size}-token blocks)): the peak would never be reached; give at most {steps}, "
            f"e.g. {max(1, steps // 8)} (an eighth of them)."
        )
    if args.cache_budget is None and args.budget_choice != DEFAULT_BUDGET_CHOICE:
        raise ValueError(
            f"--budget_choice {args.budget_choice} ranks the layers --cache_budget ties, but no --cache_budget is "
            "given; add --cache_budget F (e.g. 0.75) or drop --budget_choice."
        )
    patterns = args.distill_trainable_modules
    words = (ALL_PARAMETERS[0], AUTO_MODULES[0])
    if not patterns or (any(w in patterns for w in words) and len(patterns) > 1) or not all(patterns):
        raise ValueError(
            f"--distill_trainable_modules {' '.join(patterns) or '(nothing)'}: give name patterns (e.g. self_attn), "
            "or the single word all (every parameter) or auto (the default: every parameter when every layer is "
            "tied, self_attn when --cache_budget leaves layers untied)."
        )
    if not 0 <= args.distill_lm_weight < 1:
        raise ValueError(f"--distill_lm_weight {args.distill_lm_weight} must be in [0, 1): (1 - w) x KL + w x LM loss.")
    if not (args.distill_hidden_weight >= 0 and math.isfinite(args.distill_hidden_weight)):
        raise ValueError(
            f"--distill_hidden_weight {args.distill_hidden_weight} must be a finite number >= 0 (0 turns the "
            "hidden-state loss off)."
        )
    if args.cache_budget is not None and not 0 < args.cache_budget <= 1:
        raise ValueError(
            f"--cache_budget {args.cache_budget} must be in (0, 1]: the fraction of the source's KV-cache bytes to "
            "keep (0.5 ties every layer of Q-K=V, 1 keeps the source)."
        )


def check_output_dir(out: Path, overwrite: bool) -> None:
    """--output_dir is new, empty, or (with --overwrite_output_dir) a previous conversion; a `ValueError` otherwise."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--output_dir {str(out)!r} is a file; choose a directory.")
    if any(out.iterdir()) and not (overwrite and (out / RECORD_FILE).is_file()):
        hint = (
            "; --overwrite_output_dir replaces only a previous conversion (a directory with conversion.json)"
            if overwrite
            else ", or pass --overwrite_output_dir to replace a previous conversion"
        )
        raise ValueError(f"--output_dir {str(out)!r} is not empty; choose a new directory{hint}.")


def check_source_path(source: str) -> Path:
    """SRC as a path: a model directory or a .gguf file; a `ValueError` naming it otherwise."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    what = "is a file but not a .gguf file" if path.is_file() else "does not exist"
    raise ValueError(
        f"SRC {source!r} {what}; pass a model directory (config.json and safetensors, e.g. from save_pretrained) or "
        "a .gguf file."
    )
