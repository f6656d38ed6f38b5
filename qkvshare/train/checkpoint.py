"""The output directory of a run: its lock, its crash-safe checkpoints, and their verification on resume.

Design notes
- A checkpoint is `<output_dir>/checkpoints/checkpoint-<step>/`: accelerate's state (model as safetensors, or
  FSDP shards; optimizer, GradScaler, every rank's RNG states), the tokenizer, and `trainer_state.json` (step,
  tokens seen, the model config, what fixes the data order, and a manifest of every file with its size). With
  the LR a pure function of the step and the data order a pure function of (seed, step), that is everything
  needed to continue exactly.
- Atomicity: every rank writes into `.tmp-checkpoint-<step>/`; only when all are done does the main process
  rename it to its final name (`os.replace`, atomic on one filesystem). A crash mid-save leaves a `.tmp-*`
  directory that `latest` ignores and the next save removes; the previous checkpoint is untouched. A failed
  write (a full disk) is reported by whichever rank hit it, to every rank, and the partial folder is removed.
- `trainer_state.json` is written last, so a directory without it is never taken for a checkpoint. On resume
  the manifest is checked (every file present at its size, every safetensors header whole): `latest` falls back
  to the newest complete checkpoint and says so; an explicit path to a broken one is an error naming the file.
- One run per output directory at a time: the main process holds `<output_dir>/.qkvshare-train.lock` (pid, host,
  start time, command). A lock whose process is gone (same host, pid not alive or reused) is stale and taken over.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import struct
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from qkvshare.model_dir import SAFETENSORS_WEIGHTS
from qkvshare.runtime import folder_bytes, free_bytes, is_disk_full
from qkvshare_settings.conventions import CommandStopped
from qkvshare_settings.train import TrainingSetupError

from .ranks import first_message

STATE_FILE = "trainer_state.json"
LOCK_FILE = ".qkvshare-train.lock"
# Entries that mark a directory as a training run's (what `clear_run` may delete with --overwrite_output_dir).
RUN_MARKERS = ("checkpoints", "runs", "training_args.json", "final_metrics.json")
_CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
# Config keys that do not change the model's function (bookkeeping written by transformers).
_IGNORED_CONFIG_KEYS = {
    "transformers_version",
    "_name_or_path",
    "architectures",
    "auto_map",
    "dtype",
    "torch_dtype",
    "use_cache",
    "_attn_implementation_autoset",
    "output_attentions",
    "output_hidden_states",
}


class CheckpointWriteError(CommandStopped):
    """A checkpoint or the final model could not be written (e.g. a full disk); the message names the last good
    checkpoint and how to continue from it."""


# --------------------------------------------------------------------------------------------------------------
# Lock: one run per output directory
# --------------------------------------------------------------------------------------------------------------
def _process_start(pid: int) -> str | None:
    """Start time of process `pid` in clock ticks since boot (Linux `/proc/<pid>/stat` field 22), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # fields after the command name, which may hold spaces


def _pid_alive(pid: int, start: str | None) -> bool:
    """Whether `pid` runs on this host and is the same process that recorded `start` (pids are reused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    now = _process_start(pid)
    return start is None or now is None or now == start


class OutputDirLock:
    """`<output_dir>/.qkvshare-train.lock`, held by the main process for the whole run (`acquire`, `release`)."""

    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / LOCK_FILE
        self.held = False

    def acquire(self) -> str | None:
        """Create the output directory and the lock. Returns a note when a stale lock was taken over.

        Raises `TrainingSetupError` when the directory is not writable or another live run holds the lock.
        """
        out = self.path.parent
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise TrainingSetupError(
                f"--output_dir {out} cannot be created ({err.strerror or err}); choose a directory you can write to."
            ) from None
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "pid_start": _process_start(os.getpid()),
            "started": datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
        }
        note = None
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if not self._is_stale(holder, me["host"]):
                    raise TrainingSetupError(self._held_message(holder)) from None
                self.path.unlink(missing_ok=True)
                note = (
                    f"removed the stale lock {self.path} of process {holder['pid']} on {holder['host']} (started "
                    f"{holder.get('started', '?')}), which is no longer running."
                )
                continue
            except OSError as err:
                raise TrainingSetupError(
                    f"--output_dir {out} is not writable ({err.strerror or err}); choose a directory you can write to."
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f, indent=2)
            self.held = True
            return note
        raise TrainingSetupError(f"could not take the lock {self.path}: another run took it at the same moment.")

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if self.held:
            holder = self._holder()
            if holder is None or holder.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False

    def _holder(self) -> dict[str, Any] | None:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None

    @staticmethod
    def _is_stale(holder: dict[str, Any] | None, host: str) -> bool:
        if holder is None:  # unreadable: possibly being written right now; never guess
            return False
        return holder.get("host") == host and not _pid_alive(holder["pid"], holder.get("pid_start"))

    def _held_message(self, holder: dict[str, Any] | None) -> str:
        if holder is None:
            return (
                f"--output_dir {self.path.parent} is locked by another run ({self.path} exists but is unreadable); "
                f"wait for that run to finish, use another --output_dir, or delete {self.path} if no run uses it."
            )
        where = "this host" if holder.get("host") == socket.gethostname() else f"host {holder.get('host')}"
        return (
            f"--output_dir {self.path.parent} is in use by another run: process {holder['pid']} on {where}, started "
            f"{holder.get('started', '?')} ({holder.get('command', '')}). Two runs in one directory would overwrite "
            f"each other's checkpoints: wait for it to finish, use another --output_dir, or, if that process is no "
            f"longer running, delete {self.path}."
        )


# --------------------------------------------------------------------------------------------------------------
# The run in an output directory
# --------------------------------------------------------------------------------------------------------------
def run_entries(output_dir: str | os.PathLike) -> list[str]:
    """Names in `output_dir` (sorted), not counting the lock; empty when the directory does not exist."""
    out = Path(output_dir)
    return sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) if out.is_dir() else []


def clear_run(output_dir: str | os.PathLike) -> None:
    """Delete the previous run in `output_dir` (everything but the lock); callers check `RUN_MARKERS` first."""
    out = Path(output_dir)
    for name in run_entries(out):
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Checkpoints under `output_dir` that have their state file, oldest first (`verify_checkpoint` checks more)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT_RE.fullmatch(p.name))]
    return [p for _, p in sorted(found) if (p / STATE_FILE).is_file()]


def _safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file at `path` is not whole (header unreadable, or data shorter than it says), or None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path} is truncated ({size} bytes, no header)"
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            return f"{path} is truncated ({size} bytes, its header alone needs {header_len + 8})"
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            return f"{path} has an unreadable header"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if size != 8 + header_len + end:
        return f"{path} is truncated ({size} bytes, its header describes {8 + header_len + end})"
    return None


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """What is wrong with the checkpoint at `path` (a missing or short file, naming it), or None when it is whole."""
    path = Path(path)
    try:
        state = read_state(path)
    except FileNotFoundError:
        return f"{path / STATE_FILE} is missing"
    except (OSError, ValueError) as err:
        return f"{path / STATE_FILE} is unreadable ({err})"
    manifest = state.get("files")
    if manifest is None:  # written before manifests existed: at least the weights must be there
        manifest = {}
        if not any((path / name).exists() for name in (SAFETENSORS_WEIGHTS, "pytorch_model_fsdp_0")):
            return f"{path} holds no model weights ({SAFETENSORS_WEIGHTS})"
    for rel, size in sorted(manifest.items()):
        file = path / rel
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} is truncated ({file.stat().st_size} of {size} bytes)"
    for file in sorted(path.rglob("*.safetensors")):
        problem = _safetensors_problem(file)
        if problem:
            return problem
    return None


def resolve_resume_path(resume: str, output_dir: str) -> tuple[Path, list[str]]:
    """The checkpoint to resume from, and notes about broken checkpoints skipped on the way.

    `latest` -> the newest complete checkpoint of `output_dir`; a path -> that checkpoint, which must be whole.
    """
    if resume == "latest":
        notes = []
        for path in reversed(list_checkpoints(output_dir)):
            problem = verify_checkpoint(path)
            if problem is None:
                return path, notes
            notes.append(f"skipping the incomplete checkpoint {path.name}: {problem}.")
        skipped = f" ({' '.join(notes)})" if notes else ""
        raise TrainingSetupError(
            f"--resume_from_checkpoint latest: no complete checkpoint under {checkpoint_root(output_dir)}{skipped}; "
            "drop the flag to start a new run (with --overwrite_output_dir if the directory is not empty)."
        )
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise TrainingSetupError(
            f"--resume_from_checkpoint {resume!r} is not a checkpoint (no {STATE_FILE}); pass a "
            f"<output_dir>/checkpoints/checkpoint-<step> directory or 'latest'."
        )
    problem = verify_checkpoint(path)
    if problem is not None:
        others = [p.name for p in list_checkpoints(path.parent.parent) if p.name != path.name]
        raise TrainingSetupError(
            f"--resume_from_checkpoint {resume!r} is broken: {problem}. Resume from another checkpoint of that run "
            f"({', '.join(others) or 'none left'}) or 'latest', which skips incomplete ones."
        )
    return path, []


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    with open(Path(path) / STATE_FILE) as f:
        return json.load(f)


def comparable_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    """The config fields that define the model (bookkeeping keys removed), as JSON stores them (string keys)."""
    return {k: v for k, v in json.loads(json.dumps(config_dict)).items() if k not in _IGNORED_CONFIG_KEYS}


# what a checkpoint of an earlier version that lacks these keys was trained with
OPTIONAL_STATE = {"relative_learning_rates": False}


def check_compatible(state: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Raise if the checkpoint at `path` was written by a run with another model config or data layout.

    `current` has the same keys as the stored state: `model_config`, `block_size`, `global_batch_blocks`, `seed`,
    `trainable_modules`, `relative_learning_rates`.
    """
    problems = []
    old, new = comparable_config(state["model_config"]), comparable_config(current["model_config"])
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            problems.append(f"model {key}: checkpoint {old.get(key)!r}, now {new.get(key)!r}")
    for key in ("block_size", "global_batch_blocks", "seed", "trainable_modules", "relative_learning_rates"):
        saved = state.get(key, OPTIONAL_STATE.get(key))  # checkpoints of earlier versions lack the later keys
        if saved != current.get(key):
            problems.append(f"{key}: checkpoint {saved!r}, now {current.get(key)!r}")
    if problems:
        raise TrainingSetupError(
            f"checkpoint {path} comes from an incompatible run:\n  " + "\n  ".join(problems) + "\n"
            "Resume with the same --preset/--variant/--config_overrides, --block_size, global batch "
            "(per-device batch x accumulation x processes), --seed, --trainable_modules and --relative_learning_rates, "
            "or start a new --output_dir."
        )


# --------------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------------
NO_SPACE = "no space left on device"


def describe_write_error(err: BaseException, folder: str | os.PathLike | None = None) -> str:
    """A failed write in words: `NO_SPACE` for a full disk whatever library raised it (`runtime.is_disk_full`)."""
    text = str(err)
    if isinstance(err, OSError) and err.errno == errno.EDQUOT or "Disk quota exceeded" in text:
        return "disk quota exceeded"
    if is_disk_full(err, folder):
        return NO_SPACE
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}" + (f" ({err.filename})" if err.filename else "")
    return f"{type(err).__name__}: {text}"


def _attempt(action: Any, folder: Path) -> str | None:
    """Run `action()`, which writes under `folder`; a failed write comes back as its description, not an exception."""
    try:
        action()
    except (OSError, RuntimeError, SafetensorError) as err:  # torch.save and safetensors wrap OS errors
        return describe_write_error(err, folder)
    return None


def _manifest(folder: Path) -> dict[str, int]:
    """Every file under `folder` (relative POSIX path -> size in bytes)."""
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _finish(tmp: Path, final: Path, state: dict[str, Any], tokenizer: Any) -> None:
    """Main process: tokenizer, manifest and state file into `tmp`, then `tmp` becomes `final` atomically."""
    tokenizer.save_pretrained(tmp)
    files = _manifest(tmp)  # before the state file exists: it is not in its own manifest
    with open(tmp / STATE_FILE, "w") as f:
        json.dump(state | {"files": files}, f, indent=2)
    if final.exists():  # the same step saved again (a resumed run): swap, never leave no checkpoint
        trash = final.parent / f".old-{final.name}"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash)
    else:
        os.replace(tmp, final)


def save_checkpoint(
    accelerator: Any, output_dir: str, step: int, state: dict[str, Any], tokenizer: Any, save_total_limit: int | None
) -> Path:
    """Write checkpoint `step` atomically (all ranks call this) and delete the oldest beyond the limit.

    Raises `CheckpointWriteError` on every rank when any rank fails to write (the partial folder is removed and
    the previous checkpoints are untouched).
    """
    root = checkpoint_root(output_dir)
    tmp, final = root / f".tmp-checkpoint-{step}", root / f"checkpoint-{step}"

    def fresh_tmp() -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crash mid-save
        tmp.mkdir(parents=True)

    failure = first_message(accelerator, _attempt(fresh_tmp, root) if accelerator.is_main_process else None)
    if failure is None:
        failure = first_message(accelerator, _attempt(lambda: accelerator.save_state(str(tmp)), tmp))
    if failure is None:
        done = _attempt(lambda: _finish(tmp, final, state, tokenizer), tmp) if accelerator.is_main_process else None
        failure = first_message(accelerator, done)
    if failure is not None:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = [p for p in list_checkpoints(output_dir) if p != final]
        kept = f"the previous checkpoint {previous[-1].name} is intact" if previous else "no earlier checkpoint exists"
        if failure == NO_SPACE:
            size = f", and {previous[-1].name} took {folder_bytes(previous[-1]):,} bytes" if previous else ""
            failure = (
                f"the disk is full ({NO_SPACE}; {free_bytes(root):,} bytes free after removing the partial "
                f"checkpoint-{step}{size})"
            )
        raise CheckpointWriteError(
            f"could not write checkpoint-{step} under {root}: {failure}; {kept}. Free space (or fix the cause) and "
            "rerun the same command with --resume_from_checkpoint latest."
        )
    if accelerator.is_main_process and save_total_limit is not None:
        for old in list_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final
