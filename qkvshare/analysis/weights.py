"""`qkvshare analyze MODEL`: per layer, how similar the Q, K and V projection weights are, and their effective rank.

Definitions (the paper reports cos(W_k, W_v) = 0.73, cos(W_q, W_k) = 0.42, cos(W_q, W_v) = 0.31 and effective
ranks of K 687 vs V 702 of 1024 for trained 300M QKV models; it does not spell out its formulas, so these are ours)
- Effective weights: a projection a layer's sharing mode drops is the one it shares (Q=K-V: W_q = W_k; Q-K=V:
  W_v = W_k; Q=K=V: both), so tied pairs have similarity exactly 1.0.
- Cosine similarity of two matrices: of their flattened entries, <A, B>_F / (|A|_F |B|_F), in float64.
  With GQA/MQA, W_k and W_v have fewer rows (kv heads x head_dim) than W_q; for pairs with Q they are expanded to
  the query heads the way attention uses them (each kv head's block repeated for its group, as `repeat_kv`).
  Note: Meta-converted Llama checkpoints permute the rows of q_proj/k_proj per head for HF's rotate_half RoPE, so
  their cosines with V compare permuted rows; checkpoints trained in the HF layout (ours) have no such permutation.
- Effective rank (Roy & Vetterli 2007): exp of the Shannon entropy of the normalised singular values,
  p_i = s_i / sum(s). Between 1 and min(shape). We also give the energy rank: how many singular values hold 90%
  of sum(s_i^2).
- Weights are read from the checkpoint's safetensors files (single file or sharded with an index) with
  `safe_open`: only the Q/K/V tensors are loaded, and no pickle is ever unpickled. Works for QKVShare checkpoints
  and any Llama-architecture directory (names `...layers.N.self_attn.{q,k,v}_proj.weight`).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from qkvshare.analysis.common import markdown_table
from qkvshare.configuration_qkvshare import SHARING_MODES, QKVShareConfig, SharingMode
from qkvshare.model_dir import check_weights_fit_config, read_config_json, weight_files

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.([qkv])_proj\.weight$")


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory, each checked complete before reading (pickles are refused)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"{model_dir!s} is not a directory; pass a model directory written by save_pretrained.")
    return weight_files(model_dir, allow_pickle=False)


def load_qkv_weights(model_dir: str | Path) -> dict[int, dict[str, torch.Tensor]]:
    """{layer: {"q"|"k"|"v": weight (out, in)}} with only the projections the checkpoint has."""
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                m = _KEY.search(key)
                if m:
                    layers.setdefault(int(m.group(1)), {})[m.group(2)] = f.get_tensor(key)
    if not layers:
        raise ValueError(
            f"{model_dir!s}: no tensors named '...layers.N.self_attn.{{q,k,v}}_proj.weight'; is it a Llama-architecture "
            "or QKVShare checkpoint?"
        )
    return layers


def layer_modes(config: dict[str, Any], layers: Iterable[int]) -> dict[int, SharingMode]:
    """Sharing mode per layer, from the checkpoint's config (`analyze` checked the tensors against it): a QKVShare
    config says each layer's mode; a Llama-architecture checkpoint has every projection. (Not from the tensors
    present: two modes may share a projection set, e.g. a query taken from the key or from the value.)"""
    if config.get("model_type") != QKVShareConfig.model_type:
        return dict.fromkeys(layers, SHARING_MODES["none"])
    parsed = QKVShareConfig.from_dict(config)
    return {i: parsed.layer_mode(i) for i in layers}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two matrices' flattened entries (float64)."""
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def effective_rank(w: torch.Tensor) -> float:
    """Roy & Vetterli effective rank: exp(entropy of s / sum(s)) over the singular values s."""
    s = torch.linalg.svdvals(w.double())
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def energy_rank(w: torch.Tensor, fraction: float = 0.9) -> int:
    """Number of singular values that hold ``fraction`` of the squared Frobenius norm."""
    s2 = torch.linalg.svdvals(w.double()) ** 2
    cum = torch.cumsum(s2, 0) / s2.sum()
    return int(torch.searchsorted(cum, torch.tensor(fraction, dtype=cum.dtype)).item()) + 1


def expand_kv(w: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """(H_kv*D, d) -> (H*D, d): each kv head's rows repeated for the query heads of its group (as repeat_kv)."""
    if num_kv_heads == num_heads:
        return w
    return (
        w.view(num_kv_heads, head_dim, -1)
        .repeat_interleave(num_heads // num_kv_heads, dim=0)
        .reshape(num_heads * head_dim, -1)
    )


def analyze(model_dir: str | Path) -> dict[str, Any]:
    """Per-layer cosines and effective ranks of the effective W_q, W_k, W_v of a checkpoint, plus their means."""
    config = read_config_json(model_dir)
    missing = [key for key in ("num_attention_heads", "hidden_size") if not isinstance(config.get(key), int)]
    if missing:
        raise ValueError(
            f"{Path(model_dir) / 'config.json'} has no integer {' or '.join(missing)}: not a transformer config; "
            "pass a QKVShare or Llama-architecture model directory."
        )
    if config.get("key_context_dim"):
        raise ValueError(
            f"{model_dir!s} is a QV-Ka model (key_context_dim={config['key_context_dim']}): it has no W_k (each key is "
            "[G ; V_i] W_i^K, computed from the context and the value), so W_q/W_k/W_v cosines and ranks are not "
            "defined for it; analyze the other variants."
        )
    check_weights_fit_config(model_dir)  # a config.json from another model: every odd tensor named, none read
    layers = load_qkv_weights(model_dir)
    modes = layer_modes(config, layers)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rows = []
    for i in sorted(layers):
        p = layers[i]
        own = {"q_proj": p.get("q"), "k_proj": p["k"], "v_proj": p.get("v")}
        wk = p["k"]  # a shared query or value is the projection it is taken from (SharingMode.query_from, value_from)
        wq, wv = own[modes[i].query_from], own[modes[i].value_from]
        wk_x, wv_x = expand_kv(wk, heads, kv_heads, head_dim), expand_kv(wv, heads, kv_heads, head_dim)
        rows.append(
            {
                "layer": i,
                "mode": modes[i].name,
                "cos_qk": cosine(wq, wk_x),
                "cos_qv": cosine(wq, wv_x),
                "cos_kv": cosine(wk, wv),
                "erank_q": effective_rank(wq),
                "erank_k": effective_rank(wk),
                "erank_v": effective_rank(wv),
                "rank90_q": energy_rank(wq),
                "rank90_k": energy_rank(wk),
                "rank90_v": energy_rank(wv),
                "max_rank_q": min(wq.shape),
                "max_rank_kv": min(wk.shape),
            }
        )
    keys = [k for k in rows[0] if k not in ("layer", "mode")]
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    return {"model": str(model_dir), "model_type": config.get("model_type"), "layers": rows, "mean": mean}


def format_markdown(report: dict[str, Any]) -> str:
    headers = [
        "layer",
        "mode",
        "cos(Q,K)",
        "cos(Q,V)",
        "cos(K,V)",
        "erank Q",
        "erank K",
        "erank V",
        "rank90 Q",
        "rank90 K",
        "rank90 V",
        "max rank Q / KV",
    ]

    def line(label: Any, mode: str, r: dict[str, Any]) -> list[Any]:
        return [
            str(label),
            mode,
            f"{r['cos_qk']:.4f}",
            f"{r['cos_qv']:.4f}",
            f"{r['cos_kv']:.4f}",
            f"{r['erank_q']:.1f}",
            f"{r['erank_k']:.1f}",
            f"{r['erank_v']:.1f}",
            f"{r['rank90_q']:.0f}",
            f"{r['rank90_k']:.0f}",
            f"{r['rank90_v']:.0f}",
            f"{r['max_rank_q']:.0f} / {r['max_rank_kv']:.0f}",
        ]

    rows = [line(r["layer"], r["mode"], r) for r in report["layers"]] + [line("mean", "", report["mean"])]
    title = f"### Q/K/V weights of {report['model']} (cosine of flattened weights; Roy-Vetterli effective rank)"
    return "\n".join([title, "", markdown_table(headers, rows)])


def run_analyze(args: argparse.Namespace) -> dict[str, Any]:
    """`qkvshare analyze`: the report of `analyze(args.model)`, printed as markdown or JSON (and written to
    `args.output` when given), and returned. A directory that is not an analysable checkpoint is a `ValueError`."""
    try:
        report = analyze(args.model)
    except KeyError as err:  # a config.json or weights without a field or tensor the analysis reads
        raise ValueError(
            f"{args.model}: {err} is missing from its config.json or weights; pass a QKVShare or Llama-architecture "
            "model directory saved with save_pretrained."
        ) from err
    text = json.dumps(report, indent=2) if args.format == "json" else format_markdown(report)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return report
