"""`convert_checkpoint`: the whole of `qkvshare convert` as a function of its settings (`ConvertArgs`, parsed and
checked by `qkvshare_settings.convert`): read the source and the calibration text, convert, distil, save."""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from qkvshare import QKVShareConfig, QKVShareForCausalLM, model_dir
from qkvshare.convert import io as files
from qkvshare.convert.budget import check_cache_budget, keeps_untied_layers
from qkvshare.convert.calibration import calibration_ids, check_calibration_ids
from qkvshare.convert.conversion import ConversionRecord, convert, plan_conversion
from qkvshare.convert.distill import (
    besides_output_projections,
    check_centring,
    check_distill_memory,
    check_relative_rates,
    check_trainable_modules,
    checkpoint_bytes,
    run_distillation,
    trains_output_projections,
)
from qkvshare.convert.text import CalibrationText, add_self_text, read_calibration_text
from qkvshare.convert.transfer import (
    TransferSettings,
    activation_bytes,
    changed_layers,
    check_activation_memory,
    measure_layer_errors,
)
from qkvshare.evaluation.fidelity import reference_log_probs, score_blocks
from qkvshare.runtime import (
    MEMORY_SHARE,
    available_bytes,
    check_free_space,
    describe_bytes,
    folder_bytes,
    native_bf16,
    torch_dtype,
)
from qkvshare_settings.conventions import CommandStopped
from qkvshare_settings.convert import (
    ALL_PARAMETERS,
    AUTO_MODULES,
    BUDGET_TRAINABLE_MODULES,
    RECORD_FILE,
    TRANSFER_DEFAULTS,
    ConvertArgs,
)
from qkvshare_settings.train import DistillSettings


def convert_checkpoint(args: ConvertArgs) -> ConversionRecord:
    """Convert the checkpoint `args.source` into `args.output_dir` and return the conversion's record.

    Checks everything that needs no weights, reads the calibration text (the source writes its share of it once it is
    loaded: `--calibration_text self`), converts (resumably, with `method="transfer"`), distils (stage (c)), and
    publishes the model directory whole. Raises a `ValueError` for
    input that cannot be converted (before any long work) and a `CommandStopped` (`ConversionWriteError`,
    `DistillationStopped`) when a run stops part-way: what it saved stays, and the same call continues it.

        from qkvshare.convert import ConvertArgs, convert_checkpoint
        record = convert_checkpoint(ConvertArgs("SmolLM2-135M", "out/qv", "Q-K=V", method="transfer"))
    """
    args = with_distill_precision(args)
    source_config = model_dir.read_source_config(args.source)
    config, method, query_method = plan_conversion(
        source_config, args.variant, args.method, args.query_method, **args.overrides
    )
    tokenizer = model_dir.load_source_tokenizer(args.source)
    source_kv = source_config.get("num_key_value_heads") or source_config["num_attention_heads"]
    check_cache_budget(config, method, source_kv, args.cache_budget)
    ids = validation = description = None
    changes_attention = method is not None or config.num_key_value_heads < source_kv or query_method is not None
    if method in ("calibrated", "transfer") and tokenizer is None:
        raise ValueError(
            f"{args.source} has no tokenizer, which method={method!r} needs to read calibration text; save the "
            "source's tokenizer next to its weights, or use --method key."
        )
    settings = None
    if method == "transfer":  # before the text is read: the requested counts bound what is stored
        check_activation_memory(config, args.calibration_tokens, args.validation_tokens)
        if args.distill_tokens > 0:
            untied = keeps_untied_layers(config, changed_layers(config, source_kv), args.cache_budget)
            settings = distill_settings(args, leaves_layers_untied=untied)
            check_trainable_modules(config, settings)
            check_centring(config, settings)
            check_relative_rates(config, settings)
            check_distill_memory(config, settings)
    check_disk_space(args, config, method, settings)
    check_conversion_memory(args, source_config, config, method)
    needs_text = changes_attention and tokenizer is not None
    text = read_calibration_text(args) if needs_text else None
    writes_text = text is not None and "self" in text.sources
    if text is not None and not writes_text:  # before any weight is read: a text too short is said at once
        ids, validation, description = calibration_blocks(text, tokenizer, args, config, method)
    out = Path(args.output_dir)
    work = claim_work_dir(out, conversion_plan(args)) if method == "transfer" or writes_text else None
    source = model_dir.load_source(args.source)
    started = time.perf_counter()
    if writes_text:  # the source writes its share once loaded (resumable in the folder)
        folder = Path(args.self_text_dir).expanduser() if args.self_text_dir else work / "self-text"
        add_self_text(text, args, source, tokenizer, folder)
        ids, validation, description = calibration_blocks(text, tokenizer, args, config, method)
    model, record = convert(
        source,
        args.variant,
        args.method,
        query_method=args.query_method,
        calibration_ids=ids,
        ridge=args.ridge,
        calibration=args.calibration,
        source_name=str(args.source),
        calibration_source=description,
        validation_ids=validation,
        transfer=transfer_settings(args) if method == "transfer" else None,
        cache_budget=args.cache_budget,
        budget_choice=args.budget_choice,
        work_dir=work / "stages" if work is not None else None,
        progress=True,
        **args.overrides,
    )
    if writes_text:
        record.stages = {"self_text": self_text_stage(text.self_text)} | record.stages
    if method == "transfer" and args.distill_tokens > 0:
        stage_model = save_stage_model(model, record, tokenizer, work)
        del model  # stage (c) trains the saved copy: the converted model need not stay in memory beside it
        model = distil(args, source, stage_model, record, tokenizer, text, validation, work)
    record.seconds = round(time.perf_counter() - started, 2)
    files.publish(lambda folder: files.save_converted(model, record, folder, tokenizer, args.dtype), out)
    if work is not None:
        shutil.rmtree(work)
    _print_summary(record, model.config, source_config, out)
    return record


def calibration_blocks(
    text: CalibrationText, tokenizer: Any, args: ConvertArgs, config: QKVShareConfig, method: str | None
) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """The calibration blocks of the text's train split, with `transfer` the validation blocks of its validation
    split (else None), and what the text is; a `ValueError` when either holds too few tokens."""
    block = args.calibration_block_size
    ids = calibration_ids(tokenizer, text.documents("train"), args.calibration_tokens, block)
    check_calibration_ids(ids, config)
    validation = None
    if method == "transfer":
        validation = calibration_ids(tokenizer, text.documents("validation"), args.validation_tokens, block)
        check_calibration_ids(validation, config, "the validation split of the calibration text")
    return ids, validation, text.describe("train")


def saved_bytes(config: QKVShareConfig, dtype: str) -> int:
    """The bytes of the converted model's weights in `dtype`."""
    return parameter_count(config) * (torch.finfo(torch_dtype(dtype)).bits // 8)


def parameter_count(config: QKVShareConfig) -> int:
    """The parameters of `config`'s model (built on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in QKVShareForCausalLM(config).parameters())


def check_conversion_memory(args: ConvertArgs, source_config: Any, config: QKVShareConfig, method: str | None) -> None:
    """A `ValueError` before any weight is read when the conversion would not fit in memory: the source's float32
    weights beside the converted model's and, with `method="transfer"`, stages (a)-(b)'s stored activations; a .gguf
    source is de-quantized into a plain copy, which holds its weights twice while it loads. Stage (c) has its own
    check (`check_distill_memory`)."""
    free = available_bytes()
    if free is None:
        return
    source = 4 * parameter_count(plan_conversion(source_config)[0])  # the source's own shape
    converted = 4 * parameter_count(config)
    tokens = args.calibration_tokens + args.validation_tokens
    activations = activation_bytes(config, tokens) if method == "transfer" else 0
    gguf = str(args.source).endswith(".gguf")
    need = max(2 * source if gguf else 0, source + converted + activations)
    if need <= MEMORY_SHARE * free:
        return
    parts = [
        f"the source's weights in float32 ({describe_bytes(source)}{', twice while the .gguf loads' if gguf else ''})"
    ]
    parts.append(f"the converted model's ({describe_bytes(converted)})")
    if activations:
        parts.append(f"stages (a)-(b)'s activations of {tokens:,} tokens ({describe_bytes(activations)})")
    fewer = ", or lower --calibration_tokens" if activations else ""
    raise ValueError(
        f"converting {args.source} needs about {describe_bytes(need)} of memory ({', '.join(parts)}): more than "
        f"{MEMORY_SHARE:.0%} of the {describe_bytes(free)} available now. Free memory or convert on a larger "
        f"machine{fewer}."
    )


# The text files, tokenizers, model code and logs of a conversion's work folder and output, beside their weights
WORK_FOLDER_MARGIN = 64 * 2**20


def disk_bytes(config: QKVShareConfig, dtype: str, method: str | None, settings: DistillSettings | None) -> int:
    """The most bytes a conversion into `config` holds at once on the disk of its output's parent: the converted
    model in `dtype`, and with `method="transfer"` the work folder beside it (`WORK_FOLDER_MARGIN`, and stage (b)'s
    fitted attention projections, two float32 copies); with stage (c) (`settings`), the float32 model of stages
    (a)-(b) it trains, and the larger of two checkpoints at once (a new one is written before the last goes) and
    one checkpoint beside the run's final float32 model and the converted model. A run retried after a divergence
    adds its own checkpoints (written, or refused with the space left, as the first run's are)."""
    published = saved_bytes(config, dtype)
    if method != "transfer":
        return published
    with torch.device("meta"):
        parameters = dict(QKVShareForCausalLM(config).named_parameters())
    attention = sum(p.numel() for name, p in parameters.items() if ".self_attn." in name)
    work = WORK_FOLDER_MARGIN + 2 * 4 * attention
    if settings is None:
        return work + published
    model = 4 * sum(p.numel() for p in parameters.values())
    checkpoint = checkpoint_bytes(config, settings)
    return work + model + max(2 * checkpoint, checkpoint + model + published)


def check_disk_space(
    args: ConvertArgs, config: QKVShareConfig, method: str | None, settings: DistillSettings | None
) -> None:
    """A `ValueError` before any work when the disk of `args.output_dir`'s parent lacks `disk_bytes`, less what an
    interrupted conversion into the same folder has written already (its work folder, continued)."""
    out = Path(args.output_dir)
    needed = disk_bytes(config, args.dtype, method, settings)
    if method != "transfer":
        check_free_space(out.parent, needed, f"the converted model {out}")
        return
    work = files.work_dir_for(out)
    if settings is None:
        what, fix = f"the conversion into {out} (its work folder {work} while it runs, then the model)", ""
    else:
        what = (
            f"the conversion into {out} (in its work folder {work} while it runs: the model of stages (a)-(b), "
            "stage (c)'s checkpoints with AdamW's states and its final model; then the converted model)"
        )
        without = disk_bytes(config, args.dtype, method, None)
        fix = (
            f", or convert with --distill_tokens 0 (stages (a)-(b) only: about {without / 2**20:,.1f} MiB) and "
            "distil where the disk has room, with `qkvshare train --init_from OUT --teacher SRC`"
        )
    check_free_space(out.parent, needed - folder_bytes(work), what, fix)


# dataclass field <- command flag, for each stage's settings
TRANSFER_FLAGS = {"ridge": "ridge", "steps": "transfer_steps", "batch_size": "transfer_batch_size", "seed": "seed"}
TRANSFER_FLAGS |= {"learning_rate": "transfer_learning_rate", "eval_steps": "transfer_eval_steps"}
DISTILL_FLAGS = {f: f"distill_{f}" for f in ("tokens", "batch_size", "learning_rate", "warmup_steps", "temperature")}
DISTILL_FLAGS |= {"lm_weight": "distill_lm_weight"}
DISTILL_FLAGS |= {"hidden_weight": "distill_hidden_weight", "bf16": "distill_bf16"}
DISTILL_FLAGS |= {"block_size": "calibration_block_size", "seed": "seed"}
DISTILL_FLAGS |= {"centre_output_projections": "distill_centre_output_projections"}
DISTILL_FLAGS |= {"relative_learning_rates": "distill_relative_learning_rates"}


def with_distill_precision(args: ConvertArgs) -> ConvertArgs:
    """`args` with stage (c)'s precision decided (a copy; `args` is not changed): `distill_bf16` as given, else (None)
    the precision an interrupted conversion into the same folder started in (its work folder's plan), else bf16 mixed
    precision where the device computes bf16 natively (`runtime.native_bf16`: as good as float32 and 1.5-1.8x faster
    on a CPU with AVX512-BF16, docs/results.md section 11.3), float32 elsewhere; the choice is printed. The decided
    value goes into the work folder's plan."""
    if args.distill_bf16 is not None or args.method != "transfer":
        return args
    decided = copy.copy(args)
    decided.distill_bf16 = False
    if args.distill_tokens > 0:
        out = Path(args.output_dir)
        started = saved_plan(out)
        if started is not None:
            decided.distill_bf16 = bool(started["distill_bf16"])
            why = f"as the interrupted conversion started (delete {files.work_dir_for(out)} to choose again)"
        else:
            decided.distill_bf16, why = native_bf16()
            why += " (--no-distill_bf16 for float32)" if decided.distill_bf16 else " (--distill_bf16 forces bf16)"
        how = "bf16 mixed precision" if decided.distill_bf16 else "float32"
        print(f"qkvshare convert: stage (c) in {how}: {why}.", flush=True)
    return decided


def transfer_settings(args: ConvertArgs) -> TransferSettings:
    """Stages (a) and (b) from the command's flags."""
    return TransferSettings(**{field: getattr(args, flag) for field, flag in TRANSFER_FLAGS.items()})


def distill_settings(args: ConvertArgs, leaves_layers_untied: bool = False) -> DistillSettings:
    """Stage (c) from the command's flags (its precision decided by `with_distill_precision`; what it trains by
    `trainable_modules`)."""
    args = with_distill_precision(args)
    fields = {field: getattr(args, flag) for field, flag in DISTILL_FLAGS.items()}
    return DistillSettings(
        **fields, trainable_modules=trainable_modules(args.distill_trainable_modules, leaves_layers_untied)
    )


def trainable_modules(patterns: list[str], leaves_layers_untied: bool) -> list[str] | None:
    """What stage (c) trains (None: every parameter): `--distill_trainable_modules` `patterns` as given, where `auto` (the
    default) is every parameter when every layer is tied and the attention only (`BUDGET_TRAINABLE_MODULES`) when a
    --cache_budget leaves layers as the source has them: there, training the rest of the network too was 1% better
    on SmolLM2-135M and 3% worse on Qwen2.5-Coder-0.5B (docs/results.md section 11.3), and slower."""
    if patterns == AUTO_MODULES:
        return list(BUDGET_TRAINABLE_MODULES) if leaves_layers_untied else None
    return None if patterns == ALL_PARAMETERS else list(patterns)


def leaves_layers_untied(record: ConversionRecord) -> bool:
    """Whether the conversion's --cache_budget choice kept some layer as the source has it."""
    return record.cache_budget is not None and "none" in record.cache_budget["layer_projection_sharing"]


def conversion_plan(args: ConvertArgs) -> dict[str, Any]:
    """What a transfer conversion's saved progress depends on (a rerun must match it to continue from it)."""
    keys = ("variant", "method", "query_method", "overrides", "calibration_file", "calibration_dataset")
    keys += ("calibration_text", "self_text_tokens", "calibration_tokens", "calibration_block_size", "ridge", "seed")
    keys += tuple(TRANSFER_DEFAULTS)
    return {"source": str(Path(args.source).expanduser().resolve())} | {key: getattr(args, key) for key in keys}


# what a work folder written before a setting was recorded ran with, where that is not the setting's default now
PLAN_DEFAULTS_BEFORE = {"distill_bf16": False}


def saved_plan(out: Path) -> dict[str, Any] | None:
    """The plan of an interrupted conversion into `out` (None without one); a setting added since its folder was
    written (absent from it) at what it ran with then: `PLAN_DEFAULTS_BEFORE`, else its default."""
    plan_file = files.work_dir_for(out) / "plan.json"
    if not plan_file.is_file():
        return None
    return TRANSFER_DEFAULTS | PLAN_DEFAULTS_BEFORE | json.loads(plan_file.read_text())


def claim_work_dir(out: Path, plan: dict[str, Any]) -> Path:
    """The work folder of the conversion into `out`: new, or an interrupted one with the same plan (continued)."""
    work = files.work_dir_for(out)
    saved = saved_plan(out)
    if saved is not None:
        then = {k: saved.get(k) for k in plan}
        changed = [f"{k}: {then[k]!r} then, {v!r} now" for k, v in plan.items() if then[k] != v]
        if changed:
            raise ValueError(
                f"{work} holds the progress of an interrupted conversion into {out} with other settings "
                f"({'; '.join(changed)}); rerun with those settings to continue it, or delete {work} to start over."
            )
        print(f"qkvshare convert: continuing the interrupted conversion saved in {work}", flush=True)
        return work
    work.mkdir(parents=True, exist_ok=True)
    (work / "plan.json").write_text(json.dumps(plan, indent=2))
    return work


def save_stage_model(model: Any, record: ConversionRecord, tokenizer: Any, work: Path) -> Path:
    """The model of stages (a)-(b), saved once in the work folder for stage (c) to train."""
    stage_model = work / "stage-model"
    if not (stage_model / RECORD_FILE).is_file():  # written last: the folder is complete
        files.save_converted(model, record, stage_model, tokenizer)
    return stage_model


def distil(
    args: ConvertArgs,
    source: Any,
    stage_model: Path,
    record: ConversionRecord,
    tokenizer: Any,
    text: CalibrationText,
    validation: Any,
    work: Path,
) -> Any:
    """Stage (c): distil the model of stages (a)-(b) saved in `stage_model` from the source (in memory, its teacher)
    on the calibration text's train split (`qkvshare.train.distill`) in the work folder, and record its errors, KL
    divergence, tokens and time. Returns the distilled model. A run that diverges (`distill.DivergenceWatch`) is
    stopped; when it trained every parameter (`--distill_trainable_modules all`, or `auto` with every layer tied),
    stage (c) then trains again from the same model with the attention's output projections frozen
    (`WITHOUT_O_PROJ_RUN`, recorded as `first_run`); when that diverges too, or the user's own modules did, the model
    of stages (a)-(b) is returned (`kept_after_divergence`). `auto` reads the budget's choice from `record`."""
    started = time.perf_counter()
    settings = distill_settings(args, leaves_layers_untied(record))
    if args.distill_trainable_modules == AUTO_MODULES and settings.trainable_modules is not None:
        print(
            f"qkvshare convert: stage (c) trains the attention only ({' '.join(settings.trainable_modules)}): the "
            "cache budget keeps some layers as the source has them (--distill_trainable_modules all trains every "
            "parameter).",
            flush=True,
        )
    folder, metrics = _distillation_run(stage_model, args, text, tokenizer, work, settings, source, "distill")
    first_run = None
    config = QKVShareConfig.from_pretrained(stage_model)
    if "diverged" in metrics and settings.trainable_modules is None:
        # every parameter trained: train again without the output projections (which diverged on
        # Qwen2.5-Coder-0.5B with every layer tied; the rest converged, docs/results.md section 11.3)
        first_run = {"trainable_modules": settings.trainable_modules, "diverged": metrics["diverged"]}
        # (nothing left to centre: the output projections are frozen)
        frozen = besides_output_projections(config)
        settings = dataclasses.replace(settings, trainable_modules=frozen, centre_output_projections=False)
        print(
            f"qkvshare convert: warning: stage (c) {_diverged(metrics['diverged'])}; it trains again from the model "
            "of stages (a)-(b) without the attention's output projections (--distill_trainable_modules "
            f"{' '.join(settings.trainable_modules)}).",
            flush=True,
        )
        gc.collect()  # free what the stopped run held before the next run sizes its micro-batches
        folder, metrics = _distillation_run(
            stage_model, args, text, tokenizer, work, settings, source, WITHOUT_O_PROJ_RUN
        )
    if "diverged" in metrics:  # the stage made the model worse: the model of stages (a)-(b) is kept
        return kept_after_divergence(stage_model, config, record, settings, metrics["diverged"], first_run, started)
    distilled = QKVShareForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference, _ = reference_log_probs(source, validation, dtype=torch.float32, progress=None)
    record.layer_errors["distill"] = measure_layer_errors(source, distilled, validation)
    record.layer_errors["converted"] = record.layer_errors["distill"]
    record.stages["distill"] = asdict(settings) | {
        "steps": settings.steps,
        "tokens": metrics["tokens_seen"],
        "seconds": round(time.perf_counter() - started, 2),
        # the training steps' time and rate over every part of a resumed run (from the run's checkpoints)
        "train_seconds": metrics.get("train_seconds"),
        "tokens_per_second": metrics.get("train_tokens_per_second"),
        "kl_to_source": score_blocks(distilled, validation, reference=reference, progress=None).kl,
        "validation_kl_of_the_run": metrics.get("val_kl"),
    }
    if first_run is not None:
        record.stages["distill"]["first_run"] = first_run
    return distilled


# stage (c)'s second run, without the output projections, after the first diverged (in the work folder)
WITHOUT_O_PROJ_RUN = "distill-without-o_proj"


def _distillation_run(
    stage_model: Path,
    args: ConvertArgs,
    text: CalibrationText,
    tokenizer: Any,
    work: Path,
    settings: DistillSettings,
    source: Any,
    run: str,
) -> tuple[Path, dict[str, Any]]:
    """One training run of stage (c) (`run_distillation` in `work/run`), a stop said as `DistillationStopped`."""
    try:
        return run_distillation(
            stage_model,
            str(args.source),
            text.documents("train"),
            text.documents("validation"),
            tokenizer,
            work,
            settings,
            teacher_model=source,
            run=run,
        )
    except CommandStopped as err:
        raise DistillationStopped(
            f"the distillation stage stopped ({getattr(err, 'reason', err)}); rerun the same conversion to continue "
            "from its last checkpoint.",
            err.exit_status,
        ) from err


def _diverged(diverged: dict[str, Any]) -> str:
    losses = diverged["losses"]
    return (
        f"diverged (its KL to the source rose from {losses[0]:.3f} to {losses[-1]:.3f} nats per token by step "
        f"{diverged['step']}) and was stopped"
    )


def _rate(value: float) -> str:
    """A learning rate as a user types it: 3e-5, 0.001."""
    return f"{value:g}".replace("e-0", "e-")


def kept_after_divergence(
    stage_model: Path,
    config: QKVShareConfig,
    record: ConversionRecord,
    settings: DistillSettings,
    diverged: dict[str, Any],
    first_run: dict[str, Any] | None,
    started: float,
) -> Any:
    """Stage (c) diverged (`distill.DivergenceWatch`), in the user's `--distill_trainable_modules` or, after the
    default's first run, without the output projections: say so (what to try next), record it, and return the model
    of stages (a)-(b)."""
    hints = []
    if first_run is not None:
        hints.append("a --cache_budget that leaves some layers untied may converge")
    elif trains_output_projections(config, settings):
        kept = besides_output_projections(config, settings.trainable_modules)
        hints.append(
            "training the same without the attention's output projections may converge (on Qwen2.5-Coder-0.5B with "
            "every layer tied, where the output projections of layers whose shared key/value carries large biases "
            f"diverged, it did): --distill_trainable_modules {' '.join(kept)}"
        )
    default_peak = TRANSFER_DEFAULTS["distill_learning_rate"]
    if settings.learning_rate > default_peak:
        hints.append(
            f"a --distill_learning_rate below {_rate(settings.learning_rate)} may converge (the default "
            f"{_rate(default_peak)} did where 1e-4 diverged on Qwen2.5-Coder-0.5B at --cache_budget 0.75)"
        )
    hint = "; " + "; or ".join(hints) if hints else ""
    again = " again, without the output projections," if first_run is not None else ""
    print(
        f"qkvshare convert: warning: stage (c){again} {_diverged(diverged)}; the model of stages (a)-(b) is saved "
        f"instead{hint}.",
        flush=True,
    )
    record.stages["distill"] = asdict(settings) | {
        "diverged": diverged,
        "seconds": round(time.perf_counter() - started, 2),
    }
    if first_run is not None:
        record.stages["distill"]["first_run"] = first_run
    return QKVShareForCausalLM.from_pretrained(stage_model, dtype=torch.float32).eval()


def self_text_stage(self_text: Any) -> dict[str, Any]:
    """The record's entry for the source's own text: its tokens, and the generation time of all its shards (those
    an earlier, interrupted or reused, run wrote included) and their rate."""
    seconds = self_text.shard_seconds
    return {
        "tokens": self_text.tokens,
        "new_tokens_now": self_text.new_tokens_generated,
        "seconds": round(seconds, 2),
        "tokens_per_second": self_text.tokens / seconds if seconds > 0 else None,
    }


class DistillationStopped(CommandStopped):
    """Stage (c)'s training run stopped (a signal, a full disk, a diverged loss); rerunning continues it. The exit
    status is the training run's: 128 + the signal for SIGTERM or Ctrl-C (130, as Ctrl-C in the other stages), 1
    otherwise."""

    def __init__(self, message: str, exit_status: int = 1):
        super().__init__(message)
        self.exit_status = exit_status


# The stages the summary times (summed over the runs of a resumed conversion), in order, by the record's names.
TIMED_STAGES = (
    ("self_text", "the source's text"),
    ("closed_form", "stage (a)"),
    ("transfer", "stage (b)"),
    ("distill", "stage (c)"),
)


def stage_seconds(stage: dict[str, Any]) -> float | None:
    """A record stage's own time: stage (c)'s training steps (`train_seconds`) where it has them, else `seconds`."""
    return stage.get("train_seconds") or stage.get("seconds")


def _print_summary(record: ConversionRecord, config: Any, source_config: dict[str, Any], out: Path) -> None:
    before = QKVShareConfig.from_llama(source_config).kv_cache_bytes_per_token()
    lines = [
        f"converted {record.source} ({record.source_model_type}, {record.source_key_value_heads} key/value heads) to "
        f"{record.variant}: method {record.method or '-'} (calibration {record.calibration or '-'}), "
        f"query_method {record.query_method or '-'}, "
        f"kv_tie_point {record.kv_tie_point}, head pooling {record.head_pooling or '-'}",
        f"KV cache per token (16-bit): {config.kv_cache_bytes_per_token():,} bytes (source {before:,})",
    ]
    tokens = record.validation_tokens or record.calibration_tokens
    where = "held-out" if record.validation_tokens else "calibration"
    tied = record.cache_budget["tied_layers"] if record.cache_budget is not None else None
    for name in ("key", "value", "calibrated", "init", "closed_form", "transfer", "distill", "converted"):
        # after a --cache_budget choice (distill, converted) the untied layers are exact copies: the mean is the tied
        # layers', so it compares with the stages before, which converted every layer
        layers = tied if tied is not None and name in ("distill", "converted") else None
        mean = record.mean_error(name, layers)
        if mean is not None:
            counted = len(layers) if layers is not None else sum(e is not None for e in record.layer_errors[name])
            kind = "converted" if layers is None else "tied"
            kl = record.stages.get(name, {}).get("kl_to_source")
            then = f"; KL to the source {kl:.4f} per token" if kl is not None else ""
            lines.append(
                f"mean attention-output error ({name}): {mean:.4f} over the {counted} {kind} layers, {tokens:,} "
                f"{where} tokens{then}"
            )
    if record.layer_errors.get("drift"):
        lines.append(f"hidden-state drift after the last layer: {record.layer_errors['drift'][-1]:.4f}")
    if record.cache_budget is not None:
        b = record.cache_budget
        lines.append(
            f"cache budget {b['budget']}: tied layers {b['tied_layers']} ({b['chosen_by']}), "
            f"{b['kv_bytes_per_token']:,} of the source's {b['source_kv_bytes_per_token']:,} bytes per token "
            f"({b['fraction']:.4f}); KL to the source {record.stages['cache_budget']['kl_to_source']:.4f} per token"
        )
    timed = []
    for key, label in TIMED_STAGES:
        seconds = stage_seconds(record.stages.get(key) or {})
        if seconds is not None:
            rate = record.stages[key].get("tokens_per_second")
            timed.append(f"{label} {seconds:,.0f} s" + (f" ({rate:,.0f} tokens/s)" if rate else ""))
    if timed:
        lines.append(f"time: {', '.join(timed)}; this run {record.seconds:,.0f} s in all")
    lines.append(f"model directory: {out.resolve()}")
    print("\n".join(lines), flush=True)
