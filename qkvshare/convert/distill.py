"""Stage (c) of `qkvshare convert --method transfer`: end-to-end distillation of the converted model against the
source's logits, through `qkvshare.train.distill` (the loop, checkpoints, resume and DDP of `qkvshare train
--teacher`) inside the conversion's work folder.

The text is the calibration text's train split (never its validation or test split), written to a jsonl file with
about the tokens the budget reads; the run validates on the validation split, which gives `eval/kl`. A conversion
killed during this stage resumes from the run's last checkpoint (`--resume_from_checkpoint latest`); one that had
finished it reuses the run's final model.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from qkvshare import QKVShareConfig, QKVShareForCausalLM
from qkvshare.runtime import MEMORY_SHARE, available_bytes, write_whole
from qkvshare.train.distill import distill
from qkvshare.train.pretrain import is_weight_matrix, no_match, trained_names
from qkvshare_settings.train import DistillSettings

LOGIT_COPIES = 6  # block x vocab tensors alive at the loss: both logits, both log-softmaxes, the KL's terms, a gradient


def write_text_file(path: Path, texts: Iterable[str], tokenizer: Any, tokens: int) -> int:
    """Write documents of `texts` as jsonl until they hold `tokens` tokens (+10%, plus one block); returns the
    tokens written. The trainer then tokenizes only what its budget reads."""
    count, lines = 0, []
    for text in texts:
        lines.append(json.dumps({"text": text}) + "\n")
        count += len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]) + 1
        if count >= 1.1 * tokens + 2048:
            break
    write_whole(path, lambda tmp: tmp.write_text("".join(lines)))
    return count


def _parameters(config: Any) -> dict[str, torch.nn.Parameter]:
    """The parameters of `config`'s model by name, on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        return dict(QKVShareForCausalLM(config).named_parameters())


def _counts(config: Any, settings: DistillSettings) -> tuple[int, int]:
    """(parameters of `config`'s model, parameters stage (c) trains)."""
    names = _parameters(config)
    weights = sum(p.numel() for p in names.values())
    return weights, sum(names[n].numel() for n in trained_names(list(names), settings.trainable_modules))


def checkpoint_bytes(config: Any, settings: DistillSettings) -> int:
    """The bytes of one stage-(c) checkpoint of `config`'s model: its weights in float32 and AdamW's two float32
    states of what it trains (the tokenizer, manifest and training state beside them are small)."""
    weights, trained = _counts(config, settings)
    return 4 * weights + 8 * trained


def _memory_terms(config: Any, settings: DistillSettings, teacher: bool) -> tuple[int, int]:
    """`distill_memory`'s (bytes whatever the micro-batch, bytes per block of a pass)."""
    weights, trained = _counts(config, settings)
    kv_width = config.num_key_value_heads * config.head_dim
    per_layer = 10 * config.hidden_size + 2 * kv_width + 4 * config.intermediate_size
    per_layer += config.num_attention_heads * settings.block_size
    per_token = LOGIT_COPIES * config.vocab_size + config.num_hidden_layers * per_layer
    if settings.hidden_weight:  # the teacher's hidden states, kept for the hidden-state loss
        per_token += (config.num_hidden_layers + 1) * config.hidden_size
    return 4 * (weights * (2 if teacher else 1) + 3 * trained), 4 * settings.block_size * per_token


def distill_memory(config: Any, settings: DistillSettings, micro_batch: int, teacher: bool = True) -> int:
    """Estimated peak bytes of stage (c) on `config`'s model in float32, `micro_batch` blocks per forward/backward
    pass: the student's weights, the gradients and AdamW's two states of what it trains, the teacher's weights (about
    the student's; `teacher=False` when it is loaded already), and per token of the micro-batch the logits at the loss
    (`LOGIT_COPIES` x vocab) and the activations the backward pass keeps (per layer about 10 x hidden, 2 x key/value
    width, 4 x intermediate and the heads' attention row)."""
    fixed, per_block = _memory_terms(config, settings, teacher)
    return fixed + micro_batch * per_block


def fit_micro_batch(config: Any, settings: DistillSettings, teacher_loaded: bool, free: int | None) -> DistillSettings:
    """`settings` with the largest micro-batch (a divisor of its batch) whose `distill_memory` fits `MEMORY_SHARE` of
    `free` bytes; one block when none does. A micro-batch set by the caller, or `free` unknown (None), is kept."""
    if settings.micro_batch_size is not None or free is None:
        return settings
    fixed, per_block = _memory_terms(config, settings, teacher=not teacher_loaded)
    divisors = [m for m in range(settings.batch_size, 1, -1) if settings.batch_size % m == 0]
    micro = next((m for m in divisors if fixed + m * per_block <= MEMORY_SHARE * free), 1)
    return dataclasses.replace(settings, micro_batch_size=micro)


# The `--distill_trainable_modules` patterns of everything but the attention's output projections, where the model has
# them; `besides_output_projections` adds any other parameter's full name.
BESIDES_O_PROJ = ("q_proj", "k_proj", "v_proj", "mlp", "embed_tokens", "norm", "lm_head")
OUTPUT_PROJECTION = "o_proj"


def besides_output_projections(config: Any, patterns: list[str] | None = None) -> list[str]:
    """Patterns that train what `patterns` (--distill_trainable_modules; None: every parameter) trains of `config`'s
    model except the attention's output projections (weights and biases): `BESIDES_O_PROJ`'s that match such a
    parameter, then the full name of any other parameter none covers."""
    names = [name for name in trained_names(list(_parameters(config)), patterns) if OUTPUT_PROJECTION not in name]
    patterns = [p for p in BESIDES_O_PROJ if any(p in name for name in names)]
    patterns += [name for name in names if not any(p in name for p in patterns)]
    return patterns


def trains_output_projections(config: Any, settings: DistillSettings) -> bool:
    """Whether `settings.trainable_modules` trains any of the attention's output projections of `config`'s model."""
    trained = trained_names(list(_parameters(config)), settings.trainable_modules)
    return any(OUTPUT_PROJECTION in name for name in trained)


def check_trainable_modules(config: Any, settings: DistillSettings) -> None:
    """A `ValueError` before any work when `settings.trainable_modules` matches no parameter of `config`'s model."""
    if settings.trainable_modules is None:
        return
    names = list(_parameters(config))
    if problem := no_match("--distill_trainable_modules", settings.trainable_modules, names, "the converted model"):
        raise ValueError(problem + ", or give all (every parameter).")


def check_centring(config: Any, settings: DistillSettings) -> None:
    """A `ValueError` before any work when `settings.centre_output_projections` has no biased output projection of
    `config`'s model to centre (the bias takes the constant)."""
    if not settings.centre_output_projections:
        return
    trained = trained_names(list(_parameters(config)), settings.trainable_modules)
    if not any(OUTPUT_PROJECTION in name and name.endswith("bias") for name in trained):
        unbiased = config.attention_bias is False
        why = "its source has no attention biases" if unbiased else "none of them trains"
        fix = "drop the flag" + ("" if unbiased else ", or let --distill_trainable_modules include o_proj")
        raise ValueError(
            "--distill_centre_output_projections moves the constant of the output projections' inputs into their "
            f"biases, but the converted model's o_proj layers have none that train ({why}): {fix}."
        )


def check_relative_rates(config: Any, settings: DistillSettings) -> None:
    """A `ValueError` before any work when `settings.relative_learning_rates` has no trained weight matrix of
    `config`'s model to measure its scales against (`qkvshare.train.pretrain.relative_lr_scales`)."""
    if not settings.relative_learning_rates:
        return
    parameters = _parameters(config)
    if not any(
        is_weight_matrix(parameters[name]) for name in trained_names(list(parameters), settings.trainable_modules)
    ):
        raise ValueError(
            "--distill_relative_learning_rates scales each learning rate by the trained weight matrices' RMS, but "
            f"--distill_trainable_modules {' '.join(settings.trainable_modules or [])} trains no weight matrix: "
            "let it include one (e.g. self_attn), or drop the flag."
        )


def check_distill_memory(config: Any, settings: DistillSettings) -> None:
    """A `ValueError` before any work when stage (c) would not fit in memory even one block at a time."""
    free = available_bytes()
    need = distill_memory(config, settings, 1)
    if free is not None and need > MEMORY_SHARE * free:
        raise ValueError(
            f"stage (c) (--distill_tokens {settings.tokens}) needs about {need / 2**30:.1f} GiB of memory even one "
            f"block of {settings.block_size} tokens at a time (the model's weights, its gradients and optimizer "
            f"states, the source as teacher, one block's logits and activations): more than "
            f"{MEMORY_SHARE:.0%} of the {free / 2**30:.1f} GiB available now. Convert with --distill_tokens 0 (stages "
            "(a) and (b) only) and distil on a larger machine with `qkvshare train --init_from OUT --teacher SRC`, "
            "or free memory."
        )


# Stage (c) stops as diverged when each of its last DIVERGENCE_WINDOW steps after the first has a loss more than
# DIVERGENCE_FACTOR times the first step's. On Qwen2.5-Coder-0.5B with every layer tied, AdamW's first step took the
# KL from 3.5 to 10.0 nats (from 3.5 to 9.0 at a tenth of the learning rate) and 128 steps did not bring it back
# (docs/results.md, section 11.3); a stage (c) that converges falls from its first step. Each step, not their mean:
# a step's loss is measured on that step's blocks only, and at budget 0.75 on the same model two hard steps in a row
# (3.3x and 2.6x the first, at steps 30-31 of 128) were followed at once by the usual losses.
DIVERGENCE_FACTOR = 2.0
DIVERGENCE_WINDOW = 3
DIVERGED = "diverged.json"  # in the run's folder: what stopped it (a rerun of the conversion keeps it stopped)


class DistillationDiverged(Exception):
    """Stage (c)'s loss rose instead of falling (`DivergenceWatch`); `losses` are its steps' losses so far."""

    def __init__(self, step: int, losses: list[float]):
        super().__init__(f"the loss rose from {losses[0]:.3f} to {losses[-1]:.3f} by step {step}")
        self.step, self.losses = step, losses


class DivergenceWatch:
    """The training run's `on_step` hook that raises `DistillationDiverged` when the loss of each of the last
    `DIVERGENCE_WINDOW` steps after the first exceeds `DIVERGENCE_FACTOR` times the first step's loss (a rise that
    lasts, not one or two hard steps). With a `path`, the steps' losses are kept there, so a run resumed from a
    checkpoint is still compared with its first step."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.losses: list[float] = json.loads(path.read_text()) if path is not None and path.is_file() else []

    def __call__(self, step: int, loss: float, model: Any) -> None:
        self.losses = self.losses[: step - 1] + [loss]  # a resumed run repeats the steps after its checkpoint
        if self.path is not None:
            self.path.write_text(json.dumps(self.losses))
        recent = self.losses[1:][-DIVERGENCE_WINDOW:]
        if len(recent) == DIVERGENCE_WINDOW and min(recent) > DIVERGENCE_FACTOR * self.losses[0]:
            raise DistillationDiverged(step, list(self.losses))


def run_distillation(
    model_dir: Path,
    teacher: str,
    train_texts: Iterable[str],
    validation_texts: Iterable[str],
    tokenizer: Any,
    work: Path,
    settings: DistillSettings,
    teacher_model: Any = None,
    run: str = "distill",
) -> tuple[Path, dict[str, Any]]:
    """Stage (c): distil the model saved in `model_dir` from `teacher`, in `work/run` (its losses in
    `work/run-losses.json`; several runs share the work folder's text files). Returns the directory
    of the distilled model and the run's final metrics; raises what `qkvshare.train.distill` raises when the run
    stops (the conversion is then resumable). `teacher_model`: the teacher already in memory (not loaded again).
    Without a micro-batch in `settings`, each step runs in the largest micro-batches that fit the memory available
    (`fit_micro_batch`): the same blocks and update, in several forward/backward passes where memory is short.
    A run that diverges (`DivergenceWatch`) is stopped and recorded in `work/run/diverged.json`; the metrics
    are then `{"diverged": {"step": ..., "losses": [...]}}` (at once, on a rerun)."""
    out = work / run
    metrics_file, diverged_file = out / "final_metrics.json", out / DIVERGED
    if metrics_file.is_file():  # finished by an earlier run of this conversion
        return out, json.loads(metrics_file.read_text())
    if diverged_file.is_file():  # stopped as diverged by an earlier run of this conversion
        return out, {"diverged": json.loads(diverged_file.read_text())}
    work.mkdir(parents=True, exist_ok=True)
    train_file, validation_file = work / "distill-train.jsonl", work / "distill-validation.jsonl"
    if not train_file.is_file():
        write_text_file(train_file, train_texts, tokenizer, settings.tokens)
    if not validation_file.is_file():
        write_text_file(validation_file, validation_texts, tokenizer, settings.eval_blocks * settings.block_size)
    free = available_bytes()
    settings = fit_micro_batch(QKVShareConfig.from_pretrained(model_dir), settings, teacher_model is not None, free)
    if settings.accumulation > 1:
        print(
            f"stage (c): {settings.accumulation} passes of {settings.micro_batch_size} block(s) a step, to fit the "
            f"{free / 2**30:.1f} GiB of memory available",
            flush=True,
        )
    try:
        watch = DivergenceWatch(work / f"{run}-losses.json")
        metrics = distill(model_dir, teacher, train_file, validation_file, out, settings, teacher_model, watch)
    except DistillationDiverged as err:
        diverged = {"step": err.step, "losses": [round(x, 4) for x in err.losses]}
        diverged_file.write_text(json.dumps(diverged))
        return out, {"diverged": diverged}
    return out, metrics
