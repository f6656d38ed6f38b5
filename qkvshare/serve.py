"""`qkvshare serve MODEL_DIR`: transformers' OpenAI-compatible server, serving a QKVShare model with its tied cache.

Why a command of our own: `transformers serve` loads a checkpoint through `getattr(transformers,
config.architectures[0])`, and `QKVShareForCausalLM` is no attribute of the `transformers` module (with or without
`trust_remote_code`), so it cannot load any QKVShare checkpoint. This command builds the same server from
transformers' own pieces (`transformers.cli.serving`: model manager, the chat-completion, completion and response
handlers, `build_server`, uvicorn) with three changes:
- `QKVShareModelManager` loads the model with `QKVShareForCausalLM` (after `check_weights_fit_config`);
- the handlers check a request's sampling parameters and messages first (`check_request_fields`): a bad value is
  an HTTP 400 naming the field, where transformers answers 500 without a message or fails inside generation;
- every error of a request is answered with its message in OpenAI's shape (`{"error": {"message": ...}}`, which
  the `openai` client shows; transformers answers `{"detail": ...}` or a bare "Internal Server Error"), and the
  server keeps serving.

What is served keeps the one-tensor cache: the server's sequential path calls `model.generate()`, which builds a
`QKVShareCache` (tied layers hold one tensor). The startup log prints that cache's bytes per token, measured on a
short prefill, next to the K-and-V-in-every-layer size of the same shape. With `--continuous_batching` the server
batches through the model's `init_continuous_batching`, on the tied paged cache (`QKVSharePagedCache`); its worker
and page pool are started at startup (transformers starts them at the first request), so a model the pool cannot
hold is refused before serving and the log gives the pool's size. transformers' continuous batching applies one
generation config to every request, so a request asking for other settings is an HTTP 400 (`CheckedRequests`).

This rests on transformers' serving modules, which are not public API: tested with
`paged_cache_qkvshare.TESTED_TRANSFORMERS` (another version is warned about at startup).

The server is pinned to the one model (transformers' `force_model`): requests name it as `/v1/models` lists it
(the MODEL_DIR given on the command line); another name is an HTTP 400.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from packaging.specifiers import SpecifierSet
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.server import build_server
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import CBWorkerDeadError, GenerationState, split_revision

from qkvshare.cache_qkvshare import CacheLayout, QKVShareCache
from qkvshare.configuration_qkvshare import kv_cache_bytes_per_token
from qkvshare.model_dir import check_weights_fit_config
from qkvshare.modeling_qkvshare import QKVShareForCausalLM
from qkvshare.paged_cache_qkvshare import TESTED_TRANSFORMERS
from qkvshare.runtime import default_device

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from transformers import ContinuousBatchingConfig, GenerationConfig

PREFILL_TOKENS = 16  # tokens of the startup prefill whose cache is measured for the log


# ----------------------------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------------------------
class QKVShareModelManager(ModelManager):
    """transformers' model manager, loading through `QKVShareForCausalLM` (its own lookup, an attribute of the
    `transformers` module named by config.json's `architectures`, does not find our class)."""

    def _load_model(self, model_id_and_revision: str, **_: Any) -> QKVShareForCausalLM:
        model_dir, _revision = split_revision(model_id_and_revision)
        model = QKVShareForCausalLM.from_pretrained(
            model_dir, dtype=self.dtype, attn_implementation=self.attn_implementation
        )
        return model.to(self.device).eval()


# ----------------------------------------------------------------------------------------------------------------
# requests
# ----------------------------------------------------------------------------------------------------------------
def _number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


# Request field -> (test, what the value must be). transformers reads the sampling fields with float()/int() into a
# `GenerationConfig`: a string is a ValueError (HTTP 500), a value out of range fails inside generation (a 500, or
# an error event in a stream that already answered 200); malformed messages fail in the chat template.
# frequency_penalty becomes transformers' repetition_penalty = 1 + frequency_penalty, which must be positive; the
# other bounds are OpenAI's.
REQUEST_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
    "max_completion_tokens": (lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
    "max_output_tokens": (lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
    "temperature": (lambda v: _number(v) and 0 <= v <= 2, "a number from 0 to 2 (0: greedy)"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "frequency_penalty": (lambda v: _number(v) and -1 < v <= 2, "a number in (-1, 2]"),
    "seed": (_whole, "a whole number"),
    "stop": (
        lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
        "a string or a list of strings",
    ),
    "messages": (_messages, "a non-empty list of messages, each an object with a role"),
    "input": (lambda v: isinstance(v, str | list) and bool(v), "a non-empty string or list of input items"),
}


def check_request_fields(body: dict, required: tuple[str, ...] = ()) -> None:
    """Raise an HTTP 400 naming every field of `body` that `REQUEST_FIELDS` refuses, and every `required` field
    that is missing."""
    from fastapi import HTTPException

    bad = [f"{name} is required" for name in required if body.get(name) is None]
    bad += [
        f"{name}={body[name]!r} (must be {need})"
        for name, (test, need) in REQUEST_FIELDS.items()
        if body.get(name) is not None and not test(body[name])
    ]
    if bad:
        raise HTTPException(status_code=400, detail="Invalid request: " + "; ".join(bad) + ".")


# What transformers' continuous batching takes from each request: `max_new_tokens` and the stop token only
# (`CBGenerateManager.add_request`); every other generation setting is the one config its manager was built with.
# Setting -> what it means when unset (None, or an empty list or dict), as transformers' generation reads it.
SHARED_WHEN_BATCHED = {"do_sample": False, "repetition_penalty": 1.0, "sequence_bias": None, "stop_strings": None}
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": None}  # matter only where one of the two configs samples


def _setting(config: GenerationConfig, name: str, unset: Any) -> Any:
    value = getattr(config, name)
    return unset if value is None or value == [] or value == {} else value


def batching_differences(requested: GenerationConfig, shared: GenerationConfig) -> list[str]:
    """The settings of `requested` that continuous batching would not apply, generating with `shared` instead, as
    "name=value (the server's: value)"."""
    names = dict(SHARED_WHEN_BATCHED)
    if _setting(requested, "do_sample", False) or _setting(shared, "do_sample", False):
        names.update(SAMPLING)
    values = {name: (_setting(requested, name, unset), _setting(shared, name, unset)) for name, unset in names.items()}
    return [f"{name}={mine!r} (the server's: {theirs!r})" for name, (mine, theirs) in values.items() if mine != theirs]


class CheckedRequests:
    """Mixin for transformers' request handlers: `check_request_fields` runs with transformers' own check of the
    request, before the model is touched; with continuous batching, a request that asks for generation settings it
    would not apply (`batching_differences`) is an HTTP 400 too, where transformers would ignore them."""

    required: tuple[str, ...] = ()  # fields the endpoint cannot answer without

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The one generation config continuous batching applies to every request, set when it starts
        # (`start_continuous_batching`); None while each request is generated with its own.
        self.batching_generation: GenerationConfig | None = None

    def _validate_request(self, body: dict) -> None:
        from fastapi import HTTPException

        super()._validate_request(body)  # transformers' check: unexpected fields are an HTTP 422
        check_request_fields(body, self.required)
        if self.batching_generation is None:
            return
        requested = self._build_generation_config(body, self.batching_generation, use_cb=True)
        differences = batching_differences(requested, self.batching_generation)
        if differences:
            raise HTTPException(
                status_code=400,
                detail=f"Invalid request: {'; '.join(differences)}. This server batches requests continuously, and "
                "transformers' continuous batching generates every request with one generation config (the model's; "
                "only max_tokens and the stop token are per request). Leave these fields out, or serve without "
                "--continuous_batching.",
            )


class CheckedChatCompletionHandler(CheckedRequests, ChatCompletionHandler):
    """`/v1/chat/completions` with `check_request_fields`."""

    required = ("messages",)


class CheckedCompletionHandler(CheckedRequests, CompletionHandler):
    """`/v1/completions` with `check_request_fields` (transformers' handler refuses a prompt that is no string)."""


class CheckedResponseHandler(CheckedRequests, ResponseHandler):
    """`/v1/responses` with `check_request_fields`."""

    required = ("input",)


# ----------------------------------------------------------------------------------------------------------------
# the startup log
# ----------------------------------------------------------------------------------------------------------------
def prefilled_cache(model: QKVShareForCausalLM, tokens: int = PREFILL_TOKENS) -> QKVShareCache:
    """The `QKVShareCache` that `generate()` builds, after a prefill of `tokens` tokens of one sequence."""
    cache = QKVShareCache(config=model.config)
    ids = torch.zeros(1, tokens, dtype=torch.long, device=model.device)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache


# What a layer of each `CacheLayout` kind holds per token, for the log.
HELD = {
    "tied": "tied layer{s}, one tensor each",
    "key_value": "layer{s} with K and V",
    "context_value": "QV-Ka layer{s} with V and the context G",
}


def cache_summary(model: QKVShareForCausalLM, tokens: int = PREFILL_TOKENS) -> str:
    """One line for the startup log: the KV-cache bytes per token measured after a prefill of `tokens` tokens,
    what the layers hold, and what K and V in every layer would hold, e.g. "KV cache: 11,520 bytes/token (Q-K=V:
    30 tied layers, one tensor each; K and V in every layer would hold 23,040; torch.bfloat16)"."""
    config = model.config
    cache = prefilled_cache(model, tokens)
    if config.attention_kernel == "linear":
        return (
            f"KV cache: {cache.nbytes():,} bytes per sequence, whatever its length ({config.variant}: linear "
            f"attention keeps a constant-size state; {model.dtype})"
        )
    kinds = Counter(CacheLayout.for_config(config).layer_kinds)
    held = [f"{count} " + HELD[kind].format(s="" if count == 1 else "s") for kind, count in kinds.items()]
    held += ["token positions kept"] if config.needs_key_positions else []
    element = torch.finfo(model.dtype).bits // 8
    both = kv_cache_bytes_per_token(config, element, tied=False)
    return (
        f"KV cache: {cache.nbytes() / tokens:,.0f} bytes/token ({config.variant}: {'; '.join(held)}; K and V in "
        f"every layer would hold {both:,}; {model.dtype})"
    )


# ----------------------------------------------------------------------------------------------------------------
# the server
# ----------------------------------------------------------------------------------------------------------------
def openai_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error answer in OpenAI's shape, `{"error": {"message", "type", "code"}}`: the `openai` client puts that
    message into the exception it raises (it ignores FastAPI's `{"detail": ...}`)."""
    from fastapi.responses import JSONResponse

    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


def answer_errors_with_messages(app: FastAPI) -> None:
    """Every error of a request answered with its message in OpenAI's shape: transformers' HTTP errors (another
    model: 400, unexpected fields: 422) and ours, a body that is no JSON object (422), and any other exception (500;
    transformers' server answers a bare "Internal Server Error" there). The server keeps serving after each."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, exc: HTTPException) -> JSONResponse:
        return openai_error(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _body(_request: Request, exc: RequestValidationError) -> JSONResponse:
        where = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return openai_error(422, f"Invalid request body ({where}); send a JSON object.")

    @app.exception_handler(CBWorkerDeadError)
    async def _worker(_request: Request, exc: CBWorkerDeadError) -> JSONResponse:
        return openai_error(503, str(exc))  # transformers' answer, with the message where the client reads it

    @app.exception_handler(Exception)
    async def _other(_request: Request, exc: Exception) -> JSONResponse:
        return openai_error(500, f"{type(exc).__name__}: {exc}")


# Continuous batching on CPU, when the command line leaves these out: transformers sizes the page pool from free
# memory (on CPU: most of the RAM) and, for the sdpa and eager backends, allocates an attention mask of
# max_batch_tokens x (pool tokens + max_batch_tokens) and fills it for every batch: with its defaults, gigabytes and
# seconds per forward. Small pages also suit short requests (a request holds whole pages).
CPU_CONTINUOUS_BATCHING = {"page_size": 32, "num_blocks": 128, "max_batch_tokens": 256}
CB_START_SECONDS = 120.0  # bound on creating the page pool at startup


def continuous_batching_config(args: argparse.Namespace, device: str) -> ContinuousBatchingConfig:
    """The `ContinuousBatchingConfig` of the command line; on CPU, `CPU_CONTINUOUS_BATCHING` for what it leaves out."""
    from transformers import ContinuousBatchingConfig

    given = {
        "page_size": args.cb_page_size,
        "num_blocks": args.cb_num_blocks,
        "max_batch_tokens": args.cb_max_batch_tokens,
    }
    defaults = CPU_CONTINUOUS_BATCHING if torch.device(device).type == "cpu" else {}
    options = {name: value if value is not None else defaults.get(name) for name, value in given.items()}
    return ContinuousBatchingConfig(**{name: value for name, value in options.items() if value is not None})


def start_continuous_batching(
    state: GenerationState, model: QKVShareForCausalLM, model_id: str, handlers: list[CheckedRequests]
) -> str:
    """Start the server's continuous-batching worker now (transformers starts it at the first request) and return
    the log line of its page pool: a model it cannot batch is refused at startup (`ValueError`), and the pool is
    sized before the first request waits for it.

    transformers' server gives its continuous batching the generation config of the first request for every request
    (only max_tokens and the stop token are per request); started here, that is the model's own generation config,
    and `handlers` refuse requests that ask for other settings (`CheckedRequests`).
    """
    generation_config = handlers[0]._build_generation_config({}, model.generation_config, use_cb=True)
    manager = state.get_manager(model_id, use_cb=True)
    manager.init_cb(model, generation_config)  # the model's `init_continuous_batching`: our tied paged cache
    for handler in handlers:
        handler.batching_generation = generation_config
    deadline = time.monotonic() + CB_START_SECONDS
    while True:
        if not manager.is_alive():
            raise RuntimeError(
                "continuous batching: its worker stopped while building the page pool (see its error above)"
            )
        try:
            cache = manager.scheduler.cache  # there once the worker has built the batch processor and its pool
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"continuous batching: no page pool after {CB_START_SECONDS:.0f} s") from None
            time.sleep(0.05)
    config, element = model.config, torch.finfo(model.dtype).bits // 8
    page = next(iter(cache.cache_allocators.values())).tokens_per_page
    tokens = cache.num_blocks * page
    both = kv_cache_bytes_per_token(config, element, tied=False)
    return (
        f"Paged cache (continuous batching): {cache.num_blocks:,} blocks of {page} tokens = {tokens:,} tokens in "
        f"{cache.cache_tensor.nbytes:,} bytes; K and V in every layer would fit "
        f"{tokens * kv_cache_bytes_per_token(config, element) // both:,} tokens in these pages"
    )


def build_app(args: argparse.Namespace) -> tuple[FastAPI, QKVShareForCausalLM, str | None]:
    """transformers' server app with the model of `args.model_dir` loaded (see the module docstring); returns the
    app, the model and, with `--continuous_batching`, the log line of the page pool (else None)."""
    device = args.device or default_device()
    manager = QKVShareModelManager(
        device=device,
        dtype=args.dtype,  # a canonical --dtype name: "auto" or a torch dtype's name, as transformers' manager takes
        attn_implementation=args.attn_implementation,
        continuous_batching=args.continuous_batching,
        force_model=args.model_dir,
    )
    model_id = manager.process_model_name(args.model_dir)
    model, _tokenizer = manager.load_model_and_processor(model_id)
    cb_config = continuous_batching_config(args, device) if args.continuous_batching else None
    state = GenerationState(continuous_batching=args.continuous_batching, cb_config=cb_config)
    shared = dict(model_manager=manager, generation_state=state)
    handlers = [
        CheckedChatCompletionHandler(**shared),
        CheckedCompletionHandler(**shared),
        CheckedResponseHandler(**shared),
    ]
    app = build_server(
        manager,
        handlers[0],
        completion_handler=handlers[1],
        response_handler=handlers[2],
        transcription_handler=TranscriptionHandler(manager, state),
        systemone_handler=SystemOneHandler(**shared),
        generation_state=state,
    )
    answer_errors_with_messages(app)
    if not args.continuous_batching:
        return app, model, None
    try:
        return app, model, start_continuous_batching(state, model, model_id, handlers)
    except ValueError as err:  # a model or setting the tied paged cache refuses, with the reason
        raise ValueError(f"{err} Or serve without --continuous_batching (one generate() at a time).") from None


@contextmanager
def serve_in_subprocess(
    model_dir: str | Path,
    flags: Iterable[str] = (),
    log_path: str | Path = "serve.log",
    startup_seconds: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run `qkvshare serve MODEL_DIR --port 0 FLAGS` in a new process (this interpreter, this package), its output
    to `log_path`; yield (its base URL, e.g. "http://127.0.0.1:41489", the process) once it listens, and stop it on
    exit. A `RuntimeError` with the log when it exits or does not listen within `startup_seconds`.

    For tests and benchmarks: the port is a free one the server picks itself (no race with other processes), read
    from uvicorn's "Uvicorn running on URL" line (so `--log_level` must stay info or debug); `env` is added to this
    process's environment."""
    root = str(Path(__file__).resolve().parents[1])  # the package this process runs, not another install
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "qkvshare_cli", "serve", str(model_dir), "--port", "0", *flags]
    log_path = Path(log_path)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {}), "PYTHONPATH": path}
        )
    try:
        deadline = time.monotonic() + startup_seconds
        while (found := re.search(r"Uvicorn running on (http://\S+)", log_path.read_text())) is None:
            if process.poll() is not None:
                raise RuntimeError(f"qkvshare serve exited ({process.returncode}):\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"qkvshare serve is not up after {startup_seconds:.0f} s:\n{log_path.read_text()}")
            time.sleep(0.1)
        yield found.group(1), process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def serve(args: argparse.Namespace) -> None:
    """`qkvshare serve MODEL_DIR`: load the model, print its cache size, serve until stopped. A model directory that
    cannot be served is a `ValueError` before anything listens."""
    import uvicorn

    check_weights_fit_config(args.model_dir, model_class=QKVShareForCausalLM)
    if not SpecifierSet(TESTED_TRANSFORMERS).contains(transformers.__version__, prereleases=True):
        print(
            f"qkvshare serve: warning: this server builds on transformers' serving modules (not public API), tested "
            f"with transformers{TESTED_TRANSFORMERS}; {transformers.__version__} is installed. If it fails, install "
            f'"transformers{TESTED_TRANSFORMERS}".',
            file=sys.stderr,
        )
    if args.seed is not None:
        torch.manual_seed(args.seed)
    app, model, pool = build_app(args)  # a ValueError when continuous batching is refused (it says what to use)
    print(f"Serving {args.model_dir} ({model.config.variant}, {model.dtype}, {model.device})", flush=True)
    print(cache_summary(model), flush=True)
    if pool is not None:
        print(pool, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
