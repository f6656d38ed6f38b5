"""`qkvshare eval`: lm-evaluation-harness's official 5-shot suite on one or more models, and the paper's table.

    qkvshare eval runs/qkv/final runs/qkev/final                      # hellaswag piqa arc_easy arc_challenge winogrande
    qkvshare eval DIR --data_dir qkvshare/evaluation/fixtures --limit 8   # same official tasks on local JSON lines
    qkvshare eval --data_dir DATA --write_task_yaml tasks.yaml        # the YAML alone, for plain `lm_eval`

Design:
- Models go through lm-eval's own `HFLM` (backend "causal") by name, so lm-eval loads, batches and scores them
  exactly as `lm_eval --model hf` would; `qkvshare` is imported first, so our checkpoints need no
  `trust_remote_code`. The JSON written per model is lm-eval's results dict, serialised as lm-eval does.
- Everything the user can get wrong (model path, model type, damaged config or weights files, tokenizer, task
  names, local data) is checked for all models before the first one is evaluated; a model whose weights hold
  NaN or inf is refused before it is scored.
- Where results go is printed at the start and the end (absolute paths): one directory per model under
  `--output_dir` (default `eval_results/`), named by `slug(model)`; two models that would share one are refused.
- Offline mode swaps only the data source of the official tasks (see `tasks.py`), so task names, prompts,
  few-shot splits and metrics are the official ones.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from qkvshare.analysis.conventions import HelpFormatter, add_dtype_argument, slug

from .common import (
    EvalInputError,
    check_causal_lm,
    check_finite_weights,
    default_device,
    kv_cache_bytes_per_token,
    load_tokenizer,
    variant_of,
)
from .table import ModelRow, markdown_table
from .tasks import DEFAULT_TASKS, offline_folders, write_offline_group


@dataclass
class EvalArgs:
    """Options of `qkvshare eval` (one field per command-line flag)."""

    models: list[str]  # model directories (save_pretrained output) or hub ids
    tasks: list[str]  # lm-eval task names; default: the paper's five
    num_fewshot: int = 5  # in-context examples per question (the paper: 5)
    batch_size: str = "8"  # an int, or "auto" (lm-eval finds the largest that fits)
    limit: float | None = None  # examples per task (an int), or a fraction if < 1; for quick checks only
    device: str | None = None  # default: cuda if available, else cpu
    dtype: str = "float32"  # weights and activations: float32, bfloat16, float16, auto (as saved)
    data_dir: str | None = None  # run the official tasks on DIR/<task>_<split>.jsonl instead of the hub
    output_dir: str = "eval_results"  # results JSON per model, the table, the offline task YAML
    tokenizer: str | None = None  # tokenizer to use for every model (default: the one saved with it)
    trust_remote_code: bool = False  # only for hub models whose code is in neither transformers nor qkvshare
    kv_bytes_per_element: int = 2  # element size for the KV-cache column (2 = fp16/bf16, as in the paper)
    write_task_yaml: str | None = None  # with --data_dir: write the offline group YAML here and exit
    seed: int = 1234  # lm-eval's few-shot, numpy and torch seed (its default)


def parse_args(argv: list[str] | None) -> EvalArgs:
    """Parse the command line into `EvalArgs`."""
    p = argparse.ArgumentParser(prog="qkvshare eval", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("models", nargs="*", help="model directories or hub ids")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="comma-separated lm-eval tasks")
    p.add_argument("--num_fewshot", type=int, default=5, help="in-context examples per question")
    p.add_argument("--batch_size", default="8", help='an integer or "auto"')
    p.add_argument("--limit", type=float, default=None, help="examples per task (int) or fraction (<1); testing only")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: cuda if available)")
    add_dtype_argument(p, "float32", "weights and activations; auto: as saved")
    p.add_argument("--data_dir", default=None, help="offline: official tasks on DIR/<task>_<split>.jsonl")
    p.add_argument("--output_dir", default="eval_results", help="results JSON per model, the table, the task YAML")
    p.add_argument("--tokenizer", default=None, help="tokenizer for all models (default: saved with each model)")
    p.add_argument("--trust_remote_code", action="store_true", help="for hub models whose code is not installed")
    p.add_argument("--kv_bytes_per_element", type=int, default=2, help="bytes per cached element (2: fp16/bf16)")
    p.add_argument("--write_task_yaml", default=None, help="with --data_dir: write the offline task YAML and exit")
    p.add_argument("--seed", type=int, default=1234, help="lm-eval's few-shot, numpy and torch seed")
    ns = p.parse_args(argv)
    ns.tasks = [t.strip() for t in ns.tasks.split(",") if t.strip()]
    if not ns.tasks:
        p.error("--tasks is empty")
    if ns.num_fewshot < 0:
        p.error("--num_fewshot must be >= 0")
    if ns.batch_size != "auto" and not (ns.batch_size.isdigit() and int(ns.batch_size) > 0):
        p.error(f"--batch_size must be a positive integer or 'auto', got {ns.batch_size!r}")
    if ns.limit is not None and (ns.limit <= 0 or (ns.limit >= 1 and ns.limit != int(ns.limit))):
        p.error("--limit must be a positive integer (examples per task) or a fraction in (0, 1)")
    if ns.write_task_yaml and not ns.data_dir:
        p.error("--write_task_yaml needs --data_dir")
    if not ns.models and not ns.write_task_yaml:
        p.error("give at least one model directory or hub id")
    return EvalArgs(**vars(ns))


@functools.cache
def task_manager(folders: tuple[str, ...] | None = None):
    """lm-eval's task index, built once per process. With `folders` (names under lm_eval/tasks) it indexes only
    those: the same official YAMLs in milliseconds, where scanning all ~15k task YAMLs takes 15 s."""
    from qkvshare._extras import require

    tasks = require("lm_eval.tasks", "eval", "qkvshare eval")
    if folders is None:
        return tasks.TaskManager()
    root = Path(tasks.__file__).parent
    return tasks.TaskManager(include_path=[str(root / folder) for folder in folders], include_defaults=False)


def check_tasks(tasks: list[str]) -> None:
    """Raise `EvalInputError` for a name that is neither an lm-eval task, group or tag nor a task YAML file."""
    known = set(task_manager().all_tasks)
    unknown = [t for t in tasks if t not in known and not (t.endswith((".yaml", ".yml")) and Path(t).is_file())]
    if unknown:
        raise EvalInputError(
            f"unknown lm-eval task(s): {', '.join(unknown)}. List them with `lm-eval ls tasks`; "
            f"the paper's suite is {','.join(DEFAULT_TASKS)}."
        )


def check_writable(out: Path) -> None:
    """Create `out` now, so an unwritable `--output_dir` fails before the first model is evaluated."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".qkvshare-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise EvalInputError(
            f"--output_dir {str(out)!r} is not writable ({err.strerror or err}); pass a directory you can write to."
        ) from err


def result_dirs(models: list[str], output_dir: str | Path) -> dict[str, Path]:
    """The absolute results directory of each model, `output_dir/slug(model)`; refuses two models sharing one."""
    out = Path(output_dir).expanduser().resolve()
    dirs: dict[str, Path] = {}
    for name in models:
        path = out / slug(name)
        other = next((m for m, d in dirs.items() if d == path), None)
        if other is not None:
            raise EvalInputError(
                f"models {other!r} and {name!r} would both write their results to {path}; evaluate them in "
                "separate runs with different --output_dir, or give them distinct names."
            )
        dirs[name] = path
    return dirs


def evaluate_model(name: str, args: EvalArgs, task_spec: list, tokenizer) -> tuple[dict, object]:
    """Run lm-eval on model `name`; return (lm-eval's results dict without samples, the loaded HF model)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    device = args.device or default_device()
    batch_size = args.batch_size if args.batch_size == "auto" else int(args.batch_size)
    model_args = {"pretrained": name, "dtype": args.dtype, "trust_remote_code": args.trust_remote_code}
    lm = HFLM(backend="causal", tokenizer=tokenizer, device=device, batch_size=batch_size, **model_args)
    check_finite_weights(lm.model, name)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    try:
        results = simple_evaluate(
            model=lm,
            model_args=model_args,
            tasks=task_spec,
            num_fewshot=args.num_fewshot,
            batch_size=batch_size,
            device=device,
            limit=limit,
            log_samples=False,
            task_manager=task_manager(offline_folders(args.tasks) if args.data_dir else None),
            random_seed=0,
            numpy_random_seed=args.seed,
            torch_random_seed=args.seed,
            fewshot_random_seed=args.seed,
        )
    except (ConnectionError, OSError) as err:
        if args.data_dir:
            raise
        raise EvalInputError(
            f"lm-eval could not load the task data ({err}). Without internet, run the official tasks on "
            "local files: --data_dir DIR (see qkvshare/evaluation/fixtures for the layout)."
        ) from err
    results.pop("samples", None)
    return results, lm.model


def write_results_json(results: dict, path: Path) -> Path:
    """Write lm-eval's results dict the way lm-eval's EvaluationTracker does (indent 2, its serialiser)."""
    from lm_eval.utils import handle_non_serializable

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False), encoding="utf-8"
    )
    return path


def run(args: EvalArgs) -> str:
    """Check every input, evaluate every model, write the JSONs and the table; return the table."""
    import yaml
    from tqdm.auto import tqdm

    out = Path(args.output_dir).expanduser().resolve()
    dirs = result_dirs(args.models, out)
    check_writable(out)
    if args.data_dir:
        # The YAML is kept for plain `lm_eval --tasks FILE`; lm-eval's Python API takes the group as a dict
        # (given a path, TaskManager.load misreads a group file whose `task` key is a list).
        yaml_path = write_offline_group(
            args.data_dir, args.tasks, args.num_fewshot, out / "offline_tasks" / "qkvshare_offline.yaml"
        )
        task_spec = [yaml.safe_load(yaml_path.read_text(encoding="utf-8"))]
    else:
        check_tasks(args.tasks)
        task_spec = list(args.tasks)
    configs = {name: check_causal_lm(name, args.trust_remote_code) for name in args.models}
    tokenizers = {name: load_tokenizer(args.tokenizer or name, args.trust_remote_code) for name in args.models}
    print(f"qkvshare eval: writing to {out}: results_table.md and, per model, lm-eval's results JSON:", flush=True)
    for name, path in dirs.items():
        print(f"  {name} -> {path / 'results.json'}", flush=True)

    rows = []
    for name in tqdm(args.models, desc="models", disable=len(args.models) < 2):
        results, model = evaluate_model(name, args, task_spec, tokenizers[name])
        json_path = write_results_json(results, dirs[name] / "results.json")
        print(f"{name}: lm-eval results written to {json_path}", flush=True)
        rows.append(
            ModelRow(
                name=name,
                variant=variant_of(configs[name]),
                num_parameters=model.num_parameters(),
                kv_bytes_per_token=kv_cache_bytes_per_token(configs[name], args.kv_bytes_per_element),
                results=results["results"],
            )
        )
        del model
    table = markdown_table(rows, args.tasks, args.num_fewshot, args.kv_bytes_per_element)
    (out / "results_table.md").write_text(table, encoding="utf-8")
    print(table)
    print(f"qkvshare eval: table written to {out / 'results_table.md'}; lm-eval's results JSON:")
    for name, path in dirs.items():
        print(f"  {name} -> {path / 'results.json'}")
    return table


def main(argv: list[str] | None = None) -> int:
    """Entry point of `qkvshare eval`; returns the exit status (2 for bad input)."""
    args = parse_args(argv)
    try:
        if args.write_task_yaml:
            path = write_offline_group(args.data_dir, args.tasks, args.num_fewshot, args.write_task_yaml)
            print(f"offline task YAML written to {path}; use it as: lm_eval --tasks {path} ...")
            return 0
        run(args)
    except EvalInputError as err:
        print(f"qkvshare eval: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
