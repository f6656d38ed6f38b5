"""The generation behind `qkvshare serve`: jobs, the two engines, text and log-probabilities.

A `Job` is one prompt of one request with its `n` choices. The HTTP layer (`qkvshare.serve`) checks it at admission,
hands it to an engine and waits for it (or reads its stream); the engines run it on transformers' public generation
API and never let one job's failure reach another:

- `SequentialEngine`: one worker thread runs `model.generate()` for one job at a time (the n choices as a batch of
  n rows), which builds the model's `QKVShareCache`. A `StoppingCriteria` stops it when the client went away, the
  job's deadline passed or every choice has ended (a stop string); a `BaseStreamer` receives each new token. An
  exception inside one job's generation fails that job only; the thread goes on with the next.
- `BatchingEngine`: transformers' continuous batching through the model's `init_continuous_batching()` (the tied
  paged cache, `QKVSharePagedCache`) and the manager's public methods (`start`, `add_request`, `get_result`,
  `cancel_request`, `is_running`, `stop`). One dispatcher thread reads every result and routes it to its job, cancels
  the requests of jobs that ended (client gone, deadline, stop string) and supervises the manager: if its worker
  dies, every job in flight gets an error (HTTP 503, retry), a new manager and page pool are started, and later
  jobs are served; `restarts` and `last_error` say so (the server's /health).

Text is decoded incrementally (`TextTracker`, stop strings found as they appear); the final text of a choice is the
tokenizer's decode of all its tokens, exactly what `generate()` followed by `decode(..., skip_special_tokens=True)`
gives. Log-probabilities (`logprobs`, `echo`) come from `Scorer`: one forward of prompt + completion, after
generation (with continuous batching, with an explicit causal mask, exact whichever attention backend the worker
set, "paged|eager" included): the model's own distribution at every position, as lm-eval's HF model computes it.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation import BaseStreamer  # public: the base class generate() streams to

from .serve_protocol import ChoiceResult, RequestError, TokenLogprob

logger = logging.getLogger("qkvshare.serve")

LOGPROB_FLOOR = -9999.0  # OpenAI's value for an impossible token (JSON has no -inf)


# ----------------------------------------------------------------------------------------------------------------
# text
# ----------------------------------------------------------------------------------------------------------------
class TextTracker:
    """Incremental decoding of one choice's tokens, with stop strings.

    `push(token)` returns the text the token completes ("" while a multi-byte character is unfinished), by decoding
    a short window of tokens (text-generation-inference's method: the decode of the window minus the decode of its
    prefix). `text` is everything so far; `stop_at` the offset of the first stop string in it (None while none).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self.decode = decode
        self.stop = stop
        self.longest_stop = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.stop_at: int | None = None

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        before = len(self.text)
        self.text += new
        if self.stop and self.stop_at is None:
            self.stop_at = first_stop(self.text, self.stop, max(0, before - self.longest_stop + 1))
        return new

    def safe_length(self, finished: bool) -> int:
        """How much of `text` can be streamed: all of it once finished, else all but what could still turn out to be
        the start of a stop string."""
        if self.stop_at is not None:
            return self.stop_at
        if finished or not self.stop:
            return len(self.text)
        return max(0, len(self.text) - self.longest_stop + 1)


def first_stop(text: str, stop: list[str], start: int = 0) -> int | None:
    """The offset of the first stop string in `text` from `start` on (None if none)."""
    found = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(found) if found else None


# ----------------------------------------------------------------------------------------------------------------
# jobs
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Choice:
    """One choice of a job while it is generated."""

    index: int
    tracker: TextTracker
    tokens: list[int] = field(default_factory=list)  # generated tokens, EOS included
    finish_reason: str | None = None  # None while generating
    seen: int = 0  # tokens of continuous batching's cumulative output already fed
    streamed: int = 0  # characters of text already streamed


_job_ids = itertools.count()


class Job:
    """One prompt of a request and its n choices: what to generate, its state, how it ends.

    Thread-safe ends: `complete()`, `fail(error)` and `cancel()` may come from any thread; the first one wins and
    resolves `future` on the request's event loop. With `stream`, text deltas go to `events` as they are decoded:
    ("text", index, delta), ("end", index, finish_reason), then ("done",) or ("error", RequestError).
    """

    def __init__(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        decode: Callable[[list[int]], str],
        eos_token_ids: set[int],
        n: int = 1,
        generation: dict[str, Any] | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        logprobs: int | None = None,
        echo: bool = False,
        prompt_text: str | None = None,
        stream: bool = False,
        deadline: float = math.inf,
        timeout_seconds: float | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        on_end: Callable[[Job], None] | None = None,
    ) -> None:
        self.id = f"job{next(_job_ids)}"
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.decode = decode
        self.eos_token_ids = eos_token_ids
        self.n = n
        self.generation = generation or {}
        self.seed = seed
        self.stop = list(stop or [])
        self.logprobs = logprobs
        self.echo = echo
        self.prompt_text = prompt_text
        self.stream = stream
        self.deadline = deadline
        self.timeout_seconds = timeout_seconds
        self.loop = loop or asyncio.get_running_loop()
        self.future: asyncio.Future = self.loop.create_future()
        self.events: asyncio.Queue | None = asyncio.Queue() if stream else None
        self.choices = [Choice(i, TextTracker(decode, self.stop)) for i in range(n)]
        self.cancelled = threading.Event()
        self.error: RequestError | None = None
        self.results: list[ChoiceResult] | None = None
        self.cache_info: str | None = (
            None  # the cache that served it, e.g. "QKVShareCache; 256 bytes/token; torch.float32"
        )
        self.timed_out = False
        self.started = False
        self._ended = False
        self._lock = threading.Lock()
        self._on_end = on_end

    # -- state read by the engines ---------------------------------------------------------------------------
    @property
    def needs_scores(self) -> bool:
        return self.logprobs is not None or self.echo

    def should_stop(self) -> bool:
        """The generation of this job must stop now: cancelled (client gone) or past its deadline."""
        if self.cancelled.is_set():
            return True
        if time.monotonic() > self.deadline:
            self.timed_out = True
            return True
        return False

    def all_finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def ended(self) -> bool:
        return self._ended

    # -- tokens in -------------------------------------------------------------------------------------------
    def feed(self, index: int, token: int) -> bool:
        """One generated token of choice `index`; returns whether the choice has ended (EOS, a stop string,
        max_new_tokens)."""
        choice = self.choices[index]
        if choice.finish_reason is not None:
            return True
        choice.tokens.append(token)
        if token in self.eos_token_ids:
            self.finish_choice(index, "stop")
            return True
        choice.tracker.push(token)
        if choice.tracker.stop_at is not None:
            self.finish_choice(index, "stop")
            return True
        if len(choice.tokens) >= self.max_new_tokens:
            self.finish_choice(index, "length")
            return True
        self._stream_text(choice, finished=False)
        return False

    def finish_choice(self, index: int, reason: str) -> None:
        choice = self.choices[index]
        if choice.finish_reason is not None:
            return
        choice.finish_reason = reason
        if self.stream:
            self._stream_text(choice, finished=True)
            self._put(("end", index, reason))

    def final_text(self, choice: Choice) -> str:
        """The choice's text: the decode of all its tokens (EOS and special tokens skipped), cut at the first stop
        string."""
        text = self.decode(choice.tokens)
        cut = first_stop(text, self.stop) if self.stop else None
        return text if cut is None else text[:cut]

    def echo_text(self) -> str:
        """The prompt as echoed: as the client sent it, or the decode of its token ids."""
        return self.prompt_text if self.prompt_text is not None else self.decode(self.prompt_ids)

    def _stream_text(self, choice: Choice, finished: bool) -> None:
        if not self.stream:
            return
        if finished:
            text = self.final_text(choice)
            end = len(text) if text.startswith(choice.tracker.text[: choice.streamed]) else choice.streamed
        else:
            text, end = choice.tracker.text, choice.tracker.safe_length(False)
        if end > choice.streamed:
            self._put(("text", choice.index, text[choice.streamed : end]))
            choice.streamed = end

    def _put(self, item: tuple) -> None:
        assert self.events is not None
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    # -- ends ------------------------------------------------------------------------------------------------
    def complete(self, scores: list[list[TokenLogprob]] | None = None) -> None:
        """All choices ended: build the results (with `scores`, per choice: prompt tokens when echoed, then the
        completion's) and resolve the job."""
        results = []
        for i, choice in enumerate(self.choices):
            results.append(
                ChoiceResult(
                    index=i,
                    text=self.final_text(choice),
                    finish_reason=choice.finish_reason or "length",
                    completion_tokens=len(choice.tokens),
                    logprobs=None if scores is None else scores[i],
                    prompt_text=self.echo_text() if self.echo else "",
                )
            )
        if self._end(results=results):
            if self.stream:
                self._put(("done",))
            self.loop.call_soon_threadsafe(_resolve, self.future)

    def fail(self, error: RequestError) -> None:
        if self._end(error=error):
            if self.stream:
                self._put(("error", error))
            self.loop.call_soon_threadsafe(_resolve, self.future)

    def start(self) -> bool:
        """An engine takes the job up: False if it already ended (cancelled while it waited)."""
        with self._lock:
            if self._ended:
                return False
            self.started = True
            return True

    def cancel(self) -> None:
        """The client is gone (or the server stops it): generation stops at the next token; a job no engine has
        taken up yet ends now."""
        self.cancelled.set()
        with self._lock:
            waiting = not self.started
        if waiting:
            self.end_stopped()

    def end_stopped(self) -> None:
        """End a job whose generation was stopped by `should_stop`: a timeout is an error (HTTP 504), a
        cancellation needs no answer."""
        if self.timed_out and not self.cancelled.is_set():
            seconds = f" ({self.timeout_seconds:g} s)" if self.timeout_seconds is not None else ""
            self.fail(
                RequestError(
                    504,
                    f"The generation did not finish within the server's request timeout{seconds} and was stopped "
                    "(qkvshare serve --request_timeout). Ask for fewer tokens (max_tokens) or retry later.",
                    code="timeout",
                )
            )
        else:
            self.fail(RequestError(499, "The request was cancelled (the client closed the connection).", "cancelled"))

    def _end(self, results: list[ChoiceResult] | None = None, error: RequestError | None = None) -> bool:
        """Record the job's end (its results or its error) once; False if it had ended already."""
        with self._lock:
            if self._ended:
                return False
            self._ended = True
            self.results, self.error = results, error
        if self._on_end is not None:
            try:
                self._on_end(self)
            except Exception:  # noqa: BLE001 - bookkeeping must not break the answer
                logger.exception("qkvshare serve: job end hook failed")
        return True


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def internal_error(error: BaseException, what: str) -> RequestError:
    """An unexpected exception inside one job, as that job's answer (HTTP 500 with the exception)."""
    return RequestError(500, f"{what} failed: {type(error).__name__}: {error}", code="internal_error")


# ----------------------------------------------------------------------------------------------------------------
# log-probabilities
# ----------------------------------------------------------------------------------------------------------------
class Scorer:
    """Log-probabilities of token sequences under the model: one forward of the whole sequence (no cache) and
    `log_softmax` of the logits in float32, as lm-eval's HF model computes them. With `explicit_mask` the forward
    gets an additive causal mask (needed while continuous batching has set the model to "paged|eager", whose plain
    forward builds none); without, the model's own causal mask."""

    def __init__(self, model: torch.nn.Module, token_text: Callable[[int], str], explicit_mask: bool = False) -> None:
        self.model = model
        self.token_text = token_text
        self.explicit_mask = explicit_mask

    @torch.no_grad()
    def score(self, ids: list[int], alternatives: int, first: int) -> list[TokenLogprob]:
        """Per token from position `first` on: its log-probability given the tokens before it and the
        `alternatives` most likely tokens there (token 0 has none: logprob None)."""
        device, length, dtype = self.model.device, len(ids), self.model.dtype
        mask = None
        if self.explicit_mask:
            mask = torch.full((length, length), torch.finfo(dtype).min, dtype=dtype, device=device)
            mask = mask.triu(1)[None, None]  # (1, 1, T, T): 0 on and below the diagonal
        inputs = torch.tensor([ids], device=device)
        logits = self.model(input_ids=inputs, attention_mask=mask, use_cache=False).logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # row t: the distribution of token t + 1
        out = []
        for position in range(first, length):
            token = ids[position]
            text = self.token_text(token)
            if position == 0:
                out.append(TokenLogprob(text, None, None, list(text.encode())))
                continue
            row = logprobs[position - 1]
            top: list[tuple[str, float]] = []
            if alternatives > 0:
                values, indices = row.topk(alternatives)
                for value, index in zip(values.tolist(), indices.tolist(), strict=True):
                    top.append((self.token_text(index), max(value, LOGPROB_FLOOR)))
            out.append(TokenLogprob(text, max(float(row[token]), LOGPROB_FLOOR), top, list(text.encode())))
        return out

    def job_scores(self, job: Job) -> list[list[TokenLogprob]]:
        """The scores a job asked for, per choice: the prompt's tokens when echoed, then the completion's."""
        alternatives = job.logprobs or 0
        first = 0 if job.echo else len(job.prompt_ids)
        return [self.score(job.prompt_ids + choice.tokens, alternatives, first) for choice in job.choices]


# ----------------------------------------------------------------------------------------------------------------
# the sequential engine: one generate() at a time
# ----------------------------------------------------------------------------------------------------------------
class _JobStreamer(BaseStreamer):
    """generate()'s streamer for one job: the prompt first (skipped), then one token per row per step."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for index, token in enumerate(value.reshape(-1).tolist()):
            self.job.feed(index, int(token))

    def end(self) -> None:
        pass


class _JobStopping(StoppingCriteria):
    """Stops every row when the job must stop (client gone, deadline), and each row whose choice has ended."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor | None, **kwargs: Any) -> torch.Tensor:
        if self.job.should_stop():
            return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        ended = [c.finish_reason is not None for c in self.job.choices]
        return torch.tensor(ended, dtype=torch.bool, device=input_ids.device)


def cache_bytes(cache: Any) -> int:
    """Bytes a generation cache holds: its `nbytes()` (QKVShare caches), else the distinct key/value tensors of its
    layers (transformers' caches)."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    seen, total = set(), 0
    for layer in getattr(cache, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.nbytes
    return total


class SequentialEngine:
    """Jobs run one at a time on one worker thread with `model.generate()`."""

    mode = "sequential"

    def __init__(self, model: torch.nn.Module, scorer: Scorer, generation_config: GenerationConfig, tokenizer: Any):
        self.model = model
        self.scorer = scorer
        self.generation_config = generation_config
        self.tokenizer = tokenizer
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.restarts = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="qkvshare-generate", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        self.queue.put(job)

    def close(self, timeout: float = 10.0) -> None:
        self.queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            try:
                self._execute(job)
            except BaseException as error:  # noqa: BLE001 - one job's failure is that job's answer
                logger.exception("qkvshare serve: request %s failed", job.id)
                job.fail(internal_error(error, "Generation"))
            finally:
                job = None  # drop the reference before waiting for the next one

    @torch.no_grad()
    def _execute(self, job: Job) -> None:
        if not job.start():
            return
        if job.should_stop():
            job.end_stopped()
            return
        if job.max_new_tokens > 0:
            self._generate(job)
            if job.should_stop() and not job.all_finished():
                job.end_stopped()
                return
        job.complete(self.scorer.job_scores(job) if job.needs_scores else None)

    def _generate(self, job: Job) -> None:
        config = copy.deepcopy(self.generation_config)
        config.update(**job.generation)
        config.max_new_tokens = job.max_new_tokens
        config.num_return_sequences = 1
        config.return_dict_in_generate = True
        if job.seed is not None:
            torch.manual_seed(job.seed)
        ids = torch.tensor([job.prompt_ids] * job.n, device=self.model.device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            streamer=_JobStreamer(job),
            stopping_criteria=StoppingCriteriaList([_JobStopping(job)]),
            tokenizer=self.tokenizer,
        )
        cache = getattr(out, "cache", None)
        cached = cache.get_seq_length() if cache is not None else 0
        if cache is not None and cached:
            per_token = cache_bytes(cache) / (cached * job.n)
            job.cache_info = f"{type(cache).__name__}; {per_token:g} bytes/token; {self.model.dtype}"
        for choice in job.choices:
            if choice.finish_reason is None and not job.should_stop():
                job.finish_choice(choice.index, "length")


# ----------------------------------------------------------------------------------------------------------------
# the continuous-batching engine, supervised
# ----------------------------------------------------------------------------------------------------------------
class BatchingEngine:
    """Jobs batched continuously on the model's `init_continuous_batching()` manager (the tied paged cache), with a
    dispatcher thread that routes results, cancels ended jobs' requests and restarts a dead worker."""

    mode = "continuous batching"

    def __init__(
        self,
        model: torch.nn.Module,
        scorer: Scorer,
        generation_config: GenerationConfig,
        continuous_batching_config: Any,
        start_seconds: float = 120.0,
        restart_attempts: int = 3,
    ) -> None:
        self.model = model
        self.scorer = scorer
        self.generation_config = generation_config
        self.continuous_batching_config = continuous_batching_config
        self.start_seconds = start_seconds
        self.restart_attempts = restart_attempts
        self.restarts = 0
        self.last_error: str | None = None
        self.state = "starting"  # "ok", "restarting", "dead", "closed"
        self._lock = threading.RLock()
        self._active: dict[str, tuple[Job, int]] = {}  # manager request id -> (job, choice index)
        self._jobs: dict[str, Job] = {}  # jobs with requests in the manager
        self._last_output_error: str | None = None
        self._scoring = ThreadPoolExecutor(1, thread_name_prefix="qkvshare-score")
        self.manager = None
        self.cache = None
        self._start_manager()  # a pool the model cannot have is refused here, at startup
        self._closing = threading.Event()
        self._dispatcher = threading.Thread(target=self._dispatch, name="qkvshare-dispatch", daemon=True)
        self._dispatcher.start()

    # -- lifecycle -------------------------------------------------------------------------------------------
    def _start_manager(self) -> None:
        manager = self.model.init_continuous_batching(
            generation_config=copy.deepcopy(self.generation_config),
            continuous_batching_config=copy.deepcopy(self.continuous_batching_config),
        )
        manager.start()
        try:
            self.cache = manager.wait_for_paged_cache(self.start_seconds)
        except BaseException:
            manager.stop(block=True, timeout=5)
            raise
        self.manager = manager
        self.state = "ok"

    @property
    def healthy(self) -> bool:
        return self.state == "ok"

    def close(self, timeout: float = 10.0) -> None:
        self._closing.set()
        self.state = "closed"
        self._dispatcher.join(timeout)
        if self.manager is not None and self.manager.is_running():
            self.manager.stop(block=True, timeout=timeout)
        self._scoring.shutdown(wait=False, cancel_futures=True)

    # -- jobs in ---------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        if not job.start():
            return
        if job.max_new_tokens == 0:  # score the prompt only: no generation
            self._finish(job)
            return
        with self._lock:
            if self.state != "ok":
                job.fail(self._unavailable())
                return
            manager, cache = self.manager, self.cache
            job.cache_info = f"{type(cache).__name__}; {cache.bytes_per_token():g} bytes/token; {self.model.dtype}"
            ids = [f"{job.id}.{i}" for i in range(job.n)]
            for i, request_id in enumerate(ids):
                self._active[request_id] = (job, i)
            self._jobs[job.id] = job
            streaming = job.stream or bool(job.stop)  # stop strings are found as the tokens come
            for request_id in ids:
                try:
                    added = manager.add_request(
                        list(job.prompt_ids),
                        request_id=request_id,
                        max_new_tokens=job.max_new_tokens,
                        streaming=streaming,
                    )
                except Exception as error:  # noqa: BLE001 - e.g. its input queue stayed full
                    self._drop(job, cancel=True)
                    job.fail(internal_error(error, "Queueing the request"))
                    return
                if added is None:  # the worker no longer accepts requests: the dispatcher restarts it
                    self._drop(job, cancel=True)
                    job.fail(self._unavailable())
                    return

    def _unavailable(self) -> RequestError:
        if self.state == "dead":
            reason = f"it could not be restarted ({self.last_error})"
        else:
            reason = "it is being restarted" + (f" after an error ({self.last_error})" if self.last_error else "")
        return RequestError(
            503, f"The continuous-batching worker is not available: {reason}. Retry the request.", "worker_restarting"
        )

    def _drop(self, job: Job, cancel: bool = False) -> None:
        """Forget a job's requests (cancelling those still in the manager when `cancel`)."""
        with self._lock:
            self._jobs.pop(job.id, None)
            for i in range(job.n):
                request_id = f"{job.id}.{i}"
                if self._active.pop(request_id, None) is not None and cancel:
                    self.manager.cancel_request(request_id)

    # -- results out -----------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        last_sweep = 0.0
        while not self._closing.is_set():
            try:
                manager = self.manager
                running = manager.is_running()
                routed = self._drain(manager, wait=0.02 if running else 0.0)
                if time.monotonic() - last_sweep > 0.05:
                    self._sweep()
                    last_sweep = time.monotonic()
                if not running and not self._closing.is_set():
                    self._restart()
                elif not routed:
                    time.sleep(0.005)
            except Exception:  # noqa: BLE001 - the dispatcher itself must survive
                logger.exception("qkvshare serve: dispatcher error")
                time.sleep(0.1)

    def _drain(self, manager: Any, wait: float) -> int:
        routed = 0
        while (output := manager.get_result(timeout=wait if routed == 0 else 0.0)) is not None:
            routed += 1
            self._route(output)
        return routed

    def _route(self, output: Any) -> None:
        with self._lock:
            entry = self._active.get(output.request_id)
        if entry is None:  # cancelled or already answered
            return
        job, index = entry
        try:
            if output.error is not None:
                self._last_output_error = str(output.error)
                if self._worker_dies(self.manager):
                    return  # every request it held failed with it: `_restart` answers them (503, retry)
                self._drop(job, cancel=True)
                job.fail(RequestError(500, f"Generation failed: {output.error}", "generation_failed"))
                return
            choice = job.choices[index]
            new = output.generated_tokens[choice.seen :]
            choice.seen = len(output.generated_tokens)
            for token in new:
                if job.feed(index, int(token)):
                    break
            if choice.finish_reason is None and output.is_finished():
                job.finish_choice(index, "length")
            if choice.finish_reason is not None:
                with self._lock:
                    self._active.pop(output.request_id, None)
                if not output.is_finished():
                    self.manager.cancel_request(output.request_id)  # ended early: a stop string
                if job.all_finished():
                    self._drop(job)
                    self._finish(job)
        except Exception as error:  # noqa: BLE001 - one job's failure is that job's answer
            logger.exception("qkvshare serve: request %s failed", job.id)
            self._drop(job, cancel=True)
            job.fail(internal_error(error, "Processing the generated tokens"))

    @staticmethod
    def _worker_dies(manager: Any, seconds: float = 1.0) -> bool:
        """Whether the manager's worker stops within `seconds`: a failed result is either one request's failure (the
        worker goes on) or one of those transformers delivers for every request when its loop dies."""
        deadline = time.monotonic() + seconds
        while manager.is_running():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _finish(self, job: Job) -> None:
        if not job.needs_scores:
            job.complete()
            return

        def score() -> None:
            try:
                job.complete(self.scorer.job_scores(job))
            except Exception as error:  # noqa: BLE001
                logger.exception("qkvshare serve: scoring request %s failed", job.id)
                job.fail(internal_error(error, "Computing log-probabilities"))

        self._scoring.submit(score)

    def _sweep(self) -> None:
        """Cancel the requests of jobs that must stop (client gone, deadline) and end those jobs."""
        with self._lock:
            stopping = [job for job in self._jobs.values() if job.should_stop() or job.ended]
        for job in stopping:
            self._drop(job, cancel=True)
            job.end_stopped()

    def _restart(self) -> None:
        """The manager's worker died: fail every job in flight (503: retry), start a new manager and pool."""
        reason = self._last_output_error or "its generation loop stopped"
        with self._lock:
            self.state = "restarting"
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._active.clear()
            self.last_error = reason
        logger.error("qkvshare serve: the continuous-batching worker died (%s); restarting it", reason)
        for job in jobs:
            job.fail(
                RequestError(
                    503,
                    f"The continuous-batching worker failed while generating this request ({reason}); it was "
                    "restarted. Retry the request.",
                    "worker_restarted",
                )
            )
        try:
            self.manager.stop(block=True, timeout=5)
        except Exception:  # noqa: BLE001 - a dead manager may fail to stop cleanly
            logger.exception("qkvshare serve: stopping the dead manager")
        for attempt in range(1, self.restart_attempts + 1):
            try:
                self._start_manager()
                self.restarts += 1
                self._last_output_error = None
                logger.warning("qkvshare serve: continuous-batching worker restarted (restart %d)", self.restarts)
                return
            except Exception as error:  # noqa: BLE001
                self.last_error = f"{reason}; restart {attempt} failed: {type(error).__name__}: {error}"
                logger.exception("qkvshare serve: restarting the continuous-batching worker")
                time.sleep(1.0)
        self.state = "dead"
        self._closing.set()
