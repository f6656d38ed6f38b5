"""Load test of `qkvshare serve` on 127.0.0.1: the Llama-equivalent model (`none`) and Q-K=V side by side.

    python benchmarks/serve_load.py --threads 1                      # 64 requests, 8 clients, SmolLM2-135M shape
    python benchmarks/serve_load.py --requests 16 --clients 4 --new_tokens 16 --threads 1     # a quick look
    python benchmarks/serve_load.py --threads 1 --continuous_batching   # batched on the tied paged cache, 24 MiB each

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
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--output", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if min(args.requests, args.clients, args.prompt_tokens, args.new_tokens) < 1:
        p.error("--requests, --clients, --prompt_tokens and --new_tokens must be positive")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
