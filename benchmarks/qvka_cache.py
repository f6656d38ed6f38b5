"""What should a QV-Ka cache store? G and V (keys recomputed on read) against K and V, measured side by side.

QV-Ka (the second source, `key_context_dim`) computes each head's key from its value and a context G shared by all
heads: K_i = [G ; V_i] W_i^K. A decoding cache can hold
- G and V (`QKVShareCache`, `ContextValueLayer`): H x D + d_ctx elements per token and layer, but every step
  recomputes the keys of all cached tokens (T x H x (d_ctx + D) x D MACs per layer; with RoPE also rotates them);
- K and V (transformers' `DynamicCache`, which the model fills like a QKV model's): 2 x H x D elements, no recompute.
Both decode exactly. This script builds one QV-Ka model and decodes with each cache in the same process, with
interleaved repetitions, and prints the bytes each cache holds after the prompt and the decode time per token
(median CPU time of this process, 1 thread, so other load on a shared machine barely moves it). A QKV model of the
same shape with its own cache is the reference.

    python benchmarks/qvka_cache.py                       # small preset (d 256, 4 heads of 64, 4 layers), RoPE
    python benchmarks/qvka_cache.py --contexts 256 1024 --position_embedding_type learned
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from qkvshare import QKVShareCache, QKVShareConfig, QKVShareForCausalLM


def cache_bytes(cache) -> int:
    """Bytes of every tensor a cache holds (`QKVShareCache.nbytes`, or the keys and values of a DynamicCache)."""
    if isinstance(cache, QKVShareCache):
        return cache.nbytes()
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


@torch.no_grad()
def decode_seconds(model, make_cache, prompt: torch.Tensor, new_tokens: int) -> tuple[float, int]:
    """CPU seconds per decoded token after prefilling `prompt`, and the bytes the cache held after the prompt."""
    cache = make_cache(model.config)
    logits = model(prompt, cache=cache, use_cache=True).logits
    held = cache_bytes(cache)
    token = logits[:, -1:].argmax(-1)
    start = time.process_time()
    for _ in range(new_tokens):
        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return (time.process_time() - start) / new_tokens, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--variant", default="QV-Ka", help="QV-Ka or QV-Ka-2")
    parser.add_argument("--position_embedding_type", default="rope")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    overrides = dict(position_embedding_type=args.position_embedding_type, max_position_embeddings=4096)
    models = {}
    for name, variant in (("QKV", "QKV"), (args.variant, args.variant)):
        torch.manual_seed(0)
        config = QKVShareConfig.from_preset(args.preset, variant, **overrides)
        models[name] = QKVShareForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    runs = {  # label: (model, cache factory)
        "QKV, QKVShareCache (K, V)": (models["QKV"], QKVShareCache),
        f"{args.variant}, DynamicCache (K, V)": (models[args.variant], lambda config: DynamicCache()),
        f"{args.variant}, QKVShareCache (G, V; keys recomputed)": (models[args.variant], QKVShareCache),
    }
    config = models[args.variant].config
    print(
        f"preset {args.preset}, {args.variant} (d_ctx {config.key_context_dim}), positions "
        f"{args.position_embedding_type}: {config.num_hidden_layers} layers, {config.num_attention_heads} heads of "
        f"{config.head_dim}, batch {args.batch_size}, fp32, 1 thread; median of {args.repeats} interleaved repeats "
        f"of {args.new_tokens} decoded tokens\n"
    )
    header = "| context | cache | bytes after prompt | vs K,V | ms/token (CPU) | vs K,V |"
    print(header + "\n|---:|---|---:|---:|---:|---:|")
    for context in args.contexts:
        prompt = torch.randint(3, config.vocab_size, (args.batch_size, context))
        times = {label: [] for label in runs}
        held = {}
        for _ in range(args.repeats):
            for label, (model, make_cache) in runs.items():
                seconds, held[label] = decode_seconds(model, make_cache, prompt, args.new_tokens)
                times[label].append(seconds)
        reference = f"{args.variant}, DynamicCache (K, V)"
        ref_ms, ref_bytes = 1e3 * statistics.median(times[reference]), held[reference]
        for label in runs:
            ms = 1e3 * statistics.median(times[label])
            print(
                f"| {context} | {label} | {held[label]:,} | {held[label] / ref_bytes:.3f} | {ms:.2f} | "
                f"{ms / ref_ms:.2f} |"
            )


if __name__ == "__main__":
    main()
