"""Load test of `qkvshare serve` on 127.0.0.1: the Llama-equivalent model (`none`) and Q-K=V side by side.

    python benchmarks/serve_load.py --threads 1                      # 64 requests, 8 clients, SmolLM2-135M shape
    python benchmarks/serve_load.py --requests 16 --clients 4 --new_tokens 16 --threads 1     # a quick look
    python benchmarks/serve_load.py --threads 1 --continuous_batching   # batched on the tied paged cache, 24 MiB each
    python benchmarks/serve_load.py --faults --threads 1             # good and bad requests, both modes side by side

Not part of CI. For each variant the script writes a model of one shape with random weights (default: SmolLM2-135M's,
configs/smollm2-135m/config.json; `--variants` names them, `none` being Llama's attention in QKVShare's code) and
starts `qkvshare serve` on a free port. Then all the servers are loaded at once, side by side, so that load from
other processes on the machine hits every variant alike: each gets one warm-up request, then `--requests` chat
completions from `--clients` concurrent clients of its own (the openai package, non-streaming, greedy). Give each
server fewer `--threads` than cores / variants, so the servers do not compete with each other. Per variant it
reports the KV-cache bytes per token the server prints at startup, requests/s and generated tokens/s over the whole
run, p50/p95 request latency, and the server process's peak resident memory (VmHWM, Linux).

With `--continuous_batching` every server gets a page pool of the same memory, `--cb_cache_mib` (the number of
blocks is what that memory holds for the variant's cache: one page per tied layer, two per untied one); the table
then also gives the pool's tokens and how many requests of this length fit in it at once. The default 24 MiB holds
4 requests of the default length for Llama (`none`, fp32) and 8 for Q-K=V, so with 8 clients Llama's server keeps
requests waiting for pages that Q-K=V's runs at once.

Every request has the same length: a prompt of `--prompt_tokens` random words of a word-level tokenizer covering the
whole vocabulary (plus the chat template's few tokens) and exactly `--new_tokens` generated tokens (the model's
generation config suppresses EOS). `--max_seconds` bounds the whole run: past it no request is sent and the table
says how many were done. The model directories go to a temporary directory, removed at the end.

`--faults` (issue 24): one Q-K=V model (default `--preset small`: 4 layers, 512 positions) served twice side by side,
one `generate()` at a time and with continuous batching (`--cb_page_size 16`, a `--fault_pool_tokens` pool of 448
tokens, smaller than the model's positions), each loaded by `--clients` clients of its own in three phases:
1. `--requests` good chat completions alone (the baseline p95 latency);
2. the same good requests interleaved with as many bad ones (phases 1 and 2 alternate in rounds of `--clients`
   requests, so that load from outside hits both alike), every kind the server refuses at admission (`bad_requests`:
   empty prompt, max_tokens=1e9, a prompt past the context, a request larger than the page pool, token ids outside
   the vocabulary, n too large, an unimplemented field, a bad value, another model, a body that is no JSON object,
   logprobs with stream, a setting continuous batching does not apply; the last two kinds of pool and setting only
   where they are bad, i.e. with continuous batching);
3. a soak of `--soak_requests` requests, good and bad alternating, every 25th a streamed request whose client
   disconnects after the first chunk; the server's resident memory (VmRSS) is read before and after.
Checks, per server: every good request gets generate()'s text (computed in this process), every bad one a 4xx with
a message, /health reports no worker restart, RSS over the soak within 5%, and the good requests' p95 latency with
bad ones within 1.2x of the baseline. Exit status 0 when all hold.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SHAPE = REPO / "configs" / "smollm2-135m" / "config.json"
EOS = "<|endoftext|>"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=str(DEFAULT_SHAPE), help="a Llama-architecture config.json (default: SmolLM2)")
    p.add_argument("--variants", nargs="+", default=["none", "Q-K=V"], help="'none' (Llama's attention) or a variant")
    p.add_argument("--requests", type=int, default=64, help="chat completions per variant")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--prompt_tokens", type=int, default=64, help="words of each prompt")
    p.add_argument("--new_tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--threads", type=int, default=None, help="the server's torch threads (OMP_NUM_THREADS)")
    p.add_argument("--dtype", default="float32", help="the server's --dtype")
    p.add_argument("--continuous_batching", action="store_true", help="serve with --continuous_batching")
    p.add_argument("--cb_cache_mib", type=float, default=24.0, help="continuous batching: page pool of every server")
    p.add_argument("--cb_page_size", type=int, default=32, help="continuous batching: tokens per page")
    p.add_argument("--max_seconds", type=float, default=540.0, help="bound on the whole run")
    p.add_argument("--faults", action="store_true", help="the load-with-faults benchmark (see the docstring)")
    p.add_argument("--preset", default="small", help="--faults: the QKVShare preset of the model (Q-K=V)")
    p.add_argument("--soak_requests", type=int, default=1000, help="--faults: requests of the soak phase")
    p.add_argument("--fault_pool_tokens", type=int, default=448, help="--faults: the batching server's page pool")
    p.add_argument("--output", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if min(args.requests, args.clients, args.prompt_tokens, args.new_tokens, args.soak_requests) < 1:
        p.error("--requests, --clients, --prompt_tokens, --new_tokens and --soak_requests must be positive")
    return args


# ----------------------------------------------------------------------------------------------------------------
# the models
# ----------------------------------------------------------------------------------------------------------------
def word_tokenizer(vocab_size: int):
    """A word-level tokenizer with one word per id of the model's vocabulary ("w1", "w2", ..., the chat roles; id 0
    is EOS) and the chat template of QKVShare's trained tokenizers: every id a random model generates is a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from qkvshare.train.tokenizer import CHAT_TEMPLATE

    roles = ["system", "user", "assistant"]  # the chat template's words
    vocab = {EOS: 0, **{f"w{i}": i for i in range(1, vocab_size - len(roles))}}
    vocab.update({role: vocab_size - len(roles) + i for i, role in enumerate(roles)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, chat_template=CHAT_TEMPLATE)


def write_model(shape: dict, variant: str, path: Path) -> None:
    """A random-weight QKVShare model of `shape` (a Llama config.json) and `variant`, with the word tokenizer."""
    import torch

    from qkvshare import QKVShareConfig, QKVShareForCausalLM

    config = QKVShareConfig.from_llama(shape, variant=None if variant == "none" else variant)
    torch.manual_seed(0)
    model = QKVShareForCausalLM(config)
    model.generation_config.suppress_tokens = [0]  # no EOS: every request generates --new_tokens tokens
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    word_tokenizer(config.vocab_size).save_pretrained(path)


# ----------------------------------------------------------------------------------------------------------------
# the load
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What one variant's server did under the load."""

    variant: str
    cache_line: str = ""  # the server's "KV cache: ..." startup line
    latencies: list[float] = field(default_factory=list)  # seconds per completed request
    tokens: int = 0  # generated tokens of the completed requests
    wall: float = 0.0  # seconds from the first request sent to the last answer
    peak_rss_mib: float = 0.0
    pool_line: str = ""  # the server's "Paged cache ..." startup line (continuous batching)
    fit: int | None = None  # requests of the benchmark's length the page pool holds at once
    errors: list[str] = field(default_factory=list)

    def row(self) -> dict:
        done = len(self.latencies)
        quantiles = statistics.quantiles(self.latencies, n=20, method="inclusive") if done > 1 else [0.0] * 19
        return {
            "variant": self.variant,
            "cache_bytes_per_token": self.cache_line.partition("KV cache: ")[2].partition(" bytes/token")[0],
            "requests": done,
            "requests_per_s": done / self.wall if self.wall else 0.0,
            "tokens_per_s": self.tokens / self.wall if self.wall else 0.0,
            "p50_s": statistics.median(self.latencies) if done else 0.0,
            "p95_s": quantiles[18],
            "peak_rss_mib": self.peak_rss_mib,
            "pool_tokens": self.pool_line.partition(" = ")[2].partition(" tokens")[0],
            "requests_that_fit": self.fit,
            "errors": len(self.errors),
        }


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM) in MiB; 0 where /proc does not tell."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def load(url: str, model_id: str, prompts: list[str], args: argparse.Namespace, deadline: float, run: Run) -> None:
    """Send every prompt as a chat completion from `args.clients` concurrent clients; fill `run`."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
    lock = threading.Lock()

    def ask(prompt: str) -> None:
        if time.monotonic() > deadline:
            return
        start = time.perf_counter()
        try:
            answer = client.chat.completions.create(
                model=model_id,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=args.new_tokens,
                temperature=0,
            )
        except openai.OpenAIError as err:
            with lock:
                run.errors.append(str(err))
            return
        with lock:
            run.latencies.append(time.perf_counter() - start)
            run.tokens += answer.usage.completion_tokens

    ask(prompts[0])  # warm-up, not counted
    run.latencies.clear()
    run.tokens = 0
    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(ask, prompts))
    run.wall = time.perf_counter() - start


def continuous_batching_flags(config, prompt_tokens: int, args: argparse.Namespace) -> tuple[list[str], int]:
    """The server flags for a page pool of `args.cb_cache_mib` for this config's cache, and how many requests of
    `prompt_tokens` + `args.new_tokens` tokens it holds at once (each takes whole pages)."""
    element = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    block = args.cb_page_size * config.kv_cache_bytes_per_token(element)  # one page of every cached tensor
    blocks = int(args.cb_cache_mib * 2**20 // block)
    if blocks < 1:
        raise SystemExit(
            f"--cb_cache_mib {args.cb_cache_mib}: less than one block ({block:,} bytes) of {config.variant}"
        )
    per_request = -(-(prompt_tokens + args.new_tokens) // args.cb_page_size)
    flags = ["--continuous_batching", "--cb_page_size", str(args.cb_page_size), "--cb_num_blocks", str(blocks)]
    return flags, blocks // per_request


@dataclass
class Server:
    """One variant's model directory, `qkvshare serve` flags and prompts."""

    run: Run
    model_dir: Path
    flags: list[str]
    prompts: list[str]


def prepare(variant: str, shape: dict, work: Path, args: argparse.Namespace) -> Server:
    """Write the variant's model and choose its server flags and prompts (the same prompts for every variant)."""
    from transformers import AutoTokenizer

    from qkvshare import QKVShareConfig

    model_dir = work / variant.replace("=", "_eq_")
    write_model(shape, variant, model_dir)
    rng = random.Random(0)
    words = shape["vocab_size"] - 3  # w1 .. w{vocab-4}: the last three ids are the chat roles
    prompts = [" ".join(f"w{rng.randrange(1, words)}" for _ in range(args.prompt_tokens)) for _ in range(args.requests)]
    server = Server(Run(variant), model_dir, ["--dtype", args.dtype, "--device", "cpu"], prompts)
    if args.continuous_batching:
        chat = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
            [{"role": "user", "content": prompts[0]}], add_generation_prompt=True
        )
        config = QKVShareConfig.from_pretrained(model_dir)
        cb_flags, server.run.fit = continuous_batching_flags(config, len(chat["input_ids"]), args)
        server.flags += cb_flags
    return server


def bench(servers: list[Server], work: Path, args: argparse.Namespace, deadline: float) -> None:
    """Start every variant's server, then load them all at once (each with its own clients): a load spike from
    outside hits every variant alike. Fills each `Server.run`."""
    from qkvshare.serve import serve_in_subprocess

    env = {} if args.threads is None else {"OMP_NUM_THREADS": str(args.threads)}
    with ExitStack() as stack:
        started = []
        for server in servers:
            log = work / f"{server.model_dir.name}.log"
            url, process = stack.enter_context(serve_in_subprocess(server.model_dir, server.flags, log, env=env))
            lines = log.read_text().splitlines()
            server.run.cache_line = next((line for line in lines if line.startswith("KV cache: ")), "")
            server.run.pool_line = next((line for line in lines if line.startswith("Paged cache ")), "")
            started.append((server, url, process))
        with ThreadPoolExecutor(len(started)) as pool:
            futures = [
                pool.submit(load, url, str(server.model_dir), server.prompts, args, deadline, server.run)
                for server, url, _ in started
            ]
            for future in futures:
                future.result()
        for server, _, process in started:
            server.run.peak_rss_mib = peak_rss_mib(process.pid)


def table(rows: list[dict], args: argparse.Namespace) -> str:
    pool = args.continuous_batching
    head = "| variant | KV cache bytes/token |" + (" pool tokens | requests that fit |" if pool else "")
    lines = [
        head + " requests | requests/s | tokens/s | p50 latency (s) | p95 latency (s) | peak RSS (MiB) | errors |",
        "|---|---:|" + ("---:|---:|" if pool else "") + "---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fit = f" {r['pool_tokens']} | {r['requests_that_fit']} |" if pool else ""
        lines.append(
            f"| {r['variant']} | {r['cache_bytes_per_token']} |{fit} {r['requests']}/{args.requests} | "
            f"{r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | {r['p50_s']:.2f} | {r['p95_s']:.2f} | "
            f"{r['peak_rss_mib']:,.0f} | {r['errors']} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# --faults: good and bad requests, both modes side by side
# ----------------------------------------------------------------------------------------------------------------
def write_preset_model(preset: str, path: Path) -> None:
    """A random-weight Q-K=V model of a QKVShare preset, EOS suppressed, greedy, with the word tokenizer."""
    import torch

    from qkvshare import QKVShareConfig, QKVShareForCausalLM

    config = QKVShareConfig.from_preset(preset, variant="Q-K=V")
    torch.manual_seed(0)
    model = QKVShareForCausalLM(config)
    model.generation_config.suppress_tokens = [0]
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    word_tokenizer(config.vocab_size).save_pretrained(path)


def bad_requests(model_id: str, prompt: str, context: int, vocab: int, batching: bool) -> dict[str, tuple]:
    """Every kind of request the server refuses at admission: name -> (path, JSON body or raw bytes). With
    `batching`, also those only continuous batching refuses (the page pool, a setting it does not apply)."""
    chat = {"model": model_id, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
    completion = {"model": model_id, "prompt": prompt, "max_tokens": 8}
    kinds = {
        "empty prompt": ("/v1/completions", {**completion, "prompt": ""}),
        "max_tokens=1e9": ("/v1/completions", {**completion, "max_tokens": 1_000_000_000}),
        "prompt past the context": ("/v1/completions", {**completion, "prompt": [5] * (context + 8), "max_tokens": 1}),
        "token ids outside the vocabulary": ("/v1/completions", {**completion, "prompt": [5, vocab + 10]}),
        "n too large": ("/v1/chat/completions", {**chat, "n": 1000}),
        "unimplemented field": ("/v1/chat/completions", {**chat, "logit_bias": {"5": 3}}),
        "bad value": ("/v1/chat/completions", {**chat, "temperature": -1}),
        "messages not a list": ("/v1/chat/completions", {**chat, "messages": "hello"}),
        "another model": ("/v1/chat/completions", {**chat, "model": "no-such-model"}),
        "body not a JSON object": ("/v1/chat/completions", b"[1, 2]"),
        "logprobs with stream": ("/v1/completions", {**completion, "logprobs": 1, "stream": True}),
    }
    if batching:
        kinds["larger than the page pool"] = ("/v1/completions", {**completion, "max_tokens": context - 100})
        kinds["a setting batching does not apply"] = ("/v1/chat/completions", {**chat, "frequency_penalty": 0.5})
    return kinds


def post_json(url: str, body: dict | bytes, timeout: float = 300) -> tuple[int, dict]:
    """POST with the standard library: (status, the JSON answer)."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def abandon_stream(url: str, body: dict) -> None:
    """Start a streamed request and close the connection after the first chunk (a client that gives up)."""
    import http.client

    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    connection.request(
        "POST", "/v1/chat/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    response.readline()
    connection.close()


def vm_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class FaultRun:
    """What one server did under load with faults."""

    mode: str
    baseline: list[float] = field(default_factory=list)  # seconds per good request, alone
    mixed: list[float] = field(default_factory=list)  # seconds per good request, with bad ones
    good_ok: int = 0  # good requests answered with generate()'s text (phases 2 and 3)
    good: int = 0
    bad_4xx: int = 0  # bad requests answered 4xx with a message (phases 2 and 3)
    bad: int = 0
    soak: int = 0
    rss_start: float = 0.0
    rss_end: float = 0.0
    health: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def p95(self, latencies: list[float]) -> float:
        return statistics.quantiles(latencies, n=20, method="inclusive")[18] if len(latencies) > 1 else 0.0

    def checks(self) -> dict[str, bool]:
        ratio = self.p95(self.mixed) / self.p95(self.baseline) if self.baseline else math.inf
        return {
            "good": self.good_ok == self.good,
            "bad": self.bad_4xx == self.bad,
            "no restart": self.health.get("worker_restarts") == 0,
            "rss": abs(self.rss_end - self.rss_start) <= 0.05 * self.rss_start,
            "p95": ratio <= 1.2,
        }


def fault_load(
    url: str, model_id: str, prompts: list[str], expected: list[str], bad: dict, args, run: FaultRun
) -> None:
    """The three phases against one server (see the docstring)."""
    lock = threading.Lock()
    kinds = list(bad.values())
    names = list(bad)

    def good(i: int, latencies: list[float] | None) -> None:
        body = {
            "model": model_id,
            "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
            "max_tokens": args.new_tokens,
            "temperature": 0,
        }
        start = time.perf_counter()
        status, answer = post_json(f"{url}/v1/chat/completions", body)
        elapsed = time.perf_counter() - start
        ok = status == 200 and answer["choices"][0]["message"]["content"] == expected[i % len(expected)]
        with lock:
            if latencies is not None:
                latencies.append(elapsed)
            run.good += 1
            run.good_ok += ok
            if not ok:
                run.problems.append(f"good request {i}: {status} {str(answer)[:200]}")

    def refused(i: int) -> None:
        path, body = kinds[i % len(kinds)]
        status, answer = post_json(f"{url}{path}", body)
        ok = 400 <= status < 500 and bool(answer.get("error", {}).get("message"))
        with lock:
            run.bad += 1
            run.bad_4xx += ok
            if not ok:
                run.problems.append(f"bad request {names[i % len(kinds)]!r}: {status} {str(answer)[:200]}")

    def disconnect(i: int) -> None:
        body = {"model": model_id, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}]}
        abandon_stream(url, {**body, "max_tokens": args.new_tokens, "temperature": 0})

    good(0, None)  # warm-up, not counted
    with ThreadPoolExecutor(args.clients) as pool:
        # Phases 1 and 2 in alternating rounds of `clients` good requests, so that load from outside (other
        # processes, the other server) hits the baseline and the run with bad requests alike.
        for start in range(0, args.requests, args.clients):
            ids = range(start, min(start + args.clients, args.requests))
            list(pool.map(lambda i: good(i, run.baseline), ids))
            mixed = [task for i in ids for task in ((good, i), (refused, i))]
            list(pool.map(lambda task: task[0](task[1], run.mixed) if task[0] is good else task[0](task[1]), mixed))
        process_pid = run.health["pid"]
        run.rss_start = vm_rss_mib(process_pid)
        soak = []
        for i in range(args.soak_requests):
            if i % 25 == 24:
                soak.append((disconnect, i))
            else:
                soak.append((good, i) if i % 2 == 0 else (refused, i))
        list(pool.map(lambda task: task[0](task[1], []) if task[0] is good else task[0](task[1]), soak))
        run.soak = len(soak)
    time.sleep(1.0)  # let the cancelled streams end
    run.rss_end = vm_rss_mib(process_pid)
    status, health = post_json_get(f"{url}/health")
    run.health.update(health)


def post_json_get(url: str) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def faults_table(runs: list[FaultRun]) -> str:
    lines = [
        "| server | good: generate()'s text | bad: 4xx with a message | p95 good alone (s) | p95 good with bad (s) "
        "| ratio | soak requests | RSS before / after soak (MiB) | RSS change | worker restarts | cancelled |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        base, mixed = run.p95(run.baseline), run.p95(run.mixed)
        change = 100 * (run.rss_end - run.rss_start) / run.rss_start if run.rss_start else 0.0
        lines.append(
            f"| {run.mode} | {run.good_ok}/{run.good} | {run.bad_4xx}/{run.bad} | {base:.2f} | {mixed:.2f} | "
            f"{mixed / base if base else math.inf:.2f} | {run.soak} | {run.rss_start:,.1f} / {run.rss_end:,.1f} | "
            f"{change:+.1f}% | {run.health.get('worker_restarts')} | {run.health.get('requests', {}).get('cancelled')} |"
        )
    return "\n".join(lines)


def run_faults(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from qkvshare import QKVShareForCausalLM
    from qkvshare.serve import serve_in_subprocess

    with tempfile.TemporaryDirectory(prefix="qkvshare-serve-faults-") as tmp:
        model_dir = Path(tmp) / f"{args.preset}-qkev"
        write_preset_model(args.preset, model_dir)
        model = QKVShareForCausalLM.from_pretrained(model_dir).eval()
        tok = AutoTokenizer.from_pretrained(model_dir)
        config = model.config
        rng = random.Random(0)
        words = config.vocab_size - 3
        prompts = [
            " ".join(f"w{rng.randrange(1, words)}" for _ in range(args.prompt_tokens)) for _ in range(args.requests)
        ]
        expected = []
        for prompt in prompts:  # generate()'s greedy text, what every good request must get
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
            )
            with torch.no_grad():
                out = model.generate(**ids, max_new_tokens=args.new_tokens, do_sample=False)
            expected.append(tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
        del model
        modes = {
            "one generate() at a time": ["--dtype", args.dtype, "--device", "cpu"],
            "continuous batching": [
                "--dtype",
                args.dtype,
                "--device",
                "cpu",
                "--continuous_batching",
                "--cb_page_size",
                "16",
                "--cb_pool_tokens",
                str(args.fault_pool_tokens),
            ],
        }
        env = {} if args.threads is None else {"OMP_NUM_THREADS": str(args.threads)}
        runs = [FaultRun(mode) for mode in modes]
        with ExitStack() as stack:
            started = []
            for run, flags in zip(runs, modes.values(), strict=True):
                log = Path(tmp) / f"{len(started)}.log"
                url, process = stack.enter_context(serve_in_subprocess(model_dir, flags, log, env=env))
                run.health["pid"] = process.pid
                batching = "--continuous_batching" in flags
                bad = bad_requests(
                    str(model_dir), prompts[0], config.max_position_embeddings, config.vocab_size, batching
                )
                started.append((run, url, bad))
            with ThreadPoolExecutor(len(started)) as pool:
                futures = [
                    pool.submit(fault_load, url, str(model_dir), prompts, expected, bad, args, run)
                    for run, url, bad in started
                ]
                for future in futures:
                    future.result()
    print(
        f"\n{args.preset} preset (Q-K=V, random weights, {config.max_position_embeddings} positions), {args.dtype}, CPU, "
        f"threads={args.threads or 'default'}; {args.clients} clients per server; {args.requests} good chat requests "
        f"({args.prompt_tokens}-word prompts, {args.new_tokens} tokens) alone and interleaved with {args.requests} "
        f"bad ones (alternating rounds of {args.clients}), then a soak of {args.soak_requests} (good and bad alternating, every 25th a client that "
        "disconnects); both servers loaded at once\n"
    )
    print(faults_table(runs))
    ok = True
    for run in runs:
        checks = run.checks()
        print(f"{run.mode}: " + ", ".join(f"{name} {'ok' if passed else 'FAILED'}" for name, passed in checks.items()))
        for problem in run.problems[:5]:
            print(f"  {problem}", file=sys.stderr)
        ok &= all(checks.values())
    if args.output:
        rows = [{**vars(run), "checks": run.checks()} for run in runs]
        Path(args.output).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2, default=str))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.faults:
        return run_faults(args)
    shape = json.loads(Path(args.shape).read_text())
    deadline = time.monotonic() + args.max_seconds
    with tempfile.TemporaryDirectory(prefix="qkvshare-serve-load-") as tmp:
        servers = [prepare(variant, shape, Path(tmp), args) for variant in args.variants]
        bench(servers, Path(tmp), args, deadline)
    runs = [server.run for server in servers]
    for run in runs:
        print(f"{run.variant}: {run.cache_line}" + (f"\n{run.variant}: {run.pool_line}" if run.pool_line else ""))
        for error in run.errors[:3]:
            print(f"  error: {error}", file=sys.stderr)
    rows = [run.row() for run in runs]
    mode = (
        f"continuous batching ({args.cb_cache_mib:g} MiB page pool, {args.cb_page_size}-token pages)"
        if args.continuous_batching
        else "one generate() at a time"
    )
    print(
        f"\n{args.requests} requests from {args.clients} clients, {args.prompt_tokens}-word prompts, "
        f"{args.new_tokens} new tokens each, {Path(args.shape).parent.name} shape, {args.dtype}, {mode}, "
        f"threads={args.threads or 'default'}\n"
    )
    print(table(rows, args))
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0 if all(r["requests"] == args.requests for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
