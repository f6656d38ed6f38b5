"""Tests of `qkvshare eval` and `qkvshare perplexity` (issue 4), on a tiny QKVShare model and the shipped fixtures.

The model (Q-K=V, 2 layers) and a byte-level BPE tokenizer trained on the fixture text are built here and saved
with save_pretrained, so the checkpoint carries `auto_map` and the model code like a real one. Everything runs
offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE), fp32 on CPU, with `--limit 3` per task.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DistilBertConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from qkvshare import QKVShareConfig, QKVShareForCausalLM
from qkvshare.configuration_qkvshare import kv_cache_bytes_per_token
from qkvshare.evaluation import harness
from qkvshare.evaluation.common import NonFiniteResultError
from qkvshare.evaluation.perplexity import pack, perplexity, windows
from qkvshare.evaluation.tasks import FIXTURES_DIR, OFFLINE_TASKS
from qkvshare.train.tokenizer import train_bpe_tokenizer
from qkvshare_cli import main as cli
from qkvshare_settings.conventions import DTYPE_NAMES, slug
from qkvshare_settings.eval import DEFAULT_TASKS

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

LIMIT = 3  # documents per task: every task is scored, the run stays fast
TEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "A student pushes a box across the floor, and friction slows it down.",
    "Rinse the spoon with warm soapy water, then dry it with a towel.",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A saved tiny QKVShare causal LM (Q-K=V) with its tokenizer: a directory like a training checkpoint."""
    corpus = [line for path in sorted(FIXTURES_DIR.glob("*.jsonl")) for line in path.read_text().splitlines()]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus + TEXTS, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    eos = tok.eos_token_id
    cfg = QKVShareConfig.from_preset(
        "tiny", variant="Q-K=V", vocab_size=len(tok), max_position_embeddings=512, eos_token_id=eos, bos_token_id=eos
    )
    torch.manual_seed(0)
    model = QKVShareForCausalLM(cfg)
    path = tmp_path_factory.mktemp("ckpt") / "tiny-qkev"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    model = QKVShareForCausalLM.from_pretrained(checkpoint).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    return model, tok


@pytest.fixture(scope="module")
def llama_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """A tiny GQA Llama (a non-QKVShare model) with the same tokenizer, for a second row of the table."""
    tok = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def suite_run(checkpoint, llama_checkpoint, tmp_path_factory) -> tuple[Path, str]:
    """`qkvshare eval` on the whole five-task suite, 5-shot, on the fixtures, for two models: (output dir, stdout)."""
    out = tmp_path_factory.mktemp("eval")
    argv = ["eval", str(checkpoint), str(llama_checkpoint), "--data_dir", str(FIXTURES_DIR), "--limit", str(LIMIT)]
    argv += ["--output_dir", str(out)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli(argv + ["--device", "cpu", "--batch_size", "16"]) == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def suite(suite_run) -> Path:
    return suite_run[0]


def test_eval_suite_five_tasks_5shot(suite, checkpoint, llama_checkpoint, loaded):
    model, _ = loaded
    results = json.loads(next(suite.glob("*tiny-qkev/results.json")).read_text())
    # lm-eval's own results JSON: its keys, its config block, the official task configs with local data.
    assert {"results", "configs", "versions", "n-shot", "n-samples", "config", "lm_eval_version"} <= results.keys()
    assert results["config"]["model_num_parameters"] == model.num_parameters()
    for task, spec in OFFLINE_TASKS.items():
        res, conf = results["results"][task], results["configs"][task]
        assert results["n-shot"][task] == 5 and conf["num_fewshot"] == 5
        assert results["n-samples"][task]["effective"] == LIMIT
        assert conf["task"] == task and conf["dataset_path"] == "json"
        assert conf["training_split"] == spec.fewshot_split
        assert (conf.get("test_split") or conf["validation_split"]) == spec.eval_split
        assert Path(conf["dataset_kwargs"]["data_files"][spec.eval_split]).is_file()
        metrics = ("acc",) if task == "winogrande" else ("acc", "acc_norm")
        for m in metrics:
            # LIMIT documents scored: accuracy is a multiple of 1/LIMIT, stderr the binomial one lm-eval reports.
            value, stderr = res[f"{m},none"], res[f"{m}_stderr,none"]
            assert round(value * LIMIT) == pytest.approx(value * LIMIT)
            assert stderr == pytest.approx(math.sqrt(value * (1 - value) / (LIMIT - 1)))

    lines = (suite / "results_table.md").read_text().splitlines()
    table = [line for line in lines if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    labels = [OFFLINE_TASKS[t].label for t in DEFAULT_TASKS]
    expected = ["Model", "Variant", "Params", "KV B/token (16-bit)"]
    expected += [f"{label} {m}" for label in labels for m in ("acc", "acc_norm")] + ["Avg acc", "Avg acc_norm"]
    assert header == expected
    assert len(table) == 4  # header, rule, one row per model
    llama_row = dict(zip(header, (c.strip() for c in table[3].strip("|").split("|"))))
    assert llama_row["Model"] == str(llama_checkpoint) and llama_row["Variant"] == "llama"
    assert llama_row["KV B/token (16-bit)"] == f"{2 * 8 * 2 * 3 * 2:,}"  # kv heads * head_dim * (K, V) * layers * 2
    llama_json = json.loads(next(suite.glob("*tiny-llama/results.json")).read_text())
    assert llama_row["Params"] == f"{llama_json['config']['model_num_parameters']:,}"
    row = dict(zip(header, (c.strip() for c in table[2].strip("|").split("|"))))
    assert row["Model"] == str(checkpoint) and row["Variant"] == "Q-K=V"
    assert row["Params"] == f"{model.num_parameters():,}"
    assert row["KV B/token (16-bit)"] == f"{model.config.kv_cache_bytes_per_token(2):,}"
    assert row["WinoGrande acc_norm"] == "–"
    accs = [results["results"][t]["acc,none"] for t in DEFAULT_TASKS]
    norms = [results["results"][t].get("acc_norm,none", results["results"][t]["acc,none"]) for t in DEFAULT_TASKS]
    for task, label in zip(DEFAULT_TASKS, labels):
        res = results["results"][task]
        assert row[f"{label} acc"] == f"{100 * res['acc,none']:.2f} ± {100 * res['acc_stderr,none']:.2f}"
    assert row["Avg acc"] == f"{100 * sum(accs) / 5:.2f}"
    assert row["Avg acc_norm"] == f"{100 * sum(norms) / 5:.2f}"
    # the offline task YAML for plain lm_eval is written next to the results
    assert (suite / "offline_tasks" / "qkvshare_offline.yaml").is_file()


# Runs lm-eval's own CLI entry point in a fresh interpreter in which `import qkvshare` fails, so the model can
# only come from the code copied into the checkpoint (trust_remote_code). Prints the remote module it used.
LM_EVAL_WITHOUT_QKVSHARE = textwrap.dedent(
    """
    import sys
    class BlockQKVShare:
        def find_spec(self, name, path=None, target=None):
            if name == "qkvshare" or name.startswith("qkvshare."):
                raise ModuleNotFoundError(f"qkvshare is blocked in this test: {name}")
    sys.meta_path.insert(0, BlockQKVShare())
    from lm_eval.__main__ import cli_evaluate
    sys.argv = ["lm_eval"] + sys.argv[1:]
    cli_evaluate()
    print("REMOTE_MODULES", sorted(m for m in sys.modules if m.startswith("transformers_modules")))
    """
)


def test_plain_lm_eval_cli_with_trust_remote_code(suite, checkpoint, tmp_path):
    task_yaml = tmp_path / "tasks.yaml"
    assert cli(["eval", "--data_dir", str(FIXTURES_DIR), "--write_task_yaml", str(task_yaml)]) == 0
    out = tmp_path / "lm_eval_out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    args = ["--model", "hf", "--model_args", f"pretrained={checkpoint},trust_remote_code=True"]
    args += ["--tasks", str(task_yaml), "--num_fewshot", "5", "--limit", str(LIMIT), "--device", "cpu"]
    args += ["--batch_size", "16", "--output_path", str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", LM_EVAL_WITHOUT_QKVSHARE, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "modeling_qkvshare" in proc.stdout.split("REMOTE_MODULES")[-1]  # the checkpoint's copied code ran
    (result_file,) = out.rglob("results_*.json")
    plain = json.loads(result_file.read_text())["results"]
    ours = json.loads(next(suite.glob("*tiny-qkev/results.json")).read_text())["results"]
    # Same official tasks, same few-shot seeds, same weights: identical scores with and without the package.
    for task in DEFAULT_TASKS:
        for key in ("acc,none", "acc_norm,none"):
            assert plain[task].get(key) == pytest.approx(ours[task].get(key)), (task, key)


def test_perplexity_equals_exp_mean_token_loss(loaded):
    model, tok = loaded
    # The packed stream written out by hand: EOS doc EOS doc EOS doc EOS.
    ids = [tok.eos_token_id]
    for text in TEXTS:
        ids += tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([ids])
    assert torch.equal(pack(TEXTS, tok), ids[0])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss  # mean over every token after the first
    result = perplexity(model, tok, TEXTS, max_length=512)
    assert result["tokens"] == ids.shape[1] - 1 and result["documents"] == 3
    assert result["perplexity"] == pytest.approx(math.exp(loss.item()), rel=1e-5)


def test_perplexity_sliding_window_matches_direct_windows(loaded):
    model, tok = loaded
    ids = pack(TEXTS, tok)
    max_length, stride = 24, 8
    assert len(ids) > 2 * max_length
    # The reference loop, written independently: each window's not-yet-scored tokens carry labels, the rest -100.
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        window = ids[begin:end][None]
        labels = window.clone()
        labels[0, : max(prev_end - begin, 1)] = -100  # skip scored tokens (and the window's first, unpredictable)
        n = int((labels[0, 1:] != -100).sum())
        with torch.no_grad():
            nll += model(input_ids=window, labels=labels).loss.item() * n
        count, prev_end = count + n, end
        if end == len(ids):
            break
    assert count == len(ids) - 1  # every token after the first is scored once
    for batch_size in (1, 3):  # batching windows changes nothing: nothing is padded
        result = perplexity(model, tok, TEXTS, max_length=max_length, stride=stride, batch_size=batch_size)
        assert result["tokens"] == count
        assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    spans = windows(len(ids), max_length, stride)
    assert sum(e - f for _, e, f in spans) == len(ids) - 1 and all(e - b <= max_length for b, e, _ in spans)
    assert all(f - b >= max_length - stride for b, _, f in spans[1:])  # context of every later window's targets


def test_perplexity_cli_file(checkpoint, loaded, tmp_path):
    model, tok = loaded
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS + ["  "]))  # the blank doc is skipped
    out = tmp_path / "ppl.json"
    argv = ["perplexity", str(checkpoint), "--validation_file", str(data), "--max_length", "24", "--stride", "8"]
    assert cli(argv + ["--device", "cpu", "--output_file", str(out)]) == 0
    saved = json.loads(out.read_text())
    expected = perplexity(model, tok, TEXTS, max_length=24, stride=8)
    assert saved["documents"] == 3 and saved["tokens"] == expected["tokens"]
    assert saved["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-6)
    # a .txt file: documents are blank-line-separated paragraphs
    txt = tmp_path / "heldout.txt"
    txt.write_text("\n\n".join(TEXTS) + "\n")
    assert cli(["perplexity", str(checkpoint), "--validation_file", str(txt), "--output_file", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["documents"] == 3
    assert saved["perplexity"] == pytest.approx(perplexity(model, tok, TEXTS, max_length=512)["perplexity"], rel=1e-6)


@pytest.mark.parametrize("command", ["perplexity", "convert"])
def test_whole_documents_are_tokenized_without_the_model_length_warning(command):
    """Perplexity packs whole documents, and convert calibrates on them, then both cut the stream to the model's
    length: transformers' warning that a longer sequence "will result in indexing errors" would be false there."""
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    from qkvshare.convert import calibration_ids

    tokenizer = train_bpe_tokenizer(TEXTS * 5, 300, model_max_length=8)
    document = " ".join(TEXTS)  # dozens of tokens: longer than the tokenizer's model_max_length
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    try:
        with CaptureLogger(hf_logging.get_logger("transformers.tokenization_utils_base")) as quiet:
            ids = (
                pack([document], tokenizer)
                if command == "perplexity"
                else calibration_ids(tokenizer, [document], 16, 8)
            )
        with CaptureLogger(hf_logging.get_logger("transformers.tokenization_utils_base")) as loud:
            tokenizer(document)  # the plain call on the same text warns: the capture sees the warning
    finally:
        hf_logging.set_verbosity(verbosity)
    assert ids.numel() == (len(tokenizer(document)["input_ids"]) + 2 if command == "perplexity" else 16)
    assert quiet.out == ""
    assert "Token indices sequence length is longer than the specified maximum sequence length" in loud.out


def test_kv_cache_bytes_for_other_models():
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    assert kv_cache_bytes_per_token(llama, 2) == 2 * 16 * 2 * 3 * 2  # kv heads * head_dim * (K, V) * layers * bytes
    qkev = QKVShareConfig.from_preset("tiny", variant="Q-K=V")
    assert kv_cache_bytes_per_token(qkev, 2) == qkev.kv_cache_bytes_per_token(2)


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "empty").mkdir()
    DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64).save_pretrained(root / "distilbert")
    QKVShareConfig.from_preset("tiny", variant="QKV", is_causal=False).save_pretrained(root / "encoder")
    return root


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("missing", "does not exist"),
        ("empty", "has no config.json"),
        ("distilbert", "is not a causal language model"),
        ("encoder", "is not a causal language model"),
    ],
)
@pytest.mark.parametrize("command", ["eval", "perplexity"])
def test_bad_model_dir(command, name, message, bad_dirs, tmp_path, capsys):
    argv = [command, str(bad_dirs / name)]
    if command == "eval":
        argv += ["--data_dir", str(FIXTURES_DIR), "--output_dir", str(tmp_path)]
    else:
        (tmp_path / "t.txt").write_text("some text\n")
        argv += ["--validation_file", str(tmp_path / "t.txt")]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err and str(bad_dirs / name) in err


def test_unreachable_hub_id(tmp_path, capsys):
    # offline (HF_HUB_OFFLINE=1): a name that is not a local directory is tried as a hub id, and fails clearly
    assert (
        cli(["eval", "qkvshare-test/not-a-model", "--data_dir", str(FIXTURES_DIR), "--output_dir", str(tmp_path)]) == 2
    )
    assert "could not load a model config from directory or hub model id 'qkvshare-test/not-a-model'" in (
        capsys.readouterr().err
    )


def test_unknown_task(checkpoint, suite, tmp_path, capsys, monkeypatch):
    base = ["eval", str(checkpoint), "--output_dir", str(tmp_path), "--tasks", "hellaswag,hellaswagg"]
    assert cli(base + ["--data_dir", str(FIXTURES_DIR)]) == 2
    assert "unknown task 'hellaswagg' for --data_dir" in capsys.readouterr().err
    # Hub mode checks names against lm-eval's task index: here a real index of one folder (the full one takes 15 s).
    real = harness.task_manager
    monkeypatch.setattr(harness, "task_manager", lambda folders=None: real(("hellaswag",)))
    assert cli(base) == 2
    assert "unknown lm-eval task(s): hellaswagg" in capsys.readouterr().err


def _copy_fixtures(dst: Path) -> Path:
    dst.mkdir()
    for path in FIXTURES_DIR.glob("*.jsonl"):
        (dst / path.name).write_text(path.read_text())
    return dst


def test_local_data_missing_split(checkpoint, tmp_path, capsys):
    data = _copy_fixtures(tmp_path / "data")
    (data / "arc_easy_test.jsonl").unlink()
    assert cli(["eval", str(checkpoint), "--data_dir", str(data), "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "task 'arc_easy' needs its 'test' split" in err and "arc_easy_test.jsonl" in err


def test_local_data_missing_field(checkpoint, tmp_path, capsys):
    data = _copy_fixtures(tmp_path / "data")
    rows = [json.loads(line) for line in (data / "piqa_validation.jsonl").read_text().splitlines()]
    del rows[2]["sol2"]
    (data / "piqa_validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli(["eval", str(checkpoint), "--data_dir", str(data), "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "piqa_validation.jsonl:3: row lacks field(s) sol2" in err


def test_perplexity_missing_text_column(checkpoint, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"content": "hello"}) + "\n")
    assert cli(["perplexity", str(checkpoint), "--validation_file", str(data)]) == 2
    assert "has no column 'text' (columns: content)" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# issue 9: nothing silently wrong, nothing lost
# ----------------------------------------------------------------------------------------------------------------
def test_eval_prints_where_it_writes(suite_run, checkpoint, llama_checkpoint):
    out, printed = suite_run
    lines = printed.splitlines()
    start = lines.index(
        f"qkvshare eval: writing to {out.resolve()}: results_table.md and, per model, lm-eval's results JSON:"
    )
    end = lines.index(f"qkvshare eval: table written to {out.resolve() / 'results_table.md'}; lm-eval's results JSON:")
    assert start < end
    for model in (checkpoint, llama_checkpoint):
        json_path = out.resolve() / slug(str(model)) / "results.json"
        assert json_path.is_file()
        assert lines[start + 1 :].index(f"  {model} -> {json_path}") < end - start  # announced before any work
        assert f"  {model} -> {json_path}" in lines[end + 1 :]  # and again at the end


def test_eval_refuses_two_models_with_one_results_dir(checkpoint, tmp_path, capsys):
    argv = ["eval", str(checkpoint), f"{checkpoint}/", "--data_dir", str(FIXTURES_DIR), "--output_dir", str(tmp_path)]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "would both write their results to" in err and slug(str(checkpoint)) in err


def test_eval_unwritable_output_dir_fails_first(checkpoint, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    argv = ["eval", str(checkpoint), "--data_dir", str(FIXTURES_DIR), "--output_dir", str(tmp_path / "a_file" / "out")]
    assert cli(argv) == 2
    assert "is not writable" in capsys.readouterr().err


def _damage(checkpoint: Path, tmp_path: Path, case: str) -> tuple[Path, str, str]:
    """A copy of `checkpoint` damaged as `case`: (model dir, file the message must name, what it must say)."""
    model = tmp_path / "model"
    shutil.copytree(checkpoint, model)
    weights = model / "model.safetensors"
    if case == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) - 100])  # a download cut short
        return model, str(weights), f"is truncated: {len(data) - 100:,} of {len(data):,} bytes"
    if case == "header_cut":
        weights.write_bytes(weights.read_bytes()[:50])
        return model, str(weights), "is truncated"
    if case == "missing":
        weights.unlink()
        return model, str(model), "has no weights (model.safetensors is missing)"
    if case == "missing_shard":
        weights.unlink()
        QKVShareForCausalLM.from_pretrained(checkpoint).save_pretrained(model, max_shard_size="40KB")
        shards = sorted(model.glob("model-*.safetensors"))
        assert len(shards) > 1
        shards[-1].unlink()
        return model, shards[-1].name, "missing from"
    if case == "corrupt_config":
        config = model / "config.json"
        config.write_text(config.read_text()[:40])
        return model, str(config), "is not valid JSON"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["truncated", "header_cut", "missing", "missing_shard", "corrupt_config"])
@pytest.mark.parametrize("command", ["eval", "perplexity", "analyze"])
def test_damaged_checkpoint_files_fail_first_with_the_file_named(command, case, checkpoint, tmp_path, capsys):
    model, named, says = _damage(checkpoint, tmp_path, case)
    argv = [command, str(model)]
    if command == "eval":
        argv += ["--data_dir", str(FIXTURES_DIR), "--output_dir", str(tmp_path / "out")]
    elif command == "perplexity":
        (tmp_path / "t.txt").write_text("some text\n")
        argv += ["--validation_file", str(tmp_path / "t.txt")]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert named in err and says in err, err
    assert "Re-download the model, or re-save it with save_pretrained" in err
    assert "Traceback" not in err and "SafetensorError" not in err
    assert not list((tmp_path / "out").rglob("results.json"))  # eval: nothing written for a broken model


def _with_weights(checkpoint: Path, tmp_path: Path, edit) -> Path:
    """A copy of `checkpoint` whose weights went through `edit(model)` (under no_grad)."""
    model = QKVShareForCausalLM.from_pretrained(checkpoint)
    with torch.no_grad():
        edit(model)
    path = tmp_path / "edited"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (checkpoint / name).exists():
            shutil.copy(checkpoint / name, path / name)
    return path


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("command", ["perplexity", "eval"])
def test_non_finite_weights_are_refused_naming_the_tensor(command, value, checkpoint, tmp_path, capsys):
    path = _with_weights(checkpoint, tmp_path, lambda m: m.model.layers[1].self_attn.k_proj.weight[0, :3].fill_(value))
    argv = [command, str(path), "--device", "cpu"]
    if command == "eval":
        argv += ["--data_dir", str(FIXTURES_DIR), "--limit", "1", "--output_dir", str(tmp_path / "out")]
    else:
        (tmp_path / "t.txt").write_text("\n\n".join(TEXTS))
        argv += ["--validation_file", str(tmp_path / "t.txt"), "--output_file", str(tmp_path / "ppl.json")]
    assert cli(argv) == 2
    captured = capsys.readouterr()
    kind = "3 NaN, 0 inf" if value != value else "0 NaN, 3 inf"
    assert f"has non-finite weights in 1 tensor(s): model.layers.1.self_attn.k_proj.weight ({kind} of" in captured.err
    assert "perplexity nan" not in captured.out and not (tmp_path / "ppl.json").exists()
    assert not list((tmp_path / "out").rglob("results.json"))


def test_perplexity_non_finite_loss_is_reported_not_printed(checkpoint, tmp_path, capsys):
    # Finite weights whose activations overflow float32 (final norm gain 3e38): the weight check passes, the logits
    # are inf - inf = NaN, so the loss is NaN.
    path = _with_weights(checkpoint, tmp_path, lambda m: m.model.norm.weight.fill_(3e38))
    (tmp_path / "t.txt").write_text("\n\n".join(TEXTS))
    out = tmp_path / "ppl.json"
    argv = ["perplexity", str(path), "--validation_file", str(tmp_path / "t.txt"), "--output_file", str(out)]
    assert cli(argv + ["--max_length", "24", "--stride", "8"]) == 1
    captured = capsys.readouterr()
    assert "the loss is not finite" in captured.err and "on the window of tokens 0..23" in captured.err
    assert "its logits hold NaN or inf" in captured.err and "--dtype float32" in captured.err
    assert "perplexity" not in captured.out and not out.exists()
    # finite but astronomically large losses (gain 1e30): exp(mean NLL) would overflow, and says so
    model, tok = (
        QKVShareForCausalLM.from_pretrained(checkpoint).eval(),
        PreTrainedTokenizerFast.from_pretrained(checkpoint),
    )
    with torch.no_grad():
        model.model.norm.weight.fill_(1e30)
    with pytest.raises(NonFiniteResultError, match=r"the perplexity overflows a float \(mean NLL .* nats per token\)"):
        perplexity(model, tok, TEXTS, max_length=24, stride=8)


def test_dtype_names_are_the_same_in_every_command(capsys):
    from qkvshare_settings import bench, perplexity
    from qkvshare_settings import eval as eval_cli

    parsers = {
        "eval": lambda d: eval_cli.parse_args(["m", "--dtype", d]).dtype,
        "perplexity": lambda d: perplexity.parse_args(["m", "--validation_file", "f", "--dtype", d]).dtype,
        "bench": lambda d: bench.parse_args(["--dtype", d]).dtype,
    }
    for name, parse in parsers.items():
        for alias, canonical in DTYPE_NAMES.items():
            assert parse(alias) == canonical, (name, alias)
        assert parse("BF16") == "bfloat16"
        with pytest.raises(SystemExit) as exit_:
            parse("float64")
        assert exit_.value.code == 2
        assert "'float64' is not a dtype; use auto, float32 (fp32), bfloat16 (bf16) or float16 (fp16)" in (
            capsys.readouterr().err
        )


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("d.jsonl", b'{"text": "fine"}\n{"text": "cut off\n', "line 2 is not valid JSON"),
        ("d.txt", b"good text\n\xff\xfe binary\n", "is not valid UTF-8 at line 2 (byte offset 10"),
        ("d.txt", b"text\x00with a NUL\n", "holds a NUL byte at line 1 (byte offset 4)"),
        ("d.txt", b"", "holds no text (the file is empty or has only whitespace)"),
        ("d.txt", b" \n\n\t\n", "holds no text (the file is empty or has only whitespace)"),
        ("d.jsonl", b"\n\n", "holds no text (the file is empty or has no line with a non-empty 'text')"),
    ],
)
def test_perplexity_damaged_text_file_is_named_before_loading(name, content, message, checkpoint, tmp_path, capsys):
    data = tmp_path / name
    data.write_bytes(content)
    assert cli(["perplexity", str(checkpoint), "--validation_file", str(data)]) == 2
    err = capsys.readouterr().err
    assert f"--validation_file {str(data)!r}" in err and message in err
