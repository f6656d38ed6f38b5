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
import sys

from .conventions import PRESET_HELP, HelpFormatter, add_dtype_argument, check_nonempty, check_shape_source
from .overrides import parse_overrides

SECTIONS = ("cache", "decode", "capacity", "train")
DEFAULT_PRESET = "small"  # the shape when neither --preset nor --model_dir is given
KV_TIE_POINTS = ("post_rope", "pre_rope")  # the values of QKVShareConfig.kv_tie_point
# `--core`: the settings of the core benchmark (formerly benchmarks/bench_core.py), under any flag given.
CORE_SETTINGS = dict(
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
# --decode_caches: the cache kinds of the decode table, each (cache_implementation, cache_config, compile) as
# `qkvshare.analysis.bench_decode` builds it.
CACHE_KINDS: dict[str, tuple[str | None, dict | None, bool]] = {
    "dynamic": (None, None, False),
    "static": ("static", None, False),
    "static+compile": ("static", None, True),
    "quantized-int4": ("quantized", {"backend": "quanto", "nbits": 4}, False),
    "quantized-int8": ("quantized", {"backend": "hqq", "nbits": 8}, False),  # quanto: 2 and 4 bits only
}
# The rows of the decode table (--decode_models): `qkvshare.analysis.bench_decode` gives each its cache kinds.
DECODE_MODELS = ("Llama", "none", "Q-K=V", "Q-GQA-1")


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
        default=list(DECODE_MODELS),
        help="--decode rows: Llama (the shape's LlamaForCausalLM), none and Q-K=V (at the shape's kv heads), or "
        "paper variant names",
    )
    p.add_argument(
        "--decode_caches",
        nargs="+",
        choices=tuple(CACHE_KINDS),
        default=list(CACHE_KINDS),
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

    Every option that can be checked without the config or torch is checked here; a `ValueError` names the bad
    option. `qkvshare.analysis.bench.resolve_setup` checks the rest (override keys, variants, device).
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
    parse_overrides(args.override, "--override")
    return args


def shape_preset(args: argparse.Namespace) -> str | None:
    """The preset giving the shape: --preset, else the default one unless --model_dir gives it."""
    return args.preset or (None if args.model_dir else DEFAULT_PRESET)
