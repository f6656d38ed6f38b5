"""`qkvshare bench`: measured cache bytes, decode speed, capacity and training throughput against Llama.

What is measured and how (`qkvshare bench --help`) is written with the command's arguments in `qkvshare_settings.bench`;
`--decode` is `qkvshare.analysis.bench_decode`. This module builds the models, measures the sections and writes the
report and the plots.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import LlamaForCausalLM

from qkvshare import QKVShareForCausalLM
from qkvshare.analysis import bench_decode
from qkvshare.analysis.common import (
    base_and_variants,
    markdown_table,
    variant_config,
    with_fields,
)
from qkvshare.analysis.measure import copy_twin_weights, held_nbytes, synchronize
from qkvshare.analysis.plotting import line_plot
from qkvshare.configuration_qkvshare import kv_cache_bytes_per_token, llama_differences, llama_twin_config
from qkvshare.runtime import torch_dtype
from qkvshare.train.model import count_parameters
from qkvshare_settings.bench import shape_preset


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
            c
            for c in cands
            if c.kv_heads == kv and c.config.projection_sharing == "none" and not llama_differences(c.config)
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


def theory_bytes(c: Candidate, tokens: int, element_size: int) -> int:
    """Theoretical KV-cache bytes for ``tokens`` cached tokens (all sequences together), positions included."""
    return kv_cache_bytes_per_token(c.config, element_size, positions=True) * tokens


# ----------------------------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------------------------
def prefill_and_decode(
    model, input_ids: torch.Tensor, new_tokens: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Prefill ``input_ids`` (the model makes its default cache), then ``new_tokens`` greedy steps; times in s."""
    device = input_ids.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        synchronize(device)
        t0 = clock()
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        synchronize(device)
        t1 = clock()
        cache = out.cache
        nbytes = held_nbytes(cache)
        for _ in range(new_tokens):
            out = model(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        synchronize(device)
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
        synchronize(device)
        t0, cpu0 = clock(), time.process_time()
        for _ in range(steps):
            with torch.autocast(device.type, dtype=dtype, enabled=autocast):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        synchronize(device)
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


def run_bench(args: argparse.Namespace) -> None:
    """`qkvshare bench`: check the settings (a `ValueError` before any model is built), build the models, measure,
    print and write the report."""
    setup = resolve_setup(args)

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.decode:
        bench_decode.run(args, setup)
        return
    cands = build_candidates(setup, args.attn_implementation, args.seed)
    report = measure(args, setup, cands)
    write_report(args, setup, report)
