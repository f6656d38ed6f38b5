"""`qkvshare convert` on the command line: parse and check the arguments, then read, convert and save."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import qkvshare.convert
from qkvshare.analysis.conventions import HelpFormatter, add_dtype_argument, report_bad_input
from qkvshare.convert.calibration import (
    CALIBRATIONS,
    DEFAULT_CALIBRATION,
    DEFAULT_CALIBRATION_BLOCK,
    DEFAULT_CALIBRATION_TOKENS,
    DEFAULT_RIDGE,
    calibration_ids,
    calibration_texts,
    check_calibration_ids,
)
from qkvshare.convert.conversion import (
    CONVERT_OVERRIDES,
    DEFAULT_METHOD,
    RECORD_FILE,
    ConversionRecord,
    convert,
    plan_conversion,
)
from qkvshare.convert.io import (
    check_output_dir,
    check_source_path,
    load_source,
    load_source_tokenizer,
    read_source_config,
    save_converted,
)
from qkvshare.convert.weights import KV_METHODS, QUERY_METHODS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and check `qkvshare convert` arguments (no torch): `ValueError` for a bad value."""
    from qkvshare.overrides import parse_overrides

    p = argparse.ArgumentParser(
        prog="qkvshare convert", description=qkvshare.convert.__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("source", metavar="SRC", help="Llama-architecture model directory or .gguf file")
    p.add_argument(
        "--variant", required=True, help="paper variant: Q-K=V, Q=K-V, Q=K=V, GQA-<g>, MQA, Q-GQA-<g>, Q-MQA, QKV"
    )
    p.add_argument("--output_dir", required=True, help="where the converted model directory is written")
    p.add_argument("--method", choices=KV_METHODS, default=None, help=f"K=V layers (default: {DEFAULT_METHOD})")
    p.add_argument("--query_method", choices=QUERY_METHODS, default=None, help="Q=K layers (default: key)")
    p.add_argument(
        "--kv_tie_point",
        choices=("pre_rope", "post_rope"),
        default=None,
        help="tie point of K=V layers (default: pre_rope for calibrated, else the config default post_rope)",
    )
    p.add_argument("--calibration_file", default=None, help=".txt or .jsonl (text column); default: embedded corpus")
    p.add_argument("--calibration_tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS, help="tokens to calibrate on")
    p.add_argument("--calibration_block_size", type=int, default=DEFAULT_CALIBRATION_BLOCK, help="tokens per sequence")
    p.add_argument("--ridge", type=float, default=DEFAULT_RIDGE, help="relative ridge of the calibrated fit")
    p.add_argument(
        "--calibration",
        choices=CALIBRATIONS,
        default=DEFAULT_CALIBRATION,
        help="calibrated fit of layer l on the converted model's own hidden states (sequential) or the source's",
    )
    p.add_argument("--seed", type=int, default=0, help="order of the embedded corpus' documents")
    add_dtype_argument(p, "float32", "dtype of the saved weights (conversion runs in float32)")
    p.add_argument("--override", nargs="*", default=None, help="config fields: " + ", ".join(CONVERT_OVERRIDES))
    p.add_argument("--overwrite_output_dir", action="store_true", help="replace a previous conversion there")
    args = p.parse_args(argv)
    check_source_path(args.source)
    if args.dtype == "auto":
        raise ValueError("--dtype auto is not a dtype to save in; use float32, bfloat16 or float16.")
    for flag in ("calibration_tokens", "calibration_block_size"):
        if getattr(args, flag) < 2:
            raise ValueError(f"--{flag} {getattr(args, flag)} must be at least 2.")
    if not args.ridge >= 0:
        raise ValueError(f"--ridge {args.ridge} must be >= 0 (a small value such as {DEFAULT_RIDGE}).")
    if args.calibration_file is not None and not Path(args.calibration_file).expanduser().is_file():
        raise ValueError(f"--calibration_file {args.calibration_file!r} does not exist; pass a .txt or .jsonl file.")
    args.overrides = parse_overrides(args.override, "--override")
    if args.kv_tie_point is not None:
        args.overrides["kv_tie_point"] = args.kv_tie_point
    check_output_dir(Path(args.output_dir), args.overwrite_output_dir)
    return args


def run(args: argparse.Namespace) -> ConversionRecord:
    """Check everything that needs no weights, read calibration text, load the source, convert, save."""
    import shutil

    source_config = read_source_config(args.source)
    config, method, query_method = plan_conversion(
        source_config, args.variant, args.method, args.query_method, **args.overrides
    )
    tokenizer = load_source_tokenizer(args.source)
    source_kv = source_config.get("num_key_value_heads") or source_config["num_attention_heads"]
    ids = description = None
    changes_attention = method is not None or config.num_key_value_heads < source_kv or query_method is not None
    if method == "calibrated" and tokenizer is None:
        raise ValueError(
            f"{args.source} has no tokenizer, which method='calibrated' needs to read calibration text; save the "
            "source's tokenizer next to its weights, or use --method key."
        )
    if changes_attention and tokenizer is not None:
        documents, description = calibration_texts(args.calibration_file, args.seed)
        ids = calibration_ids(tokenizer, documents, args.calibration_tokens, args.calibration_block_size)
        check_calibration_ids(ids, config)
    source = load_source(args.source)
    model, record = convert(
        source,
        args.variant,
        args.method,
        query_method=args.query_method,
        calibration_ids=ids,
        ridge=args.ridge,
        calibration=args.calibration,
        source_name=str(args.source),
        calibration_source=description,
        **args.overrides,
    )
    out = Path(args.output_dir)
    if out.exists() and args.overwrite_output_dir and (out / RECORD_FILE).is_file():
        shutil.rmtree(out)
    save_converted(model, record, out, tokenizer, args.dtype)
    _print_summary(record, config, source_config, out)
    return record


def _print_summary(record: ConversionRecord, config: Any, source_config: dict[str, Any], out: Path) -> None:
    from qkvshare import QKVShareConfig

    before = QKVShareConfig.from_llama(source_config).kv_cache_bytes_per_token()
    lines = [
        f"converted {record.source} ({record.source_model_type}, {record.source_key_value_heads} key/value heads) to "
        f"{record.variant}: method {record.method or '-'} (calibration {record.calibration or '-'}), "
        f"Q=K {record.query_method or '-'}, "
        f"kv_tie_point {record.kv_tie_point}, head pooling {record.head_pooling or '-'}",
        f"KV cache per token (16-bit): {config.kv_cache_bytes_per_token():,} bytes (source {before:,})",
    ]
    for name in ("key", "value", "calibrated", "converted"):
        mean = record.mean_error(name)
        if mean is not None:
            lines.append(f"mean attention-output error ({name}): {mean:.4f} over {record.calibration_tokens:,} tokens")
    if record.layer_errors.get("drift"):
        lines.append(f"hidden-state drift after the last layer: {record.layer_errors['drift'][-1]:.4f}")
    lines.append(f"model directory: {out.resolve()}")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `qkvshare convert`: 0 done, 2 bad input (one paragraph on stderr)."""
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ValueError as err:
        return report_bad_input("convert", err)
    return 0
