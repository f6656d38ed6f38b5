"""Tests of `qkvshare train` never losing work and failing early (issue 9): multi-process launches without GPUs,
the output directory's lock, --overwrite_output_dir and resume safety, verified checkpoints, SIGTERM/Ctrl-C,
a full disk, clear errors for every bad flag, FSDP2 on CPU ranks, and the one home of the LR schedule and the
Llama twin config. Tiny preset, fp32, CPU; helpers and the corpus come from test_train.py."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import test_train
import torch
from commands import command
from safetensors.torch import load_file
from test_train import ENV, REPO, launch, run_losses, tiny_argv, without_use_cpu

import qkvshare.train.pretrain as pretrain
from qkvshare.train.checkpoint import (
    LOCK_FILE,
    describe_write_error,
    list_checkpoints,
    read_state,
    verify_checkpoint,
)
from qkvshare.train.pretrain import resume_command

main = command("train")

corpus_file = test_train.corpus_file  # the same ~60 kB corpus fixture
COMMON = ["--max_steps", "6", "--save_steps", "0"]


def _metrics(out: Path) -> dict:
    return json.loads((out / "final_metrics.json").read_text())


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes: equal snapshots mean nothing was touched."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(corpus_file, tmp_path_factory) -> tuple[list[float], float]:
    """Losses and final validation loss of an uninterrupted 6-step run: what every stopped-and-resumed run must give."""
    out = tmp_path_factory.mktemp("reference") / "run"
    rc, losses = run_losses(tiny_argv(corpus_file, out, *COMMON))
    assert rc == 0 and len(losses) == 6
    return losses, _metrics(out)["val_loss"]


@pytest.fixture(scope="module")
def finished(corpus_file, tmp_path_factory) -> Path:
    """A finished 2-step run with checkpoint-2."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(tiny_argv(corpus_file, out, "--max_steps", "2", "--save_steps", "2")) == 0
    return out


# --------------------------------------------------------------------------------------------------------------
# Item 7: SIGTERM and Ctrl-C save a checkpoint and print how to resume
# --------------------------------------------------------------------------------------------------------------
def test_ctrl_c_before_first_checkpoint_saves_one_and_resume_matches_uninterrupted(
    corpus_file, tmp_path, reference, capsys
):
    out = tmp_path / "run"
    argv = tiny_argv(corpus_file, out, *COMMON)  # --save_steps 0: no checkpoint would ever be written
    handler_before = signal.getsignal(signal.SIGINT)

    def press_ctrl_c(step, loss, model):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    assert main(argv, on_step=press_ctrl_c) == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert f"SIGINT received: stopped after step 3 of 6 and saved checkpoint {out}/checkpoints/checkpoint-3" in err
    assert "qkvshare train --preset tiny" in err and err.rstrip().endswith("--resume_from_checkpoint latest")
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3"]
    assert verify_checkpoint(out / "checkpoints" / "checkpoint-3") is None
    assert not (out / LOCK_FILE).exists() and signal.getsignal(signal.SIGINT) is handler_before  # restored
    rc, after = run_losses([*argv, "--resume_from_checkpoint", "latest"])
    losses, val_loss = reference
    assert rc == 0 and after == losses[3:]  # steps 4..6, bit for bit
    assert _metrics(out)["val_loss"] == val_loss


def test_second_ctrl_c_quits_at_once_without_saving(corpus_file, tmp_path, capsys):
    out = tmp_path / "run"

    def press_twice(step, loss, model):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # first: stop after this step, saving
            os.kill(os.getpid(), signal.SIGINT)  # second: quit now

    assert main(tiny_argv(corpus_file, out, *COMMON), on_step=press_twice) == 128 + signal.SIGINT
    assert "interrupted; nothing saved since the last checkpoint" in capsys.readouterr().err
    assert list_checkpoints(out) == [] and not (out / LOCK_FILE).exists()


SIGTERM_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from qkvshare_cli import main

    log, go = sys.argv[1], sys.argv[2]
    def on_step(step, loss, model):
        with open(log, "a") as f:
            f.write(json.dumps([step, loss]) + "\\n")
        if step == 2:  # hold the run here until the test has tried a second run and sent SIGTERM
            deadline = time.time() + 120
            while not os.path.exists(go) and time.time() < deadline:
                time.sleep(0.05)
    sys.exit(main(["train", *sys.argv[3:]], on_step=on_step))
    """
)


def test_sigterm_from_outside_saves_and_a_second_run_meanwhile_is_refused(corpus_file, tmp_path, reference, capsys):
    out, log, go = tmp_path / "run", tmp_path / "steps.jsonl", tmp_path / "go"
    script = tmp_path / "sigterm.py"
    script.write_text(SIGTERM_SCRIPT)
    argv = tiny_argv(corpus_file, out, *COMMON)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(log), str(go), *argv],
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 300
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):  # the run waits in step 2's hook
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, "the training subprocess did not reach step 2"
            time.sleep(0.1)
        # Item 11: a second run on the same directory while the first runs is refused, naming the holder.
        assert main(argv, on_step=lambda *a: pytest.fail("second run started")) == 2
        err = capsys.readouterr().err
        assert f"is in use by another run: process {proc.pid} on this host" in err and str(out / LOCK_FILE) in err
        lock = json.loads((out / LOCK_FILE).read_text())
        assert lock["pid"] == proc.pid and lock["host"] == socket.gethostname() and lock["started"]
        proc.send_signal(signal.SIGTERM)
        go.touch()
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert f"SIGTERM received: stopped after step 2 of 6 and saved checkpoint {out}/checkpoints/checkpoint-2" in stderr
    assert "Traceback" not in stderr and "--resume_from_checkpoint latest" in stderr
    assert not (out / LOCK_FILE).exists()
    assert verify_checkpoint(out / "checkpoints" / "checkpoint-2") is None
    rc, after = run_losses([*argv, "--resume_from_checkpoint", "latest"])
    losses, val_loss = reference
    assert rc == 0 and after == pytest.approx(losses[2:], rel=1e-5)  # the checkpoint came from another thread count
    assert _metrics(out)["val_loss"] == pytest.approx(val_loss, rel=1e-5)


def test_resume_command_replaces_the_resume_flag():
    argv = [
        "r.yaml",
        "--resume_from_checkpoint",
        "out/checkpoints/checkpoint-2",
        "--max_steps",
        "9",
        "--resume_from_checkpoint=x",
        "--output_dir",
        "my out",
    ]
    assert resume_command(argv) == (
        "qkvshare train r.yaml --max_steps 9 --output_dir 'my out' --resume_from_checkpoint latest"
    )


# --------------------------------------------------------------------------------------------------------------
# Item 11: the lock
# --------------------------------------------------------------------------------------------------------------
def test_lock_of_a_live_process_refuses_and_a_stale_one_is_taken_over(corpus_file, tmp_path, capsys):
    from qkvshare.train.checkpoint import _process_start

    out = tmp_path / "run"
    out.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        holder = {
            "pid": sleeper.pid,
            "host": socket.gethostname(),
            "pid_start": _process_start(sleeper.pid),
            "started": "2026-01-01T00:00:00+00:00",
            "command": "qkvshare train elsewhere",
        }
        (out / LOCK_FILE).write_text(json.dumps(holder))
        argv = tiny_argv(corpus_file, out, "--max_steps", "2")
        assert main(argv, on_step=lambda *a: pytest.fail("training started")) == 2
        err = capsys.readouterr().err
        assert (
            f"process {sleeper.pid} on this host, started 2026-01-01T00:00:00+00:00 (qkvshare train elsewhere)" in err
        )
        assert json.loads((out / LOCK_FILE).read_text()) == holder  # not taken from a live process
    finally:
        sleeper.kill()
        sleeper.wait()
    assert main(argv) == 0  # the holder is gone: its lock is stale
    assert f"removed the stale lock {out / LOCK_FILE} of process {sleeper.pid}" in capsys.readouterr().err
    assert not (out / LOCK_FILE).exists()
    # A live pid that is another process than the one that wrote the lock (pid reuse) is stale too.
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": "1", "started": "earlier"}
    (out / LOCK_FILE).write_text(json.dumps(holder))
    assert main([*argv, "--overwrite_output_dir", "true"]) == 0
    assert f"of process {os.getpid()}" in capsys.readouterr().err


def test_read_only_output_dir_fails_before_the_tokenizer_is_trained(corpus_file, tmp_path, monkeypatch, capsys):
    locked = tmp_path / "read-only"
    locked.mkdir()
    if os.geteuid() == 0:  # root ignores permission bits; the immutable attribute binds it too
        subprocess.run(["chattr", "+i", str(locked)], capture_output=True)
    else:
        locked.chmod(0o555)
    try:
        try:
            (locked / "probe").touch()
        except OSError:
            pass
        else:
            pytest.skip("cannot make a read-only directory on this filesystem")
        monkeypatch.setattr(pretrain, "load_corpus", lambda *a, **k: pytest.fail("data loaded"))
        monkeypatch.setattr(pretrain, "train_bpe_tokenizer", lambda *a, **k: pytest.fail("BPE trained"))
        assert main(tiny_argv(corpus_file, locked)) == 2
        assert f"--output_dir {locked} is not writable" in capsys.readouterr().err
        assert main(tiny_argv(corpus_file, locked / "run")) == 2
        assert f"--output_dir {locked / 'run'} cannot be created" in capsys.readouterr().err
    finally:
        subprocess.run(["chattr", "-i", str(locked)], capture_output=True)
        locked.chmod(0o755)


# --------------------------------------------------------------------------------------------------------------
# Items 2 and 10: other runs' directories are never touched by mistake
# --------------------------------------------------------------------------------------------------------------
def test_resume_from_another_runs_checkpoint_into_a_run_dir_is_refused(corpus_file, finished, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(finished, other)  # a second finished run, in its own directory
    before = _snapshot(other)
    source = finished / "checkpoints" / "checkpoint-2"
    argv = tiny_argv(corpus_file, other, "--max_steps", "4", "--save_steps", "1", "--save_total_limit", "1")
    assert main([*argv, "--resume_from_checkpoint", str(source)], on_step=lambda *a: pytest.fail("trained")) == 2
    err = capsys.readouterr().err
    assert f"--output_dir {other} already holds another run" in err and "belongs to another directory" in err
    assert _snapshot(other) == before
    # Forking into a new directory is fine, and leaves the source run as it was.
    source_before = _snapshot(finished)
    fork = tmp_path / "fork"
    rc, losses = run_losses(tiny_argv(corpus_file, fork, "--max_steps", "3", "--resume_from_checkpoint", str(source)))
    assert rc == 0 and len(losses) == 1 and _metrics(fork)["step"] == 3
    assert _snapshot(finished) == source_before


def test_overwrite_output_dir_checks_every_input_before_deleting(corpus_file, finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = _snapshot(out)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": "  "}) + "\n")
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "a few words only"}) + "\n" + json.dumps({"text": "and a second one"}) + "\n")
    bad = {
        f"--train_file {str(empty)!r} holds no text": tiny_argv(empty, out),
        "tokenizer has 320 tokens but vocab_size=64": tiny_argv(
            corpus_file, out, "--config_overrides", "vocab_size=64"
        ),
        "fewer than one block": tiny_argv(short, out, "--validation_split_percentage", "50"),
    }
    for message, argv in bad.items():
        assert main([*argv, "--overwrite_output_dir", "true"], on_step=lambda *a: pytest.fail("trained")) == 2
        assert message in capsys.readouterr().err
        assert _snapshot(out) == before, message
    assert main(tiny_argv(corpus_file, out, "--max_steps", "1", "--overwrite_output_dir", "true")) == 0
    assert "deleting the previous run" in capsys.readouterr().err
    assert list_checkpoints(out) == [] and _metrics(out)["step"] == 1  # the old checkpoint-2 is gone with its run
    # A directory that holds no run is never emptied.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(tiny_argv(corpus_file, mine, "--overwrite_output_dir", "true")) == 2
    assert "holds files that are not a training run's (notes.txt)" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep me"


# --------------------------------------------------------------------------------------------------------------
# Item 12: checkpoints are verified on resume
# --------------------------------------------------------------------------------------------------------------
def test_truncated_newest_checkpoint_falls_back_and_an_explicit_one_is_named(corpus_file, tmp_path, reference, capsys):
    out = tmp_path / "run"
    argv = tiny_argv(corpus_file, out, "--max_steps", "6", "--save_steps", "2", "--save_total_limit", "3")

    def terminated_at_4(step, loss, model):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    assert main(argv, on_step=terminated_at_4) == 128 + signal.SIGTERM
    weights = out / "checkpoints" / "checkpoint-4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a save cut short
    capsys.readouterr()

    assert main([*argv, "--resume_from_checkpoint", str(weights.parent)]) == 2
    err = capsys.readouterr().err
    assert f"is broken: {weights} is truncated" in err and "checkpoint-2" in err

    rc, after = run_losses([*argv, "--resume_from_checkpoint", "latest"])
    err = capsys.readouterr().err
    assert f"skipping the incomplete checkpoint checkpoint-4: {weights} is truncated" in err
    assert f"resuming from {out}/checkpoints/checkpoint-2 (step 2)" in err
    losses, val_loss = reference
    assert rc == 0 and after == losses[2:] and _metrics(out)["val_loss"] == val_loss
    assert verify_checkpoint(weights.parent) is None  # rewritten whole at step 4

    (out / "checkpoints" / "checkpoint-6" / "optimizer.bin").unlink()
    assert main([*argv, "--max_steps", "7", "--resume_from_checkpoint", str(out / "checkpoints/checkpoint-6")]) == 2
    assert f"{out}/checkpoints/checkpoint-6/optimizer.bin is missing" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------
# Item 6: a full disk
# --------------------------------------------------------------------------------------------------------------
def test_disk_full_while_saving_keeps_the_previous_checkpoint(corpus_file, tmp_path, reference, monkeypatch, capsys):
    from accelerate import Accelerator

    real_save, calls = Accelerator.save_state, []

    def save_state(self, output_dir=None, **kwargs):
        calls.append(output_dir)
        if len(calls) == 2:  # the second checkpoint hits a full disk halfway
            (Path(output_dir) / "model.safetensors").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(output_dir) / "optimizer.bin"))
        return real_save(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", save_state)
    out = tmp_path / "run"
    argv = tiny_argv(corpus_file, out, "--max_steps", "6", "--save_steps", "2")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"could not write checkpoint-4 under {out}/checkpoints: the disk is full (no space left on device; " in err
    assert "the previous checkpoint checkpoint-2 is intact" in err and "--resume_from_checkpoint latest" in err
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"] and not (
        out / "checkpoints/.tmp-checkpoint-4"
    ).exists()
    assert verify_checkpoint(out / "checkpoints/checkpoint-2") is None and not (out / LOCK_FILE).exists()
    monkeypatch.setattr(Accelerator, "save_state", real_save)
    rc, after = run_losses([*argv, "--resume_from_checkpoint", "latest"])
    losses, val_loss = reference
    assert rc == 0 and after == losses[2:] and _metrics(out)["val_loss"] == val_loss  # nothing lost


def test_disk_full_inside_torch_save_is_named_a_full_disk(corpus_file, tmp_path, monkeypatch, capsys):
    """torch's writer reports a full disk as "unexpected pos N vs M" (no errno): with almost no free space left,
    that is the full disk, and the message gives the free space and the size of the intact previous checkpoint."""
    from collections import namedtuple

    from accelerate import Accelerator

    real_save, real_usage, calls, kept = Accelerator.save_state, shutil.disk_usage, [], {}
    usage = namedtuple("usage", "total used free")

    def save_state(self, output_dir=None, **kwargs):
        calls.append(output_dir)
        if len(calls) == 2:  # what a full disk does to torch.save(optimizer.state_dict(), ...)
            (Path(output_dir) / "optimizer.bin").write_bytes(b"partial")
            monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 121024 vs 120912")
        return real_save(self, output_dir, **kwargs)

    def on_step(step, loss, model):
        if step == 2:
            kept.update(_snapshot(out / "checkpoints/checkpoint-2"))

    monkeypatch.setattr(Accelerator, "save_state", save_state)
    out = tmp_path / "run"
    assert main(tiny_argv(corpus_file, out, "--max_steps", "6", "--save_steps", "2"), on_step=on_step) == 1
    monkeypatch.setattr(shutil, "disk_usage", real_usage)
    err = capsys.readouterr().err
    assert (
        f"could not write checkpoint-4 under {out}/checkpoints: the disk is full (no space left on device; 4,096 "
        f"bytes free after removing the partial checkpoint-4, and checkpoint-2 took {sum(map(len, kept.values())):,} "
        "bytes); the previous checkpoint checkpoint-2 is intact."
    ) in err
    assert "unexpected pos" not in err
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"] and not (
        out / "checkpoints/.tmp-checkpoint-4"
    ).exists()
    assert _snapshot(out / "checkpoints/checkpoint-2") == kept  # byte for byte what step 2 wrote
    # The same error with plenty of free space is not blamed on the disk: torch's words are kept.
    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 121024 vs 120912")
    assert describe_write_error(short_write, tmp_path) == f"RuntimeError: {short_write}"


def test_disk_full_while_writing_the_final_model_names_the_checkpoint(corpus_file, tmp_path, monkeypatch, capsys):
    from qkvshare import QKVShareForCausalLM

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(QKVShareForCausalLM, "save_pretrained", full)
    out = tmp_path / "run"
    assert main(tiny_argv(corpus_file, out, "--max_steps", "2", "--save_steps", "2")) == 1
    err = capsys.readouterr().err
    assert f"could not write the final model to {out}: no space left on device" in err
    assert f"the last checkpoint {out}/checkpoints/checkpoint-2 is intact" in err


# --------------------------------------------------------------------------------------------------------------
# Item 6: clear errors, exit status 2, one paragraph
# --------------------------------------------------------------------------------------------------------------
def _broken_yaml(tmp: Path) -> str:
    path = tmp / "broken.yaml"
    path.write_text("preset: tiny\nmax_steps: [1\nlearning_rate: 0.1\n")
    return str(path)


def _recipe_txt(tmp: Path) -> str:
    path = tmp / "recipe.txt"
    path.write_text("preset: tiny\n")
    return str(path)


def _missing_tracker() -> str:
    import importlib.util

    from qkvshare_settings.train import TRACKER_PACKAGES

    missing = [name for name, module in TRACKER_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if not missing:
        pytest.skip("every tracker is installed")
    return missing[0]


BAD_FLAGS = {
    "unknown flag": (
        lambda c, o, t: tiny_argv(c, o, "--learning_rat", "0.1"),
        "unknown flag '--learning_rat' (did you mean '--learning_rate'?)",
    ),
    "abbreviated flag": (
        lambda c, o, t: tiny_argv(c, o, "--max_step", "3"),
        "unknown flag '--max_step' (did you mean '--max_steps'?)",
    ),
    "broken yaml": (
        lambda c, o, t: [_broken_yaml(t), "--output_dir", str(o)],
        "is not valid YAML at line 3, column 14: expected ',' or ']', but got ':' (while parsing a flow "
        "sequence that starts at line 2)",
    ),
    "recipe without .yaml": (
        lambda c, o, t: [_recipe_txt(t), "--output_dir", str(o)],
        "recipe.txt' must be a .yaml or .yml file",
    ),
    "bad int": (
        lambda c, o, t: tiny_argv(c, o, "--max_steps", "ten"),
        "argument --max_steps/--max-steps: invalid int value: 'ten'",
    ),
    "lr nan": (lambda c, o, t: tiny_argv(c, o, "--learning_rate", "nan"), "--learning_rate nan is not a finite number"),
    "lr inf": (lambda c, o, t: tiny_argv(c, o, "--learning_rate", "inf"), "--learning_rate inf is not a finite number"),
    "lr -inf": (lambda c, o, t: tiny_argv(c, o, "--learning_rate=-inf"), "--learning_rate -inf is not a finite number"),
    "beta nan": (lambda c, o, t: tiny_argv(c, o, "--adam_beta2", "NaN"), "--adam_beta2 nan is not a finite number"),
    "clip inf": (
        lambda c, o, t: tiny_argv(c, o, "--max_grad_norm", "Infinity"),
        "--max_grad_norm inf is not a finite number",
    ),
    "beta out of range": (
        lambda c, o, t: tiny_argv(c, o, "--adam_beta1", "1.5"),
        "--adam_beta1 1.5 is out of range; it must be in [0, 1)",
    ),
    "bogus attention": (
        lambda c, o, t: tiny_argv(c, o, "--attn_implementation", "spda"),
        "--attn_implementation 'spda' is not an attention backend (did you mean 'sdpa'?); use one of "
        "eager, sdpa, flex_attention, flash_attention_2, flash_attention_3",
    ),
    "bogus tracker": (
        lambda c, o, t: tiny_argv(c, o, "--report_to", "tensorbord"),
        "--report_to 'tensorbord' is not a tracker (did you mean 'tensorboard'?)",
    ),
    "tracker not installed": (
        lambda c, o, t: tiny_argv(c, o, "--report_to", _missing_tracker()),
        "which is not installed; install it with pip install",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flag_is_one_paragraph_with_status_2(case, corpus_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pretrain, "make_accelerator", lambda *a: pytest.fail("got past the argument checks"))
    make_argv, message = BAD_FLAGS[case]
    out = tmp_path / "out"
    assert main(make_argv(corpus_file, out, tmp_path)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("qkvshare train: error: ")
    assert message in captured.err and captured.err.count("\n") == 1  # one paragraph, one line
    assert not out.exists()


def test_flash_attention_without_its_package_is_refused(corpus_file, tmp_path, capsys):
    from transformers.utils import is_flash_attn_2_available

    if is_flash_attn_2_available():
        pytest.skip("flash-attn is installed here")
    assert main(tiny_argv(corpus_file, tmp_path / "out", "--attn_implementation", "flash_attention_2")) == 2
    assert "--attn_implementation flash_attention_2 needs the package flash-attn" in capsys.readouterr().err


def test_unknown_flag_on_the_command_line_prints_no_usage_or_traceback(tmp_path, capsys):
    # `python -m qkvshare.train` is `sys.exit(main())`: main's whole answer is this one line, status 2.
    assert main(["--output_dir", str(tmp_path / "o"), "--learning_rat", "1e-3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        "qkvshare train: error: unknown flag '--learning_rat' (did you mean '--learning_rate'?); "
        "`qkvshare train --help` lists the flags.\n"
    )
    assert not (tmp_path / "o").exists()


def test_resume_below_the_checkpoint_step_is_refused_and_a_schedule_change_is_said(
    corpus_file, finished, tmp_path, capsys
):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = _snapshot(out)
    argv = tiny_argv(corpus_file, out, "--resume_from_checkpoint", "latest")
    assert main([*argv, "--max_steps", "1"], on_step=lambda *a: pytest.fail("trained")) == 2
    err = capsys.readouterr().err
    assert "is at step 2, beyond --max_steps 1" in err and "Pass --max_steps 2 or more" in err
    assert _snapshot(out) == before
    rc, losses = run_losses([*argv, "--max_steps", "3"])
    assert rc == 0 and len(losses) == 1
    assert "resuming at step 2 with --max_steps 2 -> 3: the LR schedule changes" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------
# Item 9: one home for the LR schedule and the Llama twin config
# --------------------------------------------------------------------------------------------------------------
def _sweep_lr_before(step: int, total_steps: int, peak: float, warmup_fraction: float) -> float:
    """synthetic/sweep.py's own schedule before it moved to train/schedule.py (kept to prove nothing changed)."""
    warmup = max(1, math.ceil(warmup_fraction * total_steps)) if warmup_fraction > 0 else 0
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def test_sweep_lr_is_the_training_schedule_with_the_same_numbers():
    from qkvshare.synthetic.sweep import get_lr as sweep_lr
    from qkvshare.train.schedule import get_lr, warmup_steps_for_fraction

    for total, peak, fraction in [(100, 1e-3, 0.05), (37, 3e-4, 0.0), (7, 5e-4, 0.5), (1000, 1e-3, 0.013)]:
        for step in range(total + 3):
            expected = _sweep_lr_before(step, total, peak, fraction)
            assert sweep_lr(step, total, peak, fraction) == expected  # exactly: same floats, same order
            warmup = warmup_steps_for_fraction(fraction, total)
            assert get_lr(step, peak_lr=peak, warmup_steps=warmup, max_steps=total, min_lr_ratio=0.0) == expected
    assert warmup_steps_for_fraction(0.013, 1000) == 13 and warmup_steps_for_fraction(0.001, 10) == 1


def test_llama_twin_config_gives_llama_the_same_function():
    from transformers import LlamaForCausalLM

    from qkvshare import QKVShareConfig, QKVShareForCausalLM
    from qkvshare.configuration_qkvshare import llama_twin_config

    config = QKVShareConfig.from_preset("tiny", variant="GQA-2")
    ours = QKVShareForCausalLM(config).eval()
    twin = llama_twin_config(config, attn_implementation="eager")
    assert twin.num_key_value_heads == 2 and twin._attn_implementation == "eager"
    assert llama_twin_config(config, num_key_value_heads=1).num_key_value_heads == 1
    llama = LlamaForCausalLM(twin).eval()
    llama.load_state_dict(ours.state_dict(), strict=True)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(llama(ids).logits, ours(ids).logits)


def test_accelerate_recipes_load_and_name_real_classes():
    from accelerate.commands.config.config_args import load_config_from_file

    from qkvshare import modeling_qkvshare

    recipes = {p.stem: load_config_from_file(str(p)) for p in (REPO / "configs" / "accelerate").glob("*.yaml")}
    assert sorted(recipes) == ["cpu-2proc", "ddp", "fsdp"]
    cpu = recipes["cpu-2proc"]
    assert (cpu.distributed_type, cpu.num_processes, cpu.use_cpu) == ("MULTI_GPU", 2, True)  # two gloo ranks
    fsdp = recipes["fsdp"].fsdp_config
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    layer = getattr(modeling_qkvshare, fsdp["fsdp_transformer_layer_cls_to_wrap"])  # the wrap unit exists
    assert issubclass(layer, torch.nn.Module) and layer.__name__ == "QKVShareDecoderLayer"


# --------------------------------------------------------------------------------------------------------------
# Items 1 and 8: several processes (slow: each launch starts two interpreters)
# --------------------------------------------------------------------------------------------------------------
FSDP_SCRIPT = textwrap.dedent(
    '''
    """Run `qkvshare train` under FSDP2 on CPU ranks. accelerate turns a launch into FSDP only on GPUs
    (AcceleratorState makes MULTI_GPU, never MULTI_CPU, into FSDP), while torch's FSDP2 (`fully_shard`) itself runs
    on CPU over gloo; so this test builds the gloo group with the trainer's own `make_accelerator` and switches
    accelerate's state to FSDP with the plugin that `accelerate launch --config_file fsdp.yaml` describes."""
    import json, os, signal, sys
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    import qkvshare.train.pretrain as pretrain

    real_make_accelerator = pretrain.make_accelerator

    def fsdp_on_cpu(args):
        os.environ["ACCELERATE_USE_FSDP"] = "false"  # the trainer refuses FSDP it cannot get; here we force it
        accelerator = real_make_accelerator(args)
        plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables of configs/accelerate/fsdp.yaml
        for shared in (PartialState._shared_state, AcceleratorState._shared_state):
            shared["distributed_type"] = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        return accelerator

    pretrain.make_accelerator = fsdp_on_cpu
    log, stop_at, rank = sys.argv[1], int(sys.argv[2]), int(os.environ["RANK"])

    def on_step(step, loss, model):
        if rank == 0:
            with open(log, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "class": type(model).__name__,
                                    "param": type(next(model.parameters())).__name__}) + "\\n")
        if rank == 1 and step == stop_at:  # only rank 1 is signalled: both must stop at this step
            os.kill(os.getpid(), signal.SIGTERM)

    import qkvshare_cli

    sys.exit(qkvshare_cli.main(["train", *sys.argv[3:]], on_step=on_step))
    '''
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path; GPUs run FSDP through accelerate directly")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the path of a machine without GPUs")
def test_fsdp_recipe_without_gpus_is_refused_before_any_work(corpus_file, tmp_path, monkeypatch, capsys):
    """The FSDP recipe as is on a machine without GPUs is refused, not silently replicated: `accelerate launch
    --config_file fsdp.yaml` hands its choice to the processes as ACCELERATE_USE_FSDP / FSDP_* variables."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.state import AcceleratorState

    recipe = load_config_from_file(str(REPO / "configs" / "accelerate" / "fsdp.yaml"))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", str(recipe.distributed_type == "FSDP").lower())
    monkeypatch.setenv("FSDP_VERSION", str(recipe.fsdp_config["fsdp_version"]))
    out = tmp_path / "fsdp"
    try:
        assert main(without_use_cpu(tiny_argv(corpus_file, out)), on_step=lambda *a: pytest.fail("trained")) == 2
    finally:  # the refused run's FSDP plugin stays in accelerate's process-wide state: later runs here start afresh
        AcceleratorState._reset_state(reset_partial_state=True)
    assert "FSDP was asked for (--use_fsdp, e.g. configs/accelerate/fsdp.yaml)" in capsys.readouterr().err
    assert not out.exists()


def test_fsdp2_on_two_cpu_ranks_matches_one_process_and_resumes_from_shards(corpus_file, tmp_path):
    fsdp_yaml = str(REPO / "configs" / "accelerate" / "fsdp.yaml")
    recipe = ["--config_file", fsdp_yaml, "--num_processes", "2", "--mixed_precision", "no"]
    common = ["--max_steps", "4", "--save_steps", "0"]
    out = tmp_path / "fsdp"
    argv = without_use_cpu(tiny_argv(corpus_file, out, "--per_device_train_batch_size", "2", *common))
    script, log = tmp_path / "fsdp_cpu.py", tmp_path / "steps.jsonl"
    script.write_text(FSDP_SCRIPT)
    proc = launch(tmp_path, *recipe, str(script), str(log), "2", *argv)
    assert "SIGTERM received: stopped after step 2 of 4" in proc.stderr, proc.stderr[-3000:]
    shards = out / "checkpoints" / "checkpoint-2"
    assert verify_checkpoint(shards) is None and read_state(shards)["global_batch_blocks"] == 4
    assert len(list((shards / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2  # one shard file per rank
    proc = launch(tmp_path, *recipe, str(script), str(log), "0", *argv, "--resume_from_checkpoint", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "training_args.json").read_text())["num_processes"] == 2
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert {(s["class"], s["param"]) for s in steps} == {("FSDPQKVShareForCausalLM", "DTensor")}  # really sharded

    one = tmp_path / "one"
    rc, losses = run_losses(tiny_argv(corpus_file, one, "--per_device_train_batch_size", "4", *common))
    assert rc == 0 and [s["loss"] for s in steps] == pytest.approx(losses, rel=1e-5)
    assert _metrics(out)["val_loss"] == pytest.approx(_metrics(one)["val_loss"], rel=1e-5)
    # The gathered model directory is a plain QKVShare checkpoint (its code, not FSDP's).
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_qkvshare.QKVShareForCausalLM"
    assert (out / "modeling_qkvshare.py").is_file() and not list(out.glob("_fsdp*.py"))
    ours, ref = load_file(out / "model.safetensors"), load_file(one / "model.safetensors")
    assert set(ours) == set(ref)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_train_help_prints_each_default_once(capsys):
    """`qkvshare train --help` shows each default once: help texts that describe their default get no second
    "(default: None)" appended; plain defaults are still shown."""
    from test_analysis import _help_blocks

    from qkvshare_settings.train import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0
    blocks = _help_blocks(capsys.readouterr().out)
    assert len(blocks) > 20
    for block in blocks.values():
        assert block.count("default") <= 1, block
    assert "(default: tiny)" in blocks["--preset"]
    assert "default: train a byte-level BPE" in blocks["--tokenizer_name"]
    assert "(default: None)" not in blocks["--tokenizer_name"]
