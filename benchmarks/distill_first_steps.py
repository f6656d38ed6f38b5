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
- `centred`: every parameter, the output projections' steps centred (`DistillSettings.centre_output_projections`);
- `gradual`: every parameter, the tie made gradually (`GradualTie`): each tied layer's attention weights are its
  own plus (1 - a) times their difference from the source's (a frozen residual: q, o, and the source's key and value
  from the shared projection), a = step / `--tie_steps` up to 1, so step 1 is nearly the source and the model is
  the converted one (tied) from step `--tie_steps` on. Its losses before that step are not the tied model's;
- `gradual-warmup`: `gradual` with the learning rate's warmup as long as the tie's (`--tie_steps`);
- `gradual-outputs`: the blend on each tied layer's attention output instead: (1 - a) x the source layer's (frozen,
  on the same input) + a x the converted layer's;
- `relative`: every parameter, each weight's learning rate scaled down by its size (convert's
  `--distill_relative_learning_rates`).
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
import torch  # noqa: E402
from convert_knowledge import source_dir  # noqa: E402

from qkvshare import QKVShareConfig, QKVShareForCausalLM  # noqa: E402
from qkvshare.analysis.common import markdown_table  # noqa: E402
from qkvshare.convert import distill as stage_c  # noqa: E402
from qkvshare.runtime import native_bf16  # noqa: E402
from qkvshare.train import pretrain  # noqa: E402
from qkvshare_settings.train import DistillSettings  # noqa: E402

RUNS = ("all", "without-o_proj", "centred", "gradual", "gradual-warmup", "gradual-outputs", "relative")


class Enough(Exception):
    """Raised by the step hook after the steps asked for."""


class StepsWatch(stage_c.DivergenceWatch):
    """Stage (c)'s step hook here: records each step's loss in its file (never stops for a divergence) and stops the
    run after `steps` steps; tells the gradual run's blend (`tie`) each step."""

    steps = 6
    tie: GradualTie | None = None

    def __call__(self, step: int, loss: float, model: object) -> None:
        if self.tie is not None:
            self.tie.step(step)
        self.losses = self.losses[: step - 1] + [loss]
        print(f"{self.path.name}: step {step}: {loss:.4f}", flush=True)
        if step >= self.steps:
            self.path.write_text(json.dumps(self.losses))
            raise Enough


class GradualTie:
    """The `gradual` runs' blend with the source `teacher` (module docstring): installed on the student when the
    training loop loads it (`patch_training`), the source's share set before each step by `step`."""

    def __init__(self, teacher: object, tie_steps: int, outputs: bool = False) -> None:
        self.teacher, self.tie_steps = teacher, tie_steps
        self.outputs = outputs  # blend the attention outputs, not the weights
        self.residual_share = 1.0 - min(1.0, 1 / tie_steps)  # step 1's

    def step(self, step: int) -> None:
        """After step `step`: the share for the next one."""
        self.residual_share = 1.0 - min(1.0, (step + 1) / self.tie_steps)

    def install(self, model: object) -> None:
        """Blend every key/value-tied layer of `model` (`QKVShareConfig.is_kv_tied`) with the source's same layer."""
        sources = self.teacher.model.layers
        for i, layer in enumerate(model.model.layers):
            if model.config.is_kv_tied(i):
                (self._blend_outputs if self.outputs else self._blend_weights)(layer.self_attn, sources[i].self_attn)

    def _blend_outputs(self, attention: object, source: object) -> None:
        def hook(module, args, kwargs, output):
            c = self.residual_share
            if c <= 0:
                return output
            theirs = source(**{k: kwargs.get(k) for k in ("hidden_states", "position_embeddings", "attention_mask")})
            return ((1 - c) * output[0] + c * theirs[0], *output[1:])

        attention.register_forward_hook(hook, with_kwargs=True)

    def _blend_weights(self, attention: object, source: object) -> None:
        import torch.nn.functional as F

        def residual(theirs: torch.nn.Linear, ours: torch.nn.Linear) -> tuple:
            bias = None if theirs.bias is None else (theirs.bias - ours.bias).detach()
            return (theirs.weight - ours.weight).detach(), bias

        shared = attention.k_proj
        r_q, r_k, r_v = (
            residual(source.q_proj, attention.q_proj),
            residual(source.k_proj, shared),
            residual(source.v_proj, shared),
        )
        r_o = residual(source.o_proj, attention.o_proj)

        def project(hidden):
            c, states = self.residual_share, attention.k_proj(hidden)
            parts = [attention.q_proj(hidden), states, states]
            if c > 0:
                parts = [x + c * F.linear(hidden, *r) for x, r in zip(parts, (r_q, r_k, r_v), strict=True)]
            return tuple(x.view(*hidden.shape[:-1], -1, attention.head_dim).transpose(1, 2) for x in parts)

        def o_hook(linear, args, out):
            c = self.residual_share
            return out + c * F.linear(args[0], *r_o) if c > 0 else out

        attention.project = project
        attention.o_proj.register_forward_hook(o_hook)


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
    p.add_argument("--tie_steps", type=int, default=16, help="the gradual run's steps to the full tie")
    return p.parse_args()


def settings_for(run: str, config: QKVShareConfig, base: DistillSettings, tie_steps: int) -> DistillSettings:
    if run == "without-o_proj":
        return dataclasses.replace(base, trainable_modules=stage_c.besides_output_projections(config))
    if run == "gradual-warmup":
        return dataclasses.replace(base, warmup_steps=tie_steps)
    if run == "centred":
        return dataclasses.replace(base, centre_output_projections=True)
    if run == "relative":
        return dataclasses.replace(base, relative_learning_rates=True)
    return base


def patch_training(tie: GradualTie | None) -> None:
    """Point the training loop's student loading at this run's: `tie` installed on the student when it is loaded
    (the library's own loading without one)."""
    student = QKVShareForCausalLM
    if tie is not None:

        class Blended(QKVShareForCausalLM):
            @classmethod
            def from_pretrained(cls, *args, **kwargs):
                model = QKVShareForCausalLM.from_pretrained(*args, **kwargs)
                tie.install(model)
                return model

        student = Blended
    pretrain.QKVShareForCausalLM = student


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
        StepsWatch.tie = (
            GradualTie(teacher, args.tie_steps, run == "gradual-outputs") if run.startswith("gradual") else None
        )
        patch_training(StepsWatch.tie)
        stage_c.DivergenceWatch = StepsWatch
        try:
            stage_c.run_distillation(
                Path(args.stage_model),
                str(src),
                documents("mixed", "train"),
                documents("mixed", "validation"),
                tokenizer,
                work,
                settings_for(run, config, base, args.tie_steps),
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
