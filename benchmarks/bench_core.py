"""Core benchmark: QKVShare against transformers' LlamaForCausalLM of the same shape, side by side in one run.

Prints markdown tables of
1. full-forward time and cached decode time per token, mode "none" vs Llama (same weights), with ratios;
2. per variant, decode time per token and cache bytes at a few context lengths (QKVShareCache vs theory).

Repetitions are interleaved across models (A B C A B C ...) and medians reported, so machine noise hits all
models alike; compare ratios, not absolute times, between runs. CPU by default; `--device cuda --dtype bfloat16`
on a GPU (timings synchronise the device).

    python benchmarks/bench_core.py                 # about 2-4 minutes on 2 CPU cores
    python benchmarks/bench_core.py --quick         # smaller sizes, for a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from qkvshare import QKVShareCache, QKVShareConfig, QKVShareForCausalLM

VARIANTS = [
    ("QKV", {}),
    ("Q=K-V", {}),
    ("Q-K=V", {"kv_tie_point": "post_rope"}),
    ("Q-K=V", {"kv_tie_point": "pre_rope"}),
    ("Q=K=V", {}),
    ("GQA-2", {}),
    ("Q-GQA-2", {}),
    ("MQA", {}),
    ("Q-MQA", {}),
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved_medians(fns: dict[str, Callable[[], float]], reps: int) -> dict[str, float]:
    """Run each fn `reps` times in interleaved order; each returns seconds; return the medians."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            samples[name].append(fn())
    return {name: statistics.median(values) for name, values in samples.items()}


def timed(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def decode_seconds_per_token(model, ids: torch.Tensor, new_tokens: int, cache, device: torch.device) -> float:
    """Prefill `ids` (untimed), then time `new_tokens` single-token cached steps; seconds per token."""
    out = model(ids, cache=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    sync(device)
    start = time.perf_counter()
    for _ in range(new_tokens):
        out = model(token, cache=out.cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    sync(device)
    return (time.perf_counter() - start) / new_tokens


def cache_bytes(cache) -> int:
    if isinstance(cache, QKVShareCache):
        return cache.nbytes()
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--forward_len", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.hidden_size, args.layers, args.contexts, args.reps, args.forward_len = 128, 2, [64, 256], 3, 128
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    shape = dict(
        vocab_size=4096, hidden_size=args.hidden_size, intermediate_size=args.hidden_size * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        max_position_embeddings=max(args.contexts) + args.new_tokens + 8,
    )  # fmt: skip

    # 1. mode "none" against Llama, same weights.
    llama_config = LlamaConfig(**shape, rms_norm_eps=1e-5, tie_word_embeddings=True)
    llama = LlamaForCausalLM(llama_config).to(device, dtype).eval()
    ours = QKVShareForCausalLM(QKVShareConfig.from_preset("tiny", "QKV", **shape, tie_word_embeddings=True))
    ours.load_state_dict(llama.state_dict(), strict=True)
    ours = ours.to(device, dtype).eval()
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.forward_len), device=device)
    context = torch.randint(0, shape["vocab_size"], (args.batch, max(args.contexts)), device=device)
    with torch.inference_mode():
        forward = interleaved_medians(
            {"llama": lambda: timed(lambda: llama(ids), device), "qkvshare": lambda: timed(lambda: ours(ids), device)},
            args.reps,
        )
        decode = interleaved_medians(
            {
                "llama": lambda: decode_seconds_per_token(
                    llama, context, args.new_tokens, DynamicCache(config=llama.config), device
                ),
                "qkvshare": lambda: decode_seconds_per_token(
                    ours, context, args.new_tokens, QKVShareCache(ours.config), device
                ),
            },
            args.reps,
        )
    print(f"\n## Mode none vs LlamaForCausalLM ({args.device}, {args.dtype}, {shape['num_hidden_layers']} layers, "
          f"d={shape['hidden_size']}, batch {args.batch})\n")  # fmt: skip
    print("| measurement | Llama (ms) | QKVShare none (ms) | ratio |\n|---|---:|---:|---:|")
    for label, result in (
        (f"forward, T={args.forward_len}", forward),
        (f"decode per token, context {max(args.contexts)}", decode),
    ):
        print(f"| {label} | {result['llama'] * 1e3:.2f} | {result['qkvshare'] * 1e3:.2f} | "
              f"{result['qkvshare'] / result['llama']:.3f} |")  # fmt: skip

    # 2. every variant: decode time per token and cache bytes at several context lengths.
    models = {}
    for variant, extra in VARIANTS:
        label = variant + (f" ({extra['kv_tie_point']})" if extra else "")
        config = QKVShareConfig.from_preset("tiny", variant, **shape, **extra)
        torch.manual_seed(0)
        models[label] = QKVShareForCausalLM(config).to(device, dtype).eval()
    element = torch.finfo(dtype).bits // 8
    print(f"\n## Decode time per token and cache bytes by variant (batch {args.batch})\n")
    header = "| variant | " + " | ".join(f"ms/token @ {t}" for t in args.contexts)
    header += " | " + " | ".join(f"cache MiB @ {t}" for t in args.contexts) + " | cache vs QKV | bytes == theory |"
    print(header + "\n|---|" + "---:|" * (2 * len(args.contexts) + 2))
    rows = {label: {"ms": [], "bytes": []} for label in models}
    with torch.inference_mode():
        for length in args.contexts:
            ctx = context[:, :length]
            medians = interleaved_medians(
                {
                    label: (
                        lambda m=m, c=ctx: decode_seconds_per_token(
                            m, c, args.new_tokens, QKVShareCache(m.config), device
                        )
                    )
                    for label, m in models.items()
                },
                args.reps,
            )
            for label, model in models.items():
                cache = QKVShareCache(model.config)
                model(ctx, cache=cache, use_cache=True)
                rows[label]["ms"].append(medians[label] * 1e3)
                rows[label]["bytes"].append(cache_bytes(cache))
    qkv_bytes = rows["QKV"]["bytes"][-1]
    for label, model in models.items():
        held = rows[label]["bytes"][-1]
        positions = args.batch * args.contexts[-1] * 8 if model.config.needs_key_positions else 0
        theory = model.config.kv_cache_bytes_per_token(element) * args.batch * args.contexts[-1] + positions
        print(
            f"| {label} | " + " | ".join(f"{v:.2f}" for v in rows[label]["ms"]) + " | "
            + " | ".join(f"{b / 2**20:.2f}" for b in rows[label]["bytes"])
            + f" | {held / qkv_bytes:.4f} | {held == theory} |"
        )  # fmt: skip
    print("\n(pre_rope caches also hold int64 positions: 8 bytes per token per sequence, counted in its bytes.)")


if __name__ == "__main__":
    main()
