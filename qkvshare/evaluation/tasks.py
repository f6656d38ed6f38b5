"""The paper's five downstream tasks, and running lm-eval's official versions of them on local files.

lm-eval loads a task's data with `datasets.load_dataset(dataset_path, dataset_name, **dataset_kwargs)`.
A group YAML that lists the *built-in* tasks and overrides only those three keys (`dataset_path: json`,
`dataset_name: null`, `dataset_kwargs: {data_files: ...}`) therefore keeps the official prompts, few-shot
splits, metrics and task names while reading JSON-lines files (docs/design.md, section 8.5). Paths in `data_files` resolve against the working directory, so they are written
absolute.

Local layout (`--data_dir DIR`): `DIR/<task>_<split>.jsonl`, one row per line in the official row schema,
for the split the task draws few-shot examples from and the split it is scored on (`OFFLINE_TASKS`).
`fixtures/` ships such a set, written for this project (not copied from the datasets).
Every file is checked (splits present, fields present and well typed, enough few-shot rows) before
lm-eval starts, so a broken file fails in a second with the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .common import EvalInputError

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
OFFLINE_GROUP = "qkvshare_offline"


@dataclass(frozen=True)
class OfflineTask:
    """One official lm-eval task that can run on local files."""

    name: str  # lm-eval task name (also the file prefix)
    label: str  # column label in the table (the paper abbreviates HellaSwag as HW)
    fewshot_split: str  # the official task's training_split (few-shot examples are drawn from it)
    eval_split: str  # the official task's test_split, else validation_split (the split that is scored)
    fields: tuple[str, ...]  # fields of the official row schema that the task's prompt code reads
    folder: str  # the folder of lm_eval/tasks that holds the task's YAML (and its prompt code)


OFFLINE_TASKS: dict[str, OfflineTask] = {
    t.name: t
    for t in (
        OfflineTask(
            "hellaswag",
            "HellaSwag",
            "train",
            "validation",
            ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
            "hellaswag",
        ),
        OfflineTask("piqa", "PIQA", "train", "validation", ("goal", "sol1", "sol2", "label"), "piqa"),
        OfflineTask("arc_easy", "ARC-E", "train", "test", ("question", "choices", "answerKey"), "arc"),
        OfflineTask("arc_challenge", "ARC-C", "train", "test", ("question", "choices", "answerKey"), "arc"),
        OfflineTask(
            "winogrande",
            "WinoGrande",
            "train",
            "validation",
            ("sentence", "option1", "option2", "answer"),
            "winogrande",
        ),
    )
}


def offline_folders(tasks: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The lm_eval/tasks folders that hold the official YAMLs of these offline tasks (sorted, no repeats)."""
    return tuple(sorted({OFFLINE_TASKS[task].folder for task in tasks}))


def data_file(data_dir: Path, task: str, split: str) -> Path:
    """Where `--data_dir` keeps `task`'s `split`: `DIR/<task>_<split>.jsonl`."""
    return Path(data_dir).resolve() / f"{task}_{split}.jsonl"


def _row_problem(task: str, row: dict[str, Any]) -> str | None:
    """What is wrong with a row whose fields are present (types and values the official task code assumes)."""
    if task == "hellaswag":
        if not (isinstance(row["endings"], list) and len(row["endings"]) == 4):
            return "'endings' must be a list of 4 strings"
        if str(row["label"]) not in ("0", "1", "2", "3"):
            return f"'label' must be one of '0'..'3', got {row['label']!r}"
    elif task == "piqa":
        if row["label"] not in (0, 1):
            return f"'label' must be 0 or 1, got {row['label']!r}"
    elif task.startswith("arc_"):
        choices = row["choices"]
        if not (isinstance(choices, dict) and {"text", "label"} <= choices.keys()):
            return "'choices' must be an object with lists 'text' and 'label'"
        if len(choices["text"]) != len(choices["label"]) or len(choices["text"]) < 2:
            return "'choices.text' and 'choices.label' must be lists of the same length (>= 2)"
        if row["answerKey"] not in choices["label"]:
            return f"'answerKey' {row['answerKey']!r} is not one of choices.label {choices['label']}"
    elif task == "winogrande":
        if "_" not in str(row["sentence"]):
            return "'sentence' must contain '_' where an option goes"
        if str(row["answer"]) not in ("1", "2"):
            return f"'answer' must be '1' or '2', got {row['answer']!r}"
    return None


def check_offline_data(data_dir: str | Path, tasks: list[str], num_fewshot: int) -> dict[str, dict[str, Path]]:
    """Check `data_dir` holds every split and field `tasks` need; return {task: {split: absolute path}}.

    Raises `EvalInputError` naming the task, file, line and field for an unknown task, a missing split file,
    a line that is not a JSON object, a missing field, a malformed value, or too few few-shot rows.
    """
    data_dir = Path(data_dir).expanduser()
    if not data_dir.is_dir():
        raise EvalInputError(f"--data_dir {str(data_dir)!r} is not a directory.")
    files: dict[str, dict[str, Path]] = {}
    for task in tasks:
        spec = OFFLINE_TASKS.get(task)
        if spec is None:
            raise EvalInputError(
                f"unknown task {task!r} for --data_dir: offline mode runs the official tasks "
                f"{', '.join(OFFLINE_TASKS)}. Drop --data_dir to use any lm-eval task from the hub."
            )
        files[task] = {}
        for split in dict.fromkeys((spec.fewshot_split, spec.eval_split)):
            path = data_file(data_dir, task, split)
            if not path.is_file():
                raise EvalInputError(
                    f"task {task!r} needs its {split!r} split (lm-eval's {task} draws few-shot examples from "
                    f"{spec.fewshot_split!r} and scores {spec.eval_split!r}): missing file {path}. "
                    f"Write it as JSON lines with fields {', '.join(spec.fields)} (see {FIXTURES_DIR})."
                )
            n_rows = 0
            with path.open(encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise EvalInputError(f"{path}:{lineno}: not valid JSON ({err}).") from err
                    if not isinstance(row, dict):
                        raise EvalInputError(f"{path}:{lineno}: each line must be a JSON object (one row).")
                    missing = [name for name in spec.fields if name not in row]
                    if missing:
                        raise EvalInputError(
                            f"{path}:{lineno}: row lacks field(s) {', '.join(missing)} of the official {task} "
                            f"schema (needs {', '.join(spec.fields)})."
                        )
                    problem = _row_problem(task, row)
                    if problem:
                        raise EvalInputError(f"{path}:{lineno}: {problem}.")
                    n_rows += 1
            if n_rows == 0:
                raise EvalInputError(f"{path} has no rows: task {task!r} needs data in its {split!r} split.")
            if split == spec.fewshot_split and split != spec.eval_split and n_rows < num_fewshot:
                raise EvalInputError(
                    f"{path} has {n_rows} rows but --num_fewshot {num_fewshot} needs at least {num_fewshot} "
                    f"few-shot examples from the {split!r} split."
                )
            files[task][split] = path
    return files


def offline_group_config(files: dict[str, dict[str, Path]], group: str = OFFLINE_GROUP) -> dict[str, Any]:
    """The lm-eval group config: each official task with only its data source swapped for local JSON lines."""
    return {
        "group": group,
        "task": [
            {
                "task": task,
                "dataset_path": "json",
                "dataset_name": None,  # arc (ARC-Easy/ARC-Challenge) and winogrande name a hub config
                "dataset_kwargs": {"data_files": {split: str(path) for split, path in splits.items()}},
            }
            for task, splits in files.items()
        ],
    }


def write_offline_group(
    data_dir: str | Path, tasks: list[str], num_fewshot: int, path: str | Path, group: str = OFFLINE_GROUP
) -> Path:
    """Check `data_dir` and write the group YAML to `path`.

    The file works with plain lm-eval too: `lm_eval ... --tasks /abs/path.yaml` (HF_DATASETS_OFFLINE=1).
    """
    files = check_offline_data(data_dir, tasks, num_fewshot)
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(offline_group_config(files, group), sort_keys=False), encoding="utf-8")
    return path
