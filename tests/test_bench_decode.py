"""Tests of `qkvshare bench --decode` (qkvshare/analysis/bench_decode.py) on the tiny preset: the table's structure,
cache bytes equal to theory (by hand, not by the function under test), a failing cell printed as n/a while the others
run, the peak-RSS child and the command-line checks. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch
from commands import command

from qkvshare.analysis import bench, bench_decode
from qkvshare.configuration_qkvshare import QKVShareConfig
from qkvshare_settings.bench import parse_args as parse_bench_args

CPU = torch.device("cpu")
# tiny: 2 layers, 4 heads of 16, 4 kv heads; fp32
LAYERS, HEADS, HEAD_DIM = 2, 4, 16


@pytest.fixture(scope="module")
def tiny_rows():
    base = QKVShareConfig.from_preset("tiny")
    kinds = ["dynamic", "static", "quantized-int4"]
    return bench_decode.build_models(base, ["Llama", "none", "Q-K=V", "Q-GQA-1"], kinds, CPU, torch.float32, 0)


def test_rows_parity_and_kinds(tiny_rows):
    by = {r.name: r for r in tiny_rows}
    assert by["none"].parity_max_abs_diff is not None and by["none"].parity_max_abs_diff < 1e-5
    assert by["none"].kinds == ["dynamic", "static"]  # untied: no quantized row
    assert by["Q-K=V"].kinds == ["dynamic", "static", "quantized-int4"] and by["Q-K=V"].kv_heads == HEADS
    assert by["Q-GQA-1"].kv_heads == 1 and by["Q-GQA-1"].tied_layers == [True, True]
    assert not hasattr(by["Q-K=V"].model.model.layers[0].self_attn, "v_proj")


@pytest.mark.parametrize(
    "name, kind, per_layer",
    [
        # per layer: tensors x B x H_kv x slots x D x bytes (fp32); B=2, context 24, static slots 24 + 1 + 2 = 27
        ("Llama", "dynamic", 2 * 2 * HEADS * 24 * HEAD_DIM * 4),
        ("Q-K=V", "dynamic", 1 * 2 * HEADS * 24 * HEAD_DIM * 4),
        ("Q-GQA-1", "static", 1 * 2 * 1 * 27 * HEAD_DIM * 4),
        ("Llama", "static", 2 * 2 * HEADS * 27 * HEAD_DIM * 4),
        # quanto int4: half a byte per element, a float32 scale and shift per 64 elements
        ("Llama", "quantized-int4", 2 * (2 * HEADS * 24 * HEAD_DIM // 2 + 2 * (2 * HEADS * 24 * HEAD_DIM // 64) * 4)),
    ],
)
def test_fill_and_bytes_equal_theory(tiny_rows, name, kind, per_layer):
    row = next(r for r in tiny_rows if r.name == name)
    cell = bench_decode.Cell(name, kind, batch=2, context=24)
    bench_decode.run_cell(row, cell, 2, CPU, torch.float32, 4, bench_decode.time.perf_counter)
    assert cell.cache_bytes == cell.theory_bytes == LAYERS * per_layer
    assert len(cell.ms_per_token) == 1 and cell.ms_per_token[0] > 0


def test_fill_writes_as_the_layers_do(tiny_rows):
    row = next(r for r in tiny_rows if r.name == "Q-K=V")
    cache = bench_decode.build_cache(row.model, "dynamic", 1, 10)
    bench_decode.fill_cache(row, cache, 1, 10, CPU, torch.float32)
    assert type(cache).__name__ == "QKVShareCache" and cache.get_seq_length() == 10
    assert all(layer.values is None and layer.keys.shape == (1, HEADS, 10, HEAD_DIM) for layer in cache.layers)
    static = bench_decode.build_cache(row.model, "static", 1, 30)
    bench_decode.fill_cache(row, static, 1, 10, CPU, torch.float32)
    assert type(static).__name__ == "QKVShareStaticCache" and static.max_cache_len == 30
    assert static.get_seq_length() == 10 and static.nbytes() == LAYERS * HEADS * 30 * HEAD_DIM * 4  # one tensor
    # a pre-RoPE tie keeps the positions of the cached tokens: 0..9, 8 bytes each on top of the one tensor per layer
    base = QKVShareConfig.from_preset("tiny", kv_tie_point="pre_rope")
    (pre,) = bench_decode.build_models(base, ["Q-K=V"], ["dynamic"], CPU, torch.float32, 0)
    cache = bench_decode.build_cache(pre.model, "dynamic", 2, 10)
    bench_decode.fill_cache(pre, cache, 2, 10, CPU, torch.float32)
    assert torch.equal(cache.positions, torch.arange(10).expand(2, -1))
    assert cache.nbytes() == LAYERS * 2 * HEADS * 10 * HEAD_DIM * 4 + 8 * 2 * 10


def test_failing_cell_is_na_and_others_run(tiny_rows, monkeypatch):
    real = bench_decode.fill_cache

    def fill(row, cache, *args):
        if row.name == "Q-K=V" and type(cache).__name__ == "QKVShareStaticCache":
            raise RuntimeError("boom")
        return real(row, cache, *args)

    monkeypatch.setattr(bench_decode, "fill_cache", fill)
    rows = [r for r in tiny_rows if r.name in ("Llama", "Q-K=V")]
    cells = bench_decode.measure_decode_table(rows, [8], [1], 1, 2, 2, CPU, torch.float32, log=lambda _: None)
    summary = bench_decode.summarize(cells, rows)
    by = {(r["model"], r["cache"]): r for r in summary}
    assert by[("Q-K=V", "static")]["error"] == "RuntimeError: boom"
    assert by[("Q-K=V", "static")]["ms_per_token"] is None
    assert by[("Q-K=V", "dynamic")]["rounds"] == 2 and by[("Q-K=V", "dynamic")]["vs_llama"] > 0
    table = bench_decode.decode_table(summary)
    assert "n/a (RuntimeError: boom)" in table
    assert len(table.splitlines()) == 2 + len(summary) == 2 + 6  # header, rule, Llama x3 + Q-K=V x3


def test_decode_command_end_to_end(tmp_path):
    out = tmp_path / "decode"
    argv = ["--decode", "--preset", "tiny", "--context_lens", "8", "--batch_sizes", "1", "2", "--new_tokens"]
    argv += ["1", "--repeats", "1", "--decode_caches", "dynamic", "quantized-int8", "--rss_context", "0"]
    assert command("bench")(argv + ["--output_dir", str(out)]) == 0
    report = json.loads((out / "decode.json").read_text())
    keys = [(r["batch"], r["context"], r["model"], r["cache"]) for r in report["decode"]]
    expected = [(b, t, m, "dynamic") for b in (1, 2) for t in (8,) for m in ("Llama", "none", "Q-K=V", "Q-GQA-1")]
    expected += [(b, t, m, "quantized-int8") for b in (1, 2) for t in (8,) for m in ("Llama", "Q-K=V", "Q-GQA-1")]
    assert sorted(keys) == sorted(expected)
    for r in report["decode"]:
        if r["cache"] == "dynamic":
            assert r["bytes_equal_theory"] and r["ms_per_token"] > 0
        else:  # int8 is the HQQ backend (quanto has no int8 KV cache): measured where hqq is installed, else n/a
            assert (r["ms_per_token"] is None) == (r["error"] is not None)
            assert "hqq" in r["error"] if r["error"] else r["bytes_equal_theory"], r
    md = (out / "decode.md").read_text()
    assert "### Decode ms per token and cache bytes" in md and "Method:" in md and "- cache bytes == theory" in md
    assert "target" not in md.lower() and all("target" not in key for key in report["decode"][0])


def _png_size(path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (a ValueError when the file is not a PNG)."""
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_decode_figure_is_the_table(tmp_path):
    out, png = tmp_path / "decode", tmp_path / "figs" / "decode-small.png"
    argv = ["--decode", "--preset", "tiny", "--context_lens", "16", "8", "--batch_sizes", "2", "1", "--new_tokens"]
    argv += ["1", "--repeats", "1", "--decode_caches", "dynamic", "static", "--rss_context", "0"]
    assert command("bench")(argv + ["--output_dir", str(out), "--decode_plot", str(png)]) == 0
    assert _png_size(png) == (1440, 540)  # two 6 x 4.5 inch panels at 120 dpi
    report = json.loads((out / "decode.json").read_text())
    figure = report["figure"]
    assert (figure["path"], figure["batch"], figure["cache"]) == (str(png), 1, "dynamic")
    # the time panel: the ms the markdown table prints for batch 1, dynamic cache
    printed = {}
    for line in (out / "decode.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and cells[0] == "1" and cells[4] == "dynamic":
            printed.setdefault(cells[2], []).append((int(cells[1]), cells[5].split()[0]))
    times = figure["panels"][bench_decode.FIGURE_TIME]
    assert sorted(times) == sorted(printed) == sorted(["Llama", "none", "Q-K=V", "Q-GQA-1"])
    for model, (xs, ys) in times.items():
        assert xs == [8, 16] and [(x, f"{y:.2f}") for x, y in zip(xs, ys)] == printed[model]
    # the cache panel: MiB held, by hand: layers x tensors x (1, kv heads, context, 16) fp32
    tensors_heads = {"Llama": 2 * HEADS, "none": 2 * HEADS, "Q-K=V": HEADS, "Q-GQA-1": 1}
    cache = figure["panels"][bench_decode.FIGURE_CACHE]
    for model, (xs, ys) in cache.items():
        assert xs == [8, 16] and ys == [LAYERS * tensors_heads[model] * T * HEAD_DIM * 4 / 2**20 for T in xs]


def test_figure_data_leaves_out_na_cells():
    def row(model, context, ms, error=None):
        return {
            "model": model,
            "batch": 1,
            "cache": "dynamic",
            "context": context,
            "ms_per_token": ms,
            "error": error,
            "cache_bytes": None if error else 2**20 * context,
        }

    summary = [row("Llama", 16, 2.0), row("Llama", 8, 1.0), row("Q-K=V", 8, None, "boom"), row("Q-K=V", 16, 1.5)]
    summary.append({**row("Llama", 32, 9.0), "batch": 2})
    panels = bench_decode.figure_data(summary, 1, "dynamic")
    assert panels[bench_decode.FIGURE_TIME] == {"Llama": ([8, 16], [1.0, 2.0]), "Q-K=V": ([16], [1.5])}
    assert panels[bench_decode.FIGURE_CACHE] == {"Llama": ([8, 16], [8.0, 16.0]), "Q-K=V": ([16], [16.0])}


def test_rss_child_in_process():
    base = QKVShareConfig.from_preset("tiny")
    fields = {k: getattr(base, k) for k in bench_decode.model_fields()}
    got = bench_decode.rss_child({"base": fields, "model": "Q-K=V", "context": 16, "new_tokens": 3})
    assert got["generated"] == 3 and got["peak_rss"] >= got["rss_before_generate"] > 0
    n = base.vocab_size * 64 + LAYERS * (3 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64  # no v_proj, tied head
    assert got["weights_bytes"] == 4 * n


def test_rss_comparison_arithmetic(tiny_rows):
    # Q-K=V caches one (1, 4, T, 16) fp32 tensor per layer where Llama caches two: 1 KiB per token less in all.
    rows = [
        {"model": m, "context": 1000, "generated": 24, "peak_rss": p, "rss_before_generate": 1, "weights_bytes": w}
        for m, p, w in (("Llama", 5 * 2**20, 300), ("Q-K=V", 4 * 2**20, 200))
    ]
    versus = bench_decode.rss_comparisons(rows, tiny_rows, 4)
    assert list(versus) == ["Q-K=V"]
    v = versus["Q-K=V"]
    assert v["cache_difference"] == LAYERS * HEADS * HEAD_DIM * 4 * 1024 == 2**19
    assert v["peak_rss_saved"] == 2**20 and v["fraction"] == 2.0 and v["weights_difference"] == 100
    table = bench_decode.rss_table(rows, tiny_rows, 4)
    qkv_line = next(line for line in table.splitlines() if line.startswith("| Q-K=V |"))
    assert qkv_line.split(" | ")[-3:] == ["1.0", "0.5", "2.00 |"]  # MiB below Llama, cache MiB below, fraction


def test_a_variant_name_means_one_config_in_bench_and_bench_decode():
    # On a GQA base (2 key/value heads of 4), Q-K=V keeps the base's key/value heads in both benchmarks.
    argv = ["--preset", "tiny", "--override", "num_key_value_heads=2", "--variants", "Q-K=V", "QKV", "Q-MQA"]
    setup = bench.resolve_setup(parse_bench_args(argv))
    from_bench = dict(setup.variants)
    rows = bench_decode.build_models(setup.base, ["Q-K=V", "none", "Q-MQA"], ["dynamic"], CPU, torch.float32, 0)
    from_decode = {r.name: r.config for r in rows}
    for bench_name, decode_name in (("Q-K=V", "Q-K=V"), ("QKV", "none"), ("Q-MQA", "Q-MQA")):
        assert from_bench[bench_name].to_diff_dict() == from_decode[decode_name].to_diff_dict(), bench_name
    assert [from_bench[n].num_key_value_heads for n in ("Q-K=V", "QKV", "Q-MQA")] == [2, 2, 1]
    assert from_bench["Q-K=V"].variant == "Q-GQA-2" and from_bench["Q-K=V"].projection_sharing == "kv"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--decode", "--decode_models", "Q-GQA-3"], "--decode_models 'Q-GQA-3'"),
        (["--decode", "--core"], "--core and --decode"),
        (["--decode", "--max_repeats", "0"], "--max_repeats must be >= 1"),
    ],
)
def test_decode_bad_input(argv, message, capsys):
    assert command("bench")(["--preset", "tiny", *argv]) == 2
    assert message in capsys.readouterr().err
