"""Training throughput (tokens/s) of QKVShare QKV and Q-K=V against transformers' LlamaForCausalLM of the same shape.

    python benchmarks/train_throughput.py                      # the tiny recipe (configs/tiny.yaml shapes)
    python benchmarks/train_throughput.py --preset small --vocab_size 4096 --block_size 256 --batch_size 16

Design notes
- One process, one run: the three models are timed in interleaved rounds (QKV, Q-K=V, Llama, QKV, ...), so load
  from other processes on a shared machine hits all of them alike; the median round is reported.
- A step is exactly the trainer's: `next_token_loss` (fp32 cross-entropy over packed blocks), backward, AdamW with
  the trainer's parameter groups. Tokens are random: speed does not depend on the text.
- Besides wall-clock tokens/s it reports tokens per CPU-second of this process (`time.process_time`), which is
  what the same work would reach on otherwise idle cores (x the thread count) when the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaForCausalLM

from qkvshare import QKVShareForCausalLM
from qkvshare.train.args import parse_args
from qkvshare.train.model import build_config, count_parameters, llama_config_like
from qkvshare.train.pretrain import build_optimizer, next_token_loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--vocab_size", type=int, default=320, help="the recipe's padded tokenizer size (tiny: 320)")
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="steps per round and model")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    train_args = parse_args([])  # the trainer's default AdamW settings and parameter groups
    models = {}
    for variant in ("QKV", "Q-K=V"):
        torch.manual_seed(0)
        models[f"QKVShare {variant}"] = QKVShareForCausalLM(
            build_config(args.preset, variant, {"vocab_size": args.vocab_size})
        )
    torch.manual_seed(0)
    models["LlamaForCausalLM"] = LlamaForCausalLM(llama_config_like(models["QKVShare QKV"].config))
    optimizers = {name: build_optimizer(model, train_args) for name, model in models.items()}
    tokens = args.batch_size * args.block_size

    def run(name: str, steps: int) -> tuple[float, float]:
        model, opt = models[name], optimizers[name]
        model.train()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            blocks = torch.randint(0, args.vocab_size, (args.batch_size, args.block_size + 1))
            next_token_loss(model, blocks).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - wall, time.process_time() - cpu

    for name in models:  # warm-up: allocator, kernels
        run(name, 2)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name in models:
            samples[name].append(run(name, args.steps))
    rows = []
    for name, times in samples.items():
        wall = statistics.median(t for t, _ in times)
        cpu = statistics.median(c for _, c in times)
        rows.append({"model": name, "parameters": count_parameters(models[name]),
                     "tokens_per_s": tokens * args.steps / wall,
                     "tokens_per_cpu_s": tokens * args.steps / cpu})  # fmt: skip
    ref = rows[-1]["tokens_per_s"]
    print(f"preset {args.preset}, vocab {args.vocab_size}, batch {args.batch_size} x {args.block_size} tokens, "
          f"{args.threads} threads, {args.rounds} interleaved rounds of {args.steps} steps (median)")  # fmt: skip
    print("| model | parameters | train tokens/s | vs Llama | tokens per CPU-second |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['parameters']:,} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / ref:.2f}x "
              f"| {r['tokens_per_cpu_s']:,.0f} |")  # fmt: skip
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
