"""`qkvshare train`: pretrain a QKVShare model with Accelerate, from one CPU core to many GPUs.

    qkvshare train configs/cpu-small.yaml                       # the README's 10-minute CPU run
    accelerate launch -m qkvshare.train configs/paper-300m/Q-K=V.yaml
    accelerate launch --config_file configs/accelerate/fsdp.yaml -m qkvshare.train configs/paper-1.2b/QKV.yaml

Design notes
- One file, small named steps: `setup` (every check, before any heavy work), `build_optimizer`, `train_step`,
  `evaluate`, `save_final_model`. Bad input raises `TrainingSetupError`; `main` prints it and returns 2.
- The loss is computed here, not by the model: inputs are block[:-1], targets block[1:] of packed blocks (see
  `data.py`), so no padding exists and every target token counts once. Validation is token-weighted over ranks.
- Gradient accumulation is explicit (`no_sync` on all but the last micro-step). Every rank holds an equal number
  of equal-length blocks, so the DDP average of per-rank mean losses is the global mean: two ranks with batch 2
  produce the gradients of one process with batch 4.
- Exact resume: LR is a pure function of the step (`schedule.get_lr`), the data a pure function of (seed,
  step), and model, optimizer, scaler and RNG states come back through `accelerator.load_state`.
- A non-finite loss is detected (collectively, before the optimizer step) and stops the run, leaving the last
  checkpoint as it was.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from qkvshare import QKVShareConfig, QKVShareForCausalLM

from .args import Arguments, TrainingSetupError, check_args, parse_args, parse_config_overrides
from .checkpoint import check_compatible, list_checkpoints, read_state, resolve_resume_path, save_checkpoint
from .data import (
    BlockSchedule,
    InMemoryTrainData,
    PackedBlocks,
    StreamingTrainData,
    load_corpus,
    token_fingerprint,
    tokenize_documents,
)
from .model import build_config, count_parameters, fit_vocab, flops_per_token, peak_flops_per_device
from .schedule import get_lr
from .tokenizer import load_tokenizer, padded_vocab_size, train_bpe_tokenizer

# Files of a run inside output_dir that are not part of the Hugging Face model directory.
RUN_SUBDIRS = ("checkpoints", "runs")


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the step and the checkpoint to go back to."""


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

    @property
    def global_batch_blocks(self) -> int:
        t = self.args.train
        return t.per_device_train_batch_size * t.gradient_accumulation_steps * self.accelerator.num_processes

    def state(self, step: int) -> dict[str, Any]:
        """`trainer_state.json` of a checkpoint at `step`."""
        return {
            "step": step,
            "tokens_seen": self.tokens_seen,
            "block_size": self.block_size,
            "global_batch_blocks": self.global_batch_blocks,
            "seed": self.args.train.seed,
            "data_fingerprint": self.data_fingerprint,
            "model_config": self.config.to_dict(),
            "args": self.args.to_dict(),
        }


# --------------------------------------------------------------------------------------------------------------
# Setup: every check before any heavy work
# --------------------------------------------------------------------------------------------------------------
def make_accelerator(args: Arguments) -> Any:
    from accelerate import Accelerator

    t = args.train
    trackers = [name.strip() for name in t.report_to.split(",") if name.strip() and name.strip() != "none"]
    precision = "bf16" if t.bf16 else "fp16" if t.fp16 else "no"
    return Accelerator(
        mixed_precision=precision,
        cpu=t.use_cpu,
        log_with=trackers or None,
        project_dir=str(Path(t.output_dir) / "runs"),
    )


def check_output_dir(args: Arguments) -> Path | None:
    """Refuse to mix two runs in one directory; return the checkpoint to resume from, if any."""
    t = args.train
    out = Path(t.output_dir)
    if t.resume_from_checkpoint:
        return resolve_resume_path(t.resume_from_checkpoint, t.output_dir)
    if out.exists() and any(out.iterdir()) and not t.overwrite_output_dir:
        found = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise TrainingSetupError(
            f"--output_dir {out} already holds another run ({found}); pass --resume_from_checkpoint latest to "
            "continue it, --overwrite_output_dir to start over there, or choose a new --output_dir."
        )
    return None


def setup(args: Arguments) -> Run:
    """Check the arguments, load data and tokenizer, build model and optimizer, and restore a checkpoint."""
    check_args(args)
    accelerator = make_accelerator(args)
    resume_path = check_output_dir(args)
    accelerator.wait_for_everyone()  # every rank has looked at output_dir before the main process writes to it
    if accelerator.distributed_type == "DEEPSPEED" and args.train.gradient_accumulation_steps > 1:
        raise TrainingSetupError(
            "DeepSpeed steps inside backward, which this loop's explicit gradient accumulation does not fit; "
            "use --gradient_accumulation_steps 1 (raise the per-device batch) or the FSDP config for sharding."
        )
    m, d, t = args.model, args.data, args.train
    overrides = parse_config_overrides(m.config_overrides)
    config = build_config(m.preset, m.variant, overrides)
    block_size = d.block_size or min(1024, config.max_position_embeddings)
    if block_size > config.max_position_embeddings:
        raise TrainingSetupError(
            f"--block_size {block_size} exceeds the model's max_position_embeddings={config.max_position_embeddings}; "
            f"lower --block_size or raise it with --config_overrides max_position_embeddings={block_size}."
        )
    if d.streaming and not m.tokenizer_name and resume_path is None:
        raise TrainingSetupError(
            "a streamed dataset needs --tokenizer_name (e.g. gpt2): BPE training reads local data."
        )

    if accelerator.is_main_process and t.overwrite_output_dir and resume_path is None:
        for sub in RUN_SUBDIRS:  # stale checkpoints must not mix with the new run's
            shutil.rmtree(Path(t.output_dir) / sub, ignore_errors=True)
    accelerator.wait_for_everyone()
    rank, world = accelerator.process_index, accelerator.num_processes
    corpus = load_corpus(d, rank=rank, world_size=world, seed=t.seed)

    # Tokenizer: the checkpoint's when resuming, else the named one, else a BPE trained by the main process.
    if resume_path is not None:
        tokenizer = load_tokenizer(str(resume_path))
    elif m.tokenizer_name:
        tokenizer = load_tokenizer(m.tokenizer_name)
    else:
        with accelerator.main_process_first():
            if accelerator.is_main_process:
                vocab = m.tokenizer_vocab_size or config.vocab_size
                train_bpe_tokenizer(corpus.train, vocab).save_pretrained(t.output_dir)
            tokenizer = load_tokenizer(t.output_dir)
    fit_vocab(config, len(tokenizer), padded_vocab_size(tokenizer), "vocab_size" in overrides)
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id

    global_batch = t.per_device_train_batch_size * t.gradient_accumulation_steps * world
    saved = read_state(resume_path) if resume_path is not None else None
    if saved is not None:
        current = {"model_config": config.to_dict(), "block_size": block_size, "global_batch_blocks": global_batch,
                   "seed": t.seed}  # fmt: skip
        check_compatible(saved, current, resume_path)

    # Data: tokenize, pack, check there is at least one block on each side.
    val_tokens = tokenize_documents(tokenizer, corpus.validation)
    val_blocks = PackedBlocks(val_tokens, block_size, d.max_eval_samples)
    if len(val_blocks) == 0:
        raise TrainingSetupError(
            f"the validation split has {len(val_tokens)} tokens, fewer than one block of {block_size + 1}; "
            "lower --block_size, raise --validation_split_percentage or give a larger --validation_file."
        )
    fingerprint = None
    if corpus.streaming:
        train_data = StreamingTrainData(corpus.train, tokenizer, d.text_column, block_size,
                                        t.per_device_train_batch_size, t.gradient_accumulation_steps)  # fmt: skip
    else:
        train_tokens = tokenize_documents(tokenizer, corpus.train)
        blocks = PackedBlocks(train_tokens, block_size, d.max_train_samples)
        if len(blocks) == 0:
            raise TrainingSetupError(
                f"the training corpus has {len(train_tokens)} tokens, fewer than one block of {block_size + 1}; "
                "lower --block_size or add data."
            )
        fingerprint = token_fingerprint(blocks.tokens[: len(blocks) * block_size + 1].numpy())
        if saved is not None and saved.get("data_fingerprint") != fingerprint:
            raise TrainingSetupError(
                f"checkpoint {resume_path} was trained on other data (token fingerprint {saved.get('data_fingerprint')}"
                f", now {fingerprint}); resume with the same data arguments."
            )
        schedule = BlockSchedule(len(blocks), t.seed, t.per_device_train_batch_size, t.gradient_accumulation_steps,
                                 world, rank)  # fmt: skip
        train_data = InMemoryTrainData(blocks, schedule)

    # Model and optimizer.
    from transformers import set_seed

    set_seed(t.seed)
    if m.attn_implementation:
        model = QKVShareForCausalLM._from_config(config, attn_implementation=m.attn_implementation)
    else:
        model = QKVShareForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    if t.gradient_checkpointing:
        model.activation_checkpointing_enable()  # transformers 5 name of gradient_checkpointing_enable
    fpt = flops_per_token(model, config, block_size)
    optimizer = build_optimizer(model, args)
    model, optimizer = accelerator.prepare(model, optimizer)

    start_step, tokens_seen = 0, 0
    if saved is not None:
        accelerator.load_state(str(resume_path))
        start_step, tokens_seen = saved["step"], saved["tokens_seen"]
    return Run(args, accelerator, config, tokenizer, model, optimizer, train_data, val_blocks, block_size, start_step,
               tokens_seen, fingerprint, fpt, peak_flops_per_device(accelerator.device, t.peak_tflops))  # fmt: skip


def build_optimizer(model: torch.nn.Module, args: Arguments) -> torch.optim.AdamW:
    """AdamW with weight decay on weight matrices only: not on norms, biases or embeddings (unless asked)."""
    t = args.train
    embeddings = {id(mod.weight) for mod in model.modules() if isinstance(mod, torch.nn.Embedding)}
    decay, no_decay = [], []
    for p in {id(p): p for p in model.parameters() if p.requires_grad}.values():  # tied weights once
        matrix = p.ndim >= 2 and id(p) not in embeddings
        (decay if matrix or t.decay_norms_biases_embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon)


# --------------------------------------------------------------------------------------------------------------
# Loop
# --------------------------------------------------------------------------------------------------------------
def next_token_loss(model: Any, blocks: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of predicting block[1:] from block[:-1] (fp32 logits); blocks hold no padding."""
    logits = model(input_ids=blocks[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), blocks[:, 1:].flatten(), reduction=reduction)


def train_step(run: Run, step: int) -> tuple[float, float]:
    """One optimizer step (all micro-steps). Returns (mean loss over ranks, grad norm); raises on a non-finite loss."""
    acc, t = run.accelerator, run.args.train
    lr = get_lr(step, peak_lr=t.learning_rate, warmup_steps=t.warmup_steps, max_steps=t.max_steps,
                min_lr_ratio=t.min_lr_ratio)  # fmt: skip
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.model.train()
    loss_sum = torch.zeros((), device=acc.device)
    accumulation = t.gradient_accumulation_steps
    for micro in range(accumulation):
        blocks = run.train_data.batch(step, micro).to(acc.device)
        sync = micro == accumulation - 1
        with nullcontext() if sync else acc.no_sync(run.model):
            loss = next_token_loss(run.model, blocks)
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
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.tokens_seen += run.global_batch_blocks * run.block_size
    return mean_loss, grad_norm


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Token-weighted validation loss and perplexity over all validation blocks, split across ranks.

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
    totals = torch.zeros(2, dtype=torch.float64, device=acc.device)  # (sum of token losses, token count)
    for start in range(0, per_rank, bs):
        blocks = run.val_blocks.stack(padded[start : start + bs]).to(acc.device)
        w = torch.tensor(weights[start : start + bs], device=acc.device, dtype=torch.float64)
        per_block = next_token_loss(run.model, blocks, reduction="none").view(len(blocks), -1).double().sum(-1)
        totals[0] += (per_block * w).sum()
        totals[1] += w.sum() * run.block_size
    totals = acc.reduce(totals, reduction="sum")
    loss = (totals[0] / totals[1]).item()
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0)), "eval/tokens": int(totals[1].item())}


def train(args: Arguments, on_step: Callable[[int, float, Any], None] | None = None) -> dict[str, Any]:
    """Run the whole pretraining and return the final metrics. `on_step(step, loss, model)` is a test hook called
    after each optimizer step (and its checkpoint, if any)."""
    run = setup(args)
    acc, t = run.accelerator, args.train
    if acc.is_main_process:
        _print_header(run)
    hparams = {k: v for k, v in args.to_dict().items() if isinstance(v, int | float | str | bool)}
    acc.init_trackers(t.run_name or "qkvshare", config=hparams | {"variant": run.config.variant})

    bar = tqdm(total=t.max_steps, initial=run.start_step, disable=t.disable_tqdm or not acc.is_local_main_process,
               desc="train", dynamic_ncols=True)  # fmt: skip
    window_losses, window_time, window_tokens = [], 0.0, 0
    metrics: dict[str, Any] = {}
    for step in range(run.start_step, t.max_steps):
        started = time.perf_counter()
        loss, grad_norm = train_step(run, step)
        window_time += time.perf_counter() - started
        window_tokens += run.global_batch_blocks * run.block_size
        window_losses.append(loss)
        done = step + 1
        bar.update(1)
        if done % t.logging_steps == 0 or done == t.max_steps:
            tokens_per_s = window_tokens / max(window_time, 1e-9)
            metrics = {"train/loss": sum(window_losses) / len(window_losses), "train/grad_norm": grad_norm,
                       "train/lr": run.optimizer.param_groups[0]["lr"], "train/tokens_per_second": tokens_per_s,
                       "train/tokens_seen": run.tokens_seen}  # fmt: skip
            if run.peak_flops:
                metrics["train/mfu"] = tokens_per_s * run.flops_per_token / (run.peak_flops * acc.num_processes)
            acc.log(metrics, step=done)
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", lr=f"{metrics['train/lr']:.2e}",
                            tok_s=f"{tokens_per_s:,.0f}")  # fmt: skip
            window_losses, window_time, window_tokens = [], 0.0, 0
        if done % t.eval_steps == 0 and done != t.max_steps:
            evaluation = evaluate(run)
            acc.log(evaluation, step=done)
            if acc.is_main_process:
                bar.write(
                    f"step {done}: val loss {evaluation['eval/loss']:.4f}, ppl {evaluation['eval/perplexity']:.2f}"
                )
        if t.save_steps and done % t.save_steps == 0:
            save_checkpoint(acc, t.output_dir, done, run.state(done), run.tokenizer, t.save_total_limit)
        if on_step is not None:
            on_step(done, loss, run.model)
    bar.close()

    final = evaluate(run)
    acc.log(final, step=t.max_steps)
    result = {"step": t.max_steps, "tokens_seen": run.tokens_seen, "train_loss": metrics.get("train/loss"),
              "val_loss": final["eval/loss"], "val_perplexity": final["eval/perplexity"],
              "val_tokens": final["eval/tokens"], "tokens_per_second": metrics.get("train/tokens_per_second"),
              "mfu": metrics.get("train/mfu"), "flops_per_token": run.flops_per_token, "variant": run.config.variant,
              "parameters": count_parameters(acc.unwrap_model(run.model)),
              "kv_cache_bytes_per_token": run.config.kv_cache_bytes_per_token(),
              "qkv_kv_cache_bytes_per_token": run.config.qkv_cache_bytes_per_token()}  # fmt: skip
    save_final_model(run, result)
    acc.end_training()
    return result


# --------------------------------------------------------------------------------------------------------------
# End product
# --------------------------------------------------------------------------------------------------------------
def save_final_model(run: Run, result: dict[str, Any]) -> None:
    """Write the Hugging Face model directory (config with auto_map, code, safetensors, tokenizer, args, metrics),
    reload it from disk to generate the closing sample, and push it if asked."""
    acc, t = run.accelerator, run.args.train
    out = Path(t.output_dir)
    state_dict = acc.get_state_dict(run.model)  # gathers FSDP shards; a plain state dict otherwise
    unwrapped = acc.unwrap_model(run.model)
    if acc.is_main_process:
        unwrapped.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        run.tokenizer.save_pretrained(out)
        resolved = run.args.to_dict() | {"block_size": run.block_size, "vocab_size": run.config.vocab_size,
                                         "num_processes": acc.num_processes,
                                         "global_batch_blocks": run.global_batch_blocks,
                                         "mixed_precision": acc.mixed_precision}  # fmt: skip
        (out / "training_args.json").write_text(json.dumps(resolved, indent=2))
        if t.sample_max_new_tokens:
            result["sample"] = generate_sample(out, t.sample_prompt, t.sample_max_new_tokens, t.seed, acc.device)
        (out / "final_metrics.json").write_text(json.dumps(result, indent=2))
        _print_summary(result, out)
        if t.push_to_hub:
            from huggingface_hub import HfApi

            api = HfApi()
            api.create_repo(t.hub_model_id, private=t.hub_private_repo, exist_ok=True)
            api.upload_folder(
                folder_path=str(out), repo_id=t.hub_model_id, ignore_patterns=[f"{s}/*" for s in RUN_SUBDIRS]
            )
    acc.wait_for_everyone()


def generate_sample(model_dir: Path, prompt: str, max_new_tokens: int, seed: int, device: Any) -> str:
    """Load the saved directory as a user would and sample a continuation (top-k 40, temperature 0.8)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    torch.manual_seed(seed)
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                            pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    return tokenizer.decode(output[0], skip_special_tokens=True)


def _print_header(run: Run) -> None:
    c, t = run.config, run.args.train
    n_train = len(run.train_data.blocks) if isinstance(run.train_data, InMemoryTrainData) else "streamed"
    print(
        f"qkvshare train: {c.variant} model, {count_parameters(run.accelerator.unwrap_model(run.model)):,} parameters "
        f"({c.num_hidden_layers} layers, d={c.hidden_size}, {c.num_attention_heads} heads, vocab {c.vocab_size}); "
        f"{run.accelerator.num_processes} process(es) on {run.accelerator.device}; {n_train} train blocks, "
        f"{len(run.val_blocks)} validation blocks of {run.block_size} tokens; global batch {run.global_batch_blocks} "
        f"blocks; steps {run.start_step} -> {t.max_steps}",
        flush=True,
    )


def _print_summary(result: dict[str, Any], out: Path) -> None:
    kv, qkv = result["kv_cache_bytes_per_token"], result["qkv_kv_cache_bytes_per_token"]
    lines = [
        f"validation perplexity: {result['val_perplexity']:.2f} (loss {result['val_loss']:.4f} over "
        f"{result['val_tokens']:,} tokens)",
        f"KV cache per token (16-bit): {kv:,} bytes for {result['variant']} vs {qkv:,} bytes for QKV of the same shape "
        f"({100 * (1 - kv / qkv):.1f}% smaller)",
    ]
    if "sample" in result:
        lines.append(f"sample:\n{result['sample']}")
    lines.append(f"model directory: {out.resolve()}")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None, on_step: Callable[[int, float, Any], None] | None = None) -> int:
    """Entry point of `qkvshare train` and `accelerate launch -m qkvshare.train`. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        train(parse_args(argv), on_step=on_step)
    except TrainingSetupError as err:
        print(f"qkvshare train: error: {err}", file=sys.stderr)
        return 2
    except TrainingDiverged as err:
        print(f"qkvshare train: stopped: {err}", file=sys.stderr)
        return 1
    return 0


__all__ = ["main", "train", "setup", "evaluate", "train_step", "build_optimizer", "TrainingDiverged"]
