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
- Offline mode swaps only the data source of the official tasks (see `qkvshare/evaluation/tasks.py`), so task
  names, prompts, few-shot splits and metrics are the official ones.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .conventions import HelpFormatter, add_model_loading_arguments

DEFAULT_TASKS = ("hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande")  # the paper's suite


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
    add_model_loading_arguments(p, "tokenizer for all models (default: saved with each model)")
    p.add_argument("--data_dir", default=None, help="offline: official tasks on DIR/<task>_<split>.jsonl")
    p.add_argument("--output_dir", default="eval_results", help="results JSON per model, the table, the task YAML")
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
