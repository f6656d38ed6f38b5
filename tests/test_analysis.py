"""Tests of the analysis commands: `costs` reproduces the paper, `bench` and `compare` run end to end on the tiny
preset and produce every table and plot, `analyze` matches a direct computation."""

import inspect
import json
import math
from pathlib import Path

import pytest
import torch

from qkvshare import QKVShareConfig, QKVShareForCausalLM
from qkvshare.analysis import bench, compare, costs, weights
from qkvshare.analysis.common import base_config, default_variants, variant_config

PAPER_VARIANTS = ["QKV", "Q=K-V", "Q-K=V", "Q=K=V", "GQA-4", "Q-GQA-4", "MQA", "Q-MQA"]


def _table_rows(md: str) -> list[list[str]]:
    """Data rows of the first markdown table in ``md`` (cells stripped)."""
    lines = [line for line in md.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


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
        llama = LlamaForCausalLM(LlamaConfig(**bench.llama_config_for(cfg, 4, "sdpa").to_dict()))
    assert sum(p.numel() for p in llama.parameters()) == costs.parameter_counts(cfg)["total"]


def test_costs_cli_markdown_json_and_errors(tmp_path, capsys):
    out = tmp_path / "costs.json"
    assert costs.main(["--preset", "paper-300m", "--seq_lens", "2048", "--format", "json", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["variant"] for r in report["variants"]] == default_variants(base_config("paper-300m"))
    assert costs.main(["--preset", "tiny", "--no_meta_check", "--variants", "QKV", "Q-K=V", "--dtypes", "fp32"]) == 0
    md = capsys.readouterr().out
    assert "| Q-K=V | 50.00% | 50.0% | 512 |" in md  # 2 layers x 4 heads x 16 x 4 bytes, one tensor
    assert costs.main(["--preset", "nope"]) == 2
    assert "preset='nope' is not a known preset" in capsys.readouterr().err
    assert costs.main(["--preset", "tiny", "--override", "hiden_size=3"]) == 2
    assert "'hiden_size' is not a QKVShareConfig field" in capsys.readouterr().err
    assert costs.main(["--preset", "tiny", "--variants", "GQA-3"]) == 2
    assert "3 key/value heads must divide" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------------------------------------------------
def test_bench_end_to_end_tiny(tmp_path):
    variants = ["QKV", "Q-K=V", "Q=K=V", "GQA-2", "Q-MQA"]
    out = tmp_path / "bench"
    argv = ["--preset", "tiny", "--variants", *variants, "--context_lens", "8", "16", "--batch_sizes", "1", "2",
            "--new_tokens", "2", "--repeats", "1", "--warmup", "0", "--train_batch_size", "2", "--train_seq_len", "8",
            "--train_steps", "1", "--budget_mib", "1", "--output_dir", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    for name in ("bench.md", "bench.json", "cache.md", "decode.md", "capacity.md", "train.md", "cache_memory.png",
                 "decode_tokens_per_s.png"):  # fmt: skip
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
    assert all(r["tokens_per_s"] > 0 for r in report["train"])
    # tables: one row per (model, context) / (model, batch, context) / model
    assert len(_table_rows((out / "cache.md").read_text())) == len(models) * 2
    decode_rows = _table_rows((out / "decode.md").read_text())
    assert len(decode_rows) == len(models) * 4 and decode_rows[0][0] == "QKV (Llama weights)"
    assert [row[0] for row in _table_rows((out / "capacity.md").read_text())] == models
    assert len(_table_rows((out / "train.md").read_text())) == len(models)


def test_bench_rejects_bad_input(capsys):
    assert bench.main(["--preset", "tiny", "--batch_sizes", "0"]) == 2
    assert "--batch_sizes needs positive integers" in capsys.readouterr().err
    assert bench.main(["--preset", "tiny", "--variants", "Q=K-GQA-2"]) == 2
    assert "is not a known variant" in capsys.readouterr().err
    assert bench.main(["--preset", "tiny", "--timer", "cpu", "--device", "cuda"]) == 2
    assert "--timer cpu measures host CPU time" in capsys.readouterr().err


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
    return ["--preset", "tiny", "--variants", *variants, "--max_steps", "4", "--per_device_train_batch_size", "2",
            "--block_size", "16", "--save_steps", "2", "--eval_steps", "4", "--max_eval_samples", "4", "--output_dir",
            str(out), "--disable_tqdm", "true", *corpus]  # fmt: skip


def test_compare_end_to_end_with_resume(tmp_path, corpus, monkeypatch):
    import qkvshare.train.pretrain as pretrain

    out = tmp_path / "cmp"
    real_main = pretrain.main

    def crashing_main(argv, on_step=None):  # dies after step 3 of the second variant (checkpoint at step 2)
        def hook(step, loss, model):
            on_step(step, loss, model)
            if "Q-K=V" in argv and step == 3:
                raise RuntimeError("simulated crash")

        return real_main(argv, on_step=hook)

    monkeypatch.setattr(pretrain, "main", crashing_main)
    with pytest.raises(RuntimeError, match="simulated crash"):
        compare.main(_compare_argv(out, corpus, ["QKV", "Q-K=V"]))
    monkeypatch.setattr(pretrain, "main", real_main)
    qkv_metrics = (out / "runs" / "QKV" / "final_metrics.json").read_text()
    assert compare.main(_compare_argv(out, corpus, ["QKV", "Q-K=V"])) == 0  # QKV skipped, Q-K=V resumed at step 2
    assert (out / "runs" / "QKV" / "final_metrics.json").read_text() == qkv_metrics
    log = compare.read_log(out / "logs" / "Q-K_eq_V.jsonl")
    assert sorted(log) == [1, 2, 3, 4]

    # an uninterrupted run of Q-K=V gives the same validation loss as the crashed-and-resumed one
    fresh = tmp_path / "fresh"
    assert compare.main(_compare_argv(fresh, corpus, ["Q-K=V"])) == 0
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
    assert compare.main(_compare_argv(out, corpus, ["QKV"]) + ["--learning_rate", "0.5"]) == 2


# ----------------------------------------------------------------------------------------------------------------
# analyze
# ----------------------------------------------------------------------------------------------------------------
def _direct(wa: torch.Tensor, wb: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(wa.double().flatten(), wb.double().flatten(), dim=0).item()


def test_analyze_tied_layer_and_direct_computation(tmp_path, capsys):
    cfg = QKVShareConfig.from_preset("tiny", layer_projection_sharing=["none", "kv"])
    model = QKVShareForCausalLM(cfg)
    model.save_pretrained(tmp_path / "m")
    assert weights.main([str(tmp_path / "m")]) == 0
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

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    llama.save_pretrained(tmp_path / "llama")
    report = weights.analyze(tmp_path / "llama")
    attn = llama.model.layers[1].self_attn
    k_expanded = attn.k_proj.weight.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    assert report["layers"][1]["mode"] == "none"
    assert report["layers"][1]["cos_qk"] == pytest.approx(_direct(attn.q_proj.weight, k_expanded), abs=1e-12)
    assert report["layers"][1]["cos_kv"] == pytest.approx(_direct(attn.k_proj.weight, attn.v_proj.weight), abs=1e-12)
    # costs takes the shape from any Llama checkpoint directory
    out = tmp_path / "costs.json"
    assert costs.main(["--model_dir", str(tmp_path / "llama"), "--variants", "GQA-2", "Q-GQA-2", "--format", "json",
                       "--output", str(out)]) == 0  # fmt: skip
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
    assert weights.main([str(tmp_path / "pickled")]) == 2
    assert "pickle files are never loaded" in capsys.readouterr().err
