"""The tied paged cache of continuous batching, measured: its bytes against transformers' `PagedAttentionCache`, the
pages and concurrent sequences a fixed memory holds, and `generate_batch` throughput, Llama (`none`) and Q-K=V side
by side in one run.

    python benchmarks/paged_cache.py                                  # SmolLM2-135M shape, random weights, ~5 min
    python benchmarks/paged_cache.py --requests 16 --new_tokens 16    # a quicker look
    python benchmarks/paged_cache.py --skip_throughput                # bytes and capacity only (seconds)

Not part of CI. Three tables:
1. Bytes at equal page count: `QKVSharePagedCache.nbytes()` and transformers' own `PagedAttentionCache` built from
   the same config and block count, for QKV, Q-K=V and a per-layer mix (every other layer tied); the ratio against
   the expected fraction sum(cached tensors per layer) / (2 x layers).
2. Equal memory: the blocks (and tokens) each layout gets from `--memory_mib` of pages, the caches really built.
3. `generate_batch` on that fixed cache memory (`--run_memory_mib`): `--requests` prompts of random length in
   [`--prompt_min`, `--prompt_max`] and `--new_tokens` greedy tokens each (no EOS, random weights), for Llama
   (`projection_sharing="none"`) and Q-K=V alternately, `--repeats` times: the blocks of the cache, how many whole
   requests (prompt + new tokens) fit at once, the most requests the scheduler held active at once, wall time and
   generated tokens per second (best of the repeats, and the CPU seconds of the process: the machine may be shared).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import FIFOScheduler, PagedAttentionCache
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING
from transformers.utils import logging as hf_logging

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qkvshare import QKVShareConfig, QKVShareForCausalLM  # noqa: E402
from qkvshare.analysis.common import markdown_table  # noqa: E402
from qkvshare.paged_cache_qkvshare import QKVSharePagedCache  # noqa: E402


class PeakFIFOScheduler(FIFOScheduler):
    """transformers' FIFO scheduler that records the most requests it held active at once (`peak_active`); the
    last one created is `PeakFIFOScheduler.latest`."""

    latest: PeakFIFOScheduler | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.peak_active = 0
        PeakFIFOScheduler.latest = self

    def schedule_batch(self, *args, **kwargs):
        batch = super().schedule_batch(*args, **kwargs)
        self.peak_active = max(self.peak_active, len(self.active_requests))
        return batch


SCHEDULER_MAPPING["fifo-peak"] = PeakFIFOScheduler


def model_config(args: argparse.Namespace, variant: str | None, **overrides) -> QKVShareConfig:
    source = json.loads((REPO / args.model_config / "config.json").read_text())
    return QKVShareConfig.from_llama(source, variant=variant, attn_implementation=args.attn_implementation, **overrides)


def caches(config: QKVShareConfig, num_blocks: int, args: argparse.Namespace, dtype: torch.dtype):
    """Ours and transformers' paged caches for `config`, `num_blocks` blocks of `--page_size` tokens."""
    options = dict(device="cpu", distributed_helper=DistributedHelper(None, None), dtype=dtype)

    def batching() -> ContinuousBatchingConfig:
        return ContinuousBatchingConfig(
            num_blocks=num_blocks, page_size=args.page_size, max_batch_tokens=64, max_memory_percent=0.9
        )

    return QKVSharePagedCache(config, batching(), **options), PagedAttentionCache(config, batching(), **options)


def bytes_table(args: argparse.Namespace, dtype: torch.dtype) -> list[list]:
    rows = []
    layers = model_config(args, None).num_hidden_layers
    mix = ["kv" if i % 2 == 0 else "none" for i in range(layers)]
    for label, variant, overrides in [
        ("QKV (Llama)", None, {}),
        ("Q-K=V", "Q-K=V", {}),
        ("mix: every other layer Q-K=V", None, {"layer_projection_sharing": mix}),
    ]:
        config = model_config(args, variant, **overrides)
        ours, theirs = caches(config, args.blocks, args, dtype)
        tensors = sum(config.layer_mode(i).cached_tensors for i in range(config.num_hidden_layers))
        expected = tensors / (2 * config.num_hidden_layers)
        rows.append(
            [label, args.blocks, ours.nbytes(), theirs.cache_tensor.nbytes, ours.nbytes() / theirs.cache_tensor.nbytes]
            + [f"{tensors}/{2 * config.num_hidden_layers} = {expected:.4f}"]
        )
    return rows


def memory_table(args: argparse.Namespace, dtype: torch.dtype) -> list[list]:
    rows, budget = [], int(args.memory_mib * 2**20)
    for label, variant in [("QKV (Llama)", None), ("Q-K=V", "Q-K=V")]:
        config = model_config(args, variant)
        block = caches(config, 1, args, dtype)[0].bytes_per_block
        ours, _ = caches(config, budget // block, args, dtype)
        rows.append([label, args.memory_mib, block, ours.num_blocks, ours.max_tokens_read, ours.nbytes()])
    return rows


def run_batch(model, inputs, args) -> tuple[float, float, int, int]:
    """One generate_batch: wall and CPU seconds, generated tokens, the most requests active at once."""
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    block = caches(model.config, 1, args, model.dtype)[0].bytes_per_block
    batching = ContinuousBatchingConfig(
        num_blocks=int(args.run_memory_mib * 2**20) // block,
        page_size=args.page_size,
        max_batch_tokens=args.max_batch_tokens,
        scheduler_type="fifo-peak",
    )
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    errors = [output.error for output in outputs.values() if output.error is not None]
    if errors or len(outputs) != len(inputs):
        raise RuntimeError(f"generate_batch: {len(outputs)} of {len(inputs)} results, errors {errors[:3]}")
    generated = sum(len(output.generated_tokens) for output in outputs.values())
    return wall, cpu, generated, PeakFIFOScheduler.latest.peak_active


def throughput_table(args: argparse.Namespace) -> list[list]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.requests,), generator=generator).tolist()
    inputs = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]
    models = {}
    for label, variant in [("QKV (Llama)", None), ("Q-K=V", "Q-K=V")]:
        torch.manual_seed(0)
        models[label] = QKVShareForCausalLM(model_config(args, variant)).eval()
    # transformers' manager runs gc.collect() twice per generate_batch; freeze what setup made (torch, the models), as
    # a server would after loading, so that those collections do not scan it on every run.
    gc.freeze()
    runs = {label: [] for label in models}
    for _ in range(args.repeats):  # alternate, so load on a shared machine hits both alike
        for label, model in models.items():
            runs[label].append(run_batch(model, inputs, args))
            print(f"  {label}: {runs[label][-1]}", flush=True)
    rows = []
    per_request = max(math.ceil((p + args.new_tokens) / args.page_size) for p in lengths)
    for label, model in models.items():
        blocks = int(args.run_memory_mib * 2**20) // caches(model.config, 1, args, model.dtype)[0].bytes_per_block
        wall, cpu, generated, peak = min(runs[label])  # the fastest wall time
        rows.append(
            [label, args.run_memory_mib, blocks, blocks * args.page_size, blocks // per_request]
            + [max(run[3] for run in runs[label]), f"{wall:.1f}", f"{generated / wall:.1f}", f"{generated / cpu:.1f}"]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_config", default="configs/smollm2-135m", help="a Llama config.json directory")
    parser.add_argument("--attn_implementation", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="of the cache tables")
    parser.add_argument("--page_size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=32, help="table 1: blocks of both caches")
    parser.add_argument("--memory_mib", type=float, default=64, help="table 2: memory of the pages")
    parser.add_argument("--run_memory_mib", type=float, default=16, help="table 3: memory of the pages")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt_min", type=int, default=16)
    parser.add_argument("--prompt_max", type=int, default=48)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--max_batch_tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip_throughput", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    dtype = getattr(torch, args.dtype)
    print(
        f"transformers PagedAttentionCache vs QKVSharePagedCache, {args.model_config}, pages of {args.page_size} tokens"
    )
    print("\n1. Bytes at equal page count (" + args.dtype + ")\n")
    headers = ["layout", "blocks", "QKVSharePagedCache bytes", "PagedAttentionCache bytes", "ratio", "expected"]
    print(markdown_table(headers, bytes_table(args, dtype)))
    print(f"\n2. Equal memory: {args.memory_mib} MiB of pages ({args.dtype})\n")
    headers = ["layout", "MiB", "bytes per block", "blocks", "tokens", "pool bytes (with 2 trash sectors)"]
    print(markdown_table(headers, memory_table(args, dtype)))
    if args.skip_throughput:
        return
    print(
        f"\n3. generate_batch, {args.run_memory_mib} MiB of pages (float32): {args.requests} requests, prompts of "
        f"{args.prompt_min}-{args.prompt_max} tokens, {args.new_tokens} new tokens, {args.attn_implementation}, "
        f"{args.threads} threads, best of {args.repeats}\n"
    )
    rows = throughput_table(args)
    headers = [
        "model",
        "MiB",
        "blocks",
        "tokens",
        "whole requests at once",
        "most active",
        "wall s",
        "tok/s",
        "tok/CPU s",
    ]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
