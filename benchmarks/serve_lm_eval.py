"""lm-eval against `qkvshare serve` (local-completions) next to `qkvshare eval` (lm-eval's HF model), side by side.

    python benchmarks/serve_lm_eval.py                       # a random tiny Q-K=V model, the offline fixtures, 5-shot
    python benchmarks/serve_lm_eval.py --model_dir outputs/cpu-small --limit 8

Not part of CI. `qkvshare eval MODEL --data_dir qkvshare/evaluation/fixtures` scores the five tasks with lm-eval's
`HFLM`; then `qkvshare serve MODEL` is started (one `generate()` at a time, then with `--continuous_batching`) and
lm-eval's `local-completions` model scores the same tasks through it (loglikelihood requests: echo + logprobs),
with the model's own tokenizer read locally (`tokenizer=MODEL,tokenizer_backend=huggingface`) and
`max_length` = the model's positions. Prints acc and acc_norm per task for the three runs, and the largest
difference of a request's loglikelihood between lm-eval's HF model (as `qkvshare eval` builds it, with logged
samples) and each server. Everything offline (HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1). Without `--model_dir`, a tiny Q-K=V model
with 4,096 positions and a byte-level BPE tokenizer trained on the fixtures is written to a temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASKS = ["hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", default=None, help="a QKVShare model directory (default: a random tiny one)")
    p.add_argument("--num_fewshot", type=int, default=5)
    p.add_argument("--limit", type=int, default=None, help="examples per task (default: all of the fixtures)")
    p.add_argument("--output", default=None, help="also write the results as JSON here")
    return p.parse_args(argv)


def write_tiny_model(path: Path) -> None:
    import torch

    from qkvshare import QKVShareConfig, QKVShareForCausalLM
    from qkvshare.evaluation.tasks import FIXTURES_DIR
    from qkvshare.train.tokenizer import train_bpe_tokenizer

    corpus = [line for f in sorted(FIXTURES_DIR.glob("*.jsonl")) for line in f.read_text().splitlines()]
    tok = train_bpe_tokenizer(corpus, 1024, model_max_length=4096)
    config = QKVShareConfig.from_preset(
        "tiny", variant="Q-K=V", vocab_size=len(tok), max_position_embeddings=4096, eos_token_id=tok.eos_token_id
    )
    torch.manual_seed(0)
    QKVShareForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def scores(results: dict) -> dict[str, dict[str, float]]:
    return {
        task: {m: results[task][f"{m},none"] for m in ("acc", "acc_norm") if f"{m},none" in results[task]}
        for task in TASKS
    }


def evaluate(model: str, model_args: str, args: argparse.Namespace) -> dict:
    """lm-eval's `simple_evaluate` on the offline fixtures, with the samples logged."""
    from lm_eval import simple_evaluate

    from qkvshare.evaluation.harness import task_manager
    from qkvshare.evaluation.tasks import FIXTURES_DIR, check_offline_data, offline_folders, offline_group_config

    group = offline_group_config(check_offline_data(FIXTURES_DIR, TASKS, args.num_fewshot))
    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[group],
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        batch_size=8,
        log_samples=True,
        task_manager=task_manager(offline_folders(TASKS)),
        random_seed=0,
        numpy_random_seed=1234,
        torch_random_seed=1234,
        fewshot_random_seed=1234,
    )


def loglikelihoods(results: dict) -> list[float]:
    """Every loglikelihood request's value, in lm-eval's order (task, document, choice)."""
    samples = results["samples"]
    return [float(resp[0]) for task in TASKS for sample in samples[task] for resp in sample["filtered_resps"]]


def served(model_dir: Path, flags: list[str], args: argparse.Namespace, work: Path) -> dict:
    """lm-eval's local-completions against `qkvshare serve MODEL_DIR FLAGS`."""
    from qkvshare import QKVShareConfig
    from qkvshare.serve import serve_in_subprocess

    positions = QKVShareConfig.from_pretrained(model_dir).max_position_embeddings
    flags = ["--device", "cpu", "--dtype", "float32", *flags]
    with serve_in_subprocess(model_dir, flags, work / "serve.log") as (url, _):
        model_args = (
            f"model={model_dir},base_url={url}/v1/completions,tokenizer={model_dir},tokenizer_backend=huggingface,"
            f"max_length={positions},max_retries=1"
        )
        return evaluate("local-completions", model_args, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from qkvshare.evaluation.tasks import FIXTURES_DIR
    from qkvshare_cli import main as cli

    with tempfile.TemporaryDirectory(prefix="qkvshare-serve-lm-eval-") as tmp:
        work = Path(tmp)
        model_dir = Path(args.model_dir) if args.model_dir else work / "tiny-qkev-4k"
        if not args.model_dir:
            write_tiny_model(model_dir)
        argv = ["eval", str(model_dir), "--data_dir", str(FIXTURES_DIR), "--num_fewshot", str(args.num_fewshot)]
        argv += ["--output_dir", str(work / "eval"), "--device", "cpu", "--dtype", "float32"]
        argv += ["--limit", str(args.limit)] if args.limit else []
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli(argv) == 0
        hf = scores(json.loads(next((work / "eval").glob("*/results.json")).read_text())["results"])
        reference = loglikelihoods(evaluate("hf", f"pretrained={model_dir},dtype=float32,device=cpu", args))
        results = {
            "serve, generate()": served(model_dir, [], args, work),
            "serve, continuous batching": served(model_dir, ["--continuous_batching"], args, work),
        }
    runs = {"qkvshare eval (HFLM)": hf} | {name: scores(r["results"]) for name, r in results.items()}
    gaps = {}
    for name, result in results.items():
        values = loglikelihoods(result)
        assert len(values) == len(reference), name
        gaps[name] = max(abs(a - b) for a, b in zip(values, reference, strict=True))
    names = list(runs)
    print(
        f"\n{args.num_fewshot}-shot, offline fixtures, limit={args.limit or 'all'}; model: {args.model_dir or 'tiny'}\n"
    )
    print("| task | metric | " + " | ".join(names) + " |")
    print("|---|---|" + "---:|" * len(names))
    worst = 0.0
    for task in TASKS:
        for metric in hf[task]:
            values = [runs[name][task][metric] for name in names]
            worst = max(worst, max(abs(v - values[0]) for v in values))
            print(f"| {task} | {metric} | " + " | ".join(f"{v:.4f}" for v in values) + " |")
    print(f"\nlargest difference of a metric from qkvshare eval: {worst:.2e}")
    for name, gap in gaps.items():
        print(
            f"largest difference of one request's loglikelihood, {name} vs HFLM: {gap:.2e} ({len(reference)} requests)"
        )
    if args.output:
        Path(args.output).write_text(json.dumps({"scores": runs, "loglikelihood_gaps": gaps}, indent=2))
    return 0 if worst <= 1e-6 and max(gaps.values()) <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
