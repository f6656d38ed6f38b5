"""`qkvshare bench --decode`: decode speed and cache memory per cache kind, against `LlamaForCausalLM`.

    qkvshare bench --decode --model_dir configs/smollm2-135m     # the SmolLM2-135M shape (random weights)
    qkvshare bench --decode --preset small --context_lens 1024 4096

Method (printed above the table)
- Models: the shape's `LlamaForCausalLM`, QKVShare `none` (the same computation: Llama's weights are copied in
  and the logits checked equal), `Q-K=V` (K=V tied at the shape's key/value heads: for SmolLM2's 3 kv heads that
  is the paper's Q-GQA-3) and `Q-GQA-1` (K=V tied, one key/value head). Random weights, one process. A row name is
  a paper variant or a `projection_sharing` value, made from the shape as every command makes it
  (`analysis.common.variant_config`), so a name means the same model here as in `qkvshare bench`.
- Cache kinds, each built the way `generate()` builds it (`model._prepare_cache_for_generation`), so a model
  that picks its own cache for a `cache_implementation` is measured with that cache: dynamic (no
  `cache_implementation`), static, static + `torch.compile(fullgraph=True)` of the decode step, quantized
  (`cache_implementation="quantized"`: int4 with `cache_config={"backend": "quanto", "nbits": 4}`, int8 with
  `{"backend": "hqq", "nbits": 8}`, as transformers' quanto backend takes 2 and 4 bits only; int8 needs the `hqq`
  package, and its cells are n/a without it).
- A decode step at context C does not need a C-token prefill: the cache is filled to C tokens directly, as the
  attention layers fill it (one random (B, H_kv, C, D) tensor per layer, through `attend` for the QKVShare caches,
  which keep one tensor for tied layers and record positions when they track them, and `update` for transformers'
  caches), so it has its real layout and size. Then one untimed
  step (it compiles, for the compiled kind), then N timed greedy steps (model forward on one new token per
  sequence, with the cache). ms per token = decode time / N (a step produces B tokens: one per sequence).
- Interleaved: in every round each (model, cache kind) cell is built, filled and timed once, in a rotated order,
  and freed before the next (so only one cache is alive at a time). Median over rounds; spread = (max - min) /
  median of the rounds. Rounds are added (up to `--max_repeats`) while a cell's spread is above 5%.
- Cache bytes: `nbytes()` of a QKVShare cache, otherwise every tensor a transformers cache holds (quantized
  tensors: their packed data, scales and shifts), right after the fill; theory: tied layers one tensor, untied two,
  of (B, H_kv, slots, D) elements (slots: C, or the preallocated length of a static cache); quantized: nbits/8
  bytes per element plus a scale and a shift per group of `q_group_size` elements.
- A cell that cannot run (a cache kind the backend refuses, a compile that breaks, not enough free memory) prints
  "n/a (reason)"; the others still run.
- Peak RSS (`--rss_context`): a separate process per model runs a whole `generate()` (a real prefill of the
  context, batch 1, then `--new_tokens` tokens) and reports its peak resident memory (VmHWM). For each model other
  than Llama: its peak RSS below Llama's, the difference of their caches in theory, and the first as a fraction of
  the second.
- Reported: measurements and ratios only (ms per token and its ratio to Llama with the same cache kind, bytes
  against theory, RSS); what counts as good enough is for the docs to say.
- Figure (`--decode_plot`, default decode.png next to decode.md): decode ms per token and cache MiB against context
  length (log x), one line per model, from the table's cells of the first `--decode_caches` kind at the smallest
  batch (the numbers are in decode.json under "figure").
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LlamaForCausalLM
from transformers.generation.utils import GenerationMode

from qkvshare import QKVShareConfig, QKVShareForCausalLM
from qkvshare.analysis.common import markdown_table, model_fields, variant_config
from qkvshare.analysis.measure import copy_twin_weights, held_nbytes, synchronize
from qkvshare.analysis.plotting import line_plot
from qkvshare.cache_qkvshare import QKVShareCacheMixin, Rotation
from qkvshare.configuration_qkvshare import (
    POSITION_BYTES_PER_TOKEN,
    kv_cache_bytes_per_layer,
    kv_cache_bytes_per_token,
    llama_twin_config,
)
from qkvshare.runtime import available_bytes, torch_dtype
from qkvshare_settings.bench import CACHE_KINDS

UNTIED_KINDS = ("dynamic", "static", "static+compile")
MAX_SPREAD = 0.05  # rounds are added while a cell's spread is above this
Q_GROUP_SIZE = 64  # transformers' QuantizedCache default `q_group_size`


@dataclass
class DecodeModel:
    """One row group of the table: a model and the cache kinds it is measured with."""

    name: str
    model: Any  # LlamaForCausalLM or QKVShareForCausalLM, eval mode
    config: Any  # its LlamaConfig or QKVShareConfig
    kinds: list[str]
    kv_heads: int
    head_dim: int
    tied_layers: list[bool]  # per decoder layer: stores one tensor (QKVShare K=V tied)
    compiled: Any = None  # torch.compile(model, fullgraph=True), made on first use
    parity_max_abs_diff: float | None = None  # QKVShare `none` against Llama with the same weights


@dataclass
class Cell:
    """Measurements of one (model, cache kind) at one (batch, context)."""

    model: str
    kind: str
    batch: int
    context: int
    ms_per_token: list[float] = field(default_factory=list)  # one per timed round
    cache_bytes: int | None = None
    theory_bytes: int | None = None
    slots: int | None = None  # token slots per sequence the cache holds after the fill
    error: str | None = None  # why the cell is n/a


# ----------------------------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------------------------
def build_models(base, names: list[str], kinds: list[str], device, dtype, seed: int) -> list[DecodeModel]:
    """The Llama of the shape and the QKVShare rows (random init, ``seed``); `none` gets Llama's weights."""
    rows: list[DecodeModel] = []
    llama = None
    for name in names:
        torch.manual_seed(seed)
        if name == "Llama":
            cfg = llama_twin_config(base, attn_implementation="sdpa")
            llama = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
            tied = [False] * cfg.num_hidden_layers
            rows.append(DecodeModel(name, llama, cfg, kinds, cfg.num_key_value_heads, cfg.head_dim, tied))
            continue
        cfg = variant_config(base, name)
        cfg._attn_implementation = "sdpa"
        model = QKVShareForCausalLM(cfg).to(device=device, dtype=dtype).eval()
        tied = [cfg.is_kv_tied(i) for i in range(cfg.num_hidden_layers)]
        mine = kinds if any(tied) else [k for k in kinds if k in UNTIED_KINDS]
        rows.append(DecodeModel(name, model, cfg, mine, cfg.num_key_value_heads, cfg.head_dim, tied))
    for row in rows:
        if llama is not None and row.name == "none":
            row.parity_max_abs_diff = copy_twin_weights(llama, row.model, base.vocab_size, device)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# caches
# ----------------------------------------------------------------------------------------------------------------
def build_cache(model, kind: str, batch: int, slots: int):
    """The cache `generate()` would build for this kind (``slots`` = prompt + new tokens, for static caches)."""
    implementation, cache_config, _ = CACHE_KINDS[kind]
    gen = GenerationConfig(
        cache_implementation=implementation,
        cache_config=dict(cache_config) if cache_config else None,
        num_beams=1,
        num_return_sequences=1,
    )
    # generate() keeps static caches at least as long as the longest one it made before (to avoid recompiling):
    # each cell here must be sized for its own context.
    vars(model).pop("_previous_max_cache_length", None)
    kwargs: dict[str, Any] = {}
    model._prepare_cache_for_generation(gen, kwargs, GenerationMode.GREEDY_SEARCH, batch, slots)
    return kwargs["cache"]


def fill_cache(row: DecodeModel, cache, batch: int, context: int, device, dtype) -> None:
    """Write ``context`` random tokens per sequence into every layer as the model's attention layers do: a QKVShare
    cache through `attend` (it decides what each layer keeps, and records the positions when it tracks them), a
    transformers cache through `update`.
    """
    ours = isinstance(cache, QKVShareCacheMixin)
    with torch.inference_mode():
        if ours:
            cache.update_positions(torch.arange(context, device=device).expand(batch, -1))
        for i in range(len(row.tied_layers)):
            states = torch.randn(batch, row.kv_heads, context, row.head_dim, device=device, dtype=dtype)
            if ours:
                cache.attend(i, states, states, Rotation(new=None))  # random states: no RoPE to apply
            else:
                cache.update(states, states, i)  # the cache copies them into its own key and value storage
            del states
    held = int(cache.get_seq_length())
    if held != context:
        raise RuntimeError(f"the filled cache holds {held} tokens, expected {context}")


def theory_nbytes(row: DecodeModel, kind: str, batch: int, slots: int, element_size: int, positions: bool) -> int:
    """What the cache should hold: per layer one (tied) or two (B, H_kv, slots, D) tensors; quantized: nbits/8
    bytes per element plus a scale and a shift (``element_size`` each) per `Q_GROUP_SIZE` elements; plus int64
    positions (B, slots) when the model needs them."""
    _, cache_config, _ = CACHE_KINDS[kind]
    if cache_config is None:
        return kv_cache_bytes_per_token(row.config, element_size, positions) * batch * slots
    tensors = sum(kv_cache_bytes_per_layer(row.config, 1)) // (row.kv_heads * row.head_dim)
    elements = batch * row.kv_heads * slots * row.head_dim
    per_tensor = elements * cache_config["nbits"] // 8 + 2 * (elements // Q_GROUP_SIZE) * element_size
    return tensors * per_tensor + (POSITION_BYTES_PER_TOKEN * batch * slots if positions else 0)


# ----------------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------------
def forward_fn(row: DecodeModel, kind: str):
    """The callable of a decode step: the model, or its `torch.compile(fullgraph=True)` form for compiled kinds."""
    if not CACHE_KINDS[kind][2]:
        return row.model
    if row.compiled is None:  # dynamic shapes: one compile per model serves every batch and cache length
        row.compiled = torch.compile(row.model, fullgraph=True, dynamic=True)
    return row.compiled


def run_cell(row: DecodeModel, cell: Cell, new_tokens: int, device, dtype, element_size: int, clock) -> None:
    """Build and fill the cache, one untimed step, then ``new_tokens`` timed steps; append ms/token to ``cell``."""
    slots = cell.context + 1 + new_tokens  # the fill, the untimed step, the timed ones
    cache = build_cache(row.model, cell.kind, cell.batch, slots)
    try:
        fill_cache(row, cache, cell.batch, cell.context, device, dtype)
        if cell.cache_bytes is None:
            static = CACHE_KINDS[cell.kind][0] == "static"
            cell.slots = slots if static else cell.context
            cell.cache_bytes = held_nbytes(cache)
            positions = bool(getattr(row.config, "needs_key_positions", False))
            cell.theory_bytes = theory_nbytes(row, cell.kind, cell.batch, cell.slots, element_size, positions)
        step = forward_fn(row, cell.kind)
        with torch.inference_mode():  # inputs made inside: a compiled step would recompile for inference tensors
            token = torch.randint(0, row.config.vocab_size, (cell.batch, 1), device=device)
            positions = torch.full((cell.batch, 1), cell.context, device=device, dtype=torch.long)
            for i in range(1 + new_tokens):  # the first step is untimed (it compiles, for compiled kinds)
                if i == 1:
                    synchronize(device)
                    t0 = clock()
                logits = step(input_ids=token, position_ids=positions, cache=cache, use_cache=True).logits
                token, positions = logits[:, -1:].argmax(-1), positions + 1
            synchronize(device)
            elapsed = clock() - t0
        cell.ms_per_token.append(1e3 * elapsed / new_tokens)
    finally:
        del cache
        gc.collect()


def spread(values: list[float]) -> float:
    """(max - min) / median of the rounds; 0 for a single round."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def short_reason(err: BaseException) -> str:
    """The first line of an error, shortened for a table cell."""
    text = f"{type(err).__name__}: {err}".strip().splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


def measure_decode_table(
    rows: list[DecodeModel],
    contexts: list[int],
    batches: list[int],
    new_tokens: int,
    repeats: int,
    max_repeats: int,
    device,
    dtype,
    clock=time.perf_counter,
    log=print,
) -> list[Cell]:
    """Every (model, cache kind) cell at every (batch, context), interleaved rounds (see the module docstring)."""
    element_size = torch.tensor([], dtype=dtype).element_size()
    cells: list[Cell] = []
    broken: dict[tuple[str, str], str] = {}  # a compile or backend that failed once fails for every shape
    for B in batches:
        for T in contexts:
            group = [(row, Cell(row.name, kind, B, T)) for row in rows for kind in row.kinds]
            cells += [c for _, c in group]
            rounds = 0
            while True:
                shift = rounds % len(group)
                for row, cell in group[shift:] + group[:shift]:
                    if cell.error is not None:
                        continue
                    if (row.name, cell.kind) in broken:
                        cell.error = broken[(row.name, cell.kind)]
                        continue
                    need = 2 * theory_nbytes(row, "dynamic", B, T + 1 + new_tokens, element_size, False)
                    free = available_bytes()
                    if free is not None and need > 0.9 * free:
                        cell.error = f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"
                        continue
                    try:
                        run_cell(row, cell, new_tokens, device, dtype, element_size, clock)
                    except Exception as err:  # one cell failing must not stop the table
                        cell.error = short_reason(err)
                        if cell.kind != "dynamic" and not isinstance(err, RuntimeError | MemoryError):
                            broken[(row.name, cell.kind)] = cell.error
                rounds += 1
                live = [c for _, c in group if c.error is None]
                if rounds >= max_repeats or (
                    rounds >= repeats and all(spread(c.ms_per_token) <= MAX_SPREAD for c in live)
                ):
                    break
            log(f"decode B={B} T={T}: {rounds} rounds\n" + decode_table(summarize([c for _, c in group], rows)))
    return cells


# ----------------------------------------------------------------------------------------------------------------
# peak RSS of a whole generate()
# ----------------------------------------------------------------------------------------------------------------
def rss_child(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: build one model, run `generate()` on a ``context``-token prompt (batch 1), and return
    the peak resident memory (VmHWM) before and after, the weights' bytes and the time taken."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    base = QKVShareConfig(**spec["base"])
    torch.manual_seed(0)
    if spec["model"] == "Llama":
        model = LlamaForCausalLM(llama_twin_config(base, attn_implementation="sdpa"))
    else:
        cfg = variant_config(base, spec["model"])
        cfg._attn_implementation = "sdpa"
        model = QKVShareForCausalLM(cfg)
    model = model.eval()
    ids = torch.randint(0, base.vocab_size, (1, spec["context"]))
    before = vm_hwm()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=spec["new_tokens"], min_new_tokens=spec["new_tokens"], do_sample=False, pad_token_id=0
        )
    seconds = time.perf_counter() - t0
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "model": spec["model"],
        "context": spec["context"],
        "generated": out.shape[1] - spec["context"],
        "peak_rss": vm_hwm(),
        "rss_before_generate": before,
        "weights_bytes": weights,
        "seconds": seconds,
    }


def vm_hwm() -> int:
    """This process's peak resident memory in bytes (VmHWM of /proc/self/status; getrusage where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure_rss(base, names: list[str], context: int, new_tokens: int, threads: int | None, timeout: float, log=print):
    """One subprocess per model (`rss_child`); a failed or timed-out one gives a row with its error."""
    fields = {k: getattr(base, k) for k in model_fields()}
    fields["max_position_embeddings"] = max(base.max_position_embeddings, context + new_tokens)
    rows = []
    for name in names:
        spec = {"base": fields, "model": name, "context": context, "new_tokens": new_tokens, "threads": threads}
        code = "import json,sys; from qkvshare.analysis.bench_decode import rss_child; "
        code += "print('RSS-RESULT ' + json.dumps(rss_child(json.loads(sys.argv[1]))))"
        # A fixed mmap threshold: glibc otherwise raises it after large frees and serves later tensors from a heap it
        # does not give back, so the peak would measure fragmentation (4k probe on `small`: none 167 MiB against
        # Llama's 92 for the same computation; with the threshold fixed, 87 and 87, and Q-K=V 71).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        t0 = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, timeout=timeout, env=env
            )
        except subprocess.TimeoutExpired:
            rows.append({"model": name, "context": context, "error": f"timed out after {timeout:g} s"})
            continue
        found = [line for line in done.stdout.splitlines() if line.startswith("RSS-RESULT ")]
        if done.returncode != 0 or not found:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"model": name, "context": context, "error": f"exit {done.returncode}: {tail[:160]}"})
            continue
        rows.append(json.loads(found[-1][len("RSS-RESULT ") :]))
        log(f"peak RSS {name} @ {context}: {rows[-1]['peak_rss'] / 2**20:.0f} MiB ({time.perf_counter() - t0:.0f} s)")
    return rows


# ----------------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------------
def summarize(cells: list[Cell], rows: list[DecodeModel]) -> list[dict[str, Any]]:
    """One dict per cell: median ms/token, spread, ratio to Llama with the same cache kind, bytes against theory."""
    kv = {r.name: r.kv_heads for r in rows}
    by_key = {(c.model, c.kind, c.batch, c.context): c for c in cells}
    out = []
    for c in cells:
        ok = c.error is None
        ms = statistics.median(c.ms_per_token) if ok else None
        ref = by_key.get(("Llama", c.kind, c.batch, c.context))
        ref_ms = statistics.median(ref.ms_per_token) if ref is not None and ref.error is None else None
        out.append(
            {
                "model": c.model,
                "kv_heads": kv.get(c.model),
                "cache": c.kind,
                "batch": c.batch,
                "context": c.context,
                "ms_per_token": ms,
                "spread": spread(c.ms_per_token) if ok else None,
                "rounds": len(c.ms_per_token),
                "vs_llama": ms / ref_ms if ms is not None and ref_ms and c.model != "Llama" else None,
                "cache_bytes": c.cache_bytes,
                "theory_bytes": c.theory_bytes,
                "slots": c.slots,
                "bytes_equal_theory": None if c.cache_bytes is None else c.cache_bytes == c.theory_bytes,
                "error": c.error,
            }
        )
    return out


def decode_table(summary: list[dict[str, Any]]) -> str:
    """The markdown decode table: one line per (batch, context, model, cache kind)."""
    lines = []
    for r in summary:
        if r["error"] is not None:
            time_cell, ratio = f"n/a ({r['error']})", "-"
        else:
            time_cell = f"{r['ms_per_token']:.2f} ±{100 * r['spread']:.0f}% ({r['rounds']})"
            ratio = "-" if r["vs_llama"] is None else f"{r['vs_llama']:.3f}"
        if r["cache_bytes"] is None:
            measured, theory, equal = "-", "-", "-"
        else:
            measured, theory = f"{r['cache_bytes']:,}", f"{r['theory_bytes']:,}"
            equal = "yes" if r["bytes_equal_theory"] else f"no ({r['cache_bytes'] / r['theory_bytes']:.3f}x)"
        lines.append(
            [r["batch"], r["context"], r["model"], r["kv_heads"], r["cache"], time_cell, ratio, measured, theory, equal]
        )
    headers = [
        "batch",
        "context",
        "model",
        "kv heads",
        "cache",
        "ms/token ±spread (rounds)",
        "vs Llama (same cache)",
        "cache bytes",
        "theory bytes",
        "== theory",
    ]
    return markdown_table(headers, lines)


def rss_comparisons(
    rss_rows: list[dict[str, Any]], rows: list[DecodeModel], element_size: int
) -> dict[str, dict[str, Any]]:
    """Per measured model other than Llama: how far its peak RSS is below Llama's, against the difference of their
    caches in theory (dynamic cache, batch 1, the tokens the run held) and of their weights; ``fraction`` = RSS
    difference / cache difference (None when the caches are the same size)."""
    by_name = {r.name: r for r in rows}
    got = {r["model"]: r for r in rss_rows if "error" not in r}
    llama = got.get("Llama")
    if llama is None or "Llama" not in by_name:
        return {}
    tokens = llama["context"] + llama["generated"]
    llama_cache = theory_nbytes(by_name["Llama"], "dynamic", 1, tokens, element_size, False)
    out = {}
    for name, r in got.items():
        if name == "Llama" or name not in by_name:
            continue
        cache_diff = llama_cache - theory_nbytes(by_name[name], "dynamic", 1, tokens, element_size, False)
        saved = llama["peak_rss"] - r["peak_rss"]
        out[name] = {
            "peak_rss_saved": saved,
            "cache_difference": cache_diff,
            "weights_difference": llama["weights_bytes"] - r["weights_bytes"],
            "fraction": saved / cache_diff if cache_diff else None,
        }
    return out


def rss_table(rss_rows: list[dict[str, Any]], rows: list[DecodeModel], element_size: int) -> str:
    """Peak RSS per model with its cache in theory and its weights; for the other models, the peak RSS below
    Llama's against the cache difference in theory (`rss_comparisons`)."""
    by_name = {r.name: r for r in rows}
    versus = rss_comparisons(rss_rows, rows, element_size)
    lines = []
    for r in rss_rows:
        if "error" in r:
            lines.append([r["model"], r["context"], f"n/a ({r['error']})"] + ["-"] * 6)
            continue
        row = by_name.get(r["model"])
        cache = theory_nbytes(row, "dynamic", 1, r["context"] + r["generated"], element_size, False) if row else None
        v = versus.get(r["model"])
        lines.append(
            [
                r["model"],
                r["context"],
                f"{r['peak_rss'] / 2**20:,.1f}",
                f"{r['rss_before_generate'] / 2**20:,.1f}",
                "-" if cache is None else f"{cache / 2**20:,.1f}",
                f"{r['weights_bytes'] / 2**20:,.1f}",
                "-" if v is None else f"{v['peak_rss_saved'] / 2**20:,.1f}",
                "-" if v is None else f"{v['cache_difference'] / 2**20:,.1f}",
                "-" if v is None or v["fraction"] is None else f"{v['fraction']:.2f}",
            ]
        )
    headers = [
        "model",
        "context",
        "peak RSS MiB",
        "RSS before generate MiB",
        "cache MiB (theory)",
        "weights MiB",
        "peak RSS below Llama MiB",
        "cache below Llama MiB (theory)",
        "RSS / cache difference",
    ]
    return markdown_table(headers, lines)


def summary_lines(summary: list[dict[str, Any]], rss: dict[str, dict[str, Any]]) -> list[str]:
    """Measurements at a glance: each model's range of time ratios to Llama, how many cells hold exactly their
    theoretical bytes, and each model's peak RSS against Llama's."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in summary):
        ratios = [r["vs_llama"] for r in summary if r["model"] == model and r["vs_llama"] is not None]
        if ratios:
            lines.append(
                f"- {model} / Llama ms per token (same cache kind): {min(ratios):.3f} to {max(ratios):.3f} over "
                f"{len(ratios)} cells"
            )
    measured = [r for r in summary if r["cache_bytes"] is not None]
    if measured:
        off = [r for r in measured if not r["bytes_equal_theory"]]
        listed = ", ".join(
            f"{r['model']} {r['cache']} ({r['cache_bytes'] / r['theory_bytes']:.3f}x)"
            for r in {(r["model"], r["cache"]): r for r in off}.values()
        )
        lines.append(
            f"- cache bytes == theory: {len(measured) - len(off)} of {len(measured)} cells"
            + (f"; differ: {listed}" if off else "")
        )
    for model, v in rss.items():
        fraction = "-" if v["fraction"] is None else f"{v['fraction']:.2f}"
        lines.append(
            f"- peak RSS: {model} {v['peak_rss_saved'] / 2**20:,.1f} MiB below Llama, cache difference in theory "
            f"{v['cache_difference'] / 2**20:,.1f} MiB (weights differ by {v['weights_difference'] / 2**20:,.1f} "
            f"MiB): RSS / cache difference {fraction}"
        )
    return lines


def method_note(new_tokens: int, repeats: int, max_repeats: int) -> str:
    """The method paragraph printed above the tables."""
    return (
        "Method: each cache is built as generate() builds it and filled to the context as the attention layers fill it "
        f"(random states, real layout); after one untimed step, {new_tokens} greedy decode steps are timed. "
        f"Cells interleaved per round, {repeats} to {max_repeats} rounds (more while a spread is above "
        f"{MAX_SPREAD:.0%}); median ms per step (one token per sequence), spread = (max - min) / median. Ratios are "
        "to LlamaForCausalLM with the same cache kind, measured in the same rounds."
    )


# ----------------------------------------------------------------------------------------------------------------
# figure
# ----------------------------------------------------------------------------------------------------------------
FIGURE_TIME = "decode ms per token"
FIGURE_CACHE = "KV cache MiB"


def figure_data(summary: list[dict[str, Any]], batch: int, kind: str) -> dict[str, dict[str, tuple[list, list]]]:
    """The figure's numbers, taken from the table's rows of one batch size and cache kind: per panel (decode ms per
    token, cache MiB held after the fill), per model, (contexts, values) in context order; n/a cells are left out."""
    panels: dict[str, dict[str, tuple[list, list]]] = {FIGURE_TIME: {}, FIGURE_CACHE: {}}
    mine = sorted((r for r in summary if r["batch"] == batch and r["cache"] == kind), key=lambda r: r["context"])
    for r in mine:
        if r["error"] is not None:
            continue
        for panel, value in ((FIGURE_TIME, r["ms_per_token"]), (FIGURE_CACHE, r["cache_bytes"] / 2**20)):
            xs, ys = panels[panel].setdefault(r["model"], ([], []))
            xs.append(r["context"])
            ys.append(value)
    return panels


def write_figure(path: Path, panels: dict[str, dict[str, tuple[list, list]]], title: str) -> Path:
    """Two panels (decode time, cache memory) against context length, log-x; Llama dashed, `none` labelled QKV."""
    labels = {"none": "QKV (none)"}
    named = {p: {labels.get(m, m): xy for m, xy in series.items()} for p, series in panels.items()}
    return line_plot(
        path,
        {},
        "context length (tokens)",
        "",
        title,
        logx=True,
        dashed=["Llama"],
        panels=named,
        ylabels={FIGURE_TIME: "ms per token", FIGURE_CACHE: "MiB held after the fill"},
    )


def run(args, setup, log=print) -> str:
    """`qkvshare bench --decode`: build the models, measure, print and write decode.md, decode.json and the figure."""
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch_dtype(setup.dtype_name)
    element_size = torch.tensor([], dtype=dtype).element_size()
    base = setup.base
    t0 = time.perf_counter()
    rows = build_models(base, args.decode_models, args.decode_caches, setup.device, dtype, args.seed)
    cells = measure_decode_table(
        rows,
        sorted(args.context_lens),
        sorted(args.batch_sizes),
        args.new_tokens,
        args.repeats,
        max(args.repeats, args.max_repeats or args.repeats),
        setup.device,
        dtype,
        setup.clock,
        log,
    )
    summary = summarize(cells, rows)
    rss_rows, versus = [], {}
    if args.rss_context:
        rss_rows = measure_rss(
            base, args.rss_models, args.rss_context, args.new_tokens, args.threads, args.rss_timeout, log
        )
        versus = rss_comparisons(rss_rows, rows, element_size)
    shape = (
        f"{base.num_hidden_layers} layers, d={base.hidden_size}, {base.num_attention_heads} heads x {base.head_dim}, "
        f"{base.num_key_value_heads} kv heads, vocab {base.vocab_size}"
    )
    parity = [
        f"{r.name} vs Llama logits (same weights) max |diff| {r.parity_max_abs_diff:.2e}"
        for r in rows
        if r.parity_max_abs_diff is not None
    ]
    timer = "process CPU time" if args.timer == "cpu" else "wall time"
    text = [
        f"## qkvshare bench --decode: {shape}; {setup.device}, {setup.dtype_name}, {torch.get_num_threads()} threads, "
        f"{timer}",
        "",
        method_note(args.new_tokens, args.repeats, max(args.repeats, args.max_repeats or args.repeats)),
        "",
        *(parity + [""] if parity else []),
        "### Decode ms per token and cache bytes",
        "",
        decode_table(summary),
        "",
    ]
    if rss_rows:
        text += [
            f"### Peak RSS of a whole generate() (batch 1, {args.new_tokens} new tokens, one process each)",
            "",
            rss_table(rss_rows, rows, element_size),
            "",
        ]
    text += ["### Summary", "", *summary_lines(summary, versus), "", f"(wall time {time.perf_counter() - t0:.0f} s)"]
    md = "\n".join(text)
    log(md)
    out = setup.output_dir
    (out / "decode.md").write_text(md + "\n")
    # The figure: the first cache kind asked for (dynamic by default) at the smallest batch.
    batch, kind = min(args.batch_sizes), args.decode_caches[0]
    panels = figure_data(summary, batch, kind)
    title = f"{shape}: {kind} cache, batch {batch} ({setup.device}, {setup.dtype_name}, {timer})"
    figure = write_figure(Path(args.decode_plot) if args.decode_plot else out / "decode.png", panels, title)
    report = {
        "settings": {**vars(args), "device": str(setup.device), "dtype": setup.dtype_name, "torch": torch.__version__},
        "parity": {r.name: r.parity_max_abs_diff for r in rows if r.parity_max_abs_diff is not None},
        "decode": summary,
        "rss": rss_rows,
        "rss_vs_llama": versus,
        "figure": {"path": str(figure), "batch": batch, "cache": kind, "panels": panels},
    }
    (out / "decode.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    log(f"wrote {out.resolve() / 'decode.md'}, decode.json, {figure}")
    return md
