"""`qkvshare bench`: measured cache bytes, decode speed, capacity and training throughput against Llama.

What is measured (all in one process, models built once, repetitions interleaved across models so that drift in
machine load hits every model alike; medians reported, ratios taken between medians)
- cache: bytes actually held after a prefill of C tokens: `QKVShareCache.nbytes()` for every variant, and the
  bytes of transformers' `DynamicCache` for `LlamaForCausalLM` of the same shape (same heads and kv heads), next
  to the theory `config.kv_cache_bytes_per_token(element size) x C` (K/V tensors only: a "+" variant or a
  pre-RoPE tie also keeps the int64 positions of cached tokens, 8 bytes per token, which shows as "no" there);
- decode: a prefill (timed separately: the forward-time comparison) then N greedy decode steps through the cache,
  for every batch size and context length; ms per step and generated tokens/s (batch x N / decode time);
- capacity: from the measured bytes per token, the longest context (batch 1) and the largest batch (at a given
  context) whose KV cache fits a memory budget (the cache only; weights and activations are not counted);
- train: optimizer steps (forward, backward, AdamW) per second on random tokens, as tokens/s.

The Llama references: one `LlamaForCausalLM` per distinct kv-head count among the variants. Where the preset is
Llama-style (RMSNorm, SwiGLU, RoPE), the weights of the variant with no sharing (QKV, GQA-g, MQA) are copied into
its Llama twin and the logits are checked equal, so the "vs Llama" ratio of those rows compares identical
computations. Tied variants are compared with the Llama of their kv-head count (what they would be untied).
`--timer cpu` (CPU only, with `--threads 1`) times with this process's CPU time instead of wall time, so that
other processes competing for the cores of a shared machine do not enter the ratios. On CUDA, timings synchronise
the device and the peak memory above the weights is reported; `--dtype bf16` runs
decode in bf16 and training under bf16 autocast.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from qkvshare.analysis.common import (
    base_config,
    check_variants,
    default_variants,
    known_presets,
    markdown_table,
    parse_overrides,
    variant_config,
    with_fields,
)
from qkvshare.analysis.plotting import line_plot

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SECTIONS = ("cache", "decode", "capacity", "train")


@dataclass
class Candidate:
    """One model under test: a QKVShare variant or a Llama reference."""

    name: str
    model: torch.nn.Module
    is_llama: bool
    kv_heads: int
    config: Any  # QKVShareConfig of a variant, LlamaConfig of a reference
    reference: str | None = None  # name of the Llama reference (variants only)
    weights_copied: bool = False  # the Llama reference holds this variant's weights
    parity_max_abs_diff: float | None = None


# ----------------------------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------------------------
def llama_config_for(config, kv_heads: int, attn_implementation: str):
    """A `LlamaConfig` with the shape of a QKVShare config (and ``kv_heads`` key/value heads)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=kv_heads, head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, hidden_act=config.hidden_act,
        rope_parameters=config.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, attn_implementation=attn_implementation,
    )  # fmt: skip


def is_llama_style(config) -> bool:
    """Whether a QKVShare config computes exactly what `LlamaForCausalLM` computes when nothing is shared."""
    return (
        config.norm_type == "rmsnorm" and config.mlp_type == "gated" and config.position_embedding_type == "rope"
        and config.attention_map_pe_dim == 0 and config.is_causal and config.attention_kernel == "softmax"
    )  # fmt: skip


def llama_name(kv_heads: int, heads: int) -> str:
    return "Llama" if kv_heads == heads else ("Llama MQA" if kv_heads == 1 else f"Llama GQA-{kv_heads}")


def build_candidates(
    base, variants: list[str], device: torch.device, dtype: torch.dtype, attn_implementation: str, seed: int
) -> list[Candidate]:
    """The variants (random init, ``seed``) and one Llama reference per kv-head count, in eval mode."""
    from transformers import LlamaForCausalLM

    from qkvshare import QKVShareForCausalLM

    cands: list[Candidate] = []
    for name in variants:
        cfg = variant_config(base, name)
        cfg._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        model = QKVShareForCausalLM(cfg).to(device=device, dtype=dtype).eval()
        cands.append(Candidate(name, model, False, cfg.num_key_value_heads, cfg))
    for kv in sorted({c.kv_heads for c in cands}, reverse=True):
        lcfg = llama_config_for(base, kv, attn_implementation)
        torch.manual_seed(seed)
        llama = LlamaForCausalLM(lcfg).to(device=device, dtype=dtype).eval()
        ref = Candidate(llama_name(kv, base.num_attention_heads), llama, True, kv, lcfg)
        twin = next(
            (
                c
                for c in cands
                if c.kv_heads == kv and c.config.projection_sharing == "none" and is_llama_style(c.config)
            ),
            None,
        )
        if twin is not None:  # same computation: copy the weights and check the logits agree
            llama.load_state_dict(twin.model.state_dict(), strict=True)
            ids = torch.randint(0, base.vocab_size, (1, 16), device=device)
            with torch.inference_mode():
                diff = (llama(ids).logits.float() - twin.model(ids).logits.float()).abs().max().item()
            twin.weights_copied, twin.parity_max_abs_diff = True, diff
        for c in cands:
            if c.kv_heads == kv:
                c.reference = ref.name
        cands.append(ref)
    return cands


def cache_nbytes(cache) -> int:
    """Bytes a cache holds: `QKVShareCache.nbytes()`, or the key and value tensors of a transformers cache."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def theory_bytes(c: Candidate, tokens: int, element_size: int) -> int:
    """Theoretical KV-cache bytes for ``tokens`` cached tokens (all sequences together)."""
    if c.is_llama:
        cfg = c.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return 2 * cfg.num_hidden_layers * c.kv_heads * head_dim * element_size * tokens
    return c.config.kv_cache_bytes_per_token(element_size) * tokens


# ----------------------------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill_and_decode(
    model, input_ids: torch.Tensor, new_tokens: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Prefill ``input_ids`` (the model makes its default cache), then ``new_tokens`` greedy steps; times in s."""
    device = input_ids.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    _sync(device)
    t0 = clock()
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1:].argmax(-1)
    _sync(device)
    t1 = clock()
    cache = out.cache
    nbytes = cache_nbytes(cache)
    for _ in range(new_tokens):
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    _sync(device)
    t2 = clock()
    result = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "cache_bytes": nbytes}
    if device.type == "cuda":
        result["peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - before
    return result


def interleaved(cands: list[Candidate], reps: int, warmup: int, fn: Callable[[Candidate], dict], desc: str):
    """Run ``fn`` on every candidate ``warmup + reps`` times, rotating the order each round; keep the last reps."""
    runs: dict[str, list[dict]] = {c.name: [] for c in cands}
    rounds = warmup + reps
    for r in tqdm(range(rounds), desc=desc, leave=False):
        shift = r % len(cands)
        for c in cands[shift:] + cands[:shift]:
            result = fn(c)
            if r >= warmup:
                runs[c.name].append(result)
    return runs


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def measure_cache(cands, context_lens, device, element_size) -> list[dict]:
    """Cache bytes after a batch-1 prefill at each context length (deterministic: one run each)."""
    rows = []
    for T in context_lens:
        ids = torch.randint(0, cands[0].config.vocab_size, (1, T), device=device)
        for c in cands:
            measured = prefill_and_decode(c.model, ids, 0)["cache_bytes"]
            rows.append(
                {"model": c.name, "llama": c.is_llama, "context": T, "measured_bytes": measured,
                 "theory_bytes": theory_bytes(c, T, element_size), "reference": c.reference}
            )  # fmt: skip
    by_key = {(r["model"], r["context"]): r for r in rows}
    for r in rows:
        r["equals_theory"] = r["measured_bytes"] == r["theory_bytes"]
        ref = by_key.get((r["reference"], r["context"]))
        r["vs_llama"] = r["measured_bytes"] / ref["measured_bytes"] if ref else None
        qkv = by_key.get(("QKV", r["context"]))
        r["vs_qkv"] = r["measured_bytes"] / qkv["measured_bytes"] if qkv else None
    return rows


def measure_decode(
    cands, context_lens, batch_sizes, new_tokens, reps, warmup, device, clock=time.perf_counter
) -> list[dict]:
    """Median prefill time, decode ms/step and tokens/s per (batch, context, model), interleaved repetitions."""
    rows = []
    for B in batch_sizes:
        for T in context_lens:
            ids = torch.randint(0, cands[0].config.vocab_size, (B, T), device=device)
            runs = interleaved(cands, reps, warmup, lambda c, ids=ids: prefill_and_decode(c.model, ids, new_tokens, clock),
                               f"decode B={B} T={T}")  # fmt: skip
            for c in cands:
                decode_s = median(runs[c.name], "decode_s")
                row = {
                    "model": c.name, "llama": c.is_llama, "batch": B, "context": T,
                    "prefill_ms": 1e3 * median(runs[c.name], "prefill_s"), "ms_per_step": 1e3 * decode_s / new_tokens,
                    "tokens_per_s": B * new_tokens / decode_s, "cache_bytes": runs[c.name][-1]["cache_bytes"],
                    "reference": c.reference, "weights_copied": c.weights_copied,
                }  # fmt: skip
                if device.type == "cuda":
                    row["peak_extra_bytes"] = max(r["peak_extra_bytes"] for r in runs[c.name])
                rows.append(row)
    by_key = {(r["model"], r["batch"], r["context"]): r for r in rows}
    for r in rows:
        ref = by_key.get((r["reference"], r["batch"], r["context"]))
        qkv = by_key.get(("QKV", r["batch"], r["context"]))
        r["tps_vs_llama"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
        r["prefill_vs_llama"] = r["prefill_ms"] / ref["prefill_ms"] if ref else None
        r["tps_vs_qkv"] = r["tokens_per_s"] / qkv["tokens_per_s"] if qkv else None
    return rows


def capacity(cache_rows: list[dict], budget_bytes: int, capacity_context: int) -> list[dict]:
    """Longest context (batch 1) and largest batch at ``capacity_context`` within the budget, per model.

    Bytes per token come from the largest measured context; the rows also say whether bytes/token was the same
    at every measured context (a cache that grows linearly, so the extrapolation holds).
    """
    rows = []
    for name in dict.fromkeys(r["model"] for r in cache_rows):
        mine = [r for r in cache_rows if r["model"] == name]
        per_token = [r["measured_bytes"] / r["context"] for r in mine]
        bpt = per_token[-1]
        rows.append(
            {"model": name, "llama": mine[0]["llama"], "bytes_per_token": bpt,
             "linear": max(per_token) - min(per_token) < 1e-9 * bpt, "longest_context": int(budget_bytes // bpt),
             "largest_batch": int(budget_bytes // (bpt * capacity_context))}
        )  # fmt: skip
    qkv = next((r for r in rows if r["model"] == "QKV"), None)
    for r in rows:
        r["vs_qkv"] = r["longest_context"] / qkv["longest_context"] if qkv else None
    return rows


def measure_train(
    base, cands, batch: int, seq_len: int, steps: int, reps: int, warmup: int, device, dtype, seed,
    clock=time.perf_counter,
):  # fmt: skip
    """Training tokens/s: fresh fp32 copies of every model, AdamW, autocast when ``dtype`` is not fp32."""
    from transformers import LlamaForCausalLM

    from qkvshare import QKVShareForCausalLM

    ids = torch.randint(0, base.vocab_size, (batch, seq_len), device=device)
    state = {}
    for c in cands:
        torch.manual_seed(seed)
        cls = LlamaForCausalLM if c.is_llama else QKVShareForCausalLM
        model = cls(c.config).to(device).train()
        state[c.name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1))
    autocast = dtype != torch.float32

    def step(c: Candidate) -> dict[str, float]:
        model, opt = state[c.name]
        _sync(device)
        t0 = clock()
        for _ in range(steps):
            with torch.autocast(device.type, dtype=dtype, enabled=autocast):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        _sync(device)
        return {"step_s": (clock() - t0) / steps, "loss": float(loss.detach())}

    runs = interleaved(cands, reps, warmup, step, "train")
    rows = []
    for c in cands:
        step_s = median(runs[c.name], "step_s")
        rows.append({"model": c.name, "llama": c.is_llama, "step_ms": 1e3 * step_s,
                     "tokens_per_s": batch * seq_len / step_s, "reference": c.reference})  # fmt: skip
    by_name = {r["model"]: r for r in rows}
    for r in rows:
        ref, qkv = by_name.get(r["reference"]), by_name.get("QKV")
        r["vs_llama"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
        r["vs_qkv"] = r["tokens_per_s"] / qkv["tokens_per_s"] if qkv else None
    return rows


# ----------------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------------
def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def tables(report: dict[str, Any]) -> dict[str, str]:
    """Markdown table per measured section."""
    out = {}
    if "cache" in report:
        rows = [[r["model"], r["context"], r["measured_bytes"], r["theory_bytes"],
                 "yes" if r["equals_theory"] else f"no ({r['measured_bytes'] / r['theory_bytes']:.4f}x)",
                 _ratio(r["vs_llama"]), _ratio(r["vs_qkv"])] for r in report["cache"]]  # fmt: skip
        out["cache"] = markdown_table(
            ["model", "context", "cache bytes held", "theory bytes", "== theory", "vs Llama DynamicCache", "vs QKV"],
            rows,
        )
    if "decode" in report:
        cuda = any("peak_extra_bytes" in r for r in report["decode"])
        headers = ["model", "batch", "context", "prefill ms", "prefill vs Llama", "decode ms/step", "tokens/s",
                   "tok/s vs Llama", "tok/s vs QKV"] + (["peak MiB above weights"] if cuda else [])  # fmt: skip
        rows = []
        for r in report["decode"]:
            line = [r["model"] + (" (Llama weights)" if r["weights_copied"] else ""), r["batch"], r["context"],
                    round(r["prefill_ms"], 2), _ratio(r["prefill_vs_llama"]), round(r["ms_per_step"], 3),
                    round(r["tokens_per_s"], 1), _ratio(r["tps_vs_llama"]), _ratio(r["tps_vs_qkv"])]  # fmt: skip
            if cuda:
                line.append(round(r["peak_extra_bytes"] / 2**20, 1))
            rows.append(line)
        out["decode"] = markdown_table(headers, rows)
    if "capacity" in report:
        cap = report["capacity_settings"]
        rows = [[r["model"], round(r["bytes_per_token"], 1), "yes" if r["linear"] else "no", r["longest_context"],
                 r["largest_batch"], _ratio(r["vs_qkv"])] for r in report["capacity"]]  # fmt: skip
        out["capacity"] = markdown_table(
            ["model", "measured bytes/token", "linear in context", f"longest context @ {cap['budget_mib']:g} MiB",
             f"largest batch @ {cap['context']} tok", "vs QKV"], rows,
        )  # fmt: skip
    if "train" in report:
        rows = [[r["model"], round(r["step_ms"], 2), round(r["tokens_per_s"], 1), _ratio(r["vs_llama"]),
                 _ratio(r["vs_qkv"])] for r in report["train"]]  # fmt: skip
        out["train"] = markdown_table(["model", "step ms", "train tokens/s", "vs Llama", "vs QKV"], rows)
    return out


def plots(report: dict[str, Any], output_dir: Path) -> list[Path]:
    """cache_memory.png and decode_tokens_per_s.png (one line per model, Llama references dashed)."""
    paths = []
    if "cache" in report:
        series: dict[str, tuple[list, list]] = {}
        for r in report["cache"]:
            xs, ys = series.setdefault(r["model"], ([], []))
            xs.append(r["context"])
            ys.append(r["measured_bytes"] / 2**20)
        dashed = [r["model"] for r in report["cache"] if r["llama"]]
        paths.append(line_plot(output_dir / "cache_memory.png", series, "context length (tokens)",
                               "KV cache held after prefill (MiB, batch 1)", "KV-cache memory", logx=True,
                               dashed=dashed))  # fmt: skip
    if "decode" in report:
        panels: dict[str, dict[str, tuple[list, list]]] = {}
        for r in report["decode"]:
            xs, ys = panels.setdefault(f"batch {r['batch']}", {}).setdefault(r["model"], ([], []))
            xs.append(r["context"])
            ys.append(r["tokens_per_s"])
        dashed = [r["model"] for r in report["decode"] if r["llama"]]
        paths.append(line_plot(output_dir / "decode_tokens_per_s.png", {}, "context length (tokens)",
                               "decode tokens/s", f"Decode throughput ({report['settings']['device']}, "
                               f"{report['settings']['dtype']})", logx=True, dashed=dashed, panels=panels))  # fmt: skip
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qkvshare bench", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=None, help=f"model shape ({known_presets()}); default small")
    p.add_argument("--model_dir", help="take the shape from a QKVShare or Llama model directory's config.json")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="config field overrides")
    p.add_argument("--variants", nargs="*", help="default: QKV, Q=K-V, Q-K=V, Q=K=V, GQA-g, MQA, Q-GQA-g, Q-MQA")
    p.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--context_lens", nargs="*", type=int, default=[128, 512, 1024])
    p.add_argument("--batch_sizes", nargs="*", type=int, default=[1, 4])
    p.add_argument("--new_tokens", type=int, default=16, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (interleaved across models)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before the timed ones")
    p.add_argument("--budget_mib", type=float, default=1024.0, help="KV-cache memory budget for the capacity table")
    p.add_argument("--capacity_context", type=int, default=None, help="context of 'largest batch' (default: longest)")
    p.add_argument("--train_batch_size", type=int, default=8)
    p.add_argument("--train_seq_len", type=int, default=128)
    p.add_argument("--train_steps", type=int, default=2, help="optimizer steps per timed repetition")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default fp32 on CPU, bf16 on CUDA")
    p.add_argument("--attn_implementation", default="sdpa", help="sdpa or eager (both models use the same)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--timer", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time (synchronised on CUDA). cpu: this process's CPU time, robust to other "
                   "processes competing for the cores of a shared machine; use it with --threads 1 (CPU only)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="outputs/bench")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `qkvshare bench`."""
    args = build_parser().parse_args(argv)
    try:
        base = base_config(args.preset or (None if args.model_dir else "small"), args.model_dir,
                           parse_overrides(args.override))  # fmt: skip
        longest = max(args.context_lens) + args.new_tokens
        if base.max_position_embeddings < longest:  # RoPE/none: only a config limit; learned: needs the rows
            base = with_fields(base, max_position_embeddings=longest)
        variants = check_variants(base, args.variants or default_variants(base, plus=False))
        if not variants:
            raise ValueError("--variants is empty; give at least one variant name (e.g. QKV Q-K=V).")
        for flag in ("context_lens", "batch_sizes"):
            if not getattr(args, flag) or min(getattr(args, flag)) <= 0:
                raise ValueError(f"--{flag} needs positive integers.")
        if min(args.new_tokens, args.repeats, args.train_batch_size, args.train_seq_len, args.train_steps) <= 0:
            raise ValueError("--new_tokens, --repeats and the --train_* sizes must be positive.")
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              ("cpu" if args.device == "auto" else args.device))  # fmt: skip
        if args.timer == "cpu" and device.type != "cpu":
            raise ValueError("--timer cpu measures host CPU time; on a GPU use the default --timer wall.")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device; use --device cpu.")
    except ValueError as err:
        print(f"qkvshare bench: {err}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = DTYPES[dtype_name]
    clock = time.process_time if args.timer == "cpu" else time.perf_counter
    element_size = torch.tensor([], dtype=dtype).element_size()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)

    cands = build_candidates(base, variants, device, dtype, args.attn_implementation, args.seed)
    report: dict[str, Any] = {
        "settings": {**{k: v for k, v in vars(args).items()}, "device": str(device), "dtype": dtype_name,
                     "variants": variants, "torch": torch.__version__, "threads": torch.get_num_threads(),
                     "max_position_embeddings": base.max_position_embeddings},
        "parity": {c.name: c.parity_max_abs_diff for c in cands if c.weights_copied},
    }  # fmt: skip
    if "cache" in args.sections or "capacity" in args.sections:
        report["cache"] = measure_cache(cands, sorted(args.context_lens), device, element_size)
    if "decode" in args.sections:
        report["decode"] = measure_decode(cands, sorted(args.context_lens), sorted(args.batch_sizes), args.new_tokens,
                                          args.repeats, args.warmup, device, clock)  # fmt: skip
    if "capacity" in args.sections:
        context = args.capacity_context or max(args.context_lens)
        report["capacity_settings"] = {"budget_mib": args.budget_mib, "context": context}
        report["capacity"] = capacity(report["cache"], int(args.budget_mib * 2**20), context)
    if "train" in args.sections:
        for c in cands:  # free inference copies' activations; training builds its own fp32 models
            c.model.zero_grad(set_to_none=True)
        report["train"] = measure_train(base, cands, args.train_batch_size, args.train_seq_len, args.train_steps,
                                        args.repeats, args.warmup, device, dtype, args.seed, clock)  # fmt: skip

    md = tables(report)
    shape = (f"{base.num_hidden_layers} layers, d={base.hidden_size}, {base.num_attention_heads} heads x "
             f"{base.head_dim}, vocab {base.vocab_size}")  # fmt: skip
    titles = {
        "cache": f"KV cache after prefill (batch 1, {dtype_name})",
        "decode": f"Decode ({args.new_tokens} greedy steps after a prefill; median of {args.repeats}, interleaved)",
        "capacity": "Capacity within a KV-cache budget (from measured bytes/token)",
        "train": f"Training step throughput (batch {args.train_batch_size} x {args.train_seq_len}, AdamW)",
    }
    timer = "process CPU time" if args.timer == "cpu" else "wall time"
    text = [f"## qkvshare bench: {shape}; {device}, {dtype_name}, {torch.get_num_threads()} threads, {timer}", ""]
    if report["parity"]:
        text += ["Logit parity after copying weights into Llama (max |diff|): "
                 + ", ".join(f"{k} {v:.2e}" for k, v in report["parity"].items()), ""]  # fmt: skip
    for key, table in md.items():
        text += [f"### {titles[key]}", "", table, ""]
    text_md = "\n".join(text)
    print(text_md)
    (output_dir / "bench.md").write_text(text_md + "\n")
    for key, table in md.items():
        (output_dir / f"{key}.md").write_text(table + "\n")
    report["plots"] = [str(p) for p in plots(report, output_dir)]
    (output_dir / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {output_dir / 'bench.md'}, bench.json, " + ", ".join(Path(p).name for p in report["plots"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
