"""Command-line and YAML arguments of `qkvshare train`, as typed dataclasses (standard library and PyYAML only).

Design notes
- Flag names follow transformers' `run_clm.py` / `TrainingArguments` wherever one exists (`--output_dir`,
  `--per_device_train_batch_size`, `--block_size`, `--config_overrides`, `--save_total_limit`, ...), so the
  command reads like any Hugging Face training script; the flags are built from the dataclasses the way
  transformers' `HfArgumentParser` builds them (`--bf16 [BOOL]`, `--output-dir` for `--output_dir`). QKVShare adds
  `--preset` and `--variant`.
- A YAML file can hold any of the flags (`qkvshare train recipe.yaml --max_steps 10`): its values become the
  parser's defaults, so flags given on the command line win. Unknown YAML keys are an error, not ignored. A recipe
  for several variants writes `{variant}` in its `output_dir` (`outputs/paper-300m-{variant}`): `parse_args`
  replaces it with `--variant` as given, so each variant trains into its own directory.
- `check_args` validates everything that needs neither data, model, torch nor transformers, so bad input fails in
  milliseconds; `parse_args` runs it. The trainer (`qkvshare.train.pretrain.setup`) runs it again for arguments
  built in code, with the checks that need transformers (config field names, flash-attention availability).
- Every parse error (an unknown flag, with the closest known one; a bad value; broken YAML, with its line) is a
  `TrainingSetupError`, which `qkvshare train` prints as one paragraph with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .conventions import HelpFormatter, add_dataclass_arguments, config_model_type
from .extras import extra_providing, install_command
from .overrides import format_overrides, parse_overrides


class TrainingSetupError(ValueError):
    """Bad input found before training starts; the message says what is wrong and how to fix it (some list the
    differences of a run line by line: printed as they are)."""

    preformatted = True


# --report_to names (accelerate's trackers) -> the module that must be importable for it
TRACKER_PACKAGES = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "trackio": "trackio",
    "comet_ml": "comet_ml",
    "mlflow": "mlflow",
    "clearml": "clearml",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
    "aim": "aim",
}
# --attn_implementation names that need no optional package
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")
# ... and those that need flash-attn (and a CUDA GPU): the trainer checks that it is there
FLASH_ATTENTION_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
VARIANT_PLACEHOLDER = "{variant}"  # in --output_dir: replaced by --variant
# The flags of distillation and their defaults: set to anything else, they need --teacher.
DISTILL_DEFAULTS = {"distill_temperature": 1.0, "distill_lm_weight": 0.0, "distill_hidden_weight": 0.0}


def flag(default: Any, help: str) -> Any:
    """A field of the argument dataclasses: its default and its `--help` text, in `metadata["help"]` where
    transformers' `HfArgumentParser` reads it too."""
    return field(default=default, metadata={"help": help})


@dataclass
class ModelArguments:
    """Which model to build."""

    preset: str = flag("tiny", "model preset: tiny, small, paper-300m, paper-1.2b, llama-300m, llama-1.2b")
    variant: str | None = flag(
        None, "paper variant: QKV, Q=K-V, Q-K=V (QV), Q=K=V, (Q=K-V)+, (Q=K=V)+, GQA-<g>, MQA, Q-GQA-<g>, Q-MQA"
    )
    config_overrides: str | None = flag(
        None, "config field overrides, run_clm style: 'hidden_size=128,num_hidden_layers=2' (YAML: a mapping)"
    )
    tokenizer_name: str | None = flag(
        None, "HF tokenizer name or path; default: train a byte-level BPE on the training data"
    )
    init_from: str | None = flag(
        None,
        "continue from a QKVShare model directory (e.g. from `qkvshare convert`): its config, weights and "
        "tokenizer; --preset, --variant and --config_overrides do not apply",
    )
    tokenizer_vocab_size: int | None = flag(
        None, "vocab size of the trained BPE (default: the preset's vocab size, at least 320)"
    )
    attn_implementation: str | None = flag(
        None, "sdpa (default), eager, flex_attention, or flash_attention_2/3 (with flash-attn installed)"
    )
    teacher: str | None = flag(
        None,
        "distil from this model: a causal LM directory (Llama, QKVShare, ...) or a .gguf file with the student's "
        "vocabulary; the loss becomes the KL divergence to its next-token distribution (--distill_temperature), "
        "mixed with the LM loss by --distill_lm_weight",
    )


@dataclass
class DataArguments:
    """Where the text comes from and how it is cut into blocks."""

    dataset_name: str | None = flag(None, "HF dataset name; default (with no --train_file): the Python stdlib sources")
    dataset_config_name: str | None = flag(None, "HF dataset config name")
    train_file: str | None = flag(None, "local .txt, .jsonl/.json or .parquet training file")
    validation_file: str | None = flag(None, "local validation file (same formats)")
    text_column: str = flag("text", "column that holds the documents")
    streaming: bool = flag(False, "stream the HF dataset (for SlimPajama, FineWeb-Edu)")
    validation_split_percentage: int = flag(
        5, "percent of documents held out for validation when there is no validation split"
    )
    streaming_validation_documents: int = flag(
        1000, "documents held out for validation when streaming without a validation split"
    )
    block_size: int | None = flag(None, "tokens per training block (default: min(1024, max_position_embeddings))")
    max_train_samples: int | None = flag(None, "use at most this many training blocks")
    max_eval_samples: int | None = flag(None, "use at most this many validation blocks")


@dataclass
class TrainArguments:
    """The optimisation loop, logging and checkpoints (names from `TrainingArguments`)."""

    output_dir: str | None = flag(
        None, f"where the model, checkpoints and logs go; {VARIANT_PLACEHOLDER} is replaced by --variant"
    )
    overwrite_output_dir: bool = flag(
        False, "delete the run already in --output_dir (once the new run's inputs are checked)"
    )
    max_steps: int = flag(100, "optimizer steps")
    per_device_train_batch_size: int = flag(8, "blocks per device per micro-step")
    per_device_eval_batch_size: int = flag(8, "blocks per device in validation")
    gradient_accumulation_steps: int = flag(1, "micro-steps per optimizer step")
    learning_rate: float = flag(3e-4, "peak learning rate")
    warmup_steps: int = flag(0, "linear warmup steps")
    min_lr_ratio: float = flag(0.1, "cosine decays to this fraction of the peak LR")
    weight_decay: float = flag(0.1, "AdamW weight decay (matrices only by default)")
    decay_norms_biases_embeddings: bool = flag(False, "also apply weight decay to norms, biases and embeddings")
    adam_beta1: float = flag(0.9, "AdamW beta1")
    adam_beta2: float = flag(0.95, "AdamW beta2")
    adam_epsilon: float = flag(1e-8, "AdamW epsilon")
    max_grad_norm: float = flag(1.0, "gradient clipping (0 turns it off)")
    trainable_modules: list[str] | None = flag(
        None,
        "train only the parameters whose names contain one of these (e.g. self_attn: the attention projections, the "
        "rest frozen); default: every parameter",
    )
    seed: int = flag(42, "seed of init, data order and sampling")
    distill_temperature: float = flag(1.0, "with --teacher: softmax temperature of both distributions in the KL")
    distill_lm_weight: float = flag(
        0.0, "with --teacher: weight of the LM loss, (1 - w) x KL + w x cross-entropy (0: pure distillation)"
    )
    distill_hidden_weight: float = flag(
        0.0,
        "with --teacher: weight of the hidden-state loss added to it, each layer's output matched to the teacher's "
        "(squared error relative to the teacher's, per token, averaged over layers); needs a teacher with the "
        "student's layers and width, e.g. the model it was converted from (0: off)",
    )
    centre_output_projections: bool = flag(
        False,
        "AdamW steps on the attention output projections taken as if their inputs were centred on their mean (the "
        "constant moved into the bias; the saved weights are the usual ones): for models whose values carry large "
        "constants, e.g. a converted Qwen2 with key and value tied; needs o_proj biases, not under FSDP or DeepSpeed",
    )
    relative_learning_rates: bool = flag(
        False,
        "each parameter's learning rate scaled by its RMS over the median RMS of the weight matrices, at most 1 and "
        "at least 0.1 (fixed at the start): AdamW's first steps move every weight by about the learning rate "
        "whatever its size, which changes small weights the most; for fine-tuning a close initialisation, e.g. "
        "distilling a converted model; not under FSDP or DeepSpeed",
    )
    bf16: bool = flag(False, "bf16 mixed precision")
    fp16: bool = flag(False, "fp16 mixed precision (with loss scaling)")
    use_cpu: bool = flag(False, "train on CPU even if a GPU is present (gloo for 2+ ranks)")
    gradient_checkpointing: bool = flag(False, "recompute activations in backward")
    logging_steps: int = flag(10, "log loss, lr, tokens/s and MFU every N steps")
    eval_steps: int = flag(100, "validation loss/perplexity every N steps (and at the end)")
    save_steps: int = flag(500, "checkpoint every N steps (0: never)")
    save_total_limit: int | None = flag(2, "keep at most N checkpoints (None: all)")
    resume_from_checkpoint: str | None = flag(
        None, "checkpoint directory, or 'latest' (newest under output_dir/checkpoints)"
    )
    report_to: str = flag("tensorboard", "trackers, comma separated: " + ", ".join(TRACKER_PACKAGES) + ", or none")
    run_name: str | None = flag(None, "tracker run name")
    disable_tqdm: bool = flag(False, "no progress bar")
    peak_tflops: float | None = flag(None, "peak TFLOP/s of one device for MFU (default: known GPUs; CPU: no MFU)")
    sample_prompt: str = flag("def ", "prompt of the sample generated at the end")
    sample_max_new_tokens: int = flag(64, "tokens of the final sample (0: none)")
    push_to_hub: bool = flag(False, "upload the final model directory")
    hub_model_id: str | None = flag(None, "repo id for --push_to_hub")
    hub_private_repo: bool = flag(False, "create the hub repo as private")


ARGUMENT_CLASSES = (ModelArguments, DataArguments, TrainArguments)


@dataclass
class Arguments:
    """All arguments of one run."""

    model: ModelArguments
    data: DataArguments
    train: TrainArguments
    command_line: list[str] = field(default_factory=list)  # what `parse_args` read (repeated by the resume hint)

    def to_dict(self) -> dict[str, Any]:
        """Flat dict of every flag (what `training_args.json` holds)."""
        return {**dataclasses.asdict(self.model), **dataclasses.asdict(self.data), **dataclasses.asdict(self.train)}


@dataclass
class DistillSettings:
    """A distillation run's budget and optimiser, in the form `distill_arguments` turns into a training run (what
    `qkvshare convert`'s stage (c) passes; its --distill_* flags). Defaults: the recipe measured on SmolLM2-135M."""

    tokens: int = 0  # training tokens (0: no distillation)
    batch_size: int = 4  # blocks per step
    block_size: int = 512
    learning_rate: float = 3e-5  # configs/uptrain-smollm2.yaml's peak: larger first AdamW steps hurt a close init
    warmup_steps: int = 2
    temperature: float = 1.0
    lm_weight: float = 0.0
    hidden_weight: float = 0.0  # weight of the layer-by-layer hidden-state loss (`--distill_hidden_weight`)
    bf16: bool = False  # bf16 mixed precision (`--bf16`): the weights and optimizer stay float32
    centre_output_projections: bool = False  # `--centre_output_projections` (qkvshare.train.centring)
    relative_learning_rates: bool = False  # `--relative_learning_rates` (qkvshare.train.pretrain.build_optimizer)
    save_steps: int = 10
    eval_blocks: int = 16  # validation blocks (the run's `eval/kl`)
    seed: int = 0
    trainable_modules: list[str] | None = None  # train only these parameters (`--trainable_modules`); None: all
    # blocks per forward/backward pass: a step accumulates batch_size / micro_batch_size of them (the same blocks and,
    # up to rounding, the same update, in less memory); None: the whole batch at once
    micro_batch_size: int | None = None

    def __post_init__(self) -> None:
        micro = self.micro_batch_size
        if micro is not None and (micro < 1 or self.batch_size % micro):
            raise ValueError(
                f"DistillSettings.micro_batch_size={micro}: a divisor of batch_size ({self.batch_size}), or None for "
                "the whole batch at once."
            )

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.tokens / (self.batch_size * self.block_size)))

    @property
    def accumulation(self) -> int:
        """Forward/backward passes per step."""
        return self.batch_size // (self.micro_batch_size or self.batch_size)


def distill_arguments(
    student: str, teacher: str, train_file: str, validation_file: str, output_dir: str, s: DistillSettings
) -> Arguments:
    """The training run that distils the model directory `student` from `teacher` on the text files: the student's
    own config and tokenizer (--init_from), pure KL by default, one validation at the end, no sample, no tracker.
    A run already in `output_dir` is resumed from its latest checkpoint, or replaced when it has none (a run killed
    before its first checkpoint holds only its own files)."""
    checkpoints = Path(output_dir) / "checkpoints"
    resume = checkpoints.is_dir() and any(checkpoints.glob("checkpoint-*"))
    model = ModelArguments(init_from=student, teacher=teacher)
    data = DataArguments(
        train_file=train_file,
        validation_file=validation_file,
        block_size=s.block_size,
        max_eval_samples=s.eval_blocks,
    )
    train = TrainArguments(
        output_dir=output_dir,
        overwrite_output_dir=Path(output_dir).exists() and not resume,
        resume_from_checkpoint="latest" if resume else None,
        max_steps=s.steps,
        per_device_train_batch_size=s.batch_size // s.accumulation,
        # validation in the training passes' size: a step's micro-batch is what fits the memory
        per_device_eval_batch_size=s.batch_size // s.accumulation,
        gradient_accumulation_steps=s.accumulation,
        learning_rate=s.learning_rate,
        warmup_steps=min(s.warmup_steps, s.steps),
        weight_decay=0.0,
        distill_temperature=s.temperature,
        distill_lm_weight=s.lm_weight,
        distill_hidden_weight=s.hidden_weight,
        bf16=s.bf16,
        centre_output_projections=s.centre_output_projections,
        relative_learning_rates=s.relative_learning_rates,
        save_steps=s.save_steps,
        save_total_limit=1,
        eval_steps=s.steps,
        logging_steps=max(1, min(10, s.steps)),
        report_to="none",
        sample_max_new_tokens=0,
        seed=s.seed,
        trainable_modules=s.trainable_modules,
    )
    return Arguments(model, data, train)


def _field_names() -> set[str]:
    return {f.name for cls in ARGUMENT_CLASSES for f in dataclasses.fields(cls)}


def _closest(name: str, choices: list[str] | set[str]) -> str:
    """' (did you mean X?)' for the closest of `choices`, or '' when none is close."""
    match = difflib.get_close_matches(name, sorted(choices), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def load_yaml(path: str) -> dict[str, Any]:
    """Read a recipe; keys are flag names. `config_overrides` may be a mapping."""
    if not path.endswith((".yaml", ".yml")):
        raise TrainingSetupError(
            f"the recipe {path!r} must be a .yaml or .yml file (the only positional argument, before the flags); "
            "rename it, or pass its settings as --flags."
        )
    if not Path(path).is_file():
        raise TrainingSetupError(f"recipe {path!r} does not exist; pass the path of a YAML file (see configs/).")
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
        if context and start is not None and mark is not None and start.line != mark.line:
            problem += f" ({context} that starts at line {start.line + 1})"
        raise TrainingSetupError(
            f"recipe {path!r} is not valid YAML{where}: {problem}; fix the file (one `flag: value` per line, "
            "as in configs/tiny.yaml)."
        ) from None
    if not isinstance(values, dict):
        raise TrainingSetupError(f"recipe {path!r} must be a mapping of flag names to values.")
    unknown = sorted(set(values) - _field_names())
    if unknown:
        hints = "".join(_closest(key, _field_names()) for key in unknown[:1])
        raise TrainingSetupError(
            f"recipe {path!r} has unknown keys {unknown}{hints}; the keys are the flags of `qkvshare train --help`."
        )
    if isinstance(values.get("config_overrides"), dict):
        values["config_overrides"] = format_overrides(values["config_overrides"])
    return values


class _ArgumentParser(argparse.ArgumentParser):
    """A parser whose errors are `TrainingSetupError`s (one paragraph, exit status 2, no usage dump); `recipe`
    names the YAML file that set the defaults, so a bad value from it is traced to it."""

    recipe: str | None = None

    def error(self, message: str) -> None:  # argparse calls this for every parse error
        source = f" (a value from the recipe {self.recipe!r} unless given as a flag)" if self.recipe else ""
        raise TrainingSetupError(f"{message}{source}; `qkvshare train --help` lists the flags and their types.")


def parse_args(argv: list[str] | None = None) -> Arguments:
    """Parse `[recipe.yaml] [--flag value ...]`: flags override the recipe; then `check_args`. Raises
    `TrainingSetupError` for an unknown flag (naming the closest known one), a value of the wrong type or out of
    range, or a broken recipe."""
    command_line = list(argv or [])
    argv = list(command_line)
    parser = _ArgumentParser(
        prog="qkvshare train",
        description="Pretrain a QKVShare model.",
        allow_abbrev=False,
        formatter_class=HelpFormatter,  # each default shown once
    )
    for cls in ARGUMENT_CLASSES:
        add_dataclass_arguments(parser, cls, dash_aliases=True)
    if argv and not argv[0].startswith("-"):
        parser.recipe = argv.pop(0)
        parser.set_defaults(**load_yaml(parser.recipe))
    namespace, rest = parser.parse_known_args(argv)
    if rest:
        flag = next((item for item in rest if item.startswith("-")), None)
        if flag is None:
            raise TrainingSetupError(
                f"unexpected argument {rest[0]!r}: the only positional argument is a recipe .yaml, given first; "
                "everything else is a --flag followed by its value."
            )
        flags = {f"--{name}" for name in _field_names()}
        raise TrainingSetupError(
            f"unknown flag {flag!r}{_closest(flag.partition('=')[0], flags)}; `qkvshare train --help` lists the flags."
        )
    model, data, train = (
        cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)}) for cls in ARGUMENT_CLASSES
    )
    train.output_dir = _fill_variant(train.output_dir, model.variant, parser.recipe)
    args = Arguments(model, data, train, command_line)
    check_args(args)
    return args


def _fill_variant(output_dir: str | None, variant: str | None, recipe: str | None) -> str | None:
    """`output_dir` with `{variant}` replaced by the variant name as given (`outputs/paper-300m-Q-K=V`)."""
    if output_dir is None or VARIANT_PLACEHOLDER not in output_dir:
        return output_dir
    if not variant:
        source = f"the recipe {recipe!r}" if recipe else "--output_dir"
        raise TrainingSetupError(
            f"{source} names the run directory {output_dir!r} after the variant, but no --variant is given; pass "
            "one, e.g. --variant Q-K=V (`qkvshare train --help` lists the variants)."
        )
    return output_dir.replace(VARIANT_PLACEHOLDER, variant)


def config_overrides(text: str | None) -> dict[str, Any]:
    """`'hidden_size=128,tie_word_embeddings=false'` -> `{'hidden_size': 128, 'tie_word_embeddings': False}`, in
    the syntax every command shares (`overrides`); a `TrainingSetupError` naming the bad item. Whether the keys are
    config fields is checked by `qkvshare.train.model.parse_config_overrides`, which needs the config class."""
    try:
        return parse_overrides(text, "--config_overrides")
    except ValueError as err:
        raise TrainingSetupError(str(err)) from None


def check_args(args: Arguments) -> None:
    """Checks that need no data, model, torch or transformers. Raises `TrainingSetupError` with a how-to-fix
    message."""
    d, t = args.data, args.train
    if not t.output_dir:
        raise TrainingSetupError("--output_dir is required: the directory that receives the model and checkpoints.")
    if d.dataset_name and d.train_file:
        raise TrainingSetupError("give either --dataset_name or --train_file, not both.")
    if d.validation_file and not d.train_file:
        raise TrainingSetupError(
            "--validation_file needs --train_file (the embedded and hub corpora split themselves)."
        )
    for name in ("train_file", "validation_file"):
        path = getattr(d, name)
        if path is None:
            continue
        if not Path(path).is_file():
            raise TrainingSetupError(f"--{name} {path!r} does not exist; check the path.")
        if not path.endswith((".txt", ".text", ".json", ".jsonl", ".parquet")):
            raise TrainingSetupError(f"--{name} {path!r}: use a .txt, .jsonl/.json or .parquet file.")
        if os.path.getsize(path) == 0:
            raise TrainingSetupError(f"--{name} {path!r} is empty; point it at a file with text in it.")
    if d.streaming and not d.dataset_name:
        raise TrainingSetupError(
            "--streaming applies to --dataset_name only; local and embedded corpora load in memory."
        )
    if not 0 < d.validation_split_percentage < 100:
        raise TrainingSetupError("--validation_split_percentage must be between 1 and 99.")
    if d.block_size is not None and d.block_size < 2:
        raise TrainingSetupError(f"--block_size {d.block_size} is too small; use at least 2 tokens.")
    positive = (
        "max_steps",
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "logging_steps",
        "eval_steps",
    )
    for name in positive:
        if getattr(t, name) < 1:
            raise TrainingSetupError(f"--{name} must be at least 1, got {getattr(t, name)}.")
    if t.save_steps < 0 or (t.save_total_limit is not None and t.save_total_limit < 1):
        raise TrainingSetupError("--save_steps must be >= 0 and --save_total_limit >= 1 (or None for no limit).")
    _check_numbers(args)
    _check_attn_implementation(args.model.attn_implementation)
    _check_report_to(t.report_to)
    if t.bf16 and t.fp16:
        raise TrainingSetupError("choose one of --bf16 and --fp16.")
    if t.push_to_hub and not t.hub_model_id:
        raise TrainingSetupError("--push_to_hub needs --hub_model_id (e.g. your-name/qkvshare-small).")
    config_overrides(args.model.config_overrides)
    if args.model.init_from is not None:
        check_init_from(args.model)
    check_teacher(args)


def check_teacher(args: Arguments) -> None:
    """--teacher names a model directory or .gguf file; the distillation flags are set only with it."""
    teacher, t = args.model.teacher, args.train
    if teacher is None:
        given = [f"--{n} {getattr(t, n)}" for n, d in DISTILL_DEFAULTS.items() if getattr(t, n) != d]
        if given:
            raise TrainingSetupError(
                f"{', '.join(given)} set(s) how to distil, but no --teacher is given; pass --teacher DIR (the model "
                "to distil from) or drop the flag."
            )
        return
    path = Path(teacher).expanduser()
    if not (path / "config.json").is_file() and not (path.is_file() and path.suffix.lower() == ".gguf"):
        what = "has no config.json" if path.is_dir() else "is not a .gguf file" if path.is_file() else "does not exist"
        raise TrainingSetupError(
            f"--teacher {teacher!r} {what}; pass a model directory (config.json and weights, e.g. from "
            "save_pretrained) or a .gguf file."
        )
    if t.distill_lm_weight >= 1:
        raise TrainingSetupError(
            f"--distill_lm_weight {t.distill_lm_weight} leaves no weight on the teacher (the loss is (1 - w) x KL + "
            "w x cross-entropy); use a weight below 1, or train without --teacher."
        )


def check_init_from(m: ModelArguments) -> None:
    """--init_from names a QKVShare model directory, and no flag that would build another model is given."""
    for name in ("variant", "config_overrides"):
        if getattr(m, name) is not None:
            raise TrainingSetupError(
                f"--{name} cannot be combined with --init_from {m.init_from!r}: the model is the directory's as saved. "
                "Convert to another variant with `qkvshare convert`, or drop --init_from to train from scratch."
            )
    model_type = config_model_type(m.init_from, f"--init_from {m.init_from!r}", TrainingSetupError)
    if model_type != "qkvshare":
        raise TrainingSetupError(
            f"--init_from {m.init_from!r} holds a model_type={model_type!r} model, not a QKVShare one; convert it "
            f"first: qkvshare convert {m.init_from} --variant QKV --output_dir DIR (or any other variant)."
        )


def _check_numbers(args: Arguments) -> None:
    """Every float flag finite (argparse takes 'nan' and 'inf'), and each in its range."""
    for part in (args.model, args.data, args.train):
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise TrainingSetupError(
                    f"--{f.name} {value} is not a finite number; pass a finite value (default: {f.default})."
                )
    t = args.train
    ranges = [  # (flag, value, allowed, how to read the range)
        ("learning_rate", t.learning_rate, t.learning_rate > 0, "> 0, e.g. 3e-4"),
        ("warmup_steps", t.warmup_steps, t.warmup_steps >= 0, ">= 0"),
        ("min_lr_ratio", t.min_lr_ratio, 0 <= t.min_lr_ratio <= 1, "between 0 and 1"),
        ("weight_decay", t.weight_decay, t.weight_decay >= 0, ">= 0"),
        ("adam_beta1", t.adam_beta1, 0 <= t.adam_beta1 < 1, "in [0, 1)"),
        ("adam_beta2", t.adam_beta2, 0 <= t.adam_beta2 < 1, "in [0, 1)"),
        ("adam_epsilon", t.adam_epsilon, t.adam_epsilon > 0, "> 0"),
        ("max_grad_norm", t.max_grad_norm, t.max_grad_norm >= 0, ">= 0 (0 turns clipping off)"),
        ("peak_tflops", t.peak_tflops, t.peak_tflops is None or t.peak_tflops > 0, "> 0"),
        ("distill_temperature", t.distill_temperature, t.distill_temperature > 0, "> 0 (1 or 2 is usual)"),
        ("distill_lm_weight", t.distill_lm_weight, 0 <= t.distill_lm_weight <= 1, "between 0 and 1"),
        ("distill_hidden_weight", t.distill_hidden_weight, t.distill_hidden_weight >= 0, ">= 0 (0 turns it off)"),
    ]
    for name, value, allowed, expected in ranges:
        if not allowed:
            raise TrainingSetupError(f"--{name} {value} is out of range; it must be {expected}.")


def _check_attn_implementation(name: str | None) -> None:
    """The attention backends the model supports (whether flash-attn is installed is the trainer's check)."""
    if name is None or name in ATTENTION_IMPLEMENTATIONS or name in FLASH_ATTENTION_IMPLEMENTATIONS:
        return
    allowed = [*ATTENTION_IMPLEMENTATIONS, *FLASH_ATTENTION_IMPLEMENTATIONS]
    raise TrainingSetupError(
        f"--attn_implementation {name!r} is not an attention backend{_closest(name, allowed)}; "
        f"use one of {', '.join(allowed)}."
    )


def _check_report_to(report_to: str) -> None:
    """Known tracker names, each installed (accelerate would drop a missing one with only a log line)."""
    names = [name.strip() for name in report_to.split(",") if name.strip()]
    if "none" in names and len(names) > 1:
        raise TrainingSetupError(f"--report_to {report_to!r} mixes 'none' with trackers; give one or the other.")
    for name in names:
        if name == "none":
            continue
        if name not in TRACKER_PACKAGES:
            raise TrainingSetupError(
                f"--report_to {name!r} is not a tracker{_closest(name, set(TRACKER_PACKAGES))}; "
                f"use {', '.join(TRACKER_PACKAGES)} (comma separated) or none."
            )
        module = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            extra = extra_providing(module)
            install = install_command(extra) if extra else f"pip install {module.replace('_', '-')}"
            raise TrainingSetupError(
                f"--report_to {name} needs the package {module}, which is not installed; install it with {install}, "
                "or pass --report_to none."
            )
