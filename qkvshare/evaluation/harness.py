"""`qkvshare eval`: lm-evaluation-harness's official 5-shot suite on one or more models, and the paper's table.

The command's documentation (`qkvshare eval --help`: usage and design) and its arguments are `qkvshare_settings.eval`;
this module checks every input, runs lm-eval's `HFLM` on each model and writes the results and the table.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from qkvshare.configuration_qkvshare import kv_cache_bytes_per_token
from qkvshare.runtime import default_device
from qkvshare_settings.conventions import slug
from qkvshare_settings.eval import DEFAULT_TASKS, EvalArgs
from qkvshare_settings.extras import require

from .common import (
    EvalInputError,
    check_causal_lm,
    check_finite_weights,
    load_tokenizer,
    variant_of,
)
from .table import ModelRow, markdown_table
from .tasks import offline_folders, write_offline_group


@functools.cache
def task_manager(folders: tuple[str, ...] | None = None):
    """lm-eval's task index, built once per process. With `folders` (names under lm_eval/tasks) it indexes only
    those: the same official YAMLs in milliseconds, where scanning all ~15k task YAMLs takes 15 s."""
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


def evaluate(args: EvalArgs) -> str | Path:
    """`qkvshare eval`: the side-by-side table of every model (see `run`), or with `write_task_yaml` the path of the
    offline task YAML written there. Bad input is an `EvalInputError` (a `ValueError`) before any model loads."""
    if args.write_task_yaml:
        path = write_offline_group(args.data_dir, args.tasks, args.num_fewshot, args.write_task_yaml)
        print(f"offline task YAML written to {path}; use it as: lm_eval --tasks {path} ...")
        return path
    return run(args)
