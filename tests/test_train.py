"""Tests of `qkvshare train` (issue 3): schedule, packing, a real tiny run, two gloo ranks, kill-and-resume,
non-finite loss and every bad input. Tiny preset, fp32, CPU; the corpus is a few stdlib modules as jsonl."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from commands import command
from safetensors.torch import load_file

import qkvshare  # noqa: F401  (registers the Auto classes)
import qkvshare_cli
from qkvshare.train.checkpoint import list_checkpoints, read_state
from qkvshare.train.data import BlockSchedule, PackedBlocks, is_validation_file, stdlib_corpus, tokenize_documents
from qkvshare.train.model import build_config
from qkvshare.train.pretrain import setup
from qkvshare.train.schedule import get_lr
from qkvshare.train.tokenizer import train_bpe_tokenizer
from qkvshare_settings.train import TrainingSetupError, parse_args

main = command("train")

REPO = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "PYTHONPATH": str(REPO),
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    """~60 kB of real documents (stdlib modules), one per jsonl row: fast to tokenize, learnable."""
    import json as json_module

    root = Path(json_module.__file__).parent.parent
    docs = [
        (root / name).read_text()
        for name in (
            "bisect.py",
            "colorsys.py",
            "keyword.py",
            "heapq.py",
            "shlex.py",
            "textwrap.py",
            "fnmatch.py",
            "glob.py",
            "string.py",
        )
    ]
    path = tmp_path_factory.mktemp("data") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def tiny_argv(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--preset",
        "tiny",
        "--train_file",
        str(corpus),
        "--output_dir",
        str(out),
        "--use_cpu",
        "true",
        "--validation_split_percentage",
        "20",
        "--block_size",
        "32",
        "--per_device_train_batch_size",
        "4",
        "--learning_rate",
        "3e-3",
        "--warmup_steps",
        "2",
        "--logging_steps",
        "2",
        "--eval_steps",
        "100",
        "--max_eval_samples",
        "8",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--sample_max_new_tokens",
        "0",
        *extra,
    ]


def without_preset(argv: list[str]) -> list[str]:
    """`argv` less its --preset (a run that starts from --init_from takes the model from there)."""
    return [a for i, a in enumerate(argv) if a != "--preset" and argv[i - 1] != "--preset"]


def run_losses(argv: list[str]) -> tuple[int, list[float]]:
    losses: list[float] = []
    rc = main(argv, on_step=lambda step, loss, model: losses.append(loss))
    return rc, losses


# --------------------------------------------------------------------------------------------------------------
def test_lr_schedule_values():
    kw = dict(peak_lr=1e-3, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert get_lr(0, **kw) == pytest.approx(1e-4)
    assert get_lr(4, **kw) == pytest.approx(5e-4)
    assert get_lr(9, **kw) == pytest.approx(1e-3)
    assert get_lr(10, **kw) == pytest.approx(1e-3)  # cosine starts at the peak
    assert get_lr(60, **kw) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway: the midpoint of peak and floor
    assert get_lr(35, **kw) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.25)))
    assert get_lr(110, **kw) == pytest.approx(1e-4)  # floor: 10% of the peak
    assert get_lr(500, **kw) == pytest.approx(1e-4)
    assert get_lr(0, peak_lr=2e-4, warmup_steps=0, max_steps=100) == pytest.approx(2e-4)


def test_packing_uses_every_token_once_without_padding():
    docs = [f"document {i} " + "word " * (i % 7 + 1) for i in range(200)]
    tok = train_bpe_tokenizer(docs, 320)
    tokens = tokenize_documents(tok, docs)
    per_doc = [tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for d in docs]
    np.testing.assert_array_equal(tokens, np.concatenate(per_doc))  # docs joined by EOS, nothing inserted
    assert int((tokens == tok.eos_token_id).sum()) == len(docs)
    T = 16
    blocks = PackedBlocks(tokens, T)
    n = len(blocks)
    assert n == (len(tokens) - 1) // T and len(tokens) - 1 - n * T < T  # only a tail shorter than a block is dropped
    # Two ranks x 2 micro-steps x batch 3 over one epoch: every block exactly once, and every target token once.
    seen = []
    steps = n // 12
    for rank in range(2):
        sched = BlockSchedule(n, seed=7, per_device_batch=3, accumulation=2, world_size=2, rank=rank)
        seen += [i for s in range(steps) for m in range(2) for i in sched.indices(s, m)]
    assert len(seen) == len(set(seen)) == steps * 12
    full = BlockSchedule(n, seed=7, per_device_batch=n, accumulation=1, world_size=1, rank=0)
    assert sorted(full.indices(0, 0)) == list(range(n))
    stacked = blocks.stack(sorted(full.indices(0, 0)))
    assert stacked.shape == (n, T + 1)  # every block full length: nothing to pad
    targets = stacked[:, 1:].reshape(-1)
    torch.testing.assert_close(targets, torch.from_numpy(tokens[1 : n * T + 1]).long(), rtol=0, atol=0)
    # The next epoch is another order of the same blocks.
    assert full.indices(1, 0) != full.indices(0, 0) and sorted(full.indices(1, 0)) == list(range(n))


def test_embedded_corpus_split_is_deterministic_and_disjoint():
    a, b = stdlib_corpus(5), stdlib_corpus(5)
    assert a.train == b.train and a.validation == b.validation
    assert len(a.train) > 300 and 10 < len(a.validation) < len(a.train) // 10
    assert not set(a.train) & set(a.validation)
    assert is_validation_file("json/decoder.py", 5) == is_validation_file("json/decoder.py", 5)


def test_hub_style_dataset_in_memory_and_streaming(tmp_path):
    """`--dataset_name` (a local dataset directory stands in for the hub), in memory and streamed per rank."""
    from qkvshare.train.data import StreamingTrainData, load_corpus
    from qkvshare_settings.train import DataArguments

    docs = [f"doc {i}: " + "alpha beta gamma " * (i % 5 + 1) + f"end {i}" for i in range(40)]
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    in_memory = load_corpus(DataArguments(dataset_name=str(tmp_path / "ds")))
    assert in_memory.validation == docs[:2] and in_memory.train == docs[2:]  # run_clm's split: first 5%

    args = DataArguments(dataset_name=str(tmp_path / "ds"), streaming=True, streaming_validation_documents=5)
    corpus = load_corpus(args, rank=0, world_size=1, seed=3)
    assert corpus.streaming and corpus.validation == docs[:5]
    shards = [[row["text"] for row in load_corpus(args, rank=r, world_size=2, seed=3).train] for r in range(2)]
    assert not set(shards[0]) & set(shards[1]) and sorted(shards[0] + shards[1]) == sorted(docs[5:])

    tok = train_bpe_tokenizer(docs, 320)
    stream = StreamingTrainData(corpus.train, tok, "text", 16, per_device_batch=2, accumulation=2)
    batches = [stream.batch(s, m) for s in range(3) for m in range(2)]
    blocks = torch.cat(batches)
    assert blocks.shape == (12, 17)
    corpus.train.set_epoch(0)
    expected = tokenize_documents(tok, [row["text"] for row in corpus.train])
    torch.testing.assert_close(blocks[:, 1:].reshape(-1), torch.from_numpy(expected[1 : 12 * 16 + 1]).long())
    resumed = StreamingTrainData(corpus.train, tok, "text", 16, per_device_batch=2, accumulation=2)
    assert torch.equal(resumed.batch(2, 0), batches[4])  # resume at step 2 reads what step 2 read


# The paper's variants at each size (docs/research.md, section 4.1): one recipe per size, the variant a flag.
PAPER_VARIANTS = {
    "paper-300m": ["QKV", "Q=K-V", "Q-K=V", "Q=K=V", "GQA-4", "MQA", "Q-GQA-4", "Q-MQA"],
    "paper-1.2b": ["QKV", "Q-K=V", "GQA-8", "MQA", "Q-GQA-8", "Q-MQA"],
}


def test_recipes_parse_and_build(tmp_path):
    recipes = sorted(p.stem for p in (REPO / "configs").rglob("*.yaml") if p.parent.name != "accelerate")
    assert recipes == ["cpu-small", "paper-1.2b", "paper-300m", "tiny", "uptrain-smollm2"]
    for size, variants in PAPER_VARIANTS.items():
        for variant in variants:
            args = parse_args([str(REPO / f"configs/{size}.yaml"), "--variant", variant])
            assert build_config(args.model.preset, args.model.variant, {}).variant == variant
            assert args.train.output_dir == f"outputs/{size}-{variant}"  # the recipe's {variant} filled in
            global_tokens = 8 * args.train.per_device_train_batch_size * args.train.gradient_accumulation_steps * 2048
            assert global_tokens * args.train.max_steps >= 10e9  # the paper's 10B tokens
            assert args.train.bf16 and args.train.adam_beta2 == 0.95 and args.train.weight_decay == 0.1
        with pytest.raises(TrainingSetupError, match=rf"'outputs/{size}-{{variant}}' after the variant, but no --var"):
            parse_args([str(REPO / f"configs/{size}.yaml")])
    given = parse_args([str(REPO / "configs/paper-300m.yaml"), "--variant", "MQA", "--output_dir", "runs/mqa"])
    assert given.train.output_dir == "runs/mqa"  # a flag wins over the recipe's directory
    for name in ("tiny", "cpu-small"):
        args = parse_args([str(REPO / f"configs/{name}.yaml")])
        assert build_config(args.model.preset, args.model.variant, {}).variant == args.model.variant
    small = parse_args([str(REPO / "configs/cpu-small.yaml"), "--max_steps", "7"])
    assert small.train.max_steps == 7 and small.model.variant == "Q-K=V" and small.model.preset == "small"
    (tmp_path / "config.json").write_text('{"model_type": "qkvshare"}')  # what --init_from's check reads
    uptrain = parse_args([str(REPO / "configs/uptrain-smollm2.yaml"), "--init_from", str(tmp_path)])
    assert uptrain.model.init_from == str(tmp_path) and uptrain.train.learning_rate == 3e-5


def test_bad_variant_of_a_recipe_stops_before_anything_is_written(tmp_path, capsys):
    """A misspelt --variant with a recipe whose run directory is named after it: the message names the variant,
    and no run directory appears for it."""
    import qkvshare_cli

    out = tmp_path / "paper-{variant}"
    assert (
        qkvshare_cli.main(
            ["train", str(REPO / "configs/paper-300m.yaml"), "--variant", "Q-K-V", "--output_dir", str(out)]
        )
        == 2
    )
    assert "variant='Q-K-V' is not a known variant; allowed: QKV" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------------------------
def test_tiny_run_lowers_loss_and_saves_loadable_model(corpus_file, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    rc, losses = run_losses(
        tiny_argv(
            corpus_file,
            out,
            "--max_steps",
            "30",
            "--variant",
            "Q-K=V",
            "--sample_max_new_tokens",
            "8",
            "--peak_tflops",
            "0.5",
        )
    )
    assert rc == 0 and len(losses) == 30
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses  # from ~ln(320)=5.8 down by more than a nat
    metrics = json.loads((out / "final_metrics.json").read_text())
    assert metrics["val_perplexity"] == pytest.approx(math.exp(metrics["val_loss"]))
    assert (
        metrics["val_tokens"] == 8 * 32
        and metrics["kv_cache_bytes_per_token"] * 2 == metrics["qkv_kv_cache_bytes_per_token"]
    )
    # PaLM's count: 6 x parameters (tied head = embedding) + 12 x layers x heads x head_dim x T
    assert metrics["flops_per_token"] == 6 * metrics["parameters"] + 12 * 2 * 4 * 16 * 32
    assert metrics["mfu"] == pytest.approx(metrics["tokens_per_second"] * metrics["flops_per_token"] / 0.5e12)
    printed = capsys.readouterr().out
    assert "validation perplexity" in printed and "50.0% smaller" in printed and "sample:" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_qkvshare.QKVShareForCausalLM"
    assert config["vocab_size"] % 64 == 0 and config["projection_sharing"] == "kv"
    assert (out / "model.safetensors").is_file() and (out / "modeling_qkvshare.py").is_file()
    saved_args = json.loads((out / "training_args.json").read_text())
    assert saved_args["block_size"] == 32 and saved_args["num_processes"] == 1 and saved_args["variant"] == "Q-K=V"
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) <= model.config.vocab_size
    ids = tok("def ", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert gen.shape == (1, ids.shape[1] + 6)
    # The saved weights reproduce the final validation loss.
    from qkvshare.train.data import load_corpus

    val = PackedBlocks(
        tokenize_documents(tok, load_corpus(parse_args(tiny_argv(corpus_file, out)).data).validation), 32, 8
    )
    with torch.no_grad():
        logits = model(val.stack(list(range(8)))[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), val.stack(list(range(8)))[:, 1:].flatten())
    assert loss.item() == pytest.approx(metrics["val_loss"], rel=1e-4)


# --------------------------------------------------------------------------------------------------------------
CAPTURE_SOURCE = textwrap.dedent(
    """
    import json
    from safetensors.torch import save_file
    from qkvshare_settings.train import parse_args
    from qkvshare.train.pretrain import setup, train_step

    def capture(args_list, out_prefix):
        \"\"\"Two optimizer steps; write the losses and the gradients each step sees (after DDP's all-reduce).\"\"\"
        run = setup(parse_args(args_list))
        grads, losses = {}, []
        def hook(opt, *a, **k):  # runs inside optimizer.step: gradients after the DDP all-reduce
            for name, p in run.accelerator.unwrap_model(run.model).named_parameters():
                grads[f"{len(losses)}.{name}"] = p.grad.detach().clone()
        run.optimizer.optimizer.register_step_pre_hook(hook)
        try:
            for step in range(2):
                losses.append(train_step(run, step)[0])
        finally:
            run.release()
        if run.accelerator.is_main_process:
            save_file(grads, out_prefix + ".safetensors")
            json.dump({"losses": losses, "num_processes": run.accelerator.num_processes,
                       "distributed_type": str(run.accelerator.distributed_type)}, open(out_prefix + ".json", "w"))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a multi-process launch (`accelerate launch`, `torchrun`). One still running after `timeout` seconds is a
    hang: every process gets SIGABRT, so faulthandler prints where each one waits, and the test fails showing that."""
    proc = subprocess.Popen(
        cmd,
        env=ENV | {"PYTHONFAULTHANDLER": "1"},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"{shlex.join(cmd[:4])} ... hung ({timeout} s); stdout:\n{out[-2000:]}\nstderr:\n{err[-12000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch(cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`accelerate launch *args` on this machine, on a free port (see `run_ranks` for a hang)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--dynamo_backend", "no"]
    return run_ranks([*cmd, "--main_process_port", str(_free_port()), *args], cwd, timeout)


def without_use_cpu(argv: list[str]) -> list[str]:
    i = argv.index("--use_cpu")
    return argv[:i] + argv[i + 2 :]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the path of a machine without GPUs")
def test_multi_gpu_launch_without_gpu_gives_two_gloo_ranks_that_match_one_process(corpus_file, tmp_path):
    """`accelerate launch --multi_gpu` on a machine without GPUs trains as two real CPU ranks (not two separate
    runs): with batch 2 each and gradient accumulation 2, every step's loss and all-reduced gradients are those of
    one process with batch 4."""
    script = tmp_path / "ddp_capture.py"
    script.write_text(CAPTURE_SOURCE + "\nimport sys\ncapture(sys.argv[2:], sys.argv[1])\n")
    common = ["--max_steps", "2", "--gradient_accumulation_steps", "2", "--max_grad_norm", "0", "--save_steps", "0"]
    two = without_use_cpu(tiny_argv(corpus_file, tmp_path / "two", "--per_device_train_batch_size", "2", *common))
    ranks = ["--multi_gpu", "--num_processes", "2", "--mixed_precision", "no"]
    proc = launch(tmp_path, *ranks, str(script), str(tmp_path / "two_ranks"), *two)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("no GPU found: the 2 processes train as CPU ranks over gloo") == 1
    namespace: dict = {}
    exec(CAPTURE_SOURCE, namespace)  # the one-process reference, in this process
    one = tiny_argv(corpus_file, tmp_path / "one", "--per_device_train_batch_size", "4", *common)
    namespace["capture"](one, str(tmp_path / "one_rank"))
    a, b = json.loads((tmp_path / "two_ranks.json").read_text()), json.loads((tmp_path / "one_rank.json").read_text())
    assert a["num_processes"] == 2 and "MULTI" in a["distributed_type"] and b["num_processes"] == 1
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)
    ga, gb = load_file(tmp_path / "two_ranks.safetensors"), load_file(tmp_path / "one_rank.safetensors")
    assert set(ga) == set(gb) and len(ga) > 10
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-6, msg=name)


# --------------------------------------------------------------------------------------------------------------
KILL_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    from qkvshare_cli import main

    log = open(sys.argv[1], "w")
    def on_step(step, loss, model):
        log.write(json.dumps([step, loss]) + "\\n"); log.flush()
        if step == 6:
            os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(main(["train", *sys.argv[2:]], on_step=on_step))
    """
)


def test_sigkill_then_resume_reproduces_uninterrupted_losses(corpus_file, tmp_path):
    common = ["--max_steps", "9", "--save_steps", "4", "--gradient_accumulation_steps", "2"]
    rc, reference = run_losses(tiny_argv(corpus_file, tmp_path / "ref", *common))
    assert rc == 0 and len(reference) == 9
    script, log = tmp_path / "kill.py", tmp_path / "killed.jsonl"
    script.write_text(KILL_SCRIPT)
    killed_dir = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, str(script), str(log), *tiny_argv(corpus_file, killed_dir, *common)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    before = [loss for _, loss in map(json.loads, log.read_text().splitlines())]
    assert before == pytest.approx(reference[:6], rel=1e-5)  # same run up to the kill (other thread count)
    assert [p.name for p in list_checkpoints(killed_dir)] == ["checkpoint-4"]
    state_file = list_checkpoints(killed_dir)[0] / "trainer_state.json"
    assert json.loads(state_file.read_text())["train_seconds"] > 0  # steps 1-4, before the kill
    # a known time for the first part, so that what the resumed run carries over is exact, not timing noise
    state_file.write_text(json.dumps(json.loads(state_file.read_text()) | {"train_seconds": 1000.0}))
    (killed_dir / "checkpoints" / ".tmp-checkpoint-8").mkdir()  # a save that crashed midway is ignored
    rc, after = run_losses(tiny_argv(corpus_file, killed_dir, *common, "--resume_from_checkpoint", "latest"))
    assert rc == 0
    assert after == reference[4:]  # steps 5..9, bit for bit
    ref_w = load_file(tmp_path / "ref" / "model.safetensors")
    new_w = load_file(killed_dir / "model.safetensors")
    assert all(torch.equal(ref_w[k], new_w[k]) for k in ref_w)
    assert read_state(list_checkpoints(killed_dir)[-1])["step"] == 8
    # the steps' time adds up over the two parts (steps 5-6, redone after the kill, count once)
    final = json.loads((killed_dir / "final_metrics.json").read_text())
    assert 1000 < read_state(list_checkpoints(killed_dir)[-1])["train_seconds"] < final["train_seconds"] < 1300
    assert final["train_tokens_per_second"] == pytest.approx(final["tokens_seen"] / final["train_seconds"], rel=0.01)
    assert not (killed_dir / "checkpoints" / ".tmp-checkpoint-8").exists()


def test_non_finite_loss_stops_and_keeps_last_checkpoint(corpus_file, tmp_path, capsys):
    def poison(step, loss, model):
        if step == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))

    out = tmp_path / "nan"
    rc = main(tiny_argv(corpus_file, out, "--max_steps", "6", "--save_steps", "2"), on_step=poison)
    assert rc == 1
    err = capsys.readouterr().err
    assert "loss became nan at step 3" in err and "checkpoint-2" in err and "--learning_rate" in err
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]
    weights = load_file(out / "checkpoints" / "checkpoint-2" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not (out / "model.safetensors").exists()


# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(corpus_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(tiny_argv(corpus_file, out, "--max_steps", "2", "--save_steps", "2")) == 0
    return out


def _bad_inputs(corpus: Path, tmp: Path, finished: Path) -> dict[str, tuple[list[str], str]]:
    empty = tmp / "empty.jsonl"
    empty.write_text(json.dumps({"text": "   "}) + "\n")
    new = tmp / "new"
    return {
        "missing dataset": (tiny_argv(tmp / "nope.jsonl", new), "does not exist"),
        "empty dataset": (tiny_argv(empty, new), f"--train_file {str(empty)!r} holds no text"),
        "unknown hub dataset": (
            [
                "--preset",
                "tiny",
                "--dataset_name",
                "someone/no_such_dataset",
                "--output_dir",
                str(new),
                "--use_cpu",
                "true",
                "--report_to",
                "none",
            ],
            "could not load dataset",
        ),
        "unknown preset": (tiny_argv(corpus, new, "--preset", "huge"), "preset='huge' is not a known preset"),
        "unknown variant": (tiny_argv(corpus, new, "--variant", "QQ"), "variant='QQ' is not a known variant"),
        "tokenizer above vocab": (
            tiny_argv(corpus, new, "--config_overrides", "vocab_size=64"),
            "tokenizer has 320 tokens but vocab_size=64",
        ),
        "block above positions": (
            tiny_argv(corpus, new, "--block_size", "256"),
            "--block_size 256 exceeds the model's max_position_embeddings=128",
        ),
        "output dir holds a run": (tiny_argv(corpus, finished), "already holds another run"),
        "incompatible checkpoint": (
            tiny_argv(corpus, finished, "--variant", "Q=K=V", "--resume_from_checkpoint", "latest"),
            "incompatible run:\n  model projection_sharing",
        ),
        "no checkpoint to resume": (
            tiny_argv(corpus, new, "--resume_from_checkpoint", "latest"),
            "no complete checkpoint",
        ),
        "bf16 and fp16": (tiny_argv(corpus, new, "--bf16", "true", "--fp16", "true"), "choose one of --bf16"),
        "bad override": (tiny_argv(corpus, new, "--config_overrides", "hidden_size"), "is not key=value"),
    }


BAD_CASES = [
    "missing dataset",
    "empty dataset",
    "unknown hub dataset",
    "unknown preset",
    "unknown variant",
    "tokenizer above vocab",
    "block above positions",
    "output dir holds a run",
    "incompatible checkpoint",
    "no checkpoint to resume",
    "bf16 and fp16",
    "bad override",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_fails_before_training(case, corpus_file, finished_run, tmp_path, capsys):
    argv, message = _bad_inputs(corpus_file, tmp_path, finished_run)[case]
    before = sorted(p.name for p in finished_run.rglob("*"))
    rc = main(argv, on_step=lambda *a: pytest.fail("training started"))
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "new" / "checkpoints").exists()
    assert sorted(p.name for p in finished_run.rglob("*")) == before  # the finished run is untouched


def test_cli_dispatches_train(corpus_file, tmp_path, capsys):
    assert qkvshare_cli.main(["train", *tiny_argv(corpus_file, tmp_path / "cli", "--variant", "Q-GQA-3")]) == 2
    assert "3 key/value heads must divide num_attention_heads=4" in capsys.readouterr().err


def test_unknown_yaml_key_is_rejected(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("preset: tiny\nlearning_rat: 0.1\n")
    with pytest.raises(TrainingSetupError, match=r"unknown keys \['learning_rat'\]"):
        parse_args([str(recipe)])
    with pytest.raises(TrainingSetupError, match="required"):
        setup(parse_args(["--preset", "tiny"]))


def test_trainable_modules_train_only_those_and_are_part_of_a_resumable_run(corpus_file, tmp_path, capsys):
    from safetensors.torch import load_file

    base = tmp_path / "base"
    assert main(tiny_argv(corpus_file, base, "--max_steps", "2")) == 0
    out = tmp_path / "attention-only"
    argv = tiny_argv(corpus_file, out, "--init_from", str(base), "--max_steps", "2", "--save_steps", "1")
    argv = without_preset(argv)
    assert main([*argv, "--trainable_modules", "self_attn"]) == 0
    before, after = load_file(base / "model.safetensors"), load_file(out / "model.safetensors")
    changed = sorted(name for name in before if not torch.equal(before[name], after[name]))
    assert changed and all(".self_attn." in name for name in changed)  # embeddings, norms and MLPs as they were
    assert {n for n in before if ".self_attn." in n and n.endswith("weight")} <= set(changed)
    state = json.loads(
        sorted((out / "checkpoints").glob("checkpoint-*"))[-1].joinpath("trainer_state.json").read_text()
    )
    assert state["trainable_modules"] == ["self_attn"]
    # resuming with another choice would load an optimizer for other parameters: refused, naming it
    assert main([*argv, "--max_steps", "3", "--resume_from_checkpoint", "latest", "--trainable_modules", "mlp"]) == 2
    assert "trainable_modules: checkpoint ['self_attn'], now ['mlp']" in capsys.readouterr().err
    assert main([*tiny_argv(corpus_file, tmp_path / "none"), "--trainable_modules", "cross_attn"]) == 2
    assert "--trainable_modules cross_attn matches no parameter of the model" in capsys.readouterr().err


def test_distill_settings_reach_the_training_run(tmp_path):
    from qkvshare_settings.train import DistillSettings, distill_arguments

    settings = DistillSettings(tokens=5000, batch_size=2, block_size=256, trainable_modules=["self_attn"])
    args = distill_arguments("student", "teacher", "t.jsonl", "v.jsonl", str(tmp_path / "run"), settings)
    assert args.model.teacher == "teacher" and args.model.init_from == "student"
    assert args.train.max_steps == 10 and args.train.trainable_modules == ["self_attn"]  # ceil(5000 / 512)
    assert distill_arguments("s", "t", "a", "b", str(tmp_path), DistillSettings()).train.trainable_modules is None
    assert args.train.distill_hidden_weight == 0
    # stage (c) on Qwen2.5-Coder-0.5B was killed for memory in its final validation, 8 blocks at once (the default)
    # where its steps ran one block a pass to fit: validation now runs in the passes' size
    micro = DistillSettings(tokens=5000, batch_size=4, micro_batch_size=1)
    assert distill_arguments("s", "t", "a", "b", str(tmp_path), micro).train.per_device_eval_batch_size == 1
    assert args.train.per_device_eval_batch_size == 2
    weighted = DistillSettings(tokens=5000, hidden_weight=0.5)
    assert distill_arguments("s", "t", "a", "b", str(tmp_path), weighted).train.distill_hidden_weight == 0.5
    relative = DistillSettings(tokens=5000, relative_learning_rates=True)
    assert distill_arguments("s", "t", "a", "b", str(tmp_path), relative).train.relative_learning_rates is True
    assert args.train.relative_learning_rates is False
    warm = DistillSettings(tokens=5000, warmup_steps=3)  # 3 steps of 4 x 512 tokens
    assert distill_arguments("s", "t", "a", "b", str(tmp_path), warm).train.warmup_steps == 3
    assert args.train.warmup_steps == 2
    short = DistillSettings(tokens=1000)  # one step: the default warmup is cut to it (the step at the peak)
    assert distill_arguments("s", "t", "a", "b", str(tmp_path), short).train.warmup_steps == 1


def test_relative_lr_scales_are_rms_over_the_median_matrix_rms_clamped():
    from qkvshare.train.pretrain import relative_lr_scales

    params = [torch.full((2, 3), 1.0), torch.full((4, 2), 2.0), torch.full((3, 3), -4.0), torch.full((5,), 0.01)]
    params.append(torch.full((3,), 0.5))
    # matrices' RMS 1, 2, 4: median 2; the vectors' 0.01 and 0.5 are scaled by it too
    assert relative_lr_scales(params) == pytest.approx([0.5, 1.0, 1.0, 0.1, 0.25])
    with pytest.raises(TrainingSetupError, match="no weight matrix trains"):
        relative_lr_scales([torch.ones(3)])


def test_relative_learning_rates_scale_each_parameters_step_and_are_part_of_a_resumable_run(
    corpus_file, tmp_path, capsys
):
    """--relative_learning_rates: AdamW's update is linear in the learning rate, so each parameter's first step is
    exactly its scale (`relative_lr_scales` of the starting weights) times the plain run's; a resumed run keeps the
    per-parameter groups (bit for bit the uninterrupted run) and a resume with the other choice is refused."""
    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    assert main(tiny_argv(corpus_file, base, "--max_steps", "2")) == 0
    start = load_file(base / "model.safetensors")
    small = sorted(name for name in start if name.endswith("o_proj.weight"))
    start[small[0]] *= 0.01  # a weight far below the median (clamped to 0.1) and one part way
    start[small[1]] *= 0.4
    save_file(start, base / "model.safetensors", metadata={"format": "pt"})

    def run(name: str, steps: int, *extra: str) -> dict[str, torch.Tensor]:
        argv = tiny_argv(corpus_file, tmp_path / name, "--init_from", str(base), "--max_steps", str(steps), *extra)
        argv = without_preset(argv)
        assert main(argv) == 0, capsys.readouterr().err
        return load_file(tmp_path / name / "model.safetensors")

    plain = run("plain", 1)
    relative = run("relative", 1, "--relative_learning_rates", "true")
    matrices = [w.float().pow(2).mean().sqrt().item() for w in start.values() if w.ndim >= 2]
    median = torch.tensor(matrices).median().item()
    scales = {}
    for name, w in start.items():
        scales[name] = min(1.0, max(0.1, w.float().pow(2).mean().sqrt().item() / median))
        torch.testing.assert_close(relative[name] - w, scales[name] * (plain[name] - w), rtol=1e-3, atol=1e-7)
    assert scales[small[0]] == 0.1 and 0.2 < scales[small[1]] < 0.6 and max(scales.values()) == 1.0

    whole = run("whole", 3, "--relative_learning_rates", "true")
    run("parts", 3, "--relative_learning_rates", "true", "--save_steps", "1")
    second = str(tmp_path / "parts" / "checkpoints" / "checkpoint-2")
    resumed = run("parts", 3, "--relative_learning_rates", "true", "--resume_from_checkpoint", second)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    argv = tiny_argv(corpus_file, tmp_path / "parts", "--init_from", str(base), "--max_steps", "4")
    argv = without_preset(argv)
    assert main([*argv, "--resume_from_checkpoint", "latest"]) == 2
    assert "relative_learning_rates: checkpoint True, now False" in capsys.readouterr().err


def test_whole_parameter_flags_under_fsdp_are_refused_before_the_output_folder_is_claimed(
    corpus_file, tmp_path, capsys, monkeypatch
):
    """FSDP and DeepSpeed shard each parameter across processes, so its RMS (the relative scale) is not one
    process's to measure, nor an o_proj's whole weight and bias one process's to centre: both flags refused, naming
    the flag and what to do, before data, model or output folder."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from qkvshare.train import pretrain

    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        monkeypatch.setattr(
            pretrain, "make_accelerator", lambda args, kind=kind: SimpleNamespace(distributed_type=kind)
        )
        out = tmp_path / kind.value
        assert main([*tiny_argv(corpus_file, out), "--relative_learning_rates", "true"]) == 2
        err = capsys.readouterr().err
        assert (
            f"--relative_learning_rates scales each whole parameter's learning rate, which {kind.value} shards" in err
        )
        assert "train with DDP or one process, or drop the flag" in err and not out.exists()
        assert main([*tiny_argv(corpus_file, out), "--centre_output_projections", "true"]) == 2
        err = capsys.readouterr().err
        assert (
            f"--centre_output_projections updates each o_proj's whole weight and bias together, which {kind.value}"
            in err
        )
        assert not out.exists()
