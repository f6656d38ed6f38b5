"""Synthetic tasks, the encoder heads, score symmetry of Q=K variants, and the resumable `qkvshare synthetic` sweep."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from commands import command
from test_core import eager_scores  # the eager-path score recorder shared with the core tests

import qkvshare  # noqa: F401  (registers the Auto classes)
from qkvshare import QKVShareConfig, QKVShareForSequenceClassification, QKVShareForTokenClassification
from qkvshare.synthetic.plots import mean_attention_map
from qkvshare.synthetic.sweep import SweepArgs, get_lr, run_sweep
from qkvshare.synthetic.tasks import TASKS, make_dataset, task_targets

main = command("synthetic")


def test_task_targets_on_hand_written_examples():
    x = torch.tensor([[3, 1, 4, 1, 5, 9]])
    assert task_targets("copy", x).tolist() == [[3, 1, 4, 1, 5, 9]]
    assert task_targets("reverse", x).tolist() == [[9, 5, 1, 4, 1, 3]]
    assert task_targets("sort", x).tolist() == [[1, 1, 3, 4, 5, 9]]
    assert task_targets("sub", x).tolist() == [[6, 8, 5, 8, 4, 0]]
    assert task_targets("swap", x).tolist() == [[1, 5, 9, 3, 1, 4]]
    assert TASKS == ("reverse", "sort", "sub", "swap", "copy")
    with pytest.raises(ValueError, match="even sequence length"):
        task_targets("swap", torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="allowed: reverse, sort, sub, swap, copy"):
        task_targets("rotate", x)


def test_datasets_are_seeded_and_uniform():
    x, y = make_dataset("sub", 4000, 16, seed=3)
    x2, _ = make_dataset("sub", 4000, 16, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, 9 - x)
    counts = torch.bincount(x.flatten(), minlength=10).float() / x.numel()
    assert counts.min() > 0.09 and counts.max() < 0.11  # uniform over the 10 symbols


def encoder_config(variant: str, **overrides) -> QKVShareConfig:
    fields = dict(
        vocab_size=10,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=12,
        position_embedding_type="learned",
        is_causal=False,
        num_labels=10,
        norm_type="layernorm",
        mlp_type="plain",
        hidden_act="gelu_new",
        attention_bias=True,
        attention_map_pe_init="xavier",
        pad_token_id=0,
    )
    fields.update(overrides)
    return QKVShareConfig.from_preset("tiny", variant=variant, **fields)


@pytest.mark.parametrize("variant", ["QKV", "Q=K-V", "(Q=K-V)+", "Q-K=V", "Q=K=V", "(Q=K=V)+"])
def test_token_classification_loss_is_cross_entropy(variant):
    torch.manual_seed(0)
    model = QKVShareForTokenClassification(encoder_config(variant)).eval()
    x = torch.randint(0, 10, (3, 12))
    labels = task_targets("reverse", x)
    labels[0, :2] = -100  # ignored positions
    out = model(input_ids=x, labels=labels)
    assert out.logits.shape == (3, 12, 10)
    expected = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 10), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    # bidirectional: the first token's output depends on the last token
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % 10
    assert (model(input_ids=x2).logits[:, 0] - out.logits[:, 0]).abs().max() > 1e-4


def test_sequence_classification_shape_and_loss():
    torch.manual_seed(0)
    model = QKVShareForSequenceClassification(encoder_config("Q-K=V", num_labels=3)).eval()
    x = torch.randint(1, 10, (4, 12))
    labels = torch.tensor([0, 2, 1, 2])
    out = model(input_ids=x, labels=labels)
    assert out.logits.shape == (4, 3)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, labels))


def layer0_scores(model: QKVShareForTokenClassification, x: torch.Tensor) -> torch.Tensor:
    """Pre-softmax scores (B, H, T, T) of the first layer, "+" term included, as the eager attention path scores."""
    return eager_scores(model, x, layer=0)


@pytest.mark.parametrize(
    "variant,symmetric", [("Q=K-V", True), ("Q=K=V", True), ("QKV", False), ("(Q=K-V)+", False), ("(Q=K=V)+", False)]
)
def test_scores_symmetric_only_for_plain_query_equals_key(variant, symmetric):
    torch.manual_seed(0)
    model = QKVShareForTokenClassification(encoder_config(variant)).eval()
    with torch.no_grad():
        scores = layer0_scores(model, torch.randint(0, 10, (2, 12)))
    asymmetry = float((scores - scores.transpose(-1, -2)).abs().max())
    if symmetric:
        assert asymmetry < 1e-5
    else:
        assert asymmetry > 1e-3


def test_lr_schedule_warmup_then_cosine():
    assert get_lr(0, 100, 1e-3, 0.05) == pytest.approx(2e-4)
    assert get_lr(4, 100, 1e-3, 0.05) == pytest.approx(1e-3)
    assert get_lr(99, 100, 1e-3, 0.05) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(94 / 95 * math.pi)))


def sweep_args(tmp_path, **overrides) -> SweepArgs:
    fields = dict(
        output_dir=str(tmp_path / "sweep"),
        variants=["QKV"],
        tasks=["copy"],
        embedding_sizes=[32],
        layers=[1],
        heads=[2],
        lengths=[8],
        seeds=[0],
        train_size=2048,
        test_size=256,
        epochs=1,
        batch_size=64,
        lr=3e-3,
        workers=1,
        plots=False,
    )
    fields.update(overrides)
    return SweepArgs(**fields)


def test_one_cell_sweep_learns_copy_and_resume_skips_it(tmp_path):
    args = sweep_args(tmp_path)
    first = run_sweep(args)
    assert len(first.trained) == 1 and first.skipped == []
    (row,) = first.rows
    assert float(row["token_accuracy"]) > 0.95
    assert int(row["steps"]) == 32
    csv_path = tmp_path / "sweep" / "results.csv"
    before = csv_path.read_bytes()
    mtime = csv_path.stat().st_mtime_ns

    second = run_sweep(args)  # same grid: nothing retrained
    assert second.trained == [] and second.skipped == first.trained
    assert csv_path.read_bytes() == before and csv_path.stat().st_mtime_ns == mtime
    assert "| QKV | 1.000" in second.table or float(row["token_accuracy"]) < 0.9995

    # Extending the grid trains only the new cell; the old row stays.
    third = run_sweep(sweep_args(tmp_path, tasks=["copy", "sub"]))
    assert [key.split("|")[1] for key in third.trained] == ["sub"] and len(third.skipped) == 1
    with csv_path.open() as f:
        assert [r["task"] for r in csv.DictReader(f)] == ["copy", "sub"]


def test_cli_writes_table_and_figures(tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(
        [
            "--output_dir",
            str(out),
            "--variants",
            "QKV",
            "(Q=K=V)+",
            "--tasks",
            "reverse",
            "--embedding_sizes",
            "16",
            "--layers",
            "1",
            "--heads",
            "2",
            "--lengths",
            "6",
            "--seeds",
            "0",
            "--train_size",
            "256",
            "--test_size",
            "64",
            "--epochs",
            "1",
            "--workers",
            "1",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "| (Q=K=V)+ |" in printed and "(0.581)" in printed  # the paper's REVERSE number alongside ours
    for name in ("attention_maps.png", "loss_curves.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list((out / "models").iterdir())) == 2  # the figure cell's models, as safetensors
    assert all((d / "model.safetensors").exists() for d in (out / "models").iterdir())
    # the figure's maps come from eager attention probabilities: every row sums to 1
    attention = mean_attention_map(next((out / "models").iterdir()), "reverse", 6, layer=0)
    assert attention.shape == (6, 6)
    torch.testing.assert_close(attention.sum(-1), torch.ones(6))


def test_bad_arguments_fail_before_training(tmp_path, capsys):
    assert main(["--output_dir", str(tmp_path / "x"), "--tasks", "rotate"]) == 2
    assert "allowed: reverse, sort, sub, swap, copy" in capsys.readouterr().err
    assert main(["--output_dir", str(tmp_path / "x"), "--variants", "Q=K=Q"]) == 2
    assert "not a known variant" in capsys.readouterr().err
    assert main(["--output_dir", str(tmp_path / "x"), "--lengths", "7"]) == 2
    assert "even when the swap task" in capsys.readouterr().err
    assert main(["--output_dir", str(tmp_path / "x"), "--grid", "huge"]) == 2
    assert "allowed: paper, default" in capsys.readouterr().err
    assert not (tmp_path / "x" / "results.csv").exists()


def test_missing_figure_model_is_reported_not_silently_dropped(tmp_path, capsys):
    args = sweep_args(tmp_path, train_size=128, test_size=32, plots=True)
    run_sweep(args)
    (model_dir,) = (tmp_path / "sweep" / "models").iterdir()
    assert model_dir.name == "copy_QKV_e32_l1_h2_t8_s0"  # the variant's part through the shared `slug`
    assert "leaves out" not in capsys.readouterr().err
    model_dir.rename(model_dir.with_name("copy_QKV_old_name"))  # as saved by an older naming, or deleted
    result = run_sweep(args)  # nothing to train: the cell is in results.csv
    assert result.trained == []
    err = capsys.readouterr().err
    assert "attention_maps.png leaves out 1 figure cell(s) whose model is not in" in err and "(copy QKV)" in err
    assert "Delete their rows from results.csv to retrain them." in err
