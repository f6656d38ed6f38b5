"""`qkvshare serve MODEL_DIR`: an OpenAI-compatible HTTP server for a QKVShare model, on its tied cache.

Endpoints: POST /v1/completions, /v1/chat/completions and /v1/responses (streamed as server-sent events when the
request says `stream: true`, else one JSON answer), GET /v1/models and /health. Python API: `serve(ServeArgs(...))`
(the command: load, log, run uvicorn until SIGTERM/SIGINT; `qkvshare_settings.serve.ServeArgs` holds the flags),
`load_model` and `build_app` (a FastAPI app around a loaded model, e.g. for tests or another ASGI server), and
`serve_in_subprocess` (the command in a process of its own, for tests and benchmarks).

Why an app of our own, not transformers' server (`transformers.cli.serving`): `transformers serve` loads a
checkpoint through `getattr(transformers, config.architectures[0])` and cannot load a QKVShare model, and its
request handlers, model manager and generation managers are private API (the previous version of this module
subclassed `ModelManager._load_model` and the handlers' `_validate_request` / `_build_generation_config`). What a
server one leaves running needs sits inside those private pieces: its continuous-batching manager dies for good on
one bad request (an empty prompt, a prompt larger than the page pool), nothing checks a request against the model's
context or the pool, `n` and `logprobs` are ignored, a client that disconnects keeps its non-streamed generation
running, there is no bound on concurrent requests or per-request time, and /v1/responses streams unless asked not
to. Adding those meant overriding more private methods. Instead this server speaks OpenAI's protocol itself
(`serve_protocol`, standard library only) on transformers' public generation API (`serve_engine`:
`model.generate()` with a `StoppingCriteria` and a `BaseStreamer`; `model.init_continuous_batching()` and the
manager's `start`, `add_request`, `get_result`, `cancel_request`, `is_running`, `stop`). The one private dependency
left is the tied paged cache itself (`paged_cache_qkvshare`, which subclasses transformers' continuous-batching
internals and checks the transformers version); the sequential server uses public API only.

Every request is checked at admission, before any token is generated (an HTTP 4xx with a message, in OpenAI's
shape `{"error": {"message", "type", "param", "code"}}`):
- the fields (`serve_protocol`): each known field's value; fields the server does not implement (tools, logit_bias,
  presence_penalty, ...) are refused by name unless they ask for nothing;
- the model it names (the server is pinned to MODEL_DIR, as /v1/models lists it);
- the prompt: not empty, token ids within the vocabulary, prompt + max_tokens within the model's positions
  (OpenAI's "maximum context length" answer, naming both counts); without max_tokens, chat and responses generate
  to the end of the context (completions: 16 tokens, OpenAI's default);
- with `--continuous_batching`: prompt + max_tokens within the page pool (a longer request could never be
  scheduled), and no sampling setting other than the server's (continuous batching applies one generation config);
- the load: at most `--max_concurrent_requests` requests generate at once (HTTP 429 beyond, with Retry-After).
Then limits apply while it runs: generation stops at max_tokens (at most the context's end); a client that closes
its connection cancels its generation (streamed or not); a request still running after `--request_timeout` seconds
is stopped (HTTP 504, or an error event in a stream). An error inside one request's generation ends that request
alone (HTTP 500 with the exception); with continuous batching, a worker that dies anyway is restarted, the
requests it held get an HTTP 503 (retry), later ones are served, and /health gives the restart count and the error.
SIGTERM (or Ctrl-C) stops accepting connections, lets the requests in flight finish (up to `--request_timeout`),
then exits.

What is served keeps the one-tensor cache: `generate()` builds a `QKVShareCache`, continuous batching runs on a
`QKVSharePagedCache`. Each non-streamed answer names the cache that served it in the `x-qkvshare-kv-cache` header
(e.g. "QKVShareCache; 256 bytes/token; torch.float32"), read from that request's own cache; the startup log prints the bytes per
token of a 16-token prefill next to K-and-V-in-every-layer's, and the page pool's size with continuous batching.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from transformers import AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

from qkvshare.cache_qkvshare import CacheLayout, QKVShareCache
from qkvshare.configuration_qkvshare import kv_cache_bytes_per_token
from qkvshare.model_dir import check_weights_fit_config
from qkvshare.modeling_qkvshare import QKVShareForCausalLM
from qkvshare.paged_cache_qkvshare import CPU_MAX_BATCH_TOKENS, CPU_PAGE_SIZE, CPU_POOL_TOKENS
from qkvshare.runtime import default_device
from qkvshare.serve_engine import BatchingEngine, Job, Scorer, SequentialEngine
from qkvshare.serve_protocol import (
    ChoiceResult,
    ParsedRequest,
    RequestError,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    parse_request,
    response_body,
    sse,
    sse_event,
    usage_chunk,
)
from qkvshare_settings.serve import ServeArgs, check_model_dir

PREFILL_TOKENS = 16  # tokens of the startup prefill whose cache is measured for the log
DEFAULT_MAX_CONCURRENT_REQUESTS = 32
DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds (the openai client's own default timeout)
CB_START_SECONDS = 120.0  # bound on creating the page pool at startup
CACHE_HEADER = "x-qkvshare-kv-cache"


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
    """One line for the startup log: the KV-cache bytes per token in 16-bit (the figure every command gives), what
    the layers hold and what K and V in every layer would hold, then the bytes measured in the served dtype after a
    prefill of `tokens` tokens, e.g. "KV cache: 11,520 bytes/token in 16-bit (Q-K=V: 30 tied layers, one tensor
    each; K and V in every layer would hold 23,040); measured in this server's torch.float32 cache: 23,040"."""
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
    sixteen = kv_cache_bytes_per_token(config, 2, positions=True)
    both = kv_cache_bytes_per_token(config, 2, tied=False)
    return (
        f"KV cache: {sixteen:,} bytes/token in 16-bit ({config.variant}: {'; '.join(held)}; K and V in every layer "
        f"would hold {both:,}); measured in this server's {model.dtype} cache: {cache.nbytes() / tokens:,.0f}"
    )


def kv_bytes_per_token_untied(model: QKVShareForCausalLM) -> int:
    """Bytes per token of K and V in every layer (what a cache without tied layers holds for this shape)."""
    return kv_cache_bytes_per_token(model.config, torch.finfo(model.dtype).bits // 8, tied=False)


def pool_summary(model: QKVShareForCausalLM, cache: Any) -> str:
    """The startup line of the page pool: blocks, tokens, bytes, and the tokens the same pages would hold with K
    and V in every layer."""
    element = torch.finfo(model.dtype).bits // 8
    tokens = cache.capacity_tokens()
    untied = tokens * kv_cache_bytes_per_token(model.config, element) // kv_bytes_per_token_untied(model)
    return (
        f"Paged cache (continuous batching): {cache.num_blocks:,} blocks of {cache.page_size} tokens = {tokens:,} "
        f"tokens in {cache.nbytes():,} bytes; K and V in every layer would fit {untied:,} tokens in these pages"
    )


# ----------------------------------------------------------------------------------------------------------------
# loading and settings
# ----------------------------------------------------------------------------------------------------------------
def load_model(
    model_dir: str | Path, *, device: str | None = None, dtype: str = "auto", attn_implementation: str | None = None
) -> tuple[QKVShareForCausalLM, Any]:
    """The model (on `device`, in eval mode) and tokenizer of a QKVShare model directory. `dtype`: "auto" (as
    saved) or a torch dtype's name; `attn_implementation`: "sdpa" (default) or "eager"."""
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    model = QKVShareForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, attn_implementation=attn_implementation)
    model = model.to(device or default_device()).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def continuous_batching_config(
    model: QKVShareForCausalLM,
    *,
    page_size: int | None = None,
    num_blocks: int | None = None,
    pool_mib: float | None = None,
    pool_tokens: int | None = None,
    max_batch_tokens: int | None = None,
) -> ContinuousBatchingConfig:
    """The server's `ContinuousBatchingConfig`: the page pool from `num_blocks`, `pool_tokens` (rounded up to whole
    pages) or `pool_mib` (the blocks of this model's cache that fit), at most one of them; on CPU, pages of
    `CPU_PAGE_SIZE` tokens, a pool of `CPU_POOL_TOKENS` and `CPU_MAX_BATCH_TOKENS` per forward for what is left
    out (elsewhere transformers' sizing from free memory)."""
    sizes = {"num_blocks": num_blocks, "pool_tokens": pool_tokens, "pool_mib": pool_mib}
    given = [name for name, value in sizes.items() if value is not None]
    if len(given) > 1:
        raise ValueError(f"continuous batching: give the page pool once, not as {' and '.join(given)}.")
    cpu = model.device.type == "cpu"
    page = page_size or (CPU_PAGE_SIZE if cpu else ContinuousBatchingConfig().page_size)
    if pool_tokens is not None:
        num_blocks = math.ceil(pool_tokens / page)
    elif pool_mib is not None:
        block = page * model.config.kv_cache_bytes_per_token(torch.finfo(model.dtype).bits // 8)
        num_blocks = int(pool_mib * 2**20 // block)
        if num_blocks < 1:
            raise ValueError(
                f"continuous batching: a page pool of {pool_mib:g} MiB holds no block of this model ({block:,} bytes "
                f"for {page} tokens); give more MiB or smaller pages."
            )
    elif num_blocks is None and cpu:
        num_blocks = math.ceil(CPU_POOL_TOKENS / page)
    if max_batch_tokens is None and cpu:
        max_batch_tokens = CPU_MAX_BATCH_TOKENS
    options = {"page_size": page, "num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens}
    return ContinuousBatchingConfig(**{name: value for name, value in options.items() if value is not None})


def eos_token_ids(generation_config: GenerationConfig) -> set[int]:
    eos = generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


# What continuous batching applies to every request (transformers' manager has one generation config): a request
# asking for other values is refused there. Setting -> its value when unset, as generation reads it.
SHARED_WHEN_BATCHED = {"do_sample": False, "repetition_penalty": 1.0}
SAMPLING = {"temperature": 1.0, "top_p": 1.0}  # matter only where one of the two configs samples


def _setting(config: GenerationConfig, name: str, unset: Any) -> Any:
    value = getattr(config, name)
    return unset if value is None else value


def batching_differences(requested: GenerationConfig, shared: GenerationConfig) -> list[str]:
    """The settings of `requested` that continuous batching would not apply, generating with `shared` instead, as
    "name=value (the server's: value)"."""
    names = dict(SHARED_WHEN_BATCHED)
    if _setting(requested, "do_sample", False) or _setting(shared, "do_sample", False):
        names.update(SAMPLING)
    values = {name: (_setting(requested, name, unset), _setting(shared, name, unset)) for name, unset in names.items()}
    return [f"{name}={mine!r} (the server's: {theirs!r})" for name, (mine, theirs) in values.items() if mine != theirs]


# ----------------------------------------------------------------------------------------------------------------
# the server
# ----------------------------------------------------------------------------------------------------------------
class ConcurrencyLimit:
    """At most `limit` requests generating at once (thread-safe: released when a request's last job ends, on
    whichever thread ends it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._lock = threading.Lock()

    def acquire(self) -> Slot:
        with self._lock:
            if self.in_flight >= self.limit:
                raise RequestError(
                    429,
                    f"The server is busy: {self.in_flight} requests are being generated, its limit "
                    f"(qkvshare serve --max_concurrent_requests {self.limit}). Retry shortly.",
                    code="server_busy",
                )
            self.in_flight += 1
        return Slot(self)

    def _release(self) -> None:
        with self._lock:
            self.in_flight -= 1


class Slot:
    """One admitted request's place under the `ConcurrencyLimit`, given back once (when its last job ends)."""

    def __init__(self, limit: ConcurrencyLimit) -> None:
        self._limit, self._jobs, self._released = limit, 0, False
        self._lock = threading.Lock()

    def hold(self, jobs: int) -> None:
        with self._lock:
            self._jobs = jobs

    def job_ended(self, _job: Job | None = None) -> None:
        with self._lock:
            self._jobs -= 1
            done = self._jobs <= 0
        if done:
            self.release()

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._limit._release()


@dataclass
class ServerStats:
    """What the server has answered, for /health."""

    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    timed_out: int = 0
    refused: int = 0  # 4xx at admission
    busy: int = 0  # 429
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, name: str) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)

    def as_dict(self) -> dict[str, int]:
        names = ("completed", "failed", "cancelled", "timed_out", "refused", "busy")
        return {name: getattr(self, name) for name in names}


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


class QKVShareServer:
    """The served model, its engine and limits, and the FastAPI app answering OpenAI's protocol (`app`)."""

    def __init__(
        self,
        model: QKVShareForCausalLM,
        tokenizer: Any,
        *,
        model_id: str,
        continuous_batching: bool = False,
        cb_config: ContinuousBatchingConfig | None = None,
        max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
    ) -> None:
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.context_length = int(model.config.max_position_embeddings)
        self.vocab_size = int(model.config.vocab_size)
        self.request_timeout = request_timeout
        self.limit = ConcurrencyLimit(max_concurrent_requests)
        self.stats = ServerStats()
        self.generation_config = copy.deepcopy(model.generation_config)
        if self.generation_config.pad_token_id is None:
            self.generation_config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id or 0
        self.eos = eos_token_ids(self.generation_config)
        scorer = Scorer(model, self._token_text, explicit_mask=continuous_batching)
        self.pool_tokens: int | None = None
        if continuous_batching:
            config = cb_config if cb_config is not None else continuous_batching_config(model)
            try:
                self.engine: SequentialEngine | BatchingEngine = BatchingEngine(
                    model, scorer, self._batching_generation_config(), config, start_seconds=CB_START_SECONDS
                )
            except ValueError as err:  # a model or setting the tied paged cache refuses, with the reason
                raise ValueError(f"{err} Or serve without --continuous_batching (one generate() at a time).") from None
            self.pool_tokens = self.engine.cache.capacity_tokens()
        else:
            self.engine = SequentialEngine(model, scorer, self.generation_config, tokenizer)
        self.app = self._build_app()

    # -- text helpers ----------------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _batching_generation_config(self) -> GenerationConfig:
        config = copy.deepcopy(self.generation_config)
        config.use_cache = False  # continuous batching keeps its own (paged) cache
        return config

    def pool_line(self) -> str | None:
        return pool_summary(self.model, self.engine.cache) if isinstance(self.engine, BatchingEngine) else None

    def limits_line(self) -> str:
        timeout = f"{self.request_timeout:g} s per request" if self.request_timeout else "no per-request timeout"
        pool = f"; prompt + max_tokens within the {self.pool_tokens:,}-token page pool" if self.pool_tokens else ""
        return (
            f"Limits: {self.limit.limit} requests at once (more get HTTP 429), {timeout}, prompt + max_tokens "
            f"within the model's {self.context_length:,} positions{pool}"
        )

    def close(self) -> None:
        self.engine.close()

    # -- admission -------------------------------------------------------------------------------------------
    def _check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_id:
            raise RequestError(
                400,
                f"Server is pinned to '{self.model_id}'; requested '{requested}'. Name the model as /v1/models lists "
                "it.",
                code="model_not_found",
                param="model",
            )

    def _generation_overrides(self, request: ParsedRequest) -> dict[str, Any]:
        overrides = request.sampling.generation_overrides()
        if isinstance(self.engine, BatchingEngine):
            shared = self._batching_generation_config()
            requested = copy.deepcopy(shared)
            requested.update(**overrides)
            differences = batching_differences(requested, shared)
            if request.sampling.seed is not None and _setting(shared, "do_sample", False):
                differences.append(f"seed={request.sampling.seed} (one random generator for every request)")
            if differences:
                raise RequestError(
                    400,
                    f"Invalid request: {'; '.join(differences)}. This server batches requests continuously, and "
                    "transformers' continuous batching generates every request with one generation config (the "
                    "model's; only max_tokens is per request). Leave these fields out, or serve without "
                    "--continuous_batching.",
                )
            return {}
        return overrides

    def _prompts(self, request: ParsedRequest) -> list[tuple[list[int], str | None]]:
        """(token ids, prompt text or None) per prompt of the request (the chat template applied to messages)."""
        if request.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError(
                    400,
                    "This model's tokenizer has no chat template, so it cannot answer chat messages; use "
                    "/v1/completions with a plain prompt.",
                )
            try:
                encoded = self.tokenizer.apply_chat_template(
                    request.messages, add_generation_prompt=True, return_dict=True
                )
            except Exception as err:  # noqa: BLE001 - a template refusing these messages is the request's fault
                raise RequestError(400, f"Invalid request: the chat template refused these messages: {err}") from None
            return [(list(encoded["input_ids"]), None)]
        prompts = []
        for prompt in request.prompts:
            if isinstance(prompt, str):
                prompts.append((list(self.tokenizer(prompt)["input_ids"]), prompt))
            else:
                prompts.append((list(prompt), None))
        return prompts

    def _admit(self, request: ParsedRequest, ids: list[int]) -> int:
        """The number of tokens to generate for a prompt of `ids`; an HTTP 400 when the request cannot be served
        (empty prompt, token ids outside the vocabulary, beyond the context or the page pool)."""
        what = "prompt" if request.endpoint == "completions" else "messages"
        prompt = len(ids)
        if prompt == 0:
            raise RequestError(
                400, "Invalid request: the prompt is empty (0 tokens); give at least one token.", "empty_prompt", what
            )
        outside = [t for t in ids if not 0 <= t < self.vocab_size]
        if outside:
            raise RequestError(
                400,
                f"Invalid request: token ids {outside[:5]} are outside this model's vocabulary (0 to "
                f"{self.vocab_size - 1}).",
                "invalid_token",
                what,
            )
        limit, room = self.context_length, self.context_length - prompt
        asked = request.max_tokens
        if prompt > limit or (asked is not None and prompt + asked > limit):
            completion = f", {asked} in the completion" if asked else ""
            raise RequestError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt + (asked or 0)} tokens ({prompt} in the {what}{completion}). Please reduce the length of "
                f"the {what} or completion.",
                "context_length_exceeded",
                what,
            )
        if self.pool_tokens is not None:
            if prompt + (asked or 0) > self.pool_tokens or (asked is None and prompt >= self.pool_tokens):
                raise RequestError(
                    400,
                    f"This request needs {prompt + (asked or 1)} tokens of cache ({prompt} in the {what}, "
                    f"{asked or 1} in the completion) but the server's page pool holds {self.pool_tokens} tokens in "
                    "all, so it could never run. Reduce max_tokens or the prompt (or serve with a larger "
                    "--cb_pool_tokens / --cb_pool_mib).",
                    "pool_exceeded",
                    what,
                )
            room = min(room, self.pool_tokens - prompt)
        if request.stream and (request.logprobs is not None or request.echo):
            raise RequestError(400, "Invalid request: logprobs and echo are not implemented with stream=true.")
        return room if asked is None else asked

    # -- the app ---------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
            yield
            await asyncio.get_running_loop().run_in_executor(None, self.close)

        app = FastAPI(lifespan=lifespan, title="qkvshare serve")

        @app.exception_handler(RequestError)
        async def _refused(_request: Request, exc: RequestError) -> JSONResponse:
            headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
            return JSONResponse(exc.body(), exc.status, headers=headers)

        @app.exception_handler(HTTPException)
        async def _http(_request: Request, exc: HTTPException) -> JSONResponse:
            return JSONResponse(RequestError(exc.status_code, str(exc.detail)).body(), exc.status_code, exc.headers)

        @app.exception_handler(RequestValidationError)
        async def _body(_request: Request, exc: RequestValidationError) -> JSONResponse:
            return JSONResponse(RequestError(422, f"Invalid request body: {exc.errors()}").body(), 422)

        @app.exception_handler(Exception)
        async def _other(_request: Request, exc: Exception) -> JSONResponse:
            return JSONResponse(RequestError(500, f"{type(exc).__name__}: {exc}").body(), 500)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            entry = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "qkvshare"}
            return JSONResponse({"object": "list", "data": [entry]})

        @app.get("/health")
        async def health() -> JSONResponse:
            engine = self.engine
            body = {
                "status": "ok" if engine.healthy else getattr(engine, "state", "dead"),
                "mode": engine.mode,
                "worker_restarts": engine.restarts,
                "last_worker_error": engine.last_error,
                "requests_in_flight": self.limit.in_flight,
                "max_concurrent_requests": self.limit.limit,
                "requests": self.stats.as_dict(),
            }
            return JSONResponse(body, 200 if engine.healthy else 503)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await self.handle("completions", request)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Any:
            return await self.handle("chat.completions", request)

        @app.post("/v1/responses")
        async def responses(request: Request) -> Any:
            return await self.handle("responses", request)

        return app

    # -- one request -----------------------------------------------------------------------------------------
    async def handle(self, endpoint: str, http_request: Request) -> Any:
        try:
            try:
                body = await http_request.json()
            except Exception:  # noqa: BLE001 - any undecodable body
                raise RequestError(422, "Invalid request body (not JSON); send a JSON object.") from None
            request = parse_request(endpoint, body)
            self._check_model(request.model)
            overrides = self._generation_overrides(request)
        except RequestError as err:
            self.stats.count("refused")
            raise err from None
        try:
            slot = self.limit.acquire()
        except RequestError:
            self.stats.count("busy")
            raise
        try:
            prompts = await run_in_threadpool(self._prompts, request)
            plans = [(ids, text, self._admit(request, ids)) for ids, text in prompts]
        except BaseException as err:
            slot.release()
            if isinstance(err, RequestError):
                self.stats.count("refused")
            raise
        deadline = time.monotonic() + self.request_timeout if self.request_timeout else math.inf
        jobs = [
            Job(
                ids,
                max_new,
                decode=self._decode,
                eos_token_ids=self.eos,
                n=request.n,
                generation=overrides,
                seed=request.sampling.seed,
                stop=request.stop,
                logprobs=request.logprobs,
                echo=request.echo,
                prompt_text=text,
                stream=request.stream,
                deadline=deadline,
                timeout_seconds=self.request_timeout,
                on_end=lambda job: self._job_ended(job, slot),
            )
            for ids, text, max_new in plans
        ]
        slot.hold(len(jobs))
        for job in jobs:
            self.engine.submit(job)
        request_id = f"{'cmpl' if endpoint == 'completions' else 'chatcmpl'}-{jobs[0].id}"
        if request.stream:
            stream = self._stream(endpoint, request, jobs[0], request_id, len(plans[0][0]))
            return StreamingResponse(stream, media_type="text/event-stream")
        try:
            await self._wait(jobs, http_request)
        except ClientGone:
            return Response(status_code=499)
        failed = next((job.error for job in jobs if job.error is not None), None)
        if failed is not None:
            raise failed
        choices, prompt_tokens = [], 0
        for p, job in enumerate(jobs):
            prompt_tokens += len(job.prompt_ids)
            for result in job.results:
                result.index = p * request.n + result.index
                choices.append(result)
        headers = {CACHE_HEADER: jobs[0].cache_info} if jobs[0].cache_info else None
        if endpoint == "completions":
            answer = completion_body(request_id, self.model_id, choices, prompt_tokens)
        elif endpoint == "chat.completions":
            answer = chat_body(request_id, self.model_id, choices, prompt_tokens)
        else:
            answer = response_body(jobs[0].id, self.model_id, choices[0], prompt_tokens)
        return JSONResponse(answer, headers=headers)

    def _job_ended(self, job: Job, slot: Slot) -> None:
        if job.error is None and job.results is not None:
            self.stats.count("completed")
        elif job.error is not None and job.error.status == 499:
            self.stats.count("cancelled")
        elif job.error is not None and job.error.status == 504:
            self.stats.count("timed_out")
        else:
            self.stats.count("failed")
        slot.job_ended(job)

    async def _wait(self, jobs: list[Job], http_request: Request) -> None:
        """Wait for every job; a client that closes its connection cancels them (`ClientGone`)."""
        while pending := [job.future for job in jobs if not job.future.done()]:
            await asyncio.wait(pending, timeout=0.2)
            if not any(not job.future.done() for job in jobs):
                return
            if await http_request.is_disconnected():
                for job in jobs:
                    job.cancel()
                raise ClientGone
            if any(time.monotonic() > job.deadline + 5.0 for job in jobs):  # the engine should have stopped it
                for job in jobs:
                    job.timed_out = True
                    job.end_stopped()

    async def _stream(
        self, endpoint: str, request: ParsedRequest, job: Job, request_id: str, prompt_tokens: int
    ) -> AsyncIterator[str]:
        """Server-sent events of one job: OpenAI's chunks (completions, chat) or response events (responses)."""
        texts = [""] * request.n
        sequence = itertools.count()
        try:
            if endpoint == "chat.completions":
                for i in range(request.n):
                    yield sse(chat_chunk(request_id, self.model_id, i, {"role": "assistant", "content": ""}, None))
            elif endpoint == "responses":
                for event in response_stream_start(job.id, self.model_id, sequence):
                    yield event
            while True:
                assert job.events is not None
                item = await job.events.get()
                if item[0] == "text":
                    _, index, text = item
                    texts[index] += text
                    if endpoint == "completions":
                        yield sse(completion_chunk(request_id, self.model_id, index, text, None))
                    elif endpoint == "chat.completions":
                        yield sse(chat_chunk(request_id, self.model_id, index, {"content": text}, None))
                    else:
                        yield sse_event(
                            "response.output_text.delta",
                            {**_text_part(job.id), "delta": text, "logprobs": [], "sequence_number": next(sequence)},
                        )
                elif item[0] == "end" and endpoint != "responses":
                    _, index, reason = item
                    if endpoint == "completions":
                        yield sse(completion_chunk(request_id, self.model_id, index, "", reason))
                    else:
                        yield sse(chat_chunk(request_id, self.model_id, index, {}, reason))
                elif item[0] == "error":
                    error = item[1]
                    if endpoint == "responses":
                        yield sse_event(
                            "error", {"message": error.message, "code": str(error.code), "sequence_number": 0}
                        )
                    else:
                        yield sse(error.body())
                    return
                elif item[0] == "done":
                    break
            completion_tokens = sum(r.completion_tokens for r in job.results or [])
            if endpoint == "responses":
                result = (job.results or [None])[0]
                for event in response_stream_end(job.id, self.model_id, result, prompt_tokens, sequence):
                    yield event
                return
            if request.include_usage:
                kind = "text_completion" if endpoint == "completions" else "chat.completion.chunk"
                yield sse(usage_chunk(request_id, self.model_id, kind, prompt_tokens, completion_tokens))
            yield sse("[DONE]")
        finally:
            job.cancel()  # a client gone mid-stream stops the generation (no-op once the job has ended)


def _text_part(job_id: str) -> dict:
    return {"item_id": f"msg_{job_id}", "output_index": 0, "content_index": 0}


def response_stream_start(job_id: str, model_id: str, sequence: Iterator[int]) -> list[str]:
    """The events that open a streamed /v1/responses answer."""
    response = response_body(job_id, model_id, None, 0, status="in_progress")
    item = {"id": f"msg_{job_id}", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    return [
        sse_event("response.created", {"response": response, "sequence_number": next(sequence)}),
        sse_event("response.in_progress", {"response": response, "sequence_number": next(sequence)}),
        sse_event("response.output_item.added", {"output_index": 0, "item": item, "sequence_number": next(sequence)}),
        sse_event(
            "response.content_part.added", {**_text_part(job_id), "part": part, "sequence_number": next(sequence)}
        ),
    ]


def response_stream_end(
    job_id: str, model_id: str, result: ChoiceResult | None, prompt_tokens: int, sequence: Iterator[int]
) -> list[str]:
    """The events that close a streamed /v1/responses answer (the whole text, then the completed response)."""
    response = response_body(job_id, model_id, result, prompt_tokens)
    text = result.text if result is not None else ""
    part = {"type": "output_text", "text": text, "annotations": []}
    item = response["output"][0]
    return [
        sse_event(
            "response.output_text.done",
            {**_text_part(job_id), "text": text, "logprobs": [], "sequence_number": next(sequence)},
        ),
        sse_event(
            "response.content_part.done", {**_text_part(job_id), "part": part, "sequence_number": next(sequence)}
        ),
        sse_event("response.output_item.done", {"output_index": 0, "item": item, "sequence_number": next(sequence)}),
        sse_event("response.completed", {"response": response, "sequence_number": next(sequence)}),
    ]


def build_app(
    model: QKVShareForCausalLM,
    tokenizer: Any,
    *,
    model_id: str,
    continuous_batching: bool = False,
    cb_page_size: int | None = None,
    cb_num_blocks: int | None = None,
    cb_pool_mib: float | None = None,
    cb_pool_tokens: int | None = None,
    cb_max_batch_tokens: int | None = None,
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
) -> QKVShareServer:
    """The server of a loaded model: `.app` is the FastAPI app (run it with uvicorn), `.engine` what generates,
    `.close()` stops it (the app's shutdown does). Requests name the model `model_id`. With
    `continuous_batching`, the worker and its page pool start now (a model the tied paged cache cannot serve is a
    `ValueError` with the reason); the pool from `cb_num_blocks`, `cb_pool_tokens` or `cb_pool_mib`
    (`continuous_batching_config`). `request_timeout` in seconds (None: none)."""
    cb_config = None
    if continuous_batching:
        cb_config = continuous_batching_config(
            model,
            page_size=cb_page_size,
            num_blocks=cb_num_blocks,
            pool_mib=cb_pool_mib,
            pool_tokens=cb_pool_tokens,
            max_batch_tokens=cb_max_batch_tokens,
        )
    return QKVShareServer(
        model,
        tokenizer,
        model_id=model_id,
        continuous_batching=continuous_batching,
        cb_config=cb_config,
        max_concurrent_requests=max_concurrent_requests,
        request_timeout=request_timeout,
    )


def serve(args: ServeArgs) -> None:
    """`qkvshare serve MODEL_DIR`: serve the model of `args.model_dir` until SIGTERM or SIGINT (the requests in
    flight finish first). Prints the model, its cache bytes per token, the page pool and the limits first. A model
    directory or setting it cannot serve is a `ValueError` (with the reason) before anything listens."""
    import uvicorn

    check_model_dir(args.model_dir)
    check_weights_fit_config(args.model_dir, model_class=QKVShareForCausalLM)
    model, tokenizer = load_model(
        args.model_dir, device=args.device, dtype=args.dtype, attn_implementation=args.attn_implementation
    )
    if args.seed is not None:
        torch.manual_seed(args.seed)
    server = build_app(
        model,
        tokenizer,
        model_id=str(args.model_dir),
        continuous_batching=args.continuous_batching,
        cb_page_size=args.cb_page_size,
        cb_num_blocks=args.cb_num_blocks,
        cb_pool_mib=args.cb_pool_mib,
        cb_pool_tokens=args.cb_pool_tokens,
        cb_max_batch_tokens=args.cb_max_batch_tokens,
        max_concurrent_requests=args.max_concurrent_requests,
        request_timeout=args.request_timeout or None,
    )
    print(f"Serving {args.model_dir} ({model.config.variant}, {model.dtype}, {model.device})", flush=True)
    print(cache_summary(model), flush=True)
    if (pool := server.pool_line()) is not None:
        print(pool, flush=True)
    print(server.limits_line(), flush=True)
    timeout = server.request_timeout
    config = uvicorn.Config(
        server.app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(timeout) + 5 if timeout else None,
    )
    uvicorn.Server(config).run()


# ----------------------------------------------------------------------------------------------------------------
# the command in a subprocess (tests, benchmarks)
# ----------------------------------------------------------------------------------------------------------------
def start_serve_process(
    model_dir: str | Path,
    flags: Iterable[str] = (),
    log_path: str | Path = "serve.log",
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start `qkvshare serve MODEL_DIR --port 0 FLAGS` in a new process (this interpreter, this package), its output
    to `log_path`, and return at once (`wait_for_url` tells when it listens). `env` is added to this process's
    environment."""
    root = str(Path(__file__).resolve().parents[1])  # the package this process runs, not another install
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "qkvshare_cli", "serve", str(model_dir), "--port", "0", *flags]
    with open(log_path, "w") as log:
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {}), "PYTHONPATH": path}
        )


def wait_for_url(process: subprocess.Popen, log_path: str | Path, startup_seconds: float = 120.0) -> str:
    """The base URL (e.g. "http://127.0.0.1:41489") of a server started by `start_serve_process`, once it listens:
    read from uvicorn's "Uvicorn running on URL" line (so `--log_level` must stay info or debug). A `RuntimeError`
    with the log when it exits or does not listen within `startup_seconds`."""
    log_path = Path(log_path)
    deadline = time.monotonic() + startup_seconds
    while (found := re.search(r"Uvicorn running on (http://\S+)", log_path.read_text())) is None:
        if process.poll() is not None:
            raise RuntimeError(f"qkvshare serve exited ({process.returncode}):\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"qkvshare serve is not up after {startup_seconds:.0f} s:\n{log_path.read_text()}")
        time.sleep(0.1)
    return found.group(1)


def stop_serve_process(process: subprocess.Popen) -> None:
    """SIGTERM (the server lets its requests finish), then SIGKILL after 10 s."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def serve_in_subprocess(
    model_dir: str | Path,
    flags: Iterable[str] = (),
    log_path: str | Path = "serve.log",
    startup_seconds: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run `qkvshare serve MODEL_DIR --port 0 FLAGS` in a new process, its output to `log_path`; yield (its base
    URL, the process) once it listens, and stop it on exit. For tests and benchmarks: the port is a free one the
    server picks itself (no race with other processes). See `start_serve_process` and `wait_for_url`."""
    process = start_serve_process(model_dir, flags, log_path, env)
    try:
        yield wait_for_url(process, log_path, startup_seconds), process
    finally:
        stop_serve_process(process)
