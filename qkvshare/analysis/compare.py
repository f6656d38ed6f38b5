"""`qkvshare compare`: pretrain several variants identically, then tabulate them as the paper's LM table.

Design notes
- Every variant is trained by the real entry point, `qkvshare.train.pretrain.main(argv)`, in this process, with
  the same flags: preset, data, block size, batch, steps, learning rate, seed (so the same initialisation seed and
  the same data order, which the trainer makes a pure function of the seed and step). Only `--variant` differs.
- The first variant trains the BPE tokenizer (unless `--tokenizer_name` is passed through); every later variant
  loads it from the first one's directory, so all see exactly the same token stream.
- Layout: `<output_dir>/runs/<variant>/` is the trainer's output directory (model, checkpoints, final_metrics.json);
  `<output_dir>/logs/<variant>.jsonl` holds the per-step training loss and time (from the trainer's `on_step`
  hook); `<output_dir>/compare_settings.json` records the shared flags.
- Resumable per variant: a finished variant (final_metrics.json present) is skipped; one with checkpoints resumes
  from the latest (`--resume_from_checkpoint latest`, exact: the trainer restores data position and RNG); one that
  died before its first checkpoint restarts. Rerunning with different shared flags is refused.
- Training tokens/s is the median over logged steps of tokens per step / step time (wall clock). Variants run one
  after the other, so on a shared machine load from other processes shows in it; the table also gives tokens per
  CPU-second of this process (summed over its threads), which such load barely moves. `qkvshare bench --sections
  train` measures training throughput with interleaved repetitions instead.
- Unknown flags are passed to the trainer verbatim (e.g. `--train_file`, `--config_overrides`, `--max_eval_samples`).
- `--position_types learned rope alibi` trains every variant once per position scheme (appended to the trainer's
  `--config_overrides` as `position_embedding_type=...`), in `runs/<variant>_<type>/`, and tabulates them in one
  table, rows labelled `Q-K=V [rope]`; "vs QKV" is then against QKV with the same positions. This tests the QV
  source's claim that K=V loses least when the position signal stays out of the values (RoPE, ALiBi).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from qkvshare.analysis.common import check_variants, default_variants, markdown_table
from qkvshare.analysis.plotting import line_plot
from qkvshare.configuration_qkvshare import QKVShareConfig
from qkvshare.train import train
from qkvshare_settings.compare import SHARED_TRAIN_FLAGS
from qkvshare_settings.conventions import CommandStopped, slug
from qkvshare_settings.train import parse_args as parse_train_args


def ordered_variants(preset: str, given: list[str] | None) -> list[str]:
    """The variants to train, checked against the preset: QKV first (the reference of the "vs QKV" column), then
    Q-K=V, Q=K-V, Q=K=V (the issue's order), then the others as given; default: `default_variants` of the preset.
    """
    base = QKVShareConfig.from_preset(preset)
    variants = given or default_variants(base, plus=False)
    first = ["QKV", "Q-K=V", "Q=K-V", "Q=K=V"]
    return check_variants(base, [v for v in first if v in variants] + [v for v in variants if v not in first])


def run_plan(preset: str, variants: list[str], position_types: list[str] | None) -> list[tuple[str, str, str | None]]:
    """(label, variant, position type) of every run; the label (`Q-K=V [alibi]`) names its row and, through `slug`,
    its directory. Without position types: one run per variant, labelled by the variant, with the preset's positions.
    Every (variant, position type) config is built here, so a combination the config refuses fails before training.
    """
    if not position_types:
        return [(v, v, None) for v in variants]

    for position_type in position_types:
        for variant in variants:
            QKVShareConfig.from_preset(preset, variant, position_embedding_type=position_type)
    return [(f"{v} [{p}]", v, p) for p in position_types for v in variants]


def with_position_type(train_args: list[str], position_type: str | None) -> list[str]:
    """The trainer flags with `position_embedding_type=<position_type>` added to `--config_overrides`."""
    if position_type is None:
        return train_args
    override, argv = f"position_embedding_type={position_type}", list(train_args)
    for i, arg in enumerate(argv):
        if arg == "--config_overrides" and i + 1 < len(argv):
            argv[i + 1] = f"{argv[i + 1]},{override}"
            return argv
        if arg.startswith("--config_overrides="):
            argv[i] = f"{arg},{override}"
            return argv
    return [*argv, "--config_overrides", override]


def shared_train_args(args: argparse.Namespace, passthrough: list[str]) -> list[str]:
    """The trainer flags every variant gets (everything except --output_dir, --variant and the tokenizer)."""
    shared = [item for name in SHARED_TRAIN_FLAGS for item in (f"--{name}", str(getattr(args, name)))]
    return [*shared, "--logging_steps", "1", "--report_to", "none", "--sample_max_new_tokens", "0", *passthrough]


def check_settings(output_dir: Path, settings: dict[str, Any]) -> None:
    """Record the shared flags; refuse to extend a comparison made with other ones."""
    path = output_dir / "compare_settings.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old["train_args"] != settings["train_args"]:
            raise ValueError(
                f"{output_dir} holds a comparison trained with other flags ({' '.join(old['train_args'])}); "
                "use a new --output_dir, or the same flags to resume it."
            )
        settings = old | {"variants": list(dict.fromkeys(old["variants"] + settings["variants"]))}
    output_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2) + "\n")


def _has_checkpoint(run_dir: Path) -> bool:
    root = run_dir / "checkpoints"
    return root.is_dir() and any((p / "trainer_state.json").is_file() for p in root.glob("checkpoint-*"))


class ComparisonStopped(CommandStopped):
    """A variant's training run stopped (its message says why); rerunning the same comparison resumes it."""

    label = ""

    def __init__(self, message: str, exit_status: int = 1):
        super().__init__(message)
        self.exit_status = exit_status


def train_variant(variant: str, run_dir: Path, log_path: Path, train_args: list[str], tokenizer: str | None) -> None:
    """Train (or resume, or skip) one variant with the trainer's flags `train_args` (`qkvshare train`'s, as text:
    the comparison passes them through); raises what `train` raises."""
    if (run_dir / "final_metrics.json").is_file():
        print(f"compare: {variant} already finished ({run_dir}); skipping", flush=True)
        return
    argv = [*train_args, "--output_dir", str(run_dir), "--variant", variant]
    if _has_checkpoint(run_dir):
        argv += ["--resume_from_checkpoint", "latest"]
        print(f"compare: resuming {variant} from its latest checkpoint", flush=True)
    elif run_dir.exists() and any(run_dir.iterdir()):
        argv += ["--overwrite_output_dir", "true"]  # died before its first checkpoint: start over
    if tokenizer and "--tokenizer_name" not in train_args and not _has_checkpoint(run_dir):
        argv += ["--tokenizer_name", tokenizer]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        last = [time.perf_counter(), time.process_time()]

        def on_step(step: int, loss: float, model: Any) -> None:
            now, cpu = time.perf_counter(), time.process_time()
            record = {"step": step, "loss": float(loss), "step_s": now - last[0], "cpu_s": cpu - last[1]}
            log.write(json.dumps(record) + "\n")
            log.flush()
            last[0], last[1] = now, cpu

        print(f"compare: training {variant} -> {run_dir}", flush=True)
        train(parse_train_args(argv), on_step=on_step)


def read_log(path: Path) -> dict[int, dict[str, float]]:
    """Per-step records; a resumed run replays steps after its checkpoint, and the last record of a step wins.

    The first logged step of a (re)start includes setup time, so its duration is dropped.
    """
    steps: dict[int, dict[str, float]] = {}
    if not path.is_file():
        return steps
    previous = None
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        fresh = previous is None or rec["step"] != previous + 1
        steps[rec["step"]] = rec | ({"step_s": math.nan, "cpu_s": math.nan} if fresh else {})
        previous = rec["step"]
    return steps


def collect(
    output_dir: Path, variants: list[str], tokens_per_step: int, position_types: dict[str, str | None] | None = None
) -> list[dict[str, Any]]:
    """One row per finished run: metrics of the final model, parameters, cache cut, training speed.

    `variants` are the run labels; `position_types` maps a label to its position type (runs of `--position_types`),
    and "vs QKV" (`ppl_change`) is then against the QKV run with the same positions.
    """
    position_types = position_types or {}
    rows = []
    for v in variants:
        run_dir = output_dir / "runs" / slug(v)
        metrics_path = run_dir / "final_metrics.json"
        if not metrics_path.is_file():
            continue
        m = json.loads(metrics_path.read_text())
        cfg = QKVShareConfig.from_pretrained(run_dir)
        qkv_bytes = cfg.qkv_cache_bytes_per_token(1)
        log = read_log(output_dir / "logs" / f"{slug(v)}.jsonl")
        times = [r["step_s"] for r in log.values() if not math.isnan(r["step_s"])]
        tps = tokens_per_step / statistics.median(times) if times else m.get("tokens_per_second")
        cpu = [r["cpu_s"] for r in log.values() if not math.isnan(r.get("cpu_s", math.nan))]
        tpcs = tokens_per_step / statistics.median(cpu) if cpu else math.nan
        rows.append(
            {
                "variant": v,
                "position_type": position_types.get(v) or cfg.position_embedding_type,
                "val_perplexity": m["val_perplexity"],
                "val_loss": m["val_loss"],
                "val_tokens": m["val_tokens"],
                "tokens_seen": m["tokens_seen"],
                "parameters": m["parameters"],
                "kv_cache_cut": 1 - cfg.kv_cache_bytes_per_token(1) / qkv_bytes,
                "train_tokens_per_s": tps,
                "train_tokens_per_cpu_s": tpcs,
                "loss_curve": [[s, log[s]["loss"]] for s in sorted(log)],
            }
        )
    for r in rows:
        same = [q for q in rows if q["position_type"] == r["position_type"]] if position_types else rows
        qkv = [f"QKV [{r['position_type']}]"] if position_types else ["QKV"]
        ref = next((q for q in same if q["variant"] in qkv), same[0])
        r["ppl_change"] = r["val_perplexity"] / ref["val_perplexity"] - 1
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    bases = [r["variant"].split(" [")[0] for r in rows]  # labels of --position_types runs: "Q-K=V [alibi]"
    ref = "QKV" if "QKV" in bases else bases[0]
    table = [
        [
            r["variant"],
            round(r["val_perplexity"], 3),
            "0" if r["ppl_change"] == 0 else f"{r['ppl_change']:+.1%}",
            f"{r['kv_cache_cut']:.1%}",
            r["parameters"],
            round(r["train_tokens_per_s"] or math.nan, 1),
            round(r["train_tokens_per_cpu_s"], 1),
            r["tokens_seen"],
        ]
        for r in rows
    ]
    return markdown_table(
        [
            "variant",
            "val PPL",
            f"vs {ref}",
            "KV-cache cut",
            "params",
            "train tokens/s (wall)",
            "train tokens/CPU-s",
            "train tokens",
        ],
        table,
    )


def plot_losses(rows: list[dict[str, Any]], path: Path) -> Path:
    """Training loss (moving average over ~2% of the steps) against step, one line per variant."""
    series = {}
    for r in rows:
        steps = [s for s, _ in r["loss_curve"]]
        losses = [loss for _, loss in r["loss_curve"]]
        k = max(1, len(losses) // 50)
        smooth = [statistics.fmean(losses[max(0, i - k + 1) : i + 1]) for i in range(len(losses))]
        series[f"{r['variant']} (val ppl {r['val_perplexity']:.2f})"] = (steps, smooth)
    return line_plot(path, series, "optimizer step", "training loss (moving average)", "Pretraining loss")


def run_compare(parsed: tuple[argparse.Namespace, list[str]]) -> list[dict[str, Any]]:
    """`qkvshare compare` with its settings (its own, and the flags passed to the trainer): train every variant that
    has not finished (resuming those that stopped), then write and print the table; returns its rows. Bad settings
    are a `ValueError` before any training; a training run that stops is a `ComparisonStopped`."""
    args, passthrough = parsed
    output_dir = Path(args.output_dir)
    variants = ordered_variants(args.preset, args.variants)
    plan = run_plan(args.preset, variants, args.position_types)
    train_args = shared_train_args(args, passthrough)
    if not args.table_only:
        check_settings(output_dir, {"train_args": train_args, "variants": [label for label, _, _ in plan]})

    if not args.table_only:
        tokenizer = None
        for label, v, position_type in plan:
            run_dir = output_dir / "runs" / slug(label)
            log_path = output_dir / "logs" / f"{slug(label)}.jsonl"
            try:
                train_variant(v, run_dir, log_path, with_position_type(train_args, position_type), tokenizer)
            except CommandStopped as err:
                raise ComparisonStopped(
                    f"training {label} failed (exit {err.exit_status}: {err}); rerun the same command to resume.",
                    err.exit_status,
                ) from err
            tokenizer = tokenizer or str(run_dir)

    tokens_per_step = args.per_device_train_batch_size * args.block_size
    settings_path = output_dir / "compare_settings.json"
    if settings_path.is_file():  # the trainer's global batch (gradient accumulation is passed through)
        ta = json.loads(settings_path.read_text())["train_args"]
        if "--gradient_accumulation_steps" in ta:
            tokens_per_step *= int(ta[ta.index("--gradient_accumulation_steps") + 1])
    labels = [label for label, _, _ in plan]
    rows = collect(output_dir, labels, tokens_per_step, {label: p for label, _, p in plan if p is not None})
    if not rows:
        raise ComparisonStopped(f"no finished variant under {output_dir / 'runs'}.")
    table = format_table(rows)
    header = (
        f"### Pretraining comparison: preset {args.preset}, {args.max_steps} steps x "
        f"{tokens_per_step:,} tokens, seed {args.seed}"
    )
    text = f"{header}\n\n{table}\n"
    print(text)
    (output_dir / "compare.md").write_text(text)
    (output_dir / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot = plot_losses(rows, output_dir / "loss_curves.png")
    print(f"wrote {output_dir / 'compare.md'}, compare.json, {plot.name}")
    return rows
