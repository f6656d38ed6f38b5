"""`qkvshare export`: write a QKVShare language model for another runtime: an on-device program with its static tied
cache inside (ExecuTorch, ONNX), or, for the variants that are exactly a Llama model, a plain Llama checkpoint
(transformers, vLLM, ...) or a GGUF file (llama.cpp, Ollama).

    qkvshare export outputs/cpu-small --format executorch              # outputs/cpu-small/model.pte (XNNPACK)
    qkvshare export outputs/cpu-small --format onnx --max_cache_len 256 --output model.onnx
    qkvshare export outputs/cpu-small --format llama                   # outputs/cpu-small-llama/ (a Llama model)
    qkvshare export outputs/cpu-small --format gguf --dtype float16    # outputs/cpu-small/model.gguf

executorch, onnx: the program (see qkvshare/export.py) takes `input_ids` (B, T) and `cache_position` (T,) and
returns the logits; it runs the prefill (T = prompt length) and each decode step (T = 1). The ExecuTorch program
keeps the cache in its own mutable buffers; the ONNX model takes the cache tensors as inputs and returns them
updated. The command prints the file size, the cache bytes per token the program holds (against the config's
theory) and the total bytes of its cache buffers. Softmax attention without a sliding window.

llama, gguf (see qkvshare/export_llama.py): only variants that are exactly Llama: Q=K (q_proj = k_proj, one
key/value head per head), pre-RoPE K=V (v_proj = k_proj; GQA and MQA too), pre-RoPE Q=K=V, QKV/GQA/MQA, and
per-layer mixes of these, with Llama's block (RMSNorm, SwiGLU, RoPE, causal). The shared projections are written
out as copies, so these engines cache K and V separately: the checkpoint runs there, without the cache saving.
GGUF also needs the model's tokenizer (tokenizer.json, a byte-level BPE llama.cpp knows).

Then the written model generates greedy tokens (the program, or the Llama checkpoint loaded by transformers, or
the GGUF read back by transformers' GGUF loader) and the command compares them with the model's.

Bad input (a flag, the directory, a variant the format cannot hold, an output that is one of the model's own
files or cannot be written, an existing output without --overwrite) exits with status 2 and one message before the
model is loaded. The output is written beside its place under a temporary name and moved there only when complete,
so an existing file (with --overwrite) is replaced whole or not at all.

From Python: `qkvshare.export.export_model(ExportArgs("outputs/cpu-small", "gguf"))`.
"""

from __future__ import annotations

import argparse
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from . import extras
from .conventions import DTYPE_NAMES, HelpFormatter, add_dtype_argument

# --format: file suffix of the default --output ("" for a folder, written beside the model directory)
FORMATS = {"executorch": ".pte", "onnx": ".onnx", "llama": "", "gguf": ".gguf"}
# The modules each format imports (all in the "export" extra; a Llama checkpoint needs only the core)
FORMAT_MODULES = {
    "executorch": ("executorch",),
    "onnx": ("onnx", "onnxscript", "onnxruntime"),
    "llama": (),
    "gguf": ("gguf",),
}
BACKENDS = ("xnnpack", "portable")
PROGRAM_FORMATS = ("executorch", "onnx")  # programs with the static cache inside: --max_cache_len, --backend
DEFAULT_MAX_CACHE_LEN = 1024  # at most; never beyond the model's max_position_embeddings
CHECK_PROMPT_TOKENS = 4  # the random prompt of the token check
# torch.export traces the program with a 2-token prefill, so the cache needs 2 slots even without the check.
MIN_PROGRAM_CACHE_LEN = 2


@dataclass
class ExportArgs:
    """What `qkvshare export` writes (the command's flags and defaults); building one checks what needs no model
    (a `ValueError` naming the flag). `output` and `max_cache_len` left None take defaults that depend on the model
    directory, filled in and checked by the export before the model is loaded."""

    model_dir: str  # a QKVShare model directory (save_pretrained, e.g. a `qkvshare train` run)
    format: str  # executorch, onnx, llama or gguf
    output: str | None = None  # file (or, for llama, new folder) to write
    max_cache_len: int | None = None  # token slots of the program's cache (executorch, onnx)
    batch_size: int = 1  # sequences decoded together (executorch, onnx)
    backend: str = "xnnpack"  # ExecuTorch kernels: xnnpack or portable
    dtype: str = "auto"  # weights of the llama and gguf exports; auto: as saved
    check_tokens: int = 8  # greedy tokens compared between the written model and the model (0: no check)
    overwrite: bool = False  # replace an existing --output (only once the new one is complete)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """The flags, as far as they go without reading the model, and the packages the format needs."""
        if self.format not in FORMATS:
            raise ValueError(f"--format {self.format!r} is not one of {', '.join(FORMATS)}.")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend {self.backend!r} is not one of {', '.join(BACKENDS)}.")
        if DTYPE_NAMES.get(self.dtype) is None:
            raise ValueError(f"--dtype {self.dtype!r} is not one of auto, float32, bfloat16, float16.")
        self.dtype = DTYPE_NAMES[self.dtype]
        if self.batch_size < 1 or self.check_tokens < 0:
            raise ValueError(
                f"--batch_size {self.batch_size} / --check_tokens {self.check_tokens}: need batch_size >= 1 and "
                "check_tokens >= 0."
            )
        if self.format in PROGRAM_FORMATS:
            if self.dtype != "auto":
                raise ValueError(
                    f"--dtype {self.dtype} applies to --format llama and gguf; a {self.format} program keeps the "
                    "model's dtype: leave --dtype out."
                )
            if self.max_cache_len is not None:
                check_max_cache_len(self.max_cache_len, self.check_tokens)
        elif self.max_cache_len is not None:
            raise ValueError(
                f"--max_cache_len applies to --format executorch and onnx (a program with its cache inside); a "
                f"{self.format} export holds no cache: leave it out."
            )
        missing = [extras.EXTRAS["export"][m] for m in FORMAT_MODULES[self.format] if not extras.is_installed(m)]
        if missing:
            raise ValueError(extras.missing_message(f"--format {self.format}", missing, "export"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qkvshare export", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model_dir", help="a QKVShare model directory (save_pretrained, e.g. a `qkvshare train` run)")
    p.add_argument("--format", required=True, choices=list(FORMATS), help="executorch, onnx, llama or gguf")
    p.add_argument(
        "--output",
        help="file to write (default: MODEL_DIR/model.pte, .onnx or .gguf); for llama a new folder (default: "
        "MODEL_DIR-llama beside the model directory)",
    )
    p.add_argument(
        "--max_cache_len",
        type=int,
        help=f"token slots of the cache, prompt + generated (executorch, onnx; default: max_position_embeddings, at "
        f"most {DEFAULT_MAX_CACHE_LEN:,})",
    )
    p.add_argument("--batch_size", type=int, default=1, help="sequences decoded together (executorch, onnx)")
    p.add_argument("--backend", choices=BACKENDS, default="xnnpack", help="ExecuTorch kernels (executorch only)")
    add_dtype_argument(p, "auto", "weights of the llama and gguf exports; auto: as saved")
    p.add_argument(
        "--check_tokens",
        type=int,
        default=8,
        help="greedy tokens generated by the written model and by the model, compared (0: no check)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output file (written beside it first; replaced only when complete)",
    )
    return p


def parse_args(argv: list[str] | None) -> ExportArgs:
    """The command line, checked as far as it goes without reading the model (a `ValueError` naming the bad input).
    `--max_cache_len` and `--output` left out stay None: their defaults depend on the model directory."""
    return ExportArgs(**vars(build_parser().parse_args(argv)))


def check_max_cache_len(max_cache_len: int, check_tokens: int) -> None:
    """A `ValueError` unless the cache holds the export's trace and the token check (a prompt and one new token)."""
    need = CHECK_PROMPT_TOKENS + 1 if check_tokens else MIN_PROGRAM_CACHE_LEN
    if max_cache_len < need:
        why = (
            f"the token check needs {need} (a {CHECK_PROMPT_TOKENS}-token prompt and 1 new token); use "
            f"--max_cache_len {need} or more, or --check_tokens 0 to skip the check"
            if check_tokens
            else f"the export traces a {MIN_PROGRAM_CACHE_LEN}-token prefill; use --max_cache_len {need} or more"
        )
        raise ValueError(f"--max_cache_len {max_cache_len} is too short: {why}.")


def check_output(model_dir: Path, format: str, output: str | None, overwrite: bool = False) -> Path:
    """--output (default: beside or in `model_dir`), checked before any work; a `ValueError` naming what is wrong.

    Refused: the model directory itself or a folder holding it; a file inside it that is not a `format` file (one of
    the model's own files, or a new one among them: a program would overwrite or shadow its weights or config);
    an existing file that is one of the model's files under another name (a link); a read-only file; a folder
    that does not exist or cannot be written; an existing file without `overwrite` (it may not be an earlier export);
    for llama, a folder that already holds files.
    """
    suffix, source = FORMATS[format], model_dir.expanduser().resolve()
    if output is None:  # a Llama folder beside the model directory (resolved: "." has no name to extend)
        output = str(source.with_name(f"{source.name}-llama") if format == "llama" else model_dir / f"model{suffix}")
    path = Path(output).expanduser()
    resolved = path.resolve()
    flag = f"--output {output}"
    if resolved == source or resolved in source.parents:
        raise ValueError(f"{flag} is the model directory {str(model_dir)!r} or holds it; choose another --output.")
    # The model's own files: every file in its directory but the programs this format writes there.
    own = [f for f in source.iterdir() if f.is_file() and (format == "llama" or f.suffix != suffix)]
    same = path.is_file() and any(os.path.samefile(path, f) for f in own)
    if same or (resolved.parent == source and format != "llama" and resolved.suffix != suffix):
        kind = "a folder" if format == "llama" else f"a new {suffix} file"
        raise ValueError(
            f"{flag} is {'one of' if path.exists() else 'among'} the files of the model directory "
            f"{str(model_dir)!r}: the export would overwrite or sit among the model's own files. Choose {kind} "
            f"(default: {'MODEL_DIR-llama' if format == 'llama' else f'MODEL_DIR/model{suffix}'})."
        )
    parent = resolved.parent
    if not parent.is_dir():
        raise ValueError(f"{flag}: its directory does not exist; create it first.")
    if not os.access(parent, os.W_OK | os.X_OK) or not parent.stat().st_mode & stat.S_IWUSR:
        raise ValueError(f"{flag}: its directory {str(parent)!r} is read-only; choose a writable place.")
    if format == "llama":
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            raise ValueError(f"{flag} already exists and is not an empty folder; choose a new folder, or remove it.")
    elif path.is_dir():
        raise ValueError(f"{flag} is a folder; give the {suffix} file to write.")
    elif path.exists() and not path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"{flag} is a read-only file; make it writable to replace it, or choose another --output.")
    elif path.exists() and not overwrite:
        raise ValueError(
            f"{flag} already exists ({path.stat().st_size:,} bytes); pass --overwrite to replace it (the new file is "
            "written beside it and replaces it only when complete), or choose another --output."
        )
    return path
