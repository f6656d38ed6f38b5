"""`qkvshare costs`: analytic parameters, MACs and KV-cache bytes of every attention variant of a model shape.

Conventions (chosen to reproduce the paper's figures for ``paper-300m`` exactly; see docs/research.md, section 3)
- Parameters: every weight and bias once; a tied LM head is not counted again. "Attention" is everything inside
  the attention modules (projections, their biases, and the m weights + 1 bias of a "+" map). The analytic count
  is cross-checked against a real `QKVShareForCausalLM` built on the meta device (no memory, no init).
- MACs of one forward pass over T tokens (batch 1), multiply-accumulates of matrix products only:
    * every linear layer: in_features x out_features per token (attention projections, MLP, LM head; a tied
      LM head still costs its matmul). Bias adds, norms, activations, RoPE, softmax and residuals are not counted;
    * attention scores Q K^T and the weighted sum A V: H x T x T x head_dim each, dense (the paper does not halve
      them for the causal mask; ``--causal_scores`` does);
    * a "+" map adds T x m per layer: P[i, j] concatenates a row and a column encoding, so P.w splits into a
      row term and a column term (T x m in all, as the model computes it) broadcast-added to the scores;
    * the linear-attention kernel (paper appendix) replaces the two T x T products by a state update and a
      readout: 2 x H x head_dim^2 per token.
  With this convention paper-300m at T=2048 gives exactly the paper's figures: QKV 792,689,901,568 (792.69G),
  Q=K-V and Q-K=V 749,740,228,608 (749.74G), Q=K=V 706,790,555,648 (706.79G).
  "Attention share" = (attention projections + score/AV products + "+" map) / total; for paper-300m QKV it is
  43.3% at T=2048 and 53.4% at T=4096 (the paper: passes 50% at 4096).
- KV-cache bytes per token: num_key_value_heads x head_dim per cached tensor per layer; layers with tied K/V
  (Q-K=V, Q=K=V and the Q-GQA/Q-MQA combinations) cache one tensor, others two.
- QV-Ka (the second source, `key_context_dim` = d_ctx): parameters q, v, o as in QKV plus `ctx_proj` (d x d_ctx,
  with a bias when the attention has biases) and `k_mix` (H x (d_ctx + D) x D, no bias) instead of `k_proj`; the
  forward's MACs count `k_mix` as a (d_ctx + D) -> H x D map per token. Its cache holds V and G: H x D + d_ctx
  elements per token and layer (the positions RoPE models also keep, 8 bytes per token, are not in these figures,
  as for pre-RoPE ties). Decoding then recomputes the cached tokens' keys each step, T x H x (d_ctx + D) x D MACs
  per layer, which no forward-MAC column shows (benchmarks/qvka_cache.py measures it). Context sizes use decimal GB,
  as the paper (32k = 32,000 tokens: 2.62 GB for paper-300m QKV in fp16).
- Lengths and the model's positions: the default sequence and context lengths stop at the shape's
  `max_position_embeddings` (ending at it), and the output says which defaults were dropped. Lengths asked for
  explicitly are kept, and those beyond the positions are marked "*" with a note: they are what the shape would
  cost at that length (the paper's 4096-token MACs and 32k-token caches for its 2048-position models are such
  figures), not something the configured model can run.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from qkvshare import QKVShareForCausalLM
from qkvshare.analysis.common import (
    base_and_variants,
    markdown_table,
    variant_config,
)
from qkvshare.configuration_qkvshare import QKVShareConfig
from qkvshare_settings.costs import BYTES_PER_ELEMENT, DEFAULT_CONTEXT_LENS, DEFAULT_SEQ_LENS


# ----------------------------------------------------------------------------------------------------------------
# parameters
# ----------------------------------------------------------------------------------------------------------------
def attention_projection_shapes(config: QKVShareConfig, layer_idx: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection layer ``layer_idx`` has, by its Llama name (`config.layer_projections`: a
    projection its sharing mode drops is absent). QV-Ka's ``k_mix`` (no bias) is listed as a (d_ctx + D) -> H x D
    map: its parameters and per-token MACs."""
    d, q_out = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    d_ctx = config.key_context_dim
    shapes = {
        "q_proj": (d, q_out),
        "k_proj": (d, kv_out),
        "v_proj": (d, kv_out),
        "o_proj": (q_out, d),
        "ctx_proj": (d, d_ctx),
        "k_mix": (d_ctx + config.head_dim, kv_out),
    }
    return {name: shapes[name] for name in config.layer_projections(layer_idx)}


def parameter_counts(config: QKVShareConfig) -> dict[str, int]:
    """Analytic parameter counts: total, attention, mlp, embeddings (token + learned positions), norms, lm_head."""
    d, ff = config.hidden_size, config.intermediate_size
    attention = 0
    for i in range(config.num_hidden_layers):
        for name, (fan_in, fan_out) in attention_projection_shapes(config, i).items():
            biased = config.attention_bias and name != "k_mix"
            attention += fan_in * fan_out + (fan_out if biased else 0)
        if config.attention_map_pe_dim:
            attention += config.attention_map_pe_dim + 1
    n_mlp_mats = 3 if config.mlp_type == "gated" else 2
    mlp_layer = n_mlp_mats * d * ff
    if config.mlp_bias:
        mlp_layer += (n_mlp_mats - 1) * ff + d
    mlp = mlp_layer * config.num_hidden_layers
    per_norm = 2 * d if config.norm_type == "layernorm" else d
    norms = per_norm * (2 * config.num_hidden_layers + 1)
    embeddings = config.vocab_size * d
    if config.position_embedding_type == "learned":
        embeddings += config.max_position_embeddings * d
    lm_head = 0 if config.tie_word_embeddings else config.vocab_size * d
    total = attention + mlp + norms + embeddings + lm_head
    return dict(total=total, attention=attention, mlp=mlp, embeddings=embeddings, norms=norms, lm_head=lm_head)


def meta_parameter_counts(config: QKVShareConfig) -> dict[str, int]:
    """Total and attention parameters of a real `QKVShareForCausalLM` built on the meta device (shared tensors once)."""
    with torch.device("meta"):
        model = QKVShareForCausalLM(config)
    seen: set[int] = set()
    total = attention = 0
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if ".self_attn." in name:
            attention += p.numel()
    return dict(total=total, attention=attention)


# ----------------------------------------------------------------------------------------------------------------
# MACs and cache
# ----------------------------------------------------------------------------------------------------------------
def macs_per_forward(config: QKVShareConfig, seq_len: int, causal_scores: bool = False) -> dict[str, int]:
    """MACs of one forward over ``seq_len`` tokens (batch 1), split into parts; convention in the module docstring."""
    T, d, ff = seq_len, config.hidden_size, config.intermediate_size
    H, hd = config.num_attention_heads, config.head_dim
    pairs = T * (T + 1) // 2 if causal_scores else T * T
    projections = scores = pe_map = 0
    for i in range(config.num_hidden_layers):
        projections += T * sum(a * b for a, b in attention_projection_shapes(config, i).values())
        if config.attention_kernel == "linear":
            scores += 2 * T * H * hd * hd
        else:
            scores += 2 * H * pairs * hd  # Q K^T and A V
            pe_map += T * config.attention_map_pe_dim
    mlp = T * (3 if config.mlp_type == "gated" else 2) * d * ff * config.num_hidden_layers
    lm_head = T * d * config.vocab_size
    attention = projections + scores + pe_map
    return dict(
        total=attention + mlp + lm_head,
        attention=attention,
        attention_projections=projections,
        attention_scores=scores + pe_map,
        mlp=mlp,
        lm_head=lm_head,
    )


def kv_cache_bytes(
    config: QKVShareConfig, context_len: int = 1, bytes_per_element: int = 2, batch_size: int = 1
) -> int:
    """Theoretical KV-cache bytes for ``batch_size`` sequences of ``context_len`` tokens."""
    return config.kv_cache_bytes_per_token(bytes_per_element) * context_len * batch_size


def resolve_lengths(flag: str, given: list[int] | None, defaults: tuple[int, ...], limit: int, notes: list[str]):
    """The lengths to report: ``given`` as is, else the defaults up to ``limit`` (ending at ``limit`` itself when
    some were dropped, which ``notes`` then records)."""
    if given is not None:
        return list(given)
    kept = [t for t in defaults if t <= limit]
    dropped = [t for t in defaults if t > limit]
    if dropped:
        kept += [] if limit in kept else [limit]
        notes.append(
            f"Default --{flag} capped at the model's max_position_embeddings={limit} (dropped "
            f"{', '.join(map(str, dropped))}); pass --{flag} to ask for other lengths."
        )
    return kept


# ----------------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------------
def cost_report(
    base: QKVShareConfig,
    variants: list[str],
    seq_lens: list[int],
    context_lens: list[int],
    dtypes: list[str],
    check_meta: bool = True,
    causal_scores: bool = False,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """Every number of the tables, JSON-serialisable. The first variant is the reference for "cut" columns.

    Lengths beyond ``base.max_position_embeddings`` are listed under "beyond_positions" and explained in "notes"
    (after the caller's ``notes``).
    """
    for dt in dtypes:
        if dt not in BYTES_PER_ELEMENT:
            raise ValueError(f"dtype {dt!r} is not known; allowed: {', '.join(BYTES_PER_ELEMENT)}.")
    rows = []
    for name in variants:
        cfg = variant_config(base, name)
        params = parameter_counts(cfg)
        row: dict[str, Any] = {
            "variant": name,
            "parameters": params,
            "macs": {str(T): macs_per_forward(cfg, T, causal_scores) for T in seq_lens},
            "kv_cache_elements_per_token": cfg.kv_cache_elements_per_token(),
            "kv_cache_bytes_per_token": {dt: cfg.kv_cache_bytes_per_token(BYTES_PER_ELEMENT[dt]) for dt in dtypes},
            "kv_cache_bytes": {
                dt: {str(C): kv_cache_bytes(cfg, C, BYTES_PER_ELEMENT[dt]) for C in context_lens} for dt in dtypes
            },
        }
        if check_meta:
            meta = meta_parameter_counts(cfg)
            row["meta_parameters"] = meta
            row["meta_check"] = meta["total"] == params["total"] and meta["attention"] == params["attention"]
        rows.append(row)
    ref = rows[0]
    for row in rows:
        row["parameter_cut"] = 1 - row["parameters"]["total"] / ref["parameters"]["total"]
        row["attention_parameter_cut"] = 1 - row["parameters"]["attention"] / ref["parameters"]["attention"]
        row["kv_cache_fraction"] = row["kv_cache_elements_per_token"] / ref["kv_cache_elements_per_token"]
        row["kv_cache_cut"] = 1 - row["kv_cache_fraction"]
        for T in map(str, seq_lens):
            m = row["macs"][T]
            m["attention_share"] = m["attention"] / m["total"]
            m["cut_vs_reference"] = 1 - m["total"] / ref["macs"][T]["total"]
    limit = base.max_position_embeddings
    beyond = {"seq_lens": [t for t in seq_lens if t > limit], "context_lens": [c for c in context_lens if c > limit]}
    notes = list(notes or [])
    if beyond["seq_lens"] or beyond["context_lens"]:
        lengths = ", ".join(map(str, dict.fromkeys(beyond["seq_lens"] + beyond["context_lens"])))
        notes.append(
            f"* {lengths} tokens: beyond the model's max_position_embeddings={limit}. These columns are what this "
            "shape would cost at that length; the model as configured cannot run it."
        )
    return {
        "config": {
            k: getattr(base, k)
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "head_dim",
                "vocab_size",
                "mlp_type",
                "norm_type",
                "position_embedding_type",
                "tie_word_embeddings",
                "max_position_embeddings",
            )
        },
        "beyond_positions": beyond,
        "notes": notes,
        "reference": ref["variant"],
        "seq_lens": seq_lens,
        "context_lens": context_lens,
        "dtypes": dtypes,
        "mac_convention": "matmul MACs only; dense T x T scores" + (" halved (causal)" if causal_scores else ""),
        "variants": rows,
    }


def format_markdown(report: dict[str, Any]) -> str:
    """The three tables (parameters, MACs, KV cache) as markdown."""
    ref = report["reference"]
    rows = report["variants"]
    out = []
    headers = ["variant", "total params", "attention params", f"total vs {ref}", f"attention vs {ref}"]
    has_meta = "meta_check" in rows[0]
    if has_meta:
        headers.append("meta-device check")
    table = []
    for r in rows:
        p = r["parameters"]
        line = [
            r["variant"],
            p["total"],
            p["attention"],
            _signed(-r["parameter_cut"]),
            _signed(-r["attention_parameter_cut"]),
        ]
        if has_meta:
            line.append("equal" if r["meta_check"] else f"MISMATCH {r['meta_parameters']}")
        table.append(line)
    out += ["### Parameters", "", markdown_table(headers, table), ""]

    beyond = report.get("beyond_positions", {})
    headers = ["variant"]
    for T in report["seq_lens"]:
        star = "*" if T in beyond.get("seq_lens", ()) else ""
        headers += [f"MACs T={T}{star}", f"attn share T={T}{star}", f"vs {ref} T={T}{star}"]
    table = []
    for r in rows:
        line = [r["variant"]]
        for T in map(str, report["seq_lens"]):
            m = r["macs"][T]
            line += [f"{m['total'] / 1e9:,.2f}G", f"{m['attention_share']:.1%}", _signed(-m["cut_vs_reference"], 1)]
        table.append(line)
    out += [f"### MACs per forward (batch 1; {report['mac_convention']})", "", markdown_table(headers, table), ""]

    headers = ["variant", "cache vs " + ref, "cut"]
    for dt in report["dtypes"]:
        headers.append(f"bytes/token {dt}")
        headers += [f"{dt} @ {C:,} tok" + "*" * (C in beyond.get("context_lens", ())) for C in report["context_lens"]]
    table = []
    for r in rows:
        line = [r["variant"], f"{r['kv_cache_fraction']:.2%}", f"{r['kv_cache_cut']:.1%}"]
        for dt in report["dtypes"]:
            line.append(r["kv_cache_bytes_per_token"][dt])
            line += [_gb(r["kv_cache_bytes"][dt][str(C)]) for C in report["context_lens"]]
        table.append(line)
    out += ["### KV cache per sequence (decimal units)", "", markdown_table(headers, table), ""]
    if report.get("notes"):
        out += [*report["notes"], ""]
    return "\n".join(out)


def _signed(x: float, digits: int = 2) -> str:
    """+1.23% / -4.50%, and 0 without a sign."""
    return "0" if abs(x) < 1e-12 else f"{x:+.{digits}%}"


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"


def run_costs(args: argparse.Namespace) -> dict[str, Any]:
    """`qkvshare costs`: the cost report of every variant (printed as markdown or JSON, written to `args.output`
    when given), returned as a dict. Bad settings are a `ValueError` before anything is built."""
    base, variants = base_and_variants(args.preset, args.model_dir, args.override, args.variants, plus=True)
    notes: list[str] = []
    seq_lens = resolve_lengths("seq_lens", args.seq_lens, DEFAULT_SEQ_LENS, base.max_position_embeddings, notes)
    context_lens = resolve_lengths(
        "context_lens", args.context_lens, DEFAULT_CONTEXT_LENS, base.max_position_embeddings, notes
    )
    report = cost_report(
        base, variants, seq_lens, context_lens, args.dtypes, not args.no_meta_check, args.causal_scores, notes
    )
    text = json.dumps(report, indent=2) if args.format == "json" else format_markdown(report)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return report
