"""Stage (c)'s first steps from one saved model of stages (a)-(b), under several ways of training it, side by side:
does the KL to the source fall or rise? (`qkvshare convert --method transfer`'s distillation, issue 23.)

    python benchmarks/distill_first_steps.py --source qwen --stage_model STAGE --work OUT --steps 6 \
        --runs all without-o_proj centred

STAGE is a converted model directory (a conversion's `stage-model`, or one made with `--distill_tokens 0`); the text
is OUT/distill-train.jsonl and OUT/distill-validation.jsonl when there (copy a conversion's work files to compare
with its own run), else the embedded stdlib text's train and validation splits. Each run is stage (c) itself
(`qkvshare.convert.distill.run_distillation`: the convert defaults, bf16 where the device has it, the micro-batches
that fit, the divergence watch off) in OUT/RUN, stopped after `--steps` steps; its steps' losses are kept in
OUT/RUN-losses.json, so a run already made is not run again. Runs:
- `all`: every parameter (convert's default first run);
- `without-o_proj`: every parameter but the attention's output projections (convert's second run after a divergence);
- `centred`: every parameter, the output projections' steps centred (`DistillSettings.centre_output_projections`).
The table: each run's loss (KL to the source, nats per token, on that step's training blocks) by step; step 1's is
the same model on the same blocks for every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import knowledge_data as data  # noqa: E402
from convert_knowledge import source_dir  # noqa: E402

from qkvshare import QKVShareConfig  # noqa: E402
from qkvshare.analysis.common import markdown_table  # noqa: E402
from qkvshare.convert import distill as stage_c  # noqa: E402
from qkvshare.runtime import native_bf16  # noqa: E402
from qkvshare_settings.train import DistillSettings  # noqa: E402

RUNS = ("all", "without-o_proj", "centred")


class Enough(Exception):
    """Raised by the step hook after the steps asked for."""


class StepsWatch(stage_c.DivergenceWatch):
    """Stage (c)'s step hook here: records each step's loss in its file (never stops for a divergence) and stops the
    run after `steps` steps."""

    steps = 6

    def __call__(self, step: int, loss: float, model: object) -> None:
        self.losses = self.losses[: step - 1] + [loss]
        print(f"{self.path.name}: step {step}: {loss:.4f}", flush=True)
        if step >= self.steps:
            self.path.write_text(json.dumps(self.losses))
            raise Enough


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="smollm2, qwen, or a Llama-architecture model directory")
    p.add_argument("--stage_model", required=True, help="the converted model the runs start from")
    p.add_argument("--work", required=True, help="the runs' folder (and the text files, when there)")
    p.add_argument("--cache_dir", default=str(data.DEFAULT_CACHE))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--runs", nargs="*", default=list(RUNS), choices=RUNS)
    p.add_argument("--learning_rate", type=float, default=DistillSettings.learning_rate)
    p.add_argument("--tokens", type=int, default=262144, help="the run's budget: sets its schedule")
    return p.parse_args()


def settings_for(run: str, config: QKVShareConfig, base: DistillSettings) -> DistillSettings:
    if run == "without-o_proj":
        return dataclasses.replace(base, trainable_modules=stage_c.besides_output_projections(config))
    if run == "centred":
        return dataclasses.replace(base, centre_output_projections=True)
    return base


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from qkvshare.convert.data import documents
    from qkvshare.model_dir import load_source

    src, described = source_dir(args.source, Path(args.cache_dir))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(src)
    teacher = load_source(str(src))
    config = QKVShareConfig.from_pretrained(args.stage_model)
    bf16, why = native_bf16()
    print(f"{described}; bf16 mixed precision: {bf16} ({why})", flush=True)
    base = DistillSettings(tokens=args.tokens, learning_rate=args.learning_rate, bf16=bf16, save_steps=0)
    losses: dict[str, list[float]] = {}
    for run in args.runs:
        kept = work / f"{run}-losses.json"
        if kept.is_file() and len(json.loads(kept.read_text())) >= args.steps:
            losses[run] = json.loads(kept.read_text())[: args.steps]
            continue

        StepsWatch.steps = args.steps
        stage_c.DivergenceWatch = StepsWatch
        try:
            stage_c.run_distillation(
                Path(args.stage_model),
                str(src),
                documents("mixed", "train"),
                documents("mixed", "validation"),
                tokenizer,
                work,
                settings_for(run, config, base),
                teacher_model=teacher,
                run=run,
            )
        except Enough:
            pass
        losses[run] = json.loads(kept.read_text())
    header = ["run", *(f"step {i}" for i in range(1, args.steps + 1))]
    rows = [[run, *(f"{x:.3f}" for x in values)] for run, values in losses.items()]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
