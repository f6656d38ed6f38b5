"""Tests of the analysis commands: `costs` reproduces the paper, `bench` and `compare` run end to end on the tiny
preset and produce every table and plot, `analyze` matches a direct computation."""

import inspect
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from commands import command

from qkvshare import QKVShareConfig, QKVShareForCausalLM
from qkvshare.analysis import bench, compare, costs, weights
from qkvshare.analysis.common import base_config, default_variants, variant_config
from qkvshare.configuration_qkvshare import llama_twin_config
from qkvshare_settings import bench as bench_cli
from qkvshare_settings.conventions import slug

PAPER_VARIANTS = ["QKV", "Q=K-V", "Q-K=V", "Q=K=V", "GQA-4", "Q-GQA-4", "MQA", "Q-MQA"]


def _table_rows(md: str) -> list[list[str]]:
    """Data rows of the first markdown table in ``md`` (cells stripped)."""
    lines = [line for line in md.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def _cells_as_numbers(cells: list[str]) -> list[float]:
    """Table cells read back as numbers (thousands separators dropped: times over 1 s print as "1,412")."""
    return [float(c.replace(",", "")) for c in cells]


# ----------------------------------------------------------------------------------------------------------------
# costs
# ----------------------------------------------------------------------------------------------------------------
def test_costs_reproduce_paper_300m():
    report = costs.cost_report(base_config("paper-300m"), PAPER_VARIANTS, [2048, 4096], [32000], ["fp16"])
    rows = {r["variant"]: r for r in report["variants"]}
    totals = {"QKV": 305_534_976, "Q=K-V": 284_542_976, "Q-K=V": 284_542_976, "Q=K=V": 263_550_976}
    attention = {"QKV": 83_968_000, "Q=K-V": 62_976_000, "Q-K=V": 62_976_000, "Q=K=V": 41_984_000}
    for v in totals:
        assert rows[v]["parameters"]["total"] == totals[v]
        assert rows[v]["parameters"]["attention"] == attention[v]
    qkv = rows["QKV"]["parameters"]
    assert (qkv["embeddings"], qkv["mlp"], qkv["norms"]) == (53_608_448, 167_874_560, 83_968)
    # the analytic counts equal a real model built on the meta device, for every variant
    for r in rows.values():
        assert r["meta_check"], r
        assert r["meta_parameters"]["total"] == r["parameters"]["total"]
    cache = {"QKV": 81_920, "Q-K=V": 40_960, "GQA-4": 20_480, "Q-GQA-4": 10_240, "MQA": 5_120, "Q-MQA": 2_560}
    for v, b in cache.items():
        assert rows[v]["kv_cache_bytes_per_token"]["fp16"] == b
    assert rows["QKV"]["kv_cache_bytes"]["fp16"]["32000"] == 2_621_440_000  # 2.62 GB per user at 32k
    assert rows["Q-K=V"]["kv_cache_bytes"]["fp16"]["32000"] == 1_310_720_000
    assert rows["Q-MQA"]["kv_cache_cut"] == pytest.approx(0.96875)
    macs = {"QKV": 792.69e9, "Q=K-V": 749.74e9, "Q-K=V": 749.74e9, "Q=K=V": 706.79e9}
    for v, m in macs.items():
        assert rows[v]["macs"]["2048"]["total"] == pytest.approx(m, rel=0.005)
        assert rows[v]["macs"]["2048"]["total"] == pytest.approx(m, abs=0.005e9)  # in fact to the paper's 2 decimals
    assert rows["Q=K-V"]["macs"]["2048"]["cut_vs_reference"] == pytest.approx(0.054, abs=0.0005)
    assert rows["Q=K=V"]["macs"]["2048"]["cut_vs_reference"] == pytest.approx(0.108, abs=0.0005)
    assert rows["QKV"]["macs"]["2048"]["attention_share"] < 0.5 < rows["QKV"]["macs"]["4096"]["attention_share"]


def test_costs_analytic_equals_meta_model_for_other_shapes():
    from transformers import LlamaConfig, LlamaForCausalLM

    base = base_config("llama-300m")
    for v in default_variants(base):
        cfg = variant_config(base, v)
        assert costs.parameter_counts(cfg)["total"] == costs.meta_parameter_counts(cfg)["total"], v
        assert costs.parameter_counts(cfg)["attention"] == costs.meta_parameter_counts(cfg)["attention"], v
    mixed = QKVShareConfig.from_preset(
        "tiny", layer_projection_sharing=["qkv", "kv"], attention_bias=True, mlp_bias=True
    )
    assert costs.parameter_counts(mixed) == costs.parameter_counts(mixed) | costs.meta_parameter_counts(mixed)
    # independent of our model code: the Llama-style formula against transformers' own Llama on the meta device
    cfg = variant_config(base, "GQA-4")
    with torch.device("meta"):
        llama = LlamaForCausalLM(LlamaConfig(**llama_twin_config(cfg).to_dict()))
    assert sum(p.numel() for p in llama.parameters()) == costs.parameter_counts(cfg)["total"]


def test_costs_cli_markdown_json_and_errors(tmp_path, capsys):
    out = tmp_path / "costs.json"
    assert (
        command("costs")(["--preset", "paper-300m", "--seq_lens", "2048", "--format", "json", "--output", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    assert [r["variant"] for r in report["variants"]] == default_variants(base_config("paper-300m"))
    assert (
        command("costs")(["--preset", "tiny", "--no_meta_check", "--variants", "QKV", "Q-K=V", "--dtypes", "fp32"]) == 0
    )
    md = capsys.readouterr().out
    assert "| Q-K=V | 50.00% | 50.0% | 512 |" in md  # 2 layers x 4 heads x 16 x 4 bytes, one tensor
    assert command("costs")(["--preset", "nope"]) == 2
    assert "preset='nope' is not a known preset" in capsys.readouterr().err
    assert command("costs")(["--preset", "tiny", "--override", "hiden_size=3"]) == 2
    assert "unknown config field 'hiden_size' (did you mean 'hidden_size'?)" in capsys.readouterr().err
    assert command("costs")(["--preset", "tiny", "--variants", "GQA-3"]) == 2
    assert "3 key/value heads must divide" in capsys.readouterr().err
    assert command("costs")(["--preset", "tiny", "--variants"]) == 2
    assert "qkvshare costs: error: --variants is empty" in capsys.readouterr().err
    assert command("costs")(["--model_dir", str(tmp_path)]) == 2  # no config.json: named, no traceback
    assert str(tmp_path) in capsys.readouterr().err


def test_costs_lengths_stop_at_the_model_positions(tmp_path, capsys):
    out = tmp_path / "costs.json"
    argv = ["--preset", "tiny", "--no_meta_check", "--variants", "QKV", "Q-K=V", "--format", "json"]
    assert command("costs")(argv + ["--output", str(out)]) == 0  # tiny: 128 positions
    report = json.loads(out.read_text())
    assert report["seq_lens"] == [128] and report["context_lens"] == [128]
    assert report["beyond_positions"] == {"seq_lens": [], "context_lens": []}
    assert report["notes"] == [
        "Default --seq_lens capped at the model's max_position_embeddings=128 (dropped 512, 1024, 2048, 4096, 8192); "
        "pass --seq_lens to ask for other lengths.",
        "Default --context_lens capped at the model's max_position_embeddings=128 (dropped 2048, 32000); pass "
        "--context_lens to ask for other lengths.",
    ]
    assert report["variants"][1]["kv_cache_bytes"]["fp16"] == {"128": 128 * 256}
    capsys.readouterr()
    # paper-300m (2048 positions): defaults stop at 2048; asked-for longer lengths are kept and marked
    assert command("costs")(["--preset", "paper-300m", "--no_meta_check", "--variants", "QKV"]) == 0
    md = capsys.readouterr().out
    assert "MACs T=2048 |" in md and "T=4096" not in md and "(dropped 4096, 8192)" in md
    assert (
        command("costs")(
            [
                "--preset",
                "paper-300m",
                "--no_meta_check",
                "--variants",
                "QKV",
                "--seq_lens",
                "2048",
                "4096",
                "--context_lens",
                "32000",
            ]
        )
        == 0
    )
    md = capsys.readouterr().out
    assert "| MACs T=2048 | attn share T=2048 | vs QKV T=2048 | MACs T=4096* |" in md
    assert "fp16 @ 32,000 tok* |" in md and "| 2.62 GB |" in md
    assert "* 4096, 32000 tokens: beyond the model's max_position_embeddings=2048." in md and "capped" not in md


# ----------------------------------------------------------------------------------------------------------------
# command-line conventions
# ----------------------------------------------------------------------------------------------------------------
def _help_blocks(text: str) -> dict[str, str]:
    """Each argument's help text in argparse `--help` output, keyed by its first flag (or positional name)."""
    blocks, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (-[^\s,]+|[a-z]\w*)( |,|$)", line)
        if m:
            current = m.group(1)
            blocks[current] = line
        elif current and line.startswith("   "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


def _parsers():
    from qkvshare_settings import analyze, perplexity, synthetic
    from qkvshare_settings import compare as compare_cli
    from qkvshare_settings import costs as costs_cli
    from qkvshare_settings import eval as eval_cli

    return {
        "eval": eval_cli.parse_args,
        "perplexity": perplexity.parse_args,
        "synthetic": synthetic.parse_args,
        "costs": costs_cli.parse_args,
        "bench": bench_cli.parse_args,
        "compare": compare_cli.parse_args,
        "analyze": analyze.parse_args,
    }


@pytest.mark.parametrize("command", ["eval", "perplexity", "synthetic", "costs", "bench", "compare", "analyze"])
def test_help_prints_each_default_once(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parsers()[command](["--help"])
    assert exit_.value.code == 0
    blocks = _help_blocks(capsys.readouterr().out)
    assert len(blocks) > 2
    for block in blocks.values():
        assert block.count("default") <= 1, (command, block)
    expected = {
        "eval": ("--num_fewshot", "(default: 5)"),
        "perplexity": ("--batch_size", "(default: 4)"),
        "synthetic": ("--train_size", "(default: 10000)"),
        "costs": ("--dtypes", "(default: ['fp16'])"),
        "bench": ("--new_tokens", "(default: 16)"),
        "compare": ("--max_steps", "(default: 500)"),
        "analyze": ("--format", "(default: markdown)"),
    }
    flag, default = expected[command]
    assert default in blocks[flag]
    assert "(default: True)" not in blocks["-h"] + blocks.get("--no_plots", "") + blocks.get("--core", "")
    if "--dtype" in blocks:
        assert blocks["--dtype"].count("(aliases fp32, bf16, fp16)") == 1


PARSE_FRESH = """
import contextlib, importlib, io, json, sys
calls = []
for target, argv in {calls!r}:
    module, _, function = target.partition(":")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            getattr(importlib.import_module(module), function)(argv)
            code, message = 0, ""
        except SystemExit as exit_:
            code, message = exit_.code, ""
        except ValueError as error:  # a bad value: the entry point prints it, exit status 2
            code, message = "ValueError", str(error)
    calls.append([code, out.getvalue(), err.getvalue() + message])
heavy = [m for m in ("torch", "transformers", "lm_eval", "datasets", "safetensors", "matplotlib", "qkvshare")
         if m in sys.modules]
print(json.dumps({{"calls": calls, "heavy": heavy}}))
"""


def test_command_parsers_answer_without_torch():
    # The parsers the `qkvshare` entry point calls before it imports a command: --help, usage errors and bad values
    # are answered in a fresh interpreter, and neither the package nor torch or another heavy library is imported.
    root = Path(__file__).resolve().parents[1]
    calls = [
        ("qkvshare_settings.eval:parse_args", ["--help"]),
        ("qkvshare_settings.eval:parse_args", ["--dtype", "fp64"]),
        ("qkvshare_settings.perplexity:parse_args", ["--help"]),
        ("qkvshare_settings.perplexity:parse_args", ["model"]),
        ("qkvshare_settings.synthetic:parse_args", ["--help"]),
        ("qkvshare_settings.analyze:parse_args", ["--help"]),
        ("qkvshare_settings.analyze:parse_args", ["model", "--format", "csv"]),
        ("qkvshare_settings.costs:parse_args", ["--help"]),
        ("qkvshare_settings.costs:parse_args", ["--preset", "tiny", "--override", "hidden_size"]),
        ("qkvshare_settings.costs:parse_args", ["--preset", "tiny", "--dtypes", "fp4"]),
        ("qkvshare_settings.costs:parse_args", ["--preset", "tiny", "--seq_lens", "128", "--format", "json"]),
        ("qkvshare_settings.bench:parse_args", ["--help"]),
        ("qkvshare_settings.bench:parse_args", ["--core", "--batch_sizes", "0"]),
        ("qkvshare_settings.bench:parse_args", ["--preset", "tiny", "--model_dir", "m"]),
        ("qkvshare_settings.compare:parse_args", ["--help"]),
        ("qkvshare_settings.compare:parse_args", ["--max_steps", "0"]),
        ("qkvshare_settings.compare:parse_args", ["--variants", "QKV", "--train_file", "t.txt", "--variant=MQA"]),
        ("qkvshare_settings.compare:parse_args", ["--variants", "QKV", "--train_file", "t.txt"]),
    ]
    env = {**os.environ, "PYTHONPATH": str(root)}
    code = PARSE_FRESH.format(calls=calls)
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["heavy"] == []
    (help_eval, bad_dtype, help_ppl, no_source, help_syn, help_analyze, bad_format, *analysis) = report["calls"]
    assert help_eval[0] == 0 and "usage: qkvshare eval" in help_eval[1]
    assert bad_dtype[0] == 2 and "'fp64' is not a dtype" in bad_dtype[2]
    assert help_ppl[0] == 0 and "usage: qkvshare perplexity" in help_ppl[1]
    assert no_source[0] == 2 and "give exactly one of --validation_file and --dataset_name" in no_source[2]
    assert help_syn[0] == 0 and "--map_pe_init" in help_syn[1]
    assert help_analyze[0] == 0 and "usage: qkvshare analyze" in help_analyze[1]
    assert bad_format[0] == 2 and "invalid choice: 'csv'" in bad_format[2]
    help_costs, no_equals, bad_dtypes, costs_ok, help_bench, no_batch, two_shapes, *compare_calls = analysis
    assert help_costs[0] == 0 and "usage: qkvshare costs" in help_costs[1] and "from_preset" in help_costs[1]
    assert no_equals[0] == "ValueError" and "--override item 'hidden_size' is not key=value" in no_equals[2]
    assert bad_dtypes[0] == "ValueError" and "--dtypes fp4: not known" in bad_dtypes[2]
    assert costs_ok == [0, "", ""]  # good input passes (preset names and override keys: checked by main)
    assert help_bench[0] == 0 and "usage: qkvshare bench" in help_bench[1] and "--kv_tie_points" in help_bench[1]
    assert no_batch == ["ValueError", "", "--batch_sizes needs positive integers."]
    assert two_shapes[0] == "ValueError" and "give exactly one of --preset NAME or --model_dir DIR" in two_shapes[2]
    help_compare, no_steps, clash, passthrough = compare_calls
    assert help_compare[0] == 0 and "usage: qkvshare compare" in help_compare[1]
    assert no_steps == ["ValueError", "", "--max_steps must be at least 1."]
    assert clash[0] == "ValueError" and "--variant is set by compare itself" in clash[2]
    assert passthrough == [0, "", ""]  # unknown flags are the trainer's, not errors


def test_slug_is_the_one_file_name_helper():
    from qkvshare.evaluation import harness
    from qkvshare.synthetic.sweep import Cell, model_dir_name

    assert slug("Q-K=V") == "Q-K_eq_V" and slug("(Q=K=V)+") == "Q_eq_K_eq_V_plus"
    assert slug("outputs/cpu-small") == "outputs_cpu-small" and slug("/abs/org/model/") == "abs_org_model"
    assert slug("..") == "_" and slug("../x") == "x" and slug("a b?c") == "a_b_c"
    cell = Cell("(Q=K-V)+", "copy", 32, 1, 2, 8, 0, 1, 1, 1, 1, 1e-3, 0.05, 5.0, "xavier", "sdpa")
    assert model_dir_name(cell) == "copy_Q_eq_K-V_plus_e32_l1_h2_t8_s0"
    assert not hasattr(harness, "sanitize")
    assert harness.result_dirs(["org/model"], "/o") == {"org/model": Path("/o/org_model")}


# ----------------------------------------------------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------------------------------------------------
def test_bench_end_to_end_tiny(tmp_path):
    variants = ["QKV", "Q-K=V", "Q=K=V", "GQA-2", "Q-MQA"]
    out = tmp_path / "bench"
    argv = [
        "--preset",
        "tiny",
        "--variants",
        *variants,
        "--context_lens",
        "8",
        "16",
        "--batch_sizes",
        "1",
        "2",
        "--new_tokens",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--train_batch_size",
        "2",
        "--train_seq_len",
        "8",
        "--train_steps",
        "1",
        "--budget_mib",
        "1",
        "--output_dir",
        str(out),
    ]
    assert command("bench")(argv) == 0
    for name in (
        "bench.md",
        "bench.json",
        "parity.md",
        "by_variant.md",
        "cache.md",
        "decode.md",
        "capacity.md",
        "train.md",
        "cache_memory.png",
        "decode_tokens_per_s.png",
    ):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "bench.json").read_text())
    models = variants + ["Llama", "Llama GQA-2", "Llama MQA"]
    # cache: measured bytes equal theory everywhere; tied = half of the Llama DynamicCache of the same heads
    assert len(report["cache"]) == len(models) * 2
    for r in report["cache"]:
        assert r["measured_bytes"] == r["theory_bytes"] > 0, r
    by = {(r["model"], r["context"]): r for r in report["cache"]}
    assert by[("QKV", 16)]["measured_bytes"] == by[("Llama", 16)]["measured_bytes"] == 2 * 2 * 4 * 16 * 16 * 4
    assert by[("Q-K=V", 16)]["vs_llama"] == 0.5 and by[("Q-K=V", 16)]["vs_qkv"] == 0.5
    assert by[("Q-MQA", 16)]["vs_qkv"] == 1 / 8
    # weights copied into Llama for the unshared variants: identical logits
    assert set(report["parity"]) == {"QKV", "GQA-2"} and max(report["parity"].values()) < 1e-5
    assert len(report["decode"]) == len(models) * 2 * 2
    for r in report["decode"]:
        assert r["tokens_per_s"] > 0 and r["prefill_ms"] > 0 and r["ms_per_step"] > 0
        assert r["cache_bytes"] == by[(r["model"], r["context"])]["measured_bytes"] * r["batch"]
    cap = {r["model"]: r for r in report["capacity"]}
    assert cap["Q-K=V"]["vs_qkv"] == 2.0 and cap["Q-MQA"]["vs_qkv"] == 8.0
    assert cap["QKV"]["longest_context"] == 2**20 // 1024 and all(r["linear"] for r in cap.values())
    assert {r["model"] for r in report["train"]} == set(models)
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_cpu_s"] > 0 for r in report["train"])
    params = {r["model"]: r["parameters"] for r in report["train"]}
    assert (
        params["QKV"]
        == params["Llama"]
        == sum(p.numel() for p in QKVShareForCausalLM(variant_config(base_config("tiny"), "QKV")).parameters())
    )
    assert params["Q-K=V"] == params["QKV"] - 2 * 64 * 64  # no v_proj in either layer
    # the summary tables: `none` vs its Llama twin (same weights), and decode/cache per variant at batch 2
    parity = _table_rows((out / "parity.md").read_text())
    assert [row[0] for row in parity[:2]] == [
        "QKV: prefill, batch 1, context 8",
        "QKV: decode per token, batch 1, context 8",
    ]
    assert len(parity) == 2 * 2 * 2 * 2  # (QKV, GQA-2) x (prefill, decode) x 2 batches x 2 contexts
    decode = {(r["model"], r["batch"], r["context"]): r for r in report["decode"]}
    qkv_16 = decode[("QKV", 2, 16)]
    expected = [decode[("Llama GQA-2", 2, 16)]["ms_per_step"], decode[("GQA-2", 2, 16)]["ms_per_step"]]
    expected.append(decode[("GQA-2", 2, 16)]["ms_per_step_vs_llama"])
    assert _cells_as_numbers(parity[-1][1:]) == pytest.approx(expected, rel=1e-3, abs=1e-3)
    by_variant = {row[0]: row for row in _table_rows((out / "by_variant.md").read_text())}
    assert list(by_variant) == variants
    qkv_ms = [decode[("QKV", 2, T)]["ms_per_step"] for T in (8, 16)]
    # printed to 4 significant digits (3 decimals below 10 ms; fewer on a slow or loaded machine)
    assert _cells_as_numbers(by_variant["QKV"][1:3]) == pytest.approx(qkv_ms, rel=5e-4, abs=5e-4)
    assert by_variant["Q-K=V"][5:] == ["0.500", "yes"] and by_variant["Q-MQA"][5:] == ["0.125", "yes"]
    assert qkv_16["cache_bytes"] == qkv_16["theory_bytes"] == 2 * 2 * 2 * 4 * 16 * 16 * 4
    # tables: one row per (model, context) / (model, batch, context) / model
    assert len(_table_rows((out / "cache.md").read_text())) == len(models) * 2
    decode_rows = _table_rows((out / "decode.md").read_text())
    assert len(decode_rows) == len(models) * 4 and decode_rows[0][0] == "QKV (Llama weights)"
    assert [row[0] for row in _table_rows((out / "capacity.md").read_text())] == models
    assert len(_table_rows((out / "train.md").read_text())) == len(models)


def test_bench_tie_points_and_core_settings(tmp_path):
    out = tmp_path / "bench"
    argv = [
        "--preset",
        "tiny",
        "--variants",
        "QKV",
        "Q-K=V",
        "--kv_tie_points",
        "post_rope",
        "pre_rope",
        "--sections",
        "cache",
        "decode",
        "--context_lens",
        "8",
        "--batch_sizes",
        "1",
        "--new_tokens",
        "1",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--output_dir",
        str(out),
    ]
    assert command("bench")(argv) == 0
    report = json.loads((out / "bench.json").read_text())
    cache = {r["model"]: r for r in report["cache"]}
    assert list(cache) == ["QKV", "Q-K=V (post_rope)", "Q-K=V (pre_rope)", "Llama"]
    # a pre-RoPE tie caches one tensor plus the int64 position of every token; theory counts both
    kv_bytes = 2 * 4 * 16 * 8 * 4  # layers x heads x head_dim x tokens x fp32, one tensor
    assert cache["Q-K=V (post_rope)"]["measured_bytes"] == kv_bytes
    assert cache["Q-K=V (pre_rope)"]["measured_bytes"] == cache["Q-K=V (pre_rope)"]["theory_bytes"] == kv_bytes + 8 * 8
    assert [row[0] for row in _table_rows((out / "by_variant.md").read_text())] == list(cache)[:3]

    core = bench_cli.parse_args(["--core"])
    assert core.variants is None  # the paper's LM variants of the shape (`default_variants`), for small:
    assert default_variants(base_config("small"), plus=False) == [
        *("QKV", "Q=K-V", "Q-K=V", "Q=K=V", "GQA-2", "MQA", "Q-GQA-2", "Q-MQA")
    ]
    assert core.kv_tie_points == ["post_rope", "pre_rope"] and core.batch_sizes == [4]
    assert core.context_lens == [128, 512, 1024] and core.preset is None  # the default shape: small
    given = bench_cli.parse_args(["--core", "--batch_sizes", "1", "--preset", "tiny"])
    assert given.batch_sizes == [1] and given.preset == "tiny" and given.kv_tie_points == ["post_rope", "pre_rope"]
    assert bench_cli.parse_args([]).kv_tie_points is None and bench_cli.parse_args([]).batch_sizes == [1, 4]


def test_interleaved_rotates_order_and_drops_warmup():
    cands = [bench.Candidate(name, None, False, 1, None) for name in "ABC"]
    calls = []

    def fn(c):
        calls.append(c.name)
        return {"i": len(calls)}

    runs = bench.interleaved(cands, reps=2, warmup=1, fn=fn, desc="t")
    assert calls == list("ABCBCACAB")  # each round starts one further along
    assert runs == {"A": [{"i": 6}, {"i": 8}], "B": [{"i": 4}, {"i": 9}], "C": [{"i": 5}, {"i": 7}]}
    assert bench.median(runs["A"], "i") == 7


def test_bench_rejects_bad_input(capsys):
    assert command("bench")(["--preset", "tiny", "--batch_sizes", "0"]) == 2
    assert "--batch_sizes needs positive integers" in capsys.readouterr().err
    assert command("bench")(["--preset", "tiny", "--variants", "Q=K-GQA-2"]) == 2
    assert "is not a known variant" in capsys.readouterr().err
    assert command("bench")(["--preset", "tiny", "--timer", "cpu", "--device", "cuda"]) == 2
    assert "--timer cpu measures host CPU time" in capsys.readouterr().err
    assert command("bench")(["--preset", "tiny", "--device", "gpu0"]) == 2
    assert "--device 'gpu0' is not a device" in capsys.readouterr().err
    assert command("bench")(["--kv_tie_points", "mid_rope"]) == 2  # a usage error: argparse's message, exit status 2
    assert "invalid choice: 'mid_rope'" in capsys.readouterr().err
    # a flag given without values is an error, not the defaults; a zero capacity context is not "the longest"
    assert command("bench")(["--preset", "tiny", "--variants"]) == 2
    assert "--variants is empty; give at least one value" in capsys.readouterr().err
    assert command("bench")(["--preset", "tiny", "--sections"]) == 2
    assert "--sections is empty" in capsys.readouterr().err
    assert command("bench")(["--preset", "tiny", "--capacity_context", "0"]) == 2
    assert "--capacity_context 0: must be a positive token count" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    """A small local corpus (the package's own model code), so the test does not tokenize the whole stdlib."""
    import qkvshare.configuration_qkvshare
    import qkvshare.modeling_qkvshare

    lines = (
        inspect.getsource(qkvshare.modeling_qkvshare) + inspect.getsource(qkvshare.configuration_qkvshare)
    ).splitlines()
    root = tmp_path_factory.mktemp("corpus")
    cut = int(len(lines) * 0.9)
    (root / "train.txt").write_text("\n".join(lines[:cut]))
    (root / "val.txt").write_text("\n".join(lines[cut:]))
    return ["--train_file", str(root / "train.txt"), "--validation_file", str(root / "val.txt")]


def _compare_argv(out: Path, corpus: list[str], variants: list[str]) -> list[str]:
    return [
        "--preset",
        "tiny",
        "--variants",
        *variants,
        "--max_steps",
        "4",
        "--per_device_train_batch_size",
        "2",
        "--block_size",
        "16",
        "--save_steps",
        "2",
        "--eval_steps",
        "4",
        "--max_eval_samples",
        "4",
        "--output_dir",
        str(out),
        "--disable_tqdm",
        "true",
        *corpus,
    ]


def test_compare_orders_and_checks_variants_before_training(tmp_path, capsys):
    assert compare.ordered_variants("tiny", None) == [
        *("QKV", "Q-K=V", "Q=K-V", "Q=K=V", "GQA-2", "MQA", "Q-GQA-2", "Q-MQA")
    ]
    assert compare.ordered_variants("tiny", ["MQA", "Q=K-V", "QKV"]) == ["QKV", "Q=K-V", "MQA"]
    out = tmp_path / "cmp"
    assert command("compare")(["--preset", "tiny", "--variants", "QKV", "GQA-3", "--output_dir", str(out)]) == 2
    assert "3 key/value heads must divide" in capsys.readouterr().err
    assert command("compare")(["--preset", "nope", "--output_dir", str(out)]) == 2
    assert "preset='nope' is not a known preset" in capsys.readouterr().err
    assert command("compare")(["--variants", "Q=K-V", "Q=K-V", "--output_dir", str(out)]) == 2
    assert "--variants has duplicates: ['Q=K-V', 'Q=K-V']" in capsys.readouterr().err
    assert not out.exists()  # refused before anything is written


def test_compare_end_to_end_with_resume(tmp_path, corpus, monkeypatch):
    out = tmp_path / "cmp"
    real_train = compare.train

    def crashing_train(args, on_step=None):  # dies after step 3 of the second variant (checkpoint at step 2)
        def hook(step, loss, model):
            on_step(step, loss, model)
            if args.model.variant == "Q-K=V" and step == 3:
                raise RuntimeError("simulated crash")

        return real_train(args, on_step=hook)

    monkeypatch.setattr(compare, "train", crashing_train)
    with pytest.raises(RuntimeError, match="simulated crash"):
        command("compare")(_compare_argv(out, corpus, ["QKV", "Q-K=V"]))
    monkeypatch.setattr(compare, "train", real_train)
    qkv_metrics = (out / "runs" / "QKV" / "final_metrics.json").read_text()
    assert command("compare")(_compare_argv(out, corpus, ["QKV", "Q-K=V"])) == 0  # QKV skipped, Q-K=V resumed at step 2
    assert (out / "runs" / "QKV" / "final_metrics.json").read_text() == qkv_metrics
    log = compare.read_log(out / "logs" / "Q-K_eq_V.jsonl")
    assert sorted(log) == [1, 2, 3, 4]

    # an uninterrupted run of Q-K=V gives the same validation loss as the crashed-and-resumed one
    fresh = tmp_path / "fresh"
    assert command("compare")(_compare_argv(fresh, corpus, ["Q-K=V"])) == 0
    resumed_m = json.loads((out / "runs" / "Q-K_eq_V" / "final_metrics.json").read_text())
    fresh_m = json.loads((fresh / "runs" / "Q-K_eq_V" / "final_metrics.json").read_text())
    assert resumed_m["val_loss"] == pytest.approx(fresh_m["val_loss"], abs=1e-5)

    rows = _table_rows((out / "compare.md").read_text())
    assert [r[0] for r in rows] == ["QKV", "Q-K=V"]
    assert rows[0][2] == "0" and rows[1][3] == "50.0%"
    data = {r["variant"]: r for r in json.loads((out / "compare.json").read_text())}
    assert all(
        r["val_perplexity"] > 1 and r["train_tokens_per_s"] > 0 < r["train_tokens_per_cpu_s"] for r in data.values()
    )
    assert data["Q-K=V"]["parameters"] < data["QKV"]["parameters"]
    assert data["QKV"]["tokens_seen"] == data["Q-K=V"]["tokens_seen"] == 4 * 2 * 16
    assert data["Q-K=V"]["ppl_change"] == pytest.approx(
        data["Q-K=V"]["val_perplexity"] / data["QKV"]["val_perplexity"] - 1
    )
    assert (out / "loss_curves.png").stat().st_size > 0
    # other shared flags in the same directory are refused
    assert command("compare")(_compare_argv(out, corpus, ["QKV"]) + ["--learning_rate", "0.5"]) == 2


# ----------------------------------------------------------------------------------------------------------------
# analyze
# ----------------------------------------------------------------------------------------------------------------
def _direct(wa: torch.Tensor, wb: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(wa.double().flatten(), wb.double().flatten(), dim=0).item()


def test_analyze_tied_layer_and_direct_computation(tmp_path, capsys):
    cfg = QKVShareConfig.from_preset("tiny", layer_projection_sharing=["none", "kv"])
    model = QKVShareForCausalLM(cfg)
    model.save_pretrained(tmp_path / "m")
    assert command("analyze")([str(tmp_path / "m")]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert rows[1][:2] == ["1", "kv"] and rows[1][4] == "1.0000"  # tied K=V layer: similarity exactly 1
    report = weights.analyze(tmp_path / "m")
    attn0, attn1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    l0, l1 = report["layers"]
    assert l0["cos_qk"] == pytest.approx(_direct(attn0.q_proj.weight, attn0.k_proj.weight), abs=1e-12)
    assert l0["cos_qv"] == pytest.approx(_direct(attn0.q_proj.weight, attn0.v_proj.weight), abs=1e-12)
    assert l0["cos_kv"] == pytest.approx(_direct(attn0.k_proj.weight, attn0.v_proj.weight), abs=1e-12)
    assert l1["cos_kv"] == pytest.approx(1.0, abs=1e-12) and l1["erank_k"] == l1["erank_v"]
    assert l1["cos_qv"] == pytest.approx(_direct(attn1.q_proj.weight, attn1.k_proj.weight), abs=1e-12)
    s = torch.linalg.svdvals(attn0.v_proj.weight.detach().double())
    p = s / s.sum()
    assert l0["erank_v"] == pytest.approx(math.exp(-(p * p.log()).sum().item()), rel=1e-9)
    assert 1 <= l0["erank_v"] <= 64 and 1 <= l0["rank90_v"] <= 64


def test_analyze_llama_checkpoint_with_gqa(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    llama.save_pretrained(tmp_path / "llama")
    report = weights.analyze(tmp_path / "llama")
    attn = llama.model.layers[1].self_attn
    k_expanded = attn.k_proj.weight.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    assert report["layers"][1]["mode"] == "none"
    assert report["layers"][1]["cos_qk"] == pytest.approx(_direct(attn.q_proj.weight, k_expanded), abs=1e-12)
    assert report["layers"][1]["cos_kv"] == pytest.approx(_direct(attn.k_proj.weight, attn.v_proj.weight), abs=1e-12)
    # costs takes the shape from any Llama checkpoint directory
    out = tmp_path / "costs.json"
    assert (
        command("costs")(
            [
                "--model_dir",
                str(tmp_path / "llama"),
                "--variants",
                "GQA-2",
                "Q-GQA-2",
                "--format",
                "json",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["variants"]
    assert (
        rows[0]["parameters"]["total"]
        == sum(p.numel() for p in llama.parameters())
        == rows[0]["meta_parameters"]["total"]
    )
    assert rows[1]["kv_cache_fraction"] == 0.5
    # no safetensors (only a pickle): refused with a clear message, nothing unpickled
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"not loaded")
    assert command("analyze")([str(tmp_path / "pickled")]) == 2
    assert "pickle files are never loaded" in capsys.readouterr().err
