"""`qkvshare bench`: measured cache bytes, decode speed, capacity and training throughput against Llama.

    qkvshare bench --preset small --output_dir outputs/bench       # every section, the default variants
    qkvshare bench --core                                           # the core benchmark (settings below)
    qkvshare bench --preset llama-300m --device cuda --dtype bf16   # the same on a GPU

What is measured (all in one process, models built once, repetitions interleaved across models so that drift in
machine load hits every model alike; medians reported, ratios taken between medians)
- cache: bytes actually held after a prefill of C tokens: `QKVShareCache.nbytes()` for every variant, and the
  bytes of transformers' `DynamicCache` for `LlamaForCausalLM` of the same shape (same heads and kv heads), next
  to the theory `config.kv_cache_bytes_per_token(element size) x C`, plus 8 bytes (int64) per token of cached
  positions where the config needs them (a "+" variant, a pre-RoPE tie);
- decode: a prefill (timed separately: the forward-time comparison) then N greedy decode steps through the cache,
  for every batch size and context length; ms per step and generated tokens/s (batch x N / decode time);
- capacity: from the measured bytes per token, the longest context (batch 1) and the largest batch (at a given
  context) whose KV cache fits a memory budget (the cache only; weights and activations are not counted);
- train: optimizer steps (forward, backward, AdamW) per second on random tokens, as tokens/s, with the
  parameter count and tokens per CPU-second of this process (what other load on a shared machine barely moves).

The Llama references: one `LlamaForCausalLM` per distinct kv-head count among the variants, configured by
`qkvshare.train.model.llama_twin_config`. Where the preset is Llama-style (RMSNorm, SwiGLU, RoPE), the weights of
the variant with no sharing (QKV, GQA-g, MQA) are copied into its Llama twin and the logits are checked equal, so
the "vs Llama" ratios of those rows compare identical computations (the "QKVShare `none` vs LlamaForCausalLM"
table). Tied variants are compared with the Llama of their kv-head count (what they would be untied).
`--kv_tie_points post_rope pre_rope` measures every tied variant at each tie point ("Q-K=V (pre_rope)").

`--core` is the core benchmark: the `small` shape, QKV, Q=K-V, Q-K=V (both tie points), Q=K=V, GQA-2, Q-GQA-2,
MQA, Q-MQA at batch 4 and contexts 128, 512, 1024; any flag given with it wins. Every run prints the summary
tables (`none` vs Llama; decode ms/token and cache bytes per variant) before the per-section ones.
`--timer cpu` (CPU only, with `--threads 1`) times with this process's CPU time instead of wall time, so that
other processes competing for the cores of a shared machine do not enter the ratios. On CUDA, timings synchronise
the device and the peak memory above the weights is reported; `--dtype bf16` runs decode in bf16 and training
under bf16 autocast. torch and transformers are imported after the command line is checked.
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
from typing import TYPE_CHECKING, Any

from qkvshare.analysis import bench_decode
from qkvshare.analysis.common import (
    PRESET_HELP,
    base_and_variants,
    check_nonempty,
    check_shape_source,
    markdown_table,
    parse_overrides,
    variant_config,
    with_fields,
)
from qkvshare.analysis.conventions import HelpFormatter, add_dtype_argument, report_bad_input, torch_dtype
from qkvshare.analysis.plotting import line_plot

if TYPE_CHECKING:
    import torch

SECTIONS = ("cache", "decode", "capacity", "train")
DEFAULT_PRESET = "small"  # the shape when neither --preset nor --model_dir is given
KV_TIE_POINTS = ("post_rope", "pre_rope")  # the values of QKVShareConfig.kv_tie_point
# `--core`: the settings of the core benchmark (formerly benchmarks/bench_core.py), under any flag given.
CORE_SETTINGS = dict(
    variants=["QKV", "Q=K-V", "Q-K=V", "Q=K=V", "GQA-2", "Q-GQA-2", "MQA", "Q-MQA"],
    kv_tie_points=["post_rope", "pre_rope"],
    context_lens=[128, 512, 1024],
    batch_sizes=[4],
    repeats=5,
    output_dir="outputs/bench-core",
)
# `--decode`: the decode table's settings (see `qkvshare.analysis.bench_decode`), under any flag given.
DECODE_SETTINGS = dict(
    context_lens=[1024, 4096, 16384],
    batch_sizes=[1, 8],
    new_tokens=8,
    repeats=3,
    max_repeats=6,
    warmup=0,
    output_dir="outputs/bench-decode",
)


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


@dataclass
class Setup:
    """Everything `main` resolved from the command line before any model is built."""

    base: Any  # QKVShareConfig: the shape every variant shares
    variants: list[tuple[str, Any]]  # (label, QKVShareConfig) per variant and tie point
    device: torch.device
    dtype_name: str  # canonical --dtype name actually used
    clock: Callable[[], float]
    output_dir: Path


# ----------------------------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------------------------
def is_llama_style(config) -> bool:
    """Whether a QKVShare config computes exactly what `LlamaForCausalLM` computes when nothing is shared."""
    return (
        config.norm_type == "rmsnorm"
        and config.mlp_type == "gated"
        and config.position_embedding_type == "rope"
        and config.attention_map_pe_dim == 0
        and config.is_causal
        and config.attention_kernel == "softmax"
    )


def llama_name(kv_heads: int, heads: int) -> str:
    return "Llama" if kv_heads == heads else ("Llama MQA" if kv_heads == 1 else f"Llama GQA-{kv_heads}")


def variant_configs(base, variants: list[str], tie_points: list[str]) -> list[tuple[str, Any]]:
    """(label, config) per variant; a variant with tied K=V layers and RoPE once per tie point in ``tie_points``.

    The label is the variant name, plus " (tie point)" unless only the config's default tie point is measured.
    """
    out = []
    for name in variants:
        cfg = variant_config(base, name)
        tied = any(cfg.is_kv_tied(i) for i in range(cfg.num_hidden_layers))
        if not tied or cfg.position_embedding_type != "rope":
            out.append((name, cfg))
            continue
        for point in tie_points:
            label = name if tie_points == [base.kv_tie_point] else f"{name} ({point})"
            out.append((label, with_fields(cfg, kv_tie_point=point)))
    return out


def build_candidates(setup: Setup, attn_implementation: str, seed: int) -> list[Candidate]:
    """The variants (random init, ``seed``) and one Llama reference per kv-head count, in eval mode."""
    import torch
    from transformers import LlamaForCausalLM

    from qkvshare import QKVShareForCausalLM
    from qkvshare.train.model import llama_twin_config

    device, dtype, base = setup.device, torch_dtype(setup.dtype_name), setup.base
    cands: list[Candidate] = []
    for name, cfg in setup.variants:
        cfg._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        model = QKVShareForCausalLM(cfg).to(device=device, dtype=dtype).eval()
        cands.append(Candidate(name, model, False, cfg.num_key_value_heads, cfg))
    for kv in sorted({c.kv_heads for c in cands}, reverse=True):
        lcfg = llama_twin_config(base, num_key_value_heads=kv, attn_implementation=attn_implementation)
        torch.manual_seed(seed)
        llama = LlamaForCausalLM(lcfg).to(device=device, dtype=dtype).eval()
        ref = Candidate(llama_name(kv, base.num_attention_heads), llama, True, kv, lcfg)
        twins = [
            c for c in cands if c.kv_heads == kv and c.config.projection_sharing == "none" and is_llama_style(c.config)
        ]
        if twins:  # same computation: copy the weights and check the logits agree
            twin = twins[0]
            twin.weights_copied = True
            twin.parity_max_abs_diff = copy_twin_weights(llama, twin.model, base.vocab_size, device)
        for c in cands:
            if c.kv_heads == kv:
                c.reference = ref.name
        cands.append(ref)
    return cands


def copy_twin_weights(llama, twin, vocab_size: int, device) -> float:
    """Load the weights of ``twin`` (QKVShare, nothing shared, Llama-style) into ``llama``; return the max |logit
    difference| of the two on 16 random tokens (0 up to float rounding: the same computation)."""
    import torch

    llama.load_state_dict(twin.state_dict(), strict=True)
    ids = torch.randint(0, vocab_size, (1, 16), device=device)
    with torch.inference_mode():
        return (llama(ids).logits.float() - twin(ids).logits.float()).abs().max().item()


def cache_nbytes(cache) -> int:
    """Bytes a cache holds: `QKVShareCache.nbytes()`, or the key and value tensors of a transformers cache."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def theory_bytes(c: Candidate, tokens: int, element_size: int) -> int:
    """Theoretical KV-cache bytes for ``tokens`` cached tokens (all sequences together), positions included."""
    if c.is_llama:
        cfg = c.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return 2 * cfg.num_hidden_layers * c.kv_heads * head_dim * element_size * tokens
    positions = 8 * tokens if c.config.needs_key_positions else 0  # int64 position of every cached token
    return c.config.kv_cache_bytes_per_token(element_size) * tokens + positions


# ----------------------------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_and_decode(
    model, input_ids: torch.Tensor, new_tokens: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Prefill ``input_ids`` (the model makes its default cache), then ``new_tokens`` greedy steps; times in s."""
    import torch

    device = input_ids.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
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
    """Run ``fn`` on every candidate ``warmup + reps`` times, rotating the order each round; keep the last reps.

    The one timing loop of the package: every timed comparison (prefill, decode, training) goes through it, so
    drift in machine load hits every model alike.
    """
    from tqdm.auto import tqdm

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
    import torch

    rows = []
    for T in context_lens:
        ids = torch.randint(0, cands[0].config.vocab_size, (1, T), device=device)
        for c in cands:
            measured = prefill_and_decode(c.model, ids, 0)["cache_bytes"]
            rows.append(
                {
                    "model": c.name,
                    "llama": c.is_llama,
                    "context": T,
                    "measured_bytes": measured,
                    "theory_bytes": theory_bytes(c, T, element_size),
                    "reference": c.reference,
                }
            )
    by_key = {(r["model"], r["context"]): r for r in rows}
    for r in rows:
        r["equals_theory"] = r["measured_bytes"] == r["theory_bytes"]
        ref = by_key.get((r["reference"], r["context"]))
        r["vs_llama"] = r["measured_bytes"] / ref["measured_bytes"] if ref else None
        qkv = by_key.get(("QKV", r["context"]))
        r["vs_qkv"] = r["measured_bytes"] / qkv["measured_bytes"] if qkv else None
    return rows


def measure_decode(
    cands, context_lens, batch_sizes, new_tokens, reps, warmup, device, element_size, clock=time.perf_counter
) -> list[dict]:
    """Median prefill time, decode ms/step and tokens/s per (batch, context, model), interleaved repetitions."""
    import torch

    rows = []
    for B in batch_sizes:
        for T in context_lens:
            ids = torch.randint(0, cands[0].config.vocab_size, (B, T), device=device)
            runs = interleaved(
                cands,
                reps,
                warmup,
                lambda c, ids=ids: prefill_and_decode(c.model, ids, new_tokens, clock),
                f"decode B={B} T={T}",
            )
            for c in cands:
                decode_s = median(runs[c.name], "decode_s")
                row = {
                    "model": c.name,
                    "llama": c.is_llama,
                    "batch": B,
                    "context": T,
                    "prefill_ms": 1e3 * median(runs[c.name], "prefill_s"),
                    "ms_per_step": 1e3 * decode_s / new_tokens,
                    "tokens_per_s": B * new_tokens / decode_s,
                    "cache_bytes": runs[c.name][-1]["cache_bytes"],
                    "theory_bytes": theory_bytes(c, B * T, element_size),
                    "reference": c.reference,
                    "weights_copied": c.weights_copied,
                }
                if device.type == "cuda":
                    row["peak_extra_bytes"] = max(r["peak_extra_bytes"] for r in runs[c.name])
                rows.append(row)
    by_key = {(r["model"], r["batch"], r["context"]): r for r in rows}
    for r in rows:
        ref = by_key.get((r["reference"], r["batch"], r["context"]))
        qkv = by_key.get(("QKV", r["batch"], r["context"]))
        r["tps_vs_llama"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
        r["prefill_vs_llama"] = r["prefill_ms"] / ref["prefill_ms"] if ref else None
        r["ms_per_step_vs_llama"] = r["ms_per_step"] / ref["ms_per_step"] if ref else None
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
            {
                "model": name,
                "llama": mine[0]["llama"],
                "bytes_per_token": bpt,
                "linear": max(per_token) - min(per_token) < 1e-9 * bpt,
                "longest_context": int(budget_bytes // bpt),
                "largest_batch": int(budget_bytes // (bpt * capacity_context)),
            }
        )
    qkv = next((r for r in rows if r["model"] == "QKV"), None)
    for r in rows:
        r["vs_qkv"] = r["longest_context"] / qkv["longest_context"] if qkv else None
    return rows


def measure_train(
    cands,
    batch: int,
    seq_len: int,
    steps: int,
    reps: int,
    warmup: int,
    device,
    dtype_name: str,
    seed: int,
    clock=time.perf_counter,
):
    """Training tokens/s: fresh fp32 copies of every model, AdamW, autocast when ``dtype_name`` is not float32.

    Each repetition times ``steps`` optimizer steps with ``clock`` and, always, with this process's CPU time.
    """
    import torch
    from transformers import LlamaForCausalLM

    from qkvshare import QKVShareForCausalLM
    from qkvshare.train.model import count_parameters

    dtype = torch_dtype(dtype_name)
    ids = torch.randint(0, cands[0].config.vocab_size, (batch, seq_len), device=device)
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
        t0, cpu0 = clock(), time.process_time()
        for _ in range(steps):
            with torch.autocast(device.type, dtype=dtype, enabled=autocast):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        _sync(device)
        return {"step_s": (clock() - t0) / steps, "cpu_s": (time.process_time() - cpu0) / steps}

    runs = interleaved(cands, reps, warmup, step, "train")
    rows = []
    for c in cands:
        step_s, cpu_s = median(runs[c.name], "step_s"), median(runs[c.name], "cpu_s")
        rows.append(
            {
                "model": c.name,
                "llama": c.is_llama,
                "parameters": count_parameters(state[c.name][0]),
                "step_ms": 1e3 * step_s,
                "tokens_per_s": batch * seq_len / step_s,
                "tokens_per_cpu_s": batch * seq_len / cpu_s if cpu_s > 0 else None,
                "reference": c.reference,
            }
        )
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


def llama_parity_table(decode_rows: list[dict]) -> str | None:
    """QKVShare with nothing shared against its `LlamaForCausalLM` twin (same weights): prefill and decode times."""
    by_key = {(r["model"], r["batch"], r["context"]): r for r in decode_rows}
    rows = []
    for r in decode_rows:
        ref = by_key.get((r["reference"], r["batch"], r["context"]))
        if not r["weights_copied"] or ref is None:
            continue
        where = f"batch {r['batch']}, context {r['context']}"
        rows.append(
            [f"{r['model']}: prefill, {where}", ref["prefill_ms"], r["prefill_ms"], _ratio(r["prefill_vs_llama"])]
        )
        rows.append(
            [
                f"{r['model']}: decode per token, {where}",
                ref["ms_per_step"],
                r["ms_per_step"],
                _ratio(r["ms_per_step_vs_llama"]),
            ]
        )
    if not rows:
        return None
    rows = [[m, round(a, 3), round(b, 3), ratio] for m, a, b, ratio in rows]
    return markdown_table(["measurement", "Llama (ms)", "QKVShare (ms)", "ratio"], rows)


def by_variant_table(decode_rows: list[dict]) -> str:
    """Per variant at the largest batch: decode ms/token and cache MiB at each context, cache vs QKV, == theory."""
    batch = max(r["batch"] for r in decode_rows)
    mine = [r for r in decode_rows if r["batch"] == batch and not r["llama"]]
    contexts = sorted({r["context"] for r in mine})
    by_key = {(r["model"], r["context"]): r for r in mine}
    qkv = by_key.get(("QKV", contexts[-1]))
    headers = ["variant"] + [f"ms/token @ {T}" for T in contexts] + [f"cache MiB @ {T}" for T in contexts]
    headers += ["cache vs QKV", "bytes == theory"]
    rows = []
    for name in dict.fromkeys(r["model"] for r in mine):
        cells = [by_key[(name, T)] for T in contexts]
        rows.append(
            [name]
            + [round(c["ms_per_step"], 3) for c in cells]
            + [round(c["cache_bytes"] / 2**20, 3) for c in cells]
            + [_ratio(cells[-1]["cache_bytes"] / qkv["cache_bytes"]) if qkv else "-"]
            + ["yes" if all(c["cache_bytes"] == c["theory_bytes"] for c in cells) else "no"]
        )
    return markdown_table(headers, rows)


def tables(report: dict[str, Any]) -> dict[str, str]:
    """Markdown table per measured section (and the summary views of the decode section)."""
    out = {}
    if "decode" in report:
        parity = llama_parity_table(report["decode"])
        if parity:
            out["parity"] = parity
        out["by_variant"] = by_variant_table(report["decode"])
    if "cache" in report:
        rows = [
            [
                r["model"],
                r["context"],
                r["measured_bytes"],
                r["theory_bytes"],
                "yes" if r["equals_theory"] else f"no ({r['measured_bytes'] / r['theory_bytes']:.4f}x)",
                _ratio(r["vs_llama"]),
                _ratio(r["vs_qkv"]),
            ]
            for r in report["cache"]
        ]
        out["cache"] = markdown_table(
            ["model", "context", "cache bytes held", "theory bytes", "== theory", "vs Llama DynamicCache", "vs QKV"],
            rows,
        )
    if "decode" in report:
        cuda = any("peak_extra_bytes" in r for r in report["decode"])
        headers = [
            "model",
            "batch",
            "context",
            "prefill ms",
            "prefill vs Llama",
            "decode ms/step",
            "tokens/s",
            "tok/s vs Llama",
            "tok/s vs QKV",
        ] + (["peak MiB above weights"] if cuda else [])
        rows = []
        for r in report["decode"]:
            line = [
                r["model"] + (" (Llama weights)" if r["weights_copied"] else ""),
                r["batch"],
                r["context"],
                round(r["prefill_ms"], 2),
                _ratio(r["prefill_vs_llama"]),
                round(r["ms_per_step"], 3),
                round(r["tokens_per_s"], 1),
                _ratio(r["tps_vs_llama"]),
                _ratio(r["tps_vs_qkv"]),
            ]
            if cuda:
                line.append(round(r["peak_extra_bytes"] / 2**20, 1))
            rows.append(line)
        out["decode"] = markdown_table(headers, rows)
    if "capacity" in report:
        cap = report["capacity_settings"]
        rows = [
            [
                r["model"],
                round(r["bytes_per_token"], 1),
                "yes" if r["linear"] else "no",
                r["longest_context"],
                r["largest_batch"],
                _ratio(r["vs_qkv"]),
            ]
            for r in report["capacity"]
        ]
        out["capacity"] = markdown_table(
            [
                "model",
                "measured bytes/token",
                "linear in context",
                f"longest context @ {cap['budget_mib']:g} MiB",
                f"largest batch @ {cap['context']} tok",
                "vs QKV",
            ],
            rows,
        )
    if "train" in report:
        rows = [
            [
                r["model"],
                r["parameters"],
                round(r["step_ms"], 2),
                round(r["tokens_per_s"], 1),
                _ratio(r["vs_llama"]),
                _ratio(r["vs_qkv"]),
                "-" if r["tokens_per_cpu_s"] is None else round(r["tokens_per_cpu_s"], 1),
            ]
            for r in report["train"]
        ]
        out["train"] = markdown_table(
            ["model", "parameters", "step ms", "train tokens/s", "vs Llama", "vs QKV", "tokens per CPU-second"], rows
        )
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
        paths.append(
            line_plot(
                output_dir / "cache_memory.png",
                series,
                "context length (tokens)",
                "KV cache held after prefill (MiB, batch 1)",
                "KV-cache memory",
                logx=True,
                dashed=dashed,
            )
        )
    if "decode" in report:
        panels: dict[str, dict[str, tuple[list, list]]] = {}
        for r in report["decode"]:
            xs, ys = panels.setdefault(f"batch {r['batch']}", {}).setdefault(r["model"], ([], []))
            xs.append(r["context"])
            ys.append(r["tokens_per_s"])
        dashed = [r["model"] for r in report["decode"] if r["llama"]]
        paths.append(
            line_plot(
                output_dir / "decode_tokens_per_s.png",
                {},
                "context length (tokens)",
                "decode tokens/s",
                f"Decode throughput ({report['settings']['device']}, {report['settings']['dtype']})",
                logx=True,
                dashed=dashed,
                panels=panels,
            )
        )
    return paths


# ----------------------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qkvshare bench", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--core", action="store_true", help="the core benchmark's settings (see above); flags given win")
    p.add_argument(
        "--decode",
        action="store_true",
        help="the decode table instead: ms/token and cache bytes per cache kind against Llama, and the peak RSS "
        "of a whole generate() (method: python -m pydoc qkvshare.analysis.bench_decode); flags given win over its "
        "settings (contexts 1024 4096 16384, batches 1 8, 8 new tokens, 3-6 rounds)",
    )
    p.add_argument("--preset", default=None, help=f"{PRESET_HELP}; default {DEFAULT_PRESET}")
    p.add_argument("--model_dir", help="take the shape from a QKVShare or Llama model directory's config.json")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="config field overrides")
    p.add_argument("--variants", nargs="*", help="default: QKV, Q=K-V, Q-K=V, Q=K=V, GQA-g, MQA, Q-GQA-g, Q-MQA")
    p.add_argument(
        "--kv_tie_points",
        nargs="+",
        choices=KV_TIE_POINTS,
        default=None,
        help="measure tied variants at each of these tie points (default: the config's, post_rope)",
    )
    p.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=SECTIONS, help="what to measure")
    p.add_argument("--context_lens", nargs="*", type=int, default=[128, 512, 1024], help="prefill lengths")
    p.add_argument("--batch_sizes", nargs="*", type=int, default=[1, 4], help="decode batch sizes")
    p.add_argument("--new_tokens", type=int, default=16, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (interleaved across models)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before the timed ones")
    p.add_argument(
        "--decode_models",
        nargs="+",
        default=list(bench_decode.DEFAULT_MODELS),
        help="--decode rows: Llama (the shape's LlamaForCausalLM), none and Q-K=V (at the shape's kv heads), or "
        "paper variant names",
    )
    p.add_argument(
        "--decode_caches",
        nargs="+",
        choices=tuple(bench_decode.CACHE_KINDS),
        default=list(bench_decode.CACHE_KINDS),
        help="--decode cache kinds (untied models get the unquantized ones)",
    )
    p.add_argument(
        "--max_repeats", type=int, default=None, help="--decode: rounds added up to this while a spread is above 5%%"
    )
    p.add_argument(
        "--rss_context", type=int, default=16384, help="--decode: prompt length of the peak-RSS runs (0: none)"
    )
    p.add_argument("--rss_models", nargs="+", default=["Llama", "Q-K=V"], help="--decode: models of the RSS runs")
    p.add_argument(
        "--decode_plot",
        default=None,
        metavar="PNG",
        help="--decode: the figure (decode time and cache memory against context length); default decode.png in "
        "--output_dir",
    )
    p.add_argument("--rss_timeout", type=float, default=1800.0, help="--decode: seconds allowed per RSS process")
    p.add_argument("--budget_mib", type=float, default=1024.0, help="KV-cache memory budget for the capacity table")
    p.add_argument("--capacity_context", type=int, default=None, help="context of 'largest batch' (default: longest)")
    p.add_argument("--train_batch_size", type=int, default=8, help="sequences per training step")
    p.add_argument("--train_seq_len", type=int, default=128, help="tokens per training sequence")
    p.add_argument("--train_steps", type=int, default=2, help="optimizer steps per timed repetition")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add_dtype_argument(p, "auto", "decode dtype and training autocast; auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--attn_implementation", default="sdpa", help="sdpa or eager (both models use the same)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--timer",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time (synchronised on CUDA). cpu: this process's CPU time, robust to other "
        "processes competing for the cores of a shared machine; use it with --threads 1 (CPU only)",
    )
    p.add_argument("--seed", type=int, default=0, help="initialisation and input seed")
    p.add_argument("--output_dir", default="outputs/bench", help="bench.md, bench.json, one .md per table, PNGs")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; with `--core`, the core benchmark's settings replace the defaults (given flags win).

    Every option that can be checked without the config or torch is checked here (light: see `qkvshare_cli`); a
    `ValueError` names the bad option. `resolve_setup` checks the rest (override keys, variants, device).
    """
    parser = build_parser()
    given = sys.argv[1:] if argv is None else argv
    if "--core" in given:
        parser.set_defaults(**CORE_SETTINGS)
    if "--decode" in given:
        parser.set_defaults(**DECODE_SETTINGS)
    args = parser.parse_args(argv)
    if args.core and args.decode:
        raise ValueError("--core and --decode are two different benchmarks; give one of them.")
    if (args.max_repeats is not None and args.max_repeats < 1) or args.rss_context < 0 or args.rss_timeout <= 0:
        raise ValueError("--max_repeats must be >= 1, --rss_context >= 0 (0: no RSS runs) and --rss_timeout > 0.")
    check_nonempty(args, ("variants", "sections"))
    for flag in ("context_lens", "batch_sizes"):
        if not getattr(args, flag) or min(getattr(args, flag)) <= 0:
            raise ValueError(f"--{flag} needs positive integers.")
    if min(args.new_tokens, args.repeats, args.train_batch_size, args.train_seq_len, args.train_steps) <= 0:
        raise ValueError("--new_tokens, --repeats and the --train_* sizes must be positive.")
    if args.warmup < 0 or (args.threads is not None and args.threads < 1) or args.budget_mib <= 0:
        raise ValueError("--warmup must be >= 0, --threads >= 1 and --budget_mib > 0.")
    if args.capacity_context is not None and args.capacity_context < 1:
        raise ValueError(f"--capacity_context {args.capacity_context}: must be a positive token count.")
    if args.attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"--attn_implementation {args.attn_implementation!r}: allowed: sdpa, eager.")
    check_shape_source(shape_preset(args), args.model_dir)
    parse_overrides(args.override, check_keys=False)
    return args


def shape_preset(args: argparse.Namespace) -> str | None:
    """The preset giving the shape: --preset, else the default one unless --model_dir gives it."""
    return args.preset or (None if args.model_dir else DEFAULT_PRESET)


def resolve_setup(args: argparse.Namespace) -> Setup:
    """Build the configs and check what `parse_args` could not; a `ValueError` naming the option, before any model."""
    base, variants = base_and_variants(shape_preset(args), args.model_dir, args.override, args.variants, plus=False)
    longest = max(args.context_lens + [args.train_seq_len]) + args.new_tokens
    if base.max_position_embeddings < longest:  # RoPE/none: only a config limit; learned: needs the rows
        base = with_fields(base, max_position_embeddings=longest)
    if args.decode:
        longest = max(longest, args.rss_context + args.new_tokens)
        if base.max_position_embeddings < longest:
            base = with_fields(base, max_position_embeddings=longest)
        for name in args.decode_models:  # a ValueError naming a bad row before any model is built
            if name != "Llama":
                try:
                    variant_config(base, name)
                except ValueError as err:
                    raise ValueError(f"--decode_models {name!r}: {err}") from None
    tie_points = list(dict.fromkeys(args.kv_tie_points or [base.kv_tie_point]))

    import torch

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError as err:
            raise ValueError(
                f"--device {args.device!r} is not a device ({err}); use auto, cpu, cuda or cuda:N."
            ) from err
    if args.timer == "cpu" and device.type != "cpu":
        raise ValueError("--timer cpu measures host CPU time; on a GPU use the default --timer wall.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device; use --device cpu.")
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    output_dir = Path(args.output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create --output_dir {args.output_dir!r} ({err}).") from None
    return Setup(
        base=base,
        variants=variant_configs(base, variants, tie_points),
        device=device,
        dtype_name=dtype_name,
        clock=time.process_time if args.timer == "cpu" else time.perf_counter,
        output_dir=output_dir,
    )


def measure(args: argparse.Namespace, setup: Setup, cands: list[Candidate]) -> dict[str, Any]:
    """Run the requested sections; the JSON-serialisable report."""
    import torch

    element_size = torch.tensor([], dtype=torch_dtype(setup.dtype_name)).element_size()
    base = setup.base
    report: dict[str, Any] = {
        "settings": {
            **vars(args),
            "device": str(setup.device),
            "dtype": setup.dtype_name,
            "variants": [label for label, _ in setup.variants],
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "max_position_embeddings": base.max_position_embeddings,
        },
        "parity": {c.name: c.parity_max_abs_diff for c in cands if c.weights_copied},
    }
    contexts = sorted(args.context_lens)
    if "cache" in args.sections or "capacity" in args.sections:
        report["cache"] = measure_cache(cands, contexts, setup.device, element_size)
    if "decode" in args.sections:
        report["decode"] = measure_decode(
            cands,
            contexts,
            sorted(args.batch_sizes),
            args.new_tokens,
            args.repeats,
            args.warmup,
            setup.device,
            element_size,
            setup.clock,
        )
    if "capacity" in args.sections:
        context = args.capacity_context or max(contexts)
        report["capacity_settings"] = {"budget_mib": args.budget_mib, "context": context}
        report["capacity"] = capacity(report["cache"], int(args.budget_mib * 2**20), context)
    if "train" in args.sections:
        for c in cands:  # free inference copies' activations; training builds its own fp32 models
            c.model.zero_grad(set_to_none=True)
        report["train"] = measure_train(
            cands,
            args.train_batch_size,
            args.train_seq_len,
            args.train_steps,
            args.repeats,
            args.warmup,
            setup.device,
            setup.dtype_name,
            args.seed,
            setup.clock,
        )
    return report


def write_report(args: argparse.Namespace, setup: Setup, report: dict[str, Any]) -> str:
    """Print and write bench.md, one .md per table, bench.json and the plots; return the markdown."""
    import torch

    md = tables(report)
    base = setup.base
    shape = (
        f"{base.num_hidden_layers} layers, d={base.hidden_size}, {base.num_attention_heads} heads x "
        f"{base.head_dim}, vocab {base.vocab_size}"
    )
    batch = max(args.batch_sizes)
    titles = {
        "parity": "QKVShare `none` vs LlamaForCausalLM of the same shape and weights",
        "by_variant": f"Decode time per token and cache bytes by variant (batch {batch})",
        "cache": f"KV cache after prefill (batch 1, {setup.dtype_name})",
        "decode": f"Decode ({args.new_tokens} greedy steps after a prefill; median of {args.repeats}, interleaved)",
        "capacity": "Capacity within a KV-cache budget (from measured bytes/token)",
        "train": f"Training step throughput (batch {args.train_batch_size} x {args.train_seq_len}, AdamW)",
    }
    timer = "process CPU time" if args.timer == "cpu" else "wall time"
    device, dtype = setup.device, setup.dtype_name
    text = [f"## qkvshare bench: {shape}; {device}, {dtype}, {torch.get_num_threads()} threads, {timer}", ""]
    if report["parity"]:
        text += [
            "Logit parity after copying weights into Llama (max |diff|): "
            + ", ".join(f"{k} {v:.2e}" for k, v in report["parity"].items()),
            "",
        ]
    for key, table in md.items():
        text += [f"### {titles[key]}", "", table, ""]
    if any(c.needs_key_positions for _, c in setup.variants):
        text += [
            '(Caches of pre_rope and "+" variants also hold int64 positions: 8 bytes per token per '
            "sequence, counted in their bytes and in theory.)",
            "",
        ]
    text_md = "\n".join(text)
    print(text_md)
    out = setup.output_dir
    (out / "bench.md").write_text(text_md + "\n")
    for key, table in md.items():
        (out / f"{key}.md").write_text(table + "\n")
    report["plots"] = [str(p) for p in plots(report, out)]
    (out / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {out.resolve() / 'bench.md'}, bench.json, " + ", ".join(Path(p).name for p in report["plots"]))
    return text_md


def main(argv: list[str] | None = None) -> int:
    """Entry point of `qkvshare bench`: parse, check, build the models, measure, write."""
    try:
        args = parse_args(argv)
        setup = resolve_setup(args)
    except ValueError as err:
        return report_bad_input("bench", err)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.decode:
        bench_decode.run(args, setup)
        return 0
    cands = build_candidates(setup, args.attn_implementation, args.seed)
    report = measure(args, setup, cands)
    write_report(args, setup, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
