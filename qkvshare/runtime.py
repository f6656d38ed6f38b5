"""What the tools need to know of the machine they run on: the `torch.dtype` of a `--dtype` name, the default device
and whether it computes bf16 natively, the memory available now, and the disk: free space before a write, and a full
disk named as such after one.

The `--dtype` names and aliases themselves are `qkvshare_settings.conventions`, which the command-line parsers
import without torch.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from qkvshare_settings.conventions import dtype_name


def torch_dtype(name: str) -> torch.dtype | str:
    """The `torch.dtype` of a canonical `--dtype` name; ``auto`` stays the string transformers understands."""
    if name == "auto":
        return "auto"
    return getattr(torch, dtype_name(name))


def default_device() -> str:
    """`cuda` when a GPU is visible, otherwise `cpu`."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# CPU feature flags (Linux /proc/cpuinfo) of native bf16 arithmetic: x86 AVX512-BF16 and AMX, Arm's BF16 extension
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags() -> set[str]:
    """The feature flags /proc/cpuinfo lists for the first CPU (x86 "flags", Arm "Features"); empty where unknown."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_bf16(device: str | None = None) -> tuple[bool, str]:
    """Whether `device` (default: `default_device()`) computes bf16 natively, and what says so: a GPU that supports
    it without emulation, or a CPU with bf16 instructions (`BF16_CPU_FLAGS`). Elsewhere bf16 autocast is emulated and
    slower than float32."""
    device = device or default_device()
    if device.startswith("cuda"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{torch.cuda.get_device_name()} computes bf16"
        return False, "this GPU has no native bf16"
    found = sorted(cpu_flags().intersection(BF16_CPU_FLAGS))
    if found:
        return True, f"this CPU has bf16 instructions ({', '.join(found)})"
    return False, "this CPU has no bf16 instructions (AVX512-BF16, AMX or Arm BF16)"


MEMORY_SHARE = 0.8  # of the memory available (`available_bytes`), what one piece of work may plan to use


def available_bytes() -> int | None:
    """The memory the system can give a process now: MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def describe_bytes(n: float | None) -> str:
    """A size as people read it: 512 B, 3.2 MiB, 17.9 GiB ("unknown" for None)."""
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system holding `path` (its nearest existing parent), or None when unknown."""
    path = Path(path).expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def folder_bytes(folder: str | Path) -> int:
    """The bytes of the files under `folder` (0 when it does not exist)."""
    folder = Path(folder)
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def check_free_space(path: str | Path, needed: int, what: str, fix: str = "") -> None:
    """A `ValueError` naming `what`, `path` and both sizes when the file system holding `path` has less than
    `needed` bytes free (checked before a write starts; nothing happens when the free space is unknown). `fix`: a
    further way out, said after "free space there or write elsewhere" (", or ...")."""
    free = free_bytes(path)
    if free is not None and free < needed:
        raise ValueError(
            f"{what} needs about {needed / 2**20:,.1f} MiB but the disk holding {Path(path).expanduser()} has "
            f"{free / 2**20:,.1f} MiB free; free space there or write elsewhere{fix}."
        )


# torch's zip writer loses the errno of a failed write: "[enforce fail at inline_container.cc:672] . unexpected pos
# 121024 vs 120912" (a short write), or "PytorchStreamWriter failed writing file ...: file write failed".
_TORCH_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")
_FULL_DISK_BYTES = 1 << 20  # free bytes below which a short write means the disk filled up


def is_disk_full(error: BaseException, folder: str | Path | None = None) -> bool:
    """Whether `error` is a full disk or quota, whatever library raised it: an OSError, or a safetensors/torch error
    that carries one as text. torch's short-write error carries no errno; it counts as a full disk when `folder`
    (where the write went) has under 1 MiB free at the moment of the failure."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    if "No space left on device" in text or "StorageFull" in text or "Disk quota exceeded" in text:
        return True
    free = free_bytes(folder) if folder is not None and any(s in text for s in _TORCH_SHORT_WRITE) else None
    return free is not None and free < _FULL_DISK_BYTES


def describe_disk_full(path: str | Path, needed: int | None = None) -> str:
    """'the disk holding PATH is full (N MiB free, about M MiB needed)': the message of a write that ran out of space."""
    free = free_bytes(path)
    sizes = [f"{free / 2**20:,.1f} MiB free" if free is not None else None]
    sizes.append(f"about {needed / 2**20:,.1f} MiB needed" if needed is not None else None)
    shown = ", ".join(s for s in sizes if s)
    return f"the disk holding {Path(path).expanduser()} is full{f' ({shown})' if shown else ''}: free space there or write elsewhere"


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` to a temporary name beside `path`, then rename it to `path`: a reader (or a resumed run) never
    sees a partly written file."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
