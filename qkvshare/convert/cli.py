"""`qkvshare convert` run: read the source and the calibration text, convert, save (the arguments are parsed and
checked by `qkvshare_cli.convert`)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from qkvshare import QKVShareConfig
from qkvshare.convert.calibration import calibration_ids, calibration_texts, check_calibration_ids
from qkvshare.convert.conversion import ConversionRecord, convert, plan_conversion
from qkvshare.convert.io import load_source, load_source_tokenizer, read_source_config, save_converted
from qkvshare_cli import main as cli_main
from qkvshare_cli.conventions import report_bad_input
from qkvshare_cli.convert import RECORD_FILE


def run(args: argparse.Namespace) -> ConversionRecord:
    """Check everything that needs no weights, read calibration text, load the source, convert, save."""
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
    """`qkvshare convert ARGV` (the same as the console command); returns the exit status."""
    return cli_main(["convert", *(sys.argv[1:] if argv is None else argv)])


def execute(args: argparse.Namespace) -> int:
    """`qkvshare convert` with its parsed arguments: 0 done, 2 bad input (one paragraph on stderr)."""
    try:
        run(args)
    except ValueError as err:
        return report_bad_input("convert", err)
    return 0
