"""`qkvshare serve`: an OpenAI-compatible HTTP server for a QKVShare model, with the one-tensor cache.

    qkvshare serve outputs/cpu-small                                # http://127.0.0.1:8000/v1
    qkvshare serve outputs/cpu-small --port 0                       # a free port, printed when the server is up
    qkvshare serve outputs/cpu-small --continuous_batching          # transformers' continuous batching

It is transformers' server (`transformers serve`, which cannot load QKVShare checkpoints) with the model loaded by
QKVShareForCausalLM: POST /v1/chat/completions, /v1/completions and /v1/responses (streaming or not), GET
/v1/models and /health. The server is pinned to MODEL_DIR: requests name the model as /v1/models lists it (the
MODEL_DIR given here). At startup it prints the KV-cache bytes per token it holds. A bad request (another model, a
sampling parameter out of range) is answered with an HTTP error and a message; the server keeps serving.

MODEL_DIR must hold a QKVShare causal LM (save_pretrained, e.g. a `qkvshare train` run) and its tokenizer (with a
chat template for the chat and response endpoints). Needs the 'serve' extra (fastapi, uvicorn, openai).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .conventions import TOKENIZER_FILES, HelpFormatter, add_dtype_argument, config_model_type

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qkvshare serve", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model_dir", help="a QKVShare model directory with its tokenizer (save_pretrained)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one, printed at startup)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: cuda if available)")
    add_dtype_argument(p, "auto", "weights and activations; auto: as saved")
    p.add_argument(
        "--attn_implementation", choices=["sdpa", "eager"], default=None, help="attention backend (default: sdpa)"
    )
    p.add_argument(
        "--continuous_batching",
        action="store_true",
        help="batch the requests with transformers' continuous batching (paged cache)",
    )
    p.add_argument(
        "--cb_page_size", type=int, default=None, help="continuous batching: tokens per page (default on CPU: 32)"
    )
    p.add_argument(
        "--cb_num_blocks",
        type=int,
        default=None,
        help="continuous batching: blocks of the page pool, each page_size tokens of every layer (default on CPU: 128; "
        "elsewhere transformers' sizing from free memory)",
    )
    p.add_argument(
        "--cb_max_batch_tokens",
        type=int,
        default=None,
        help="continuous batching: tokens per forward, prompts chunked to it (default on CPU: 256)",
    )
    p.add_argument("--seed", type=int, default=None, help="torch seed at startup, for sampled requests")
    p.add_argument("--log_level", choices=LOG_LEVELS, default="info", help="uvicorn's log level")
    return p


def check_model_dir(model_dir: str) -> None:
    """A `ValueError` naming `model_dir` unless it has a QKVShare config.json and tokenizer files (stdlib only:
    the weights are checked against the config when the command runs)."""
    model_type = config_model_type(model_dir, repr(model_dir))
    if model_type != "qkvshare":
        raise ValueError(
            f"{model_dir!r} holds a {model_type!r} model, not a QKVShare one (model_type 'qkvshare'); other models "
            "are served by `transformers serve`."
        )
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{model_dir!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); the server answers text. Save the "
            "tokenizer next to the model: tokenizer.save_pretrained(MODEL_DIR)."
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked without torch (a `ValueError` naming the bad input)."""
    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: a port is 0 to 65535 (0: a free one).")
    cb_flags = ("cb_page_size", "cb_num_blocks", "cb_max_batch_tokens")
    for flag in cb_flags:
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag} {value}: must be a positive number.")
    if not args.continuous_batching and any(getattr(args, flag) is not None for flag in cb_flags):
        raise ValueError(f"--{', --'.join(cb_flags)} configure --continuous_batching; add that flag.")
    check_model_dir(args.model_dir)
    return args
