"""`qkvshare serve`: an OpenAI-compatible HTTP server for a QKVShare model, with the one-tensor cache.

    qkvshare serve outputs/cpu-small                                # http://127.0.0.1:8000/v1
    qkvshare serve outputs/cpu-small --port 0                       # a free port, printed when the server is up
    qkvshare serve outputs/cpu-small --continuous_batching          # transformers' continuous batching

OpenAI's protocol (`transformers serve` cannot load QKVShare checkpoints): POST /v1/chat/completions,
/v1/completions and /v1/responses (streamed with "stream": true), GET /v1/models and /health. The server is pinned
to MODEL_DIR: requests name the model as /v1/models lists it (the MODEL_DIR given here). At startup it prints the
KV-cache bytes per token it holds, the page pool and the limits.

Every request is checked before it generates: its fields (ones the server does not implement are refused by name),
an empty prompt, prompt + max_tokens beyond the model's positions or the page pool: an HTTP 4xx with a message. At
most --max_concurrent_requests generate at once (HTTP 429 beyond); a request is stopped after --request_timeout
seconds (HTTP 504); a client that disconnects cancels its generation. One request's error ends that request only;
a continuous-batching worker that dies is restarted (/health says so). SIGTERM lets the requests in flight finish,
then exits.

MODEL_DIR must hold a QKVShare causal LM (save_pretrained, e.g. a `qkvshare train` run) and its tokenizer (with a
chat template for the chat and response endpoints). Needs the 'serve' extra (fastapi, uvicorn, openai).

From Python: `qkvshare.serve.serve(ServeArgs("outputs/cpu-small", continuous_batching=True))`, or
`qkvshare.serve.build_app(model, tokenizer, model_id=...)` for an app around a model already loaded.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from .conventions import DTYPE_NAMES, TOKENIZER_FILES, HelpFormatter, add_dtype_argument, config_model_type

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
CB_FLAGS = ("cb_page_size", "cb_num_blocks", "cb_pool_tokens", "cb_pool_mib", "cb_max_batch_tokens")
POOL_FLAGS = ("cb_num_blocks", "cb_pool_tokens", "cb_pool_mib")  # the page pool, in one of three units


@dataclass
class ServeArgs:
    """What `qkvshare serve` serves and how (the command's flags and defaults); building one checks what needs no
    model (a `ValueError` naming the flag). The model directory itself is checked when the server starts."""

    model_dir: str  # a QKVShare model directory with its tokenizer (save_pretrained)
    host: str = "127.0.0.1"  # address to listen on (0.0.0.0: every interface)
    port: int = 8000  # 0: a free one, printed at startup
    device: str | None = None  # cpu, cuda, cuda:1, mps (None: cuda if available)
    dtype: str = "auto"  # weights and activations; auto: as saved
    attn_implementation: str | None = None  # sdpa (None) or eager
    continuous_batching: bool = False  # batch the requests on the tied paged cache
    cb_page_size: int | None = None  # tokens per page (None on CPU: 32)
    cb_num_blocks: int | None = None  # the page pool in blocks (page_size tokens of every layer) ...
    cb_pool_tokens: int | None = None  # ... or in tokens, rounded up to whole pages ...
    cb_pool_mib: float | None = None  # ... or in MiB of pages (None on CPU: 4,096 tokens)
    cb_max_batch_tokens: int | None = None  # tokens per forward (None on CPU: 256)
    max_concurrent_requests: int = 32  # requests generating at once; more are answered HTTP 429
    request_timeout: float = 600.0  # seconds a request may run (HTTP 504 after); 0: no limit
    seed: int | None = None  # torch seed at startup, for sampled requests
    log_level: str = "info"  # uvicorn's

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """The flags, as far as they go without reading the model."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port}: a port is 0 to 65535 (0: a free one).")
        if DTYPE_NAMES.get(self.dtype) is None:
            raise ValueError(f"--dtype {self.dtype!r} is not one of auto, float32, bfloat16, float16.")
        self.dtype = DTYPE_NAMES[self.dtype]
        if self.attn_implementation not in (None, *ATTN_IMPLEMENTATIONS):
            raise ValueError(f"--attn_implementation {self.attn_implementation!r} is not one of sdpa, eager.")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log_level {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}.")
        for flag in CB_FLAGS:
            value = getattr(self, flag)
            if value is not None and not value > 0:
                raise ValueError(f"--{flag} {value}: must be a positive number.")
        if self.cb_page_size is not None and self.cb_page_size < 4:
            raise ValueError(f"--cb_page_size {self.cb_page_size}: transformers' pages hold at least 4 tokens.")
        if not self.continuous_batching and any(getattr(self, flag) is not None for flag in CB_FLAGS):
            raise ValueError(f"--{', --'.join(CB_FLAGS)} configure --continuous_batching; add that flag.")
        pool = [f"--{flag}" for flag in POOL_FLAGS if getattr(self, flag) is not None]
        if len(pool) > 1:
            raise ValueError(f"{' and '.join(pool)} both size the page pool; give one.")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"--max_concurrent_requests {self.max_concurrent_requests}: must be at least 1.")
        if not self.request_timeout >= 0:
            raise ValueError(f"--request_timeout {self.request_timeout}: seconds, >= 0 (0: no limit).")


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
        help="continuous batching: blocks of the page pool, each page_size tokens of every layer (default on CPU: "
        "4,096 tokens' worth; elsewhere transformers' sizing from free memory)",
    )
    p.add_argument(
        "--cb_pool_tokens",
        type=int,
        default=None,
        help="continuous batching: the page pool in tokens, rounded up to whole pages (instead of --cb_num_blocks)",
    )
    p.add_argument(
        "--cb_pool_mib",
        type=float,
        default=None,
        help="continuous batching: the page pool in MiB of pages (instead of --cb_num_blocks; the tied cache fits "
        "more tokens in the same MiB)",
    )
    p.add_argument(
        "--cb_max_batch_tokens",
        type=int,
        default=None,
        help="continuous batching: tokens per forward, prompts chunked to it (default on CPU: 256)",
    )
    p.add_argument(
        "--max_concurrent_requests",
        type=int,
        default=32,
        help="requests generating at once; more are answered HTTP 429 (retry)",
    )
    p.add_argument(
        "--request_timeout",
        type=float,
        default=600.0,
        help="seconds a request may take before it is stopped (HTTP 504); 0: no limit. Also how long SIGTERM waits",
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


def parse_args(argv: list[str] | None) -> ServeArgs:
    """The command line, checked without torch (a `ValueError` naming the bad input), the model directory's
    config.json and tokenizer files included."""
    args = ServeArgs(**vars(build_parser().parse_args(argv)))
    check_model_dir(args.model_dir)
    return args
