"""`qkvshare train`: pretrain a QKVShare model with Accelerate, from one CPU core to many GPUs.

    qkvshare train configs/cpu-small.yaml                       # the README's main job
    accelerate launch -m qkvshare_cli train configs/paper-300m.yaml --variant Q-K=V
    accelerate launch --config_file configs/accelerate/fsdp.yaml -m qkvshare_cli train configs/paper-1.2b.yaml --variant QKV

From Python: `train(parse_args(["configs/cpu-small.yaml"]))` or `train(Arguments(...))` (`qkvshare_settings.train`);
it returns the final metrics and raises what the command line reports (`TrainingSetupError`, a `ValueError`, for bad
input; `TrainingDiverged`, `CheckpointWriteError` and `TrainingInterrupted` for a run that stopped, each a
`CommandStopped` with its exit status).

Design notes
- One file, small named steps. `setup` runs every check before any heavy work and before anything in
  --output_dir is deleted: `build_model_config` (before anything is written), `make_accelerator`,
  `claim_output_dir` (lock, resume checkpoint), `load_or_train_tokenizer`, `prepare_data`, `build_model`,
  `restore_checkpoint`, and only then `replace_previous_run` (--overwrite_output_dir). Bad input raises
  `TrainingSetupError`, which the command line prints as one paragraph with exit status 2. The arguments are `qkvshare_settings.train`'s (parsed and checked without torch).
- Ranks agree on every decision (`ranks.py`): the main process takes the lock and trains the BPE tokenizer and
  hands the result to all; a failed checkpoint write or a stop signal seen by one rank stops all of them at the
  same step.
- The loss is computed here, not by the model: inputs are block[:-1], targets block[1:] of packed blocks (see
  `data.py`), so no padding exists and every target token counts once. Validation is token-weighted over ranks.
- Gradient accumulation is explicit (`no_sync` on all but the last micro-step). Every rank holds an equal number
  of equal-length blocks, so the DDP average of per-rank mean losses is the global mean: two ranks with batch 2
  produce the gradients of one process with batch 4.
- Exact resume: LR is a pure function of the step (`schedule.get_lr`), the data a pure function of (seed,
  step), and model, optimizer, scaler and RNG states come back through `accelerator.load_state`.
- Nothing is lost: SIGTERM or Ctrl-C finishes the current step, saves a checkpoint and prints the command that
  resumes (exit status 128 + signal); a non-finite loss stops the run before the update, keeping the last
  checkpoint; a full disk while saving is reported with the checkpoint that is still intact (exit status 1).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from huggingface_hub import HfApi
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from qkvshare import QKVShareConfig, QKVShareForCausalLM
from qkvshare.configuration_qkvshare import kv_cache_bytes_per_token
from qkvshare.model_dir import check_weights_fit_config, load_source
from qkvshare_settings.conventions import CommandStopped
from qkvshare_settings.train import Arguments, TrainingSetupError, check_args

from .centring import CentredOutputProjections, centring, output_projections
from .checkpoint import (
    RUN_MARKERS,
    CheckpointWriteError,
    OutputDirLock,
    check_compatible,
    checkpoint_root,
    clear_run,
    describe_write_error,
    list_checkpoints,
    read_state,
    resolve_resume_path,
    run_entries,
    save_checkpoint,
)
from .data import (
    BlockSchedule,
    Corpus,
    InMemoryTrainData,
    PackedBlocks,
    StreamingTrainData,
    load_corpus,
    token_fingerprint,
    tokenize_documents,
)
from .model import (
    build_config,
    check_flash_attention,
    count_parameters,
    fit_vocab,
    flops_per_token,
    parse_config_overrides,
    peak_flops_per_device,
)
from .ranks import first_message, max_over_ranks, on_main
from .schedule import get_lr
from .tokenizer import load_tokenizer, padded_vocab_size, train_bpe_tokenizer

# Files of a run inside output_dir that are not part of the Hugging Face model directory.
RUN_SUBDIRS = ("checkpoints", "runs")
# Launcher variables that give the number of processes of a distributed launch (torchrun, MPI).
WORLD_SIZE_VARIABLES = ["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"]
# The training arguments that shape the LR schedule (a resumed run that changes one changes the LR from then on).
SCHEDULE_FLAGS = ("max_steps", "learning_rate", "warmup_steps", "min_lr_ratio")


class TrainingDiverged(CommandStopped):
    """The loss became NaN or infinite; the message names the step and the checkpoint to go back to."""


class TrainingInterrupted(CommandStopped):
    """SIGTERM or Ctrl-C stopped the run at a step boundary, after saving a checkpoint; `signum` is the signal and
    the exit status is 128 + it, as a shell reports a process ended by that signal."""

    label = ""

    def __init__(self, reason: str, signum: int, resume: str = ""):
        hint = f" Resume with the same command and --resume_from_checkpoint latest: {resume}" if resume else ""
        super().__init__(reason + hint)
        self.reason = reason  # what happened, without the hint (for callers that resume otherwise)
        self.signum = signum
        self.exit_status = 128 + signum


@dataclass
class Run:
    """Everything `setup` builds for the loop."""

    args: Arguments
    accelerator: Any
    config: QKVShareConfig
    tokenizer: Any
    model: Any
    optimizer: torch.optim.Optimizer
    train_data: Any
    val_blocks: PackedBlocks
    block_size: int
    start_step: int
    tokens_seen: int
    data_fingerprint: str | None
    flops_per_token: float
    peak_flops: float | None
    lock: OutputDirLock | None  # held by the main process until the run ends
    teacher: Any = None  # --teacher's model (eval mode, no gradients) on this rank's device, or None
    train_seconds: float = 0.0  # time in training steps, over every resumed part of the run up to its checkpoint
    centring: CentredOutputProjections | None = None  # --centre_output_projections

    @property
    def global_batch_blocks(self) -> int:
        t = self.args.train
        return t.per_device_train_batch_size * t.gradient_accumulation_steps * self.accelerator.num_processes

    def state(self, step: int) -> dict[str, Any]:
        """`trainer_state.json` of a checkpoint at `step`."""
        return {
            "step": step,
            "tokens_seen": self.tokens_seen,
            "train_seconds": round(self.train_seconds, 3),
            "block_size": self.block_size,
            "global_batch_blocks": self.global_batch_blocks,
            "seed": self.args.train.seed,
            "trainable_modules": self.args.train.trainable_modules,
            "relative_learning_rates": self.args.train.relative_learning_rates,
            "data_fingerprint": self.data_fingerprint,
            "model_config": self.config.to_dict(),
            "args": self.args.to_dict(),
        }

    def save_checkpoint(self, step: int) -> Path:
        t = self.args.train
        return save_checkpoint(
            self.accelerator, t.output_dir, step, self.state(step), self.tokenizer, t.save_total_limit
        )

    def release(self) -> None:
        """Give the output directory back (the lock); safe to call twice."""
        if self.lock is not None:
            self.lock.release()


def note(accelerator: Any, message: str) -> None:
    """A notice from the main process (stderr, so it stays apart from the results on stdout)."""
    if accelerator is None or accelerator.is_main_process:
        print(f"qkvshare train: note: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------------
# Setup: every check before any heavy work, and before anything is deleted
# --------------------------------------------------------------------------------------------------------------
def _accelerator_available() -> bool:
    """Whether torch sees a GPU or another accelerator (CUDA, ROCm, XPU, MPS, ...)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def make_accelerator(args: Arguments) -> Any:
    """The `Accelerator` of this run, with as many processes as the launcher started.

    A multi-process launch on a machine without GPUs (`accelerate launch --multi_gpu`, `torchrun`) runs as CPU
    ranks over gloo: accelerate alone would start that many independent single-process runs writing the same
    --output_dir. FSDP is refused there, as accelerate would silently fall back to plain data parallelism.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, get_int_from_env

    t = args.train
    world = get_int_from_env(WORLD_SIZE_VARIABLES, 1)
    cpu_ranks = world > 1 and not t.use_cpu and not _accelerator_available()
    trackers = [name.strip() for name in t.report_to.split(",") if name.strip() and name.strip() != "none"]
    precision = "bf16" if t.bf16 else "fp16" if t.fp16 else "no"
    if AcceleratorState._shared_state.get("_mixed_precision", precision) != precision:
        # accelerate keeps the first run's precision process-wide and refuses another; a library caller's earlier
        # run (e.g. a conversion's stage (c) after a float32 training) must not decide this one's
        AcceleratorState._reset_state()
    accelerator = Accelerator(
        mixed_precision=precision,
        cpu=t.use_cpu or cpu_ranks,
        log_with=trackers or None,
        project_dir=str(Path(t.output_dir) / "runs"),
    )
    if accelerator.num_processes != world:
        raise TrainingSetupError(
            f"the launcher started {world} processes but accelerate joined {accelerator.num_processes} "
            f"({accelerator.distributed_type}), so they would train as separate runs over one --output_dir; "
            "pass --use_cpu true to train as CPU ranks (gloo), or give every process its own GPU."
        )
    fsdp_asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp_asked and accelerator.distributed_type != DistributedType.FSDP:
        raise TrainingSetupError(
            f"FSDP was asked for (--use_fsdp, e.g. configs/accelerate/fsdp.yaml) but this run is "
            f"{accelerator.distributed_type} on {accelerator.device}: accelerate runs FSDP only on GPUs and would "
            "otherwise replicate the whole model on every rank. Launch on GPUs, or use "
            "configs/accelerate/cpu-2proc.yaml (data parallel over gloo) on CPUs."
        )
    if accelerator.distributed_type == DistributedType.DEEPSPEED and t.gradient_accumulation_steps > 1:
        raise TrainingSetupError(
            "DeepSpeed steps inside backward, which this loop's explicit gradient accumulation does not fit; "
            "use --gradient_accumulation_steps 1 (raise the per-device batch) or the FSDP config for sharding."
        )
    if cpu_ranks:
        note(
            accelerator,
            f"no GPU found: the {world} processes train as CPU ranks over gloo (--use_cpu true asks for it).",
        )
    return accelerator


def check_output_dir(args: Arguments) -> tuple[Path | None, list[str]]:
    """Refuse to mix two runs in one directory; return the checkpoint to resume from (if any) and notes.

    Called on the main process, under the lock.
    """
    t = args.train
    out = Path(t.output_dir)
    entries = run_entries(out)
    found = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    resume_path, notes = None, []
    if t.resume_from_checkpoint:
        resume_path, notes = resolve_resume_path(t.resume_from_checkpoint, t.output_dir)
        if resume_path.resolve().is_relative_to(checkpoint_root(out).resolve()):
            return resume_path, notes  # continuing the run of this directory (--overwrite_output_dir is moot)
    if entries and not any(name in RUN_MARKERS for name in entries):
        raise TrainingSetupError(
            f"--output_dir {out} holds files that are not a training run's ({found}); choose a new or empty "
            "--output_dir (--overwrite_output_dir deletes only a previous run: a directory with checkpoints/, runs/ "
            "or training_args.json)."
        )
    if entries and not t.overwrite_output_dir and resume_path is not None:
        raise TrainingSetupError(
            f"--output_dir {out} already holds another run ({found}), and --resume_from_checkpoint {resume_path} "
            "belongs to another directory: continuing there would overwrite that run's model and rotate away its "
            f"checkpoints. Resume into a new or empty --output_dir, pass --overwrite_output_dir to replace the run in "
            f"{out}, or pass --resume_from_checkpoint latest to continue the run that {out} holds."
        )
    if entries and not t.overwrite_output_dir:
        raise TrainingSetupError(
            f"--output_dir {out} already holds another run ({found}); pass --resume_from_checkpoint latest to "
            "continue it, --overwrite_output_dir to start over there, or choose a new --output_dir."
        )
    return resume_path, notes


def check_resume_steps(args: Arguments, saved: dict[str, Any], path: Path) -> list[str]:
    """Refuse a --max_steps the checkpoint is already past; note the flags that change the LR schedule."""
    t = args.train
    if saved["step"] > t.max_steps:
        raise TrainingSetupError(
            f"checkpoint {path} is at step {saved['step']}, beyond --max_steps {t.max_steps}: the run would stop at "
            f"once and label a step-{saved['step']} model as step {t.max_steps}. Pass --max_steps {saved['step']} or "
            "more, or resume from an earlier checkpoint."
        )
    before = saved.get("args", {})
    changed = [
        f"--{k} {before[k]} -> {getattr(t, k)}" for k in SCHEDULE_FLAGS if k in before and before[k] != getattr(t, k)
    ]
    if not changed:
        return []
    return [f"resuming at step {saved['step']} with {', '.join(changed)}: the LR schedule changes from there on."]


def claim_output_dir(accelerator: Any, args: Arguments) -> tuple[OutputDirLock | None, Path | None, dict | None]:
    """Main process: take the output directory's lock and find the checkpoint to resume from; every rank gets
    the result. Returns (the lock on the main process, else None; the checkpoint; its trainer state)."""
    lock = OutputDirLock(args.train.output_dir) if accelerator.is_main_process else None

    def claim() -> tuple[Path | None, dict | None, list[str]]:
        stale = lock.acquire()
        try:
            resume_path, notes = check_output_dir(args)
            saved = read_state(resume_path) if resume_path is not None else None
            if saved is not None:
                notes += check_resume_steps(args, saved, resume_path)
        except BaseException:
            lock.release()
            raise
        return resume_path, saved, [n for n in (stale, *notes) if n]

    resume_path, saved, notes = on_main(accelerator, claim)
    for text in notes:
        note(accelerator, text)
    if resume_path is not None:
        note(accelerator, f"resuming from {resume_path} (step {saved['step']}).")
    return lock, resume_path, saved


def build_model_config(args: Arguments) -> tuple[QKVShareConfig, dict[str, Any], int]:
    """The model config from --preset/--variant/--config_overrides, its overrides, and the block size."""
    m, d = args.model, args.data
    overrides = parse_config_overrides(m.config_overrides)
    if m.init_from is not None:  # the directory's config as saved (check_args refused --variant/--config_overrides)
        config = QKVShareConfig.from_pretrained(m.init_from)
        label = f"--init_from {m.init_from!r}"
        check_weights_fit_config(m.init_from, config, QKVShareForCausalLM, label, TrainingSetupError)
    else:
        config = build_config(m.preset, m.variant, overrides)
    block_size = d.block_size or min(1024, config.max_position_embeddings)
    if block_size > config.max_position_embeddings:
        raise TrainingSetupError(
            f"--block_size {block_size} exceeds the model's max_position_embeddings={config.max_position_embeddings}; "
            f"lower --block_size or raise it with --config_overrides max_position_embeddings={block_size}."
        )
    return config, overrides, block_size


def load_or_train_tokenizer(
    accelerator: Any, args: Arguments, config: QKVShareConfig, corpus: Corpus, resume_path: Path | None
) -> Any:
    """The checkpoint's tokenizer when resuming, else the named one, else a BPE the main process trains on the
    training documents and hands to every rank (it is first written with the first checkpoint)."""
    m = args.model
    if resume_path is not None:
        return load_tokenizer(str(resume_path))
    if m.init_from is not None:
        return init_from_tokenizer(m.init_from, m.tokenizer_name, config)
    if m.tokenizer_name:
        return load_tokenizer(m.tokenizer_name)
    vocab = m.tokenizer_vocab_size or config.vocab_size
    return on_main(accelerator, lambda: train_bpe_tokenizer(corpus.train, vocab, config.max_position_embeddings))


def init_from_tokenizer(init_from: str, tokenizer_name: str | None, config: QKVShareConfig) -> Any:
    """--init_from's own tokenizer, or --tokenizer_name when it is the same vocabulary; either must fit the model.

    A tokenizer is the other half of a pretrained model: ids from another vocabulary would read rows of the
    embedding learned for other tokens, so a mismatch is refused rather than trained through.
    """
    own = Path(init_from) / "tokenizer_config.json"
    has_own = own.is_file() or (Path(init_from) / "tokenizer.json").is_file()
    if not has_own and not tokenizer_name:
        raise TrainingSetupError(
            f"--init_from {init_from!r} holds no tokenizer; pass --tokenizer_name with the tokenizer its weights were "
            "trained with (`qkvshare convert` saves the source's)."
        )
    tokenizer = load_tokenizer(tokenizer_name or init_from)
    if has_own and tokenizer_name:
        if tokenizer.get_vocab() != load_tokenizer(init_from).get_vocab():
            raise TrainingSetupError(
                f"--tokenizer_name {tokenizer_name!r} does not match the vocabulary of --init_from {init_from!r} (its "
                "own tokenizer); leave --tokenizer_name out to use the directory's tokenizer."
            )
    if len(tokenizer) > config.vocab_size:
        name = tokenizer_name or init_from
        raise TrainingSetupError(
            f"the tokenizer {name!r} has {len(tokenizer)} tokens but the model of --init_from {init_from!r} has "
            f"vocab_size={config.vocab_size}: the tokenizer does not match the model's vocabulary. Use the tokenizer "
            "the model was trained with (leave --tokenizer_name out)."
        )
    return tokenizer


def _at_least_one_block(tokens: Any, block_size: int, max_samples: int | None, split: str, fix: str) -> PackedBlocks:
    """`tokens` packed into blocks; a TrainingSetupError naming `split` and `fix` when not even one block fits."""
    blocks = PackedBlocks(tokens, block_size, max_samples)
    if len(blocks) == 0:
        raise TrainingSetupError(f"{split} has {len(tokens)} tokens, fewer than one block of {block_size + 1}; {fix}.")
    return blocks


def prepare_data(
    args: Arguments,
    accelerator: Any,
    tokenizer: Any,
    corpus: Corpus,
    block_size: int,
    saved: dict | None,
    resume_path: Path | None,
) -> tuple[PackedBlocks, Any, str | None]:
    """Tokenize and pack; check there is at least one block on each side and, when resuming, that the data is
    the checkpoint's. Returns (validation blocks, training data, token fingerprint of in-memory data)."""
    d, t = args.data, args.train
    val_blocks = _at_least_one_block(
        tokenize_documents(tokenizer, corpus.validation),
        block_size,
        d.max_eval_samples,
        "the validation split",
        "lower --block_size, raise --validation_split_percentage or give a larger --validation_file",
    )
    if corpus.streaming:
        train_data = StreamingTrainData(
            corpus.train,
            tokenizer,
            d.text_column,
            block_size,
            t.per_device_train_batch_size,
            t.gradient_accumulation_steps,
        )
        return val_blocks, train_data, None
    blocks = _at_least_one_block(
        tokenize_documents(tokenizer, corpus.train),
        block_size,
        d.max_train_samples,
        "the training corpus",
        "lower --block_size or add data",
    )
    fingerprint = token_fingerprint(blocks.tokens[: len(blocks) * block_size + 1].numpy())
    if saved is not None and saved.get("data_fingerprint") != fingerprint:
        raise TrainingSetupError(
            f"checkpoint {resume_path} was trained on other data (token fingerprint {saved.get('data_fingerprint')}"
            f", now {fingerprint}); resume with the same data arguments."
        )
    schedule = BlockSchedule(
        len(blocks),
        t.seed,
        t.per_device_train_batch_size,
        t.gradient_accumulation_steps,
        accelerator.num_processes,
        accelerator.process_index,
    )
    return val_blocks, InMemoryTrainData(blocks, schedule), fingerprint


def build_model(args: Arguments, config: QKVShareConfig) -> QKVShareForCausalLM:
    """A freshly initialised model (seeded), or --init_from's weights, with the requested attention backend and
    checkpointing."""
    m, t = args.model, args.train
    set_seed(t.seed)
    if (
        m.init_from is not None
    ):  # float32 master weights whatever the directory's dtype (mixed precision is accelerate's)
        backend = {"attn_implementation": m.attn_implementation} if m.attn_implementation else {}
        model = QKVShareForCausalLM.from_pretrained(m.init_from, config=config, dtype=torch.float32, **backend)
    elif m.attn_implementation:
        model = QKVShareForCausalLM._from_config(config, attn_implementation=m.attn_implementation)
    else:
        model = QKVShareForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    if t.trainable_modules is not None:
        freeze_all_but(model, t.trainable_modules)
    if t.gradient_checkpointing:
        model.activation_checkpointing_enable()  # transformers 5 name of gradient_checkpointing_enable
    return model


def trained_names(names: list[str], patterns: list[str] | None) -> list[str]:
    """The parameter names --trainable_modules `patterns` trains: those containing one of them (None: every name)."""
    return list(names) if patterns is None else [name for name in names if any(p in name for p in patterns)]


def no_match(flag: str, patterns: list[str], names: list[str], whose: str) -> str | None:
    """The error when `patterns` (of `flag`) match none of the parameter `names` of `whose` model; None when some
    match."""
    if trained_names(names, patterns):
        return None
    return (
        f"{flag} {' '.join(patterns)} matches no parameter of {whose}; its parameters are named like "
        f"{names[min(1, len(names) - 1)]!r} and {names[-1]!r} (e.g. self_attn, mlp, embed_tokens)"
    )


def freeze_all_but(model: torch.nn.Module, patterns: list[str]) -> None:
    """Train only the parameters whose names contain one of `patterns`: the rest take no gradient and no optimizer
    state (their activations' gradients still flow). A `TrainingSetupError` when no parameter matches."""
    names = [name for name, _ in model.named_parameters()]
    if problem := no_match("--trainable_modules", patterns, names, "the model"):
        raise TrainingSetupError(problem + ".")
    trained = trained_names(names, patterns)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trained)


def restore_checkpoint(accelerator: Any, path: Path) -> None:
    """Load model, optimizer, scaler and RNG states; a file that passed the size checks but does not load is
    reported with the checkpoint's name."""
    try:
        accelerator.load_state(str(path))
    except Exception as err:  # unpickling, safetensors or shape errors: all mean this checkpoint cannot be used
        raise TrainingSetupError(
            f"checkpoint {path} does not load ({type(err).__name__}: {' '.join(str(err).split())[:500]}); resume "
            f"from an earlier checkpoint (--resume_from_checkpoint {path.parent}/checkpoint-<step>)."
        ) from err


def replace_previous_run(accelerator: Any, args: Arguments, resume_path: Path | None) -> None:
    """--overwrite_output_dir: delete the previous run, now that every input of the new one has been checked."""
    t = args.train
    continuing = resume_path is not None and resume_path.resolve().is_relative_to(
        checkpoint_root(t.output_dir).resolve()
    )
    if t.overwrite_output_dir and not continuing and accelerator.is_main_process and run_entries(t.output_dir):
        note(accelerator, f"--overwrite_output_dir: deleting the previous run in {t.output_dir}.")
        clear_run(t.output_dir)
    accelerator.wait_for_everyone()


def setup(args: Arguments, teacher_model: Any = None) -> Run:
    """Check the arguments, load data and tokenizer, build model and optimizer, restore a checkpoint, and only
    then clear a previous run (--overwrite_output_dir). The returned run holds the output directory's lock.
    `teacher_model`: --teacher's model already in memory (frozen, eval mode), used instead of loading it again."""
    check_args(args)  # again: arguments built in code have not been through `parse_args`
    check_flash_attention(args.model.attn_implementation)
    config, overrides, block_size = build_model_config(args)  # a bad variant or override: nothing written yet
    accelerator = make_accelerator(args)
    refuse_sharding(accelerator, args.train)  # before the output folder is claimed
    lock, resume_path, saved = claim_output_dir(accelerator, args)
    try:
        m, d, t = args.model, args.data, args.train
        if d.streaming and not m.tokenizer_name and resume_path is None:
            raise TrainingSetupError(
                "a streamed dataset needs --tokenizer_name (e.g. gpt2): BPE training reads local data."
            )
        rank, world = accelerator.process_index, accelerator.num_processes
        corpus = load_corpus(d, rank=rank, world_size=world, seed=t.seed)
        tokenizer = load_or_train_tokenizer(accelerator, args, config, corpus, resume_path)
        if m.init_from is None:  # a pretrained model keeps its vocabulary (init_from_tokenizer checked the fit)
            fit_vocab(config, len(tokenizer), padded_vocab_size(tokenizer), "vocab_size" in overrides)
        config.eos_token_id = tokenizer.eos_token_id
        config.bos_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
        if saved is not None:
            global_batch = t.per_device_train_batch_size * t.gradient_accumulation_steps * world
            current = {
                "model_config": config.to_dict(),
                "block_size": block_size,
                "global_batch_blocks": global_batch,
                "seed": t.seed,
                "trainable_modules": t.trainable_modules,
                "relative_learning_rates": t.relative_learning_rates,
            }
            check_compatible(saved, current, resume_path)
        val_blocks, train_data, fingerprint = prepare_data(
            args, accelerator, tokenizer, corpus, block_size, saved, resume_path
        )

        model = build_model(args, config)
        teacher = teacher_model
        if teacher is None and m.teacher:
            teacher = load_teacher(m.teacher, config, tokenizer)
        if teacher is not None and t.distill_hidden_weight > 0:
            check_hidden_teacher(teacher.config, config, t.distill_hidden_weight)
        fpt = flops_per_token(model, config, block_size)
        optimizer = build_optimizer(model, args)
        model, optimizer = accelerator.prepare(model, optimizer)
        if teacher is not None:  # not prepared: it takes no gradients, so DDP/FSDP have nothing to synchronise
            teacher = teacher.to(accelerator.device)
        start_step, tokens_seen, train_seconds = 0, 0, 0.0
        if saved is not None:
            restore_checkpoint(accelerator, resume_path)
            start_step, tokens_seen = saved["step"], saved["tokens_seen"]
            train_seconds = saved.get("train_seconds", 0.0)  # absent from checkpoints of earlier versions
        replace_previous_run(accelerator, args, resume_path)
        centred = (
            centre_output_projections(accelerator, args, model, val_blocks) if t.centre_output_projections else None
        )
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Run(
        args,
        accelerator,
        config,
        tokenizer,
        model,
        optimizer,
        train_data,
        val_blocks,
        block_size,
        start_step,
        tokens_seen,
        fingerprint,
        fpt,
        peak_flops_per_device(accelerator.device, t.peak_tflops),
        lock,
        teacher,
        train_seconds,
        centred,
    )


def centre_output_projections(accelerator: Any, args: Arguments, model: Any, val_blocks: PackedBlocks) -> Any:
    """--centre_output_projections: the centring (`centring.CentredOutputProjections`) of the model's biased output
    projections on their mean inputs, measured on the first validation blocks (the same on every rank) before the
    first step, or read back from the output folder where the run saved them (a resumed run)."""
    unwrapped = accelerator.unwrap_model(model)
    if not output_projections(unwrapped):
        raise TrainingSetupError(
            "--centre_output_projections centres the attention output projections' inputs and moves the constant "
            "into their biases, but this model's o_proj layers have no bias (or do not train): convert or build it "
            "with attention_bias=True, or drop the flag."
        )
    blocks = val_blocks.stack(list(range(min(len(val_blocks), args.train.per_device_train_batch_size))))

    def forward() -> None:
        was_training = unwrapped.training
        unwrapped.eval()
        unwrapped(input_ids=blocks[:, :-1].to(accelerator.device))
        unwrapped.train(was_training)

    return centring(unwrapped, Path(args.train.output_dir), forward, accelerator.is_main_process)


# The training flags that work on whole parameters, which FSDP and DeepSpeed shard across processes: flag -> what
# it does with them (the error's words).
WHOLE_PARAMETER_FLAGS = {
    "centre_output_projections": "updates each o_proj's whole weight and bias together",
    "relative_learning_rates": "scales each whole parameter's learning rate",
}


def refuse_sharding(accelerator: Any, t: Any) -> None:
    """A `TrainingSetupError` when the run shards its parameters across processes (FSDP, DeepSpeed) and training
    arguments `t` ask for a flag of `WHOLE_PARAMETER_FLAGS`."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return
    for flag, what in WHOLE_PARAMETER_FLAGS.items():
        if getattr(t, flag):
            raise TrainingSetupError(
                f"--{flag} {what}, which {accelerator.distributed_type.value} shards across processes: train with "
                "DDP or one process, or drop the flag."
            )


def check_hidden_teacher(teacher: Any, student: QKVShareConfig, weight: float) -> None:
    """--distill_hidden_weight matches the student's layers to the teacher's one by one: both configs need the same
    number of layers and the same width."""
    shapes = [(c.num_hidden_layers, c.hidden_size) for c in (teacher, student)]
    if shapes[0] != shapes[1]:
        (tl, td), (sl, sd) = shapes
        raise TrainingSetupError(
            f"--distill_hidden_weight {weight} matches each layer's output to the teacher's, but the teacher has {tl} "
            f"layers of width {td} and the student {sl} of width {sd}; distil from a teacher of the student's shape "
            "(e.g. the model it was converted from) or pass --distill_hidden_weight 0."
        )


def load_teacher(path: str, config: QKVShareConfig, tokenizer: Any) -> Any:
    """--teacher's causal LM (float32, eval mode, frozen): a model directory of any causal LM transformers loads
    (its weights checked against its config first), or a .gguf file (de-quantized as `qkvshare convert` reads it).
    Its logits must cover the student's vocabulary and, when it has a tokenizer, that tokenizer must be the
    student's: KL divergence compares the two distributions token id by token id."""
    teacher_path = Path(path).expanduser()
    label = f"--teacher {path!r}"
    if teacher_path.is_file():
        try:
            model = load_source(str(teacher_path))
        except ValueError as err:
            raise TrainingSetupError(f"{label}: {err}") from None
    else:
        check_weights_fit_config(teacher_path, model_class=AutoModelForCausalLM, label=label, error=TrainingSetupError)
        model = AutoModelForCausalLM.from_pretrained(str(teacher_path), dtype=torch.float32)
        has_tokenizer = any((teacher_path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
        if has_tokenizer and load_tokenizer(str(teacher_path)).get_vocab() != tokenizer.get_vocab():
            raise TrainingSetupError(
                f"{label} has another tokenizer than the student's: its next-token distribution is over other "
                "tokens. Distil from a teacher with the student's vocabulary (e.g. the model it was converted from)."
            )
    if model.config.vocab_size != config.vocab_size:
        raise TrainingSetupError(
            f"{label} predicts {model.config.vocab_size} token ids but the student {config.vocab_size}: the two "
            "distributions cannot be compared. Distil from a teacher with the student's vocabulary."
        )
    return model.eval().requires_grad_(False)


def build_optimizer(model: torch.nn.Module, args: Arguments) -> torch.optim.AdamW:
    """AdamW with weight decay on weight matrices only: not on norms, biases or embeddings (unless asked). With
    --relative_learning_rates, one group per parameter, each with its `lr_scale` (`relative_lr_scales`), which the
    loop multiplies into the schedule's learning rate at every step (`train_step`)."""
    t = args.train
    embeddings = {id(mod.weight) for mod in model.modules() if isinstance(mod, torch.nn.Embedding)}
    decay, no_decay = [], []
    for p in {id(p): p for p in model.parameters() if p.requires_grad}.values():  # tied weights once
        matrix = p.ndim >= 2 and id(p) not in embeddings
        (decay if matrix or t.decay_norms_biases_embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if t.relative_learning_rates:
        scales = iter(relative_lr_scales(decay + no_decay))
        groups = [
            {"params": [p], "weight_decay": group["weight_decay"], "lr_scale": next(scales)}
            for group in groups
            for p in group["params"]
        ]
    return torch.optim.AdamW(groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon)


# --relative_learning_rates' bounds on a parameter's scale
RELATIVE_LR_BOUNDS = (0.1, 1.0)


def is_weight_matrix(param: torch.Tensor) -> bool:
    """Whether `param` is one of the weight matrices (2+ dimensions) whose median RMS `relative_lr_scales` measures
    every scale against."""
    return param.ndim >= 2


def relative_lr_scales(params: Sequence[torch.Tensor]) -> list[float]:
    """--relative_learning_rates: each parameter's RMS over the median RMS of the weight matrices (2+ dimensions)
    among `params`, clamped to `RELATIVE_LR_BOUNDS`. AdamW's first steps move every element by about the learning
    rate whatever its size, so a weight smaller than the median takes a proportionally smaller step (down to a tenth)
    and none a larger one: a close initialisation (a converted model) keeps its small weights, e.g. the output
    projections of Qwen2.5-Coder's attention, which diverged at the learning rate of the rest."""
    rms = [p.detach().float().pow(2).mean().sqrt().item() for p in params]
    matrices = [r for p, r in zip(params, rms, strict=True) if is_weight_matrix(p)]
    if not matrices:
        raise TrainingSetupError(
            "--relative_learning_rates scales learning rates by the trained weight matrices' RMS, but no weight "
            "matrix trains (--trainable_modules): train one, or drop the flag."
        )
    median = torch.tensor(matrices).median().item()
    low, high = RELATIVE_LR_BOUNDS
    return [min(high, max(low, r / median)) if median > 0 else high for r in rms]


# --------------------------------------------------------------------------------------------------------------
# Loop
# --------------------------------------------------------------------------------------------------------------
def next_token_loss(model: Any, blocks: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of predicting block[1:] from block[:-1] (fp32 logits); blocks hold no padding."""
    logits = model(input_ids=blocks[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), blocks[:, 1:].flatten(), reduction=reduction)


def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 x KL(teacher || student) of the softened distributions, summed over the vocabulary and averaged over
    tokens (Hinton et al. 2015: the T^2 keeps the gradient scale independent of T)."""
    student = F.log_softmax(logits.float().flatten(0, -2) / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.float().flatten(0, -2) / temperature, dim=-1)
    kl = F.kl_div(student, teacher, log_target=True, reduction="sum") / student.shape[0]
    return kl * temperature**2


def hidden_state_loss(hidden: Sequence[torch.Tensor], teacher_hidden: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each layer's output matched to the teacher's: the squared error relative to the teacher's squared norm at
    the same token, averaged over tokens and layers (the embeddings, entry 0, left out). Relative per token, so the
    few tokens and late layers of large activations weigh no more than the rest."""
    if len(hidden) != len(teacher_hidden):
        raise ValueError(f"{len(hidden)} hidden states against the teacher's {len(teacher_hidden)}")
    terms = []
    for own, ref in zip(hidden[1:], teacher_hidden[1:], strict=True):
        ref = ref.float()
        terms.append(((own.float() - ref).pow(2).sum(-1) / ref.pow(2).sum(-1).clamp_min(1e-12)).mean())
    return torch.stack(terms).mean()


def train_loss(run: Run, blocks: torch.Tensor) -> torch.Tensor:
    """The loss of one micro-batch: the LM loss, or with --teacher the distillation loss mixed with it (plus
    --distill_hidden_weight x `hidden_state_loss`)."""
    if run.teacher is None:
        return next_token_loss(run.model, blocks)
    t = run.args.train
    inputs = blocks[:, :-1]
    hidden = t.distill_hidden_weight > 0
    out = run.model(input_ids=inputs, use_cache=False, output_hidden_states=hidden)
    with torch.no_grad(), run.accelerator.autocast():
        teacher_out = run.teacher(input_ids=inputs, use_cache=False, output_hidden_states=hidden)
    loss = distillation_loss(out.logits, teacher_out.logits, t.distill_temperature)
    if t.distill_lm_weight:
        lm = F.cross_entropy(out.logits.float().flatten(0, 1), blocks[:, 1:].flatten())
        loss = (1 - t.distill_lm_weight) * loss + t.distill_lm_weight * lm
    if hidden:
        loss = loss + t.distill_hidden_weight * hidden_state_loss(out.hidden_states, teacher_out.hidden_states)
    return loss


def scheduled_lr(t: Any, step: int) -> float:
    """The schedule's learning rate at `step` of the run with training arguments `t` (before any group's scale)."""
    return get_lr(
        step, peak_lr=t.learning_rate, warmup_steps=t.warmup_steps, max_steps=t.max_steps, min_lr_ratio=t.min_lr_ratio
    )


def train_step(run: Run, step: int) -> tuple[float, float]:
    """One optimizer step (all micro-steps). Returns (mean loss over ranks, grad norm); raises on a non-finite loss."""
    acc, t = run.accelerator, run.args.train
    lr = scheduled_lr(t, step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # --relative_learning_rates' per-parameter scale
    run.model.train()
    loss_sum = torch.zeros((), device=acc.device)
    accumulation = t.gradient_accumulation_steps
    for micro in range(accumulation):
        blocks = run.train_data.batch(step, micro).to(acc.device)
        sync = micro == accumulation - 1
        with nullcontext() if sync else acc.no_sync(run.model):
            loss = train_loss(run, blocks)
            acc.backward(loss / accumulation)
        loss_sum += loss.detach()
    mean_loss = acc.reduce(loss_sum / accumulation, reduction="mean").item()
    if not math.isfinite(mean_loss):  # every rank sees the same reduced value, so all stop together
        run.optimizer.zero_grad(set_to_none=True)
        found = list_checkpoints(t.output_dir)
        where = f"the last good checkpoint is {found[-1]}" if found else "no checkpoint was written yet"
        raise TrainingDiverged(
            f"loss became {mean_loss} at step {step + 1}; stopped before updating the weights, {where}. Resume from "
            "it with a lower --learning_rate, more --warmup_steps, --max_grad_norm 1.0, or --bf16 instead of --fp16."
        )
    grad_norm = float("nan")
    if t.max_grad_norm > 0:
        norm = acc.clip_grad_norm_(run.model.parameters(), t.max_grad_norm)  # None under DeepSpeed (it clips)
        grad_norm = float(norm) if norm is not None else grad_norm
    if run.centring is not None:
        run.centring.before_step()
    run.optimizer.step()
    if run.centring is not None:
        run.centring.after_step()
    run.optimizer.zero_grad(set_to_none=True)
    run.tokens_seen += run.global_batch_blocks * run.block_size
    return mean_loss, grad_norm


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Token-weighted validation loss and perplexity over all validation blocks, split across ranks; with
    --teacher also the mean KL(teacher || model) per token at temperature 1 (`eval/kl`).

    Every rank runs the same number of forward passes (short ranks repeat block 0 with weight 0), which
    collective wrappers such as FSDP need.
    """
    acc, bs = run.accelerator, run.args.train.per_device_eval_batch_size
    n, world, rank = len(run.val_blocks), acc.num_processes, acc.process_index
    mine = list(range(rank, n, world))
    per_rank = -(-n // world)
    padded = mine + [0] * (per_rank - len(mine))
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    run.model.eval()
    # (sum of token losses, token count, sum of token KL divergences to the teacher)
    totals = torch.zeros(3, dtype=torch.float64, device=acc.device)
    for start in range(0, per_rank, bs):
        blocks = run.val_blocks.stack(padded[start : start + bs]).to(acc.device)
        w = torch.tensor(weights[start : start + bs], device=acc.device, dtype=torch.float64)
        logits = run.model(input_ids=blocks[:, :-1], use_cache=False).logits.float()
        token_loss = F.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten(), reduction="none")
        totals[0] += (token_loss.view(len(blocks), -1).double().sum(-1) * w).sum()
        totals[1] += w.sum() * run.block_size
        if run.teacher is not None:
            with acc.autocast():
                teacher_logits = run.teacher(input_ids=blocks[:, :-1], use_cache=False).logits
            teacher = F.log_softmax(teacher_logits.float(), dim=-1)
            kl = (teacher.exp() * (teacher - F.log_softmax(logits, dim=-1))).sum(-1)  # (B, T)
            totals[2] += (kl.double().sum(-1) * w).sum()
    totals = acc.reduce(totals, reduction="sum")
    loss = (totals[0] / totals[1]).item()
    result = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0)), "eval/tokens": int(totals[1].item())}
    if run.teacher is not None:
        result["eval/kl"] = (totals[2] / totals[1]).item()
    return result


class StopRequest:
    """SIGTERM and Ctrl-C (SIGINT) during the loop become a request to stop at the next step boundary.

    The handler only records the signal; the loop asks `agreed` after every step, which takes the largest signal
    over the ranks, so all of them save the same checkpoint and stop together even when one rank alone was
    signalled. A second Ctrl-C raises `KeyboardInterrupt` at once (quit without saving). Handlers are installed
    only in the main thread (Python allows no other) and restored on exit.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def agreed(self, accelerator: Any) -> int:
        """The signal that stops the run (0: none), the same on every rank."""
        return max_over_ranks(accelerator, self.signum)


def train(
    args: Arguments, on_step: Callable[[int, float, Any], None] | None = None, teacher_model: Any = None
) -> dict[str, Any]:
    """Run the whole pretraining and return the final metrics. `on_step(step, loss, model)` is a test hook called
    after each optimizer step (and its checkpoint, if any); `teacher_model` is --teacher's model when the caller
    holds it already (`setup`)."""
    run = setup(args, teacher_model)
    try:
        return _train(run, on_step)
    finally:
        run.release()


def _train(run: Run, on_step: Callable[[int, float, Any], None] | None) -> dict[str, Any]:
    acc, t = run.accelerator, run.args.train
    if acc.is_main_process:
        _print_header(run)
    hparams = {k: v for k, v in run.args.to_dict().items() if isinstance(v, int | float | str | bool)}
    acc.init_trackers(t.run_name or "qkvshare", config=hparams | {"variant": run.config.variant})

    bar = tqdm(
        total=t.max_steps,
        initial=run.start_step,
        disable=t.disable_tqdm or not acc.is_local_main_process,
        desc="train",
        dynamic_ncols=True,
    )
    window_losses, window_time, window_tokens = [], 0.0, 0
    metrics: dict[str, Any] = {}
    with StopRequest() as stop:
        for step in range(run.start_step, t.max_steps):
            started = time.perf_counter()
            loss, grad_norm = train_step(run, step)
            spent = time.perf_counter() - started
            window_time += spent
            run.train_seconds += spent
            window_tokens += run.global_batch_blocks * run.block_size
            window_losses.append(loss)
            done = step + 1
            bar.update(1)
            if done % t.logging_steps == 0 or done == t.max_steps:
                tokens_per_s = window_tokens / max(window_time, 1e-9)
                metrics = {
                    "train/loss": sum(window_losses) / len(window_losses),
                    "train/grad_norm": grad_norm,
                    "train/lr": scheduled_lr(t, step),
                    "train/tokens_per_second": tokens_per_s,
                    "train/tokens_seen": run.tokens_seen,
                }
                if run.peak_flops:
                    metrics["train/mfu"] = tokens_per_s * run.flops_per_token / (run.peak_flops * acc.num_processes)
                acc.log(metrics, step=done)
                bar.set_postfix(
                    loss=f"{metrics['train/loss']:.3f}", lr=f"{metrics['train/lr']:.2e}", tok_s=f"{tokens_per_s:,.0f}"
                )
                window_losses, window_time, window_tokens = [], 0.0, 0
            if done % t.eval_steps == 0 and done != t.max_steps:
                evaluation = evaluate(run)
                acc.log(evaluation, step=done)
                if acc.is_main_process:
                    bar.write(
                        f"step {done}: val loss {evaluation['eval/loss']:.4f}, ppl {evaluation['eval/perplexity']:.2f}"
                    )
            saved = bool(t.save_steps) and done % t.save_steps == 0
            if saved:
                run.save_checkpoint(done)
            if on_step is not None:
                try:
                    on_step(done, loss, run.model)
                except BaseException:  # the hook stopped the run (e.g. a diverged distillation): end it tidily
                    bar.close()
                    acc.end_training()
                    raise
            signum = stop.agreed(acc)
            if signum:
                bar.close()
                path = checkpoint_root(t.output_dir) / f"checkpoint-{done}" if saved else run.save_checkpoint(done)
                acc.end_training()
                raise TrainingInterrupted(
                    f"{signal.Signals(signum).name} received: stopped after step {done} of {t.max_steps} and saved "
                    f"checkpoint {path}.",
                    signum,
                    resume_command(run.args.command_line),
                )
    bar.close()

    final = evaluate(run)
    acc.log(final, step=t.max_steps)
    result = {
        "step": t.max_steps,
        "tokens_seen": run.tokens_seen,
        "train_loss": metrics.get("train/loss"),
        "val_loss": final["eval/loss"],
        "val_perplexity": final["eval/perplexity"],
        "val_tokens": final["eval/tokens"],
        "val_kl": final.get("eval/kl"),
        "tokens_per_second": metrics.get("train/tokens_per_second"),
        # the steps' time over every part of a resumed run (steps redone after a kill counted once)
        "train_seconds": round(run.train_seconds, 3),
        "train_tokens_per_second": run.tokens_seen / run.train_seconds if run.train_seconds > 0 else None,
        "mfu": metrics.get("train/mfu"),
        "flops_per_token": run.flops_per_token,
        "variant": run.config.variant,
        "parameters": count_parameters(acc.unwrap_model(run.model)),
        "kv_cache_bytes_per_token": run.config.kv_cache_bytes_per_token(),
        "qkv_kv_cache_bytes_per_token": run.config.qkv_cache_bytes_per_token(),
    }
    if run.teacher is not None:  # the model it replaces (a converted model's source: GQA, not the MHA reference)
        result["teacher_kv_cache_bytes_per_token"] = kv_cache_bytes_per_token(run.teacher.config)
    save_final_model(run, result)
    acc.end_training()
    return result


# --------------------------------------------------------------------------------------------------------------
# End product
# --------------------------------------------------------------------------------------------------------------
def save_final_model(run: Run, result: dict[str, Any]) -> None:
    """Write the Hugging Face model directory (config with auto_map, code, safetensors, tokenizer, args, metrics),
    reload it from disk to generate the closing sample, and push it if asked.

    A failed write (a full disk) raises `CheckpointWriteError` on every rank, naming the last checkpoint.
    """
    acc, t = run.accelerator, run.args.train
    out = Path(t.output_dir)
    state_dict = acc.get_state_dict(run.model)  # gathers FSDP shards; a plain state dict otherwise
    unwrapped = acc.unwrap_model(run.model)
    if type(unwrapped) is not QKVShareForCausalLM:
        # FSDP2 swaps the class for a generated subclass (FSDPQKVShareForCausalLM, defined in torch's FSDP module):
        # save_pretrained would copy torch's files as the model code and name that class in auto_map. A weightless
        # model of the real class writes the directory instead; the weights come from `state_dict`.
        with torch.device("meta"):
            plain = QKVShareForCausalLM(run.config)
        plain.generation_config = unwrapped.generation_config
        unwrapped = plain
    # A gathered FSDP state dict holds tied weights (the LM head) as separate, equal copies, which save_pretrained's
    # storage-based dedupe does not see: keep only the source, as an unsharded save does.
    for target, source in unwrapped.all_tied_weights_keys.items():
        if target in state_dict and source in state_dict and torch.equal(state_dict[target], state_dict[source]):
            del state_dict[target]
    failure = None
    if acc.is_main_process:
        try:
            unwrapped.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
            run.tokenizer.save_pretrained(out)
            resolved = run.args.to_dict() | {
                "block_size": run.block_size,
                "vocab_size": run.config.vocab_size,
                "num_processes": acc.num_processes,
                "global_batch_blocks": run.global_batch_blocks,
                "mixed_precision": acc.mixed_precision,
            }
            (out / "training_args.json").write_text(json.dumps(resolved, indent=2))
        except (OSError, RuntimeError) as err:
            failure = describe_write_error(err, out)
    failure = first_message(acc, failure)
    if failure is not None:
        found = list_checkpoints(out)
        kept = f"the last checkpoint {found[-1]} is intact" if found else "no checkpoint was written"
        raise CheckpointWriteError(
            f"could not write the final model to {out}: {failure}; {kept}. Free space (or fix the cause) and rerun "
            "the same command with --resume_from_checkpoint latest."
        )
    if acc.is_main_process:
        if t.sample_max_new_tokens:
            result["sample"] = generate_sample(out, t.sample_prompt, t.sample_max_new_tokens, t.seed, acc.device)
        (out / "final_metrics.json").write_text(json.dumps(result, indent=2))
        _print_summary(result, out)
        if t.push_to_hub:
            api = HfApi()
            api.create_repo(t.hub_model_id, private=t.hub_private_repo, exist_ok=True)
            api.upload_folder(
                folder_path=str(out), repo_id=t.hub_model_id, ignore_patterns=[f"{s}/*" for s in RUN_SUBDIRS]
            )
    acc.wait_for_everyone()


def generate_sample(model_dir: Path, prompt: str, max_new_tokens: int, seed: int, device: Any) -> str:
    """Load the saved directory as a user would and sample a continuation (top-k 40, temperature 0.8)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    torch.manual_seed(seed)
    output = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=True,
        top_k=40,
        temperature=0.8,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(output[0], skip_special_tokens=True)


def _print_header(run: Run) -> None:
    c, t = run.config, run.args.train
    n_train = len(run.train_data.blocks) if isinstance(run.train_data, InMemoryTrainData) else "streamed"
    print(
        f"qkvshare train: {c.variant} model, {count_parameters(run.accelerator.unwrap_model(run.model)):,} parameters "
        f"({c.num_hidden_layers} layers, d={c.hidden_size}, {c.num_attention_heads} heads, vocab {c.vocab_size}); "
        f"{run.accelerator.num_processes} process(es) on {run.accelerator.device}; {n_train} train blocks, "
        f"{len(run.val_blocks)} validation blocks of {run.block_size} tokens; global batch {run.global_batch_blocks} "
        f"blocks; steps {run.start_step} -> {t.max_steps}"
        + (
            f"; distilling from {run.args.model.teacher} (T={t.distill_temperature})" if run.teacher is not None else ""
        ),
        flush=True,
    )


def _print_summary(result: dict[str, Any], out: Path) -> None:
    kv = result["kv_cache_bytes_per_token"]
    # Against the teacher where there is one (a converted GQA model's source caches fewer heads than QKV of its shape).
    reference, what = result.get("teacher_kv_cache_bytes_per_token"), "the teacher"
    if reference is None:
        reference, what = result["qkv_kv_cache_bytes_per_token"], "QKV of the same shape"
    lines = [
        f"validation perplexity: {result['val_perplexity']:.2f} (loss {result['val_loss']:.4f} over "
        f"{result['val_tokens']:,} tokens)"
        + (f", KL to the teacher {result['val_kl']:.4f} per token" if result.get("val_kl") is not None else ""),
        f"KV cache per token (16-bit): {kv:,} bytes for {result['variant']} vs {reference:,} bytes for {what} "
        f"({100 * (1 - kv / reference):.1f}% smaller)",
    ]
    if "sample" in result:
        lines.append(f"sample:\n{result['sample']}")
    lines.append(f"model directory: {out.resolve()}")
    print("\n".join(lines), flush=True)


def resume_command(argv: list[str]) -> str:
    """`qkvshare train` with `argv`, its --resume_from_checkpoint replaced by `latest`."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--resume_from_checkpoint":
            skip = True
        elif not item.startswith("--resume_from_checkpoint="):
            kept.append(item)
    return shlex.join(["qkvshare", "train", *kept, "--resume_from_checkpoint", "latest"])


__all__ = [
    "train",
    "setup",
    "evaluate",
    "train_step",
    "build_optimizer",
    "TrainingDiverged",
    "TrainingInterrupted",
]
