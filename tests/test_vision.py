"""Vision: the ViT head (parity with transformers' ViT, every sharing mode, "+" with m=50, save/load, Auto,
pipeline, Trainer), the set anomaly model (permutation equivariance) and `qkvshare vision` (resume, bad input,
local Hugging Face datasets). Tiny configs, fp32, CPU."""

import copy
import csv
import dataclasses
import json

import pytest
import torch
from commands import command
from transformers import AutoModelForImageClassification, ViTConfig, ViTForImageClassification

import qkvshare  # noqa: F401  (registers the Auto classes)
from qkvshare import QKVShareConfig, QKVShareForImageClassification
from qkvshare.vision import run as vision_run
from qkvshare.vision.data import image_processor, load_images
from qkvshare.vision.sets import SetAnomalyModel, make_sets

EVERY_VARIANT = ["QKV", "Q=K-V", "(Q=K-V)+", "Q-K=V", "Q=K=V", "(Q=K=V)+", "GQA-2", "MQA", "Q-GQA-2", "Q-MQA"]


def tiny_vit(variant: str = "QKV", **overrides) -> QKVShareConfig:
    """The issue's small ViT: 8x8 grey images, 2x2 patches, 10 classes."""
    fields = dict(is_causal=False, image_size=8, patch_size=2, num_channels=1, num_labels=10) | overrides
    return QKVShareConfig.from_preset("tiny", variant, **fields)


def vit_pair(num_hidden_layers: int = 2) -> tuple[QKVShareForImageClassification, ViTForImageClassification]:
    """A QKV `vit-small`-style model and transformers' ViT of the same shape, with the same weights."""
    shape = dict(hidden_size=32, num_hidden_layers=num_hidden_layers, num_attention_heads=2, intermediate_size=64)
    vit = ViTForImageClassification(ViTConfig(image_size=8, patch_size=2, num_channels=3, num_labels=10, **shape))
    ours = QKVShareForImageClassification(QKVShareConfig.from_preset("vit-small", **shape))
    theirs = vit.state_dict()
    state = {
        "embeddings.projection.weight": theirs["vit.embeddings.patch_embeddings.projection.weight"],
        "embeddings.projection.bias": theirs["vit.embeddings.patch_embeddings.projection.bias"],
        "embeddings.cls_token": theirs["vit.embeddings.cls_token"],
        "embeddings.position_embeddings": theirs["vit.embeddings.position_embeddings"],
    }
    names = {
        "attention.q_proj": "self_attn.q_proj",
        "attention.k_proj": "self_attn.k_proj",
        "attention.v_proj": "self_attn.v_proj",
        "attention.o_proj": "self_attn.o_proj",
        "mlp.fc1": "mlp.up_proj",
        "mlp.fc2": "mlp.down_proj",
        "layernorm_before": "input_layernorm",
        "layernorm_after": "post_attention_layernorm",
    }
    for i in range(num_hidden_layers):
        for src, dst in names.items():
            for kind in ("weight", "bias"):
                state[f"model.layers.{i}.{dst}.{kind}"] = theirs[f"vit.layers.{i}.{src}.{kind}"]
    for kind in ("weight", "bias"):
        state[f"model.norm.{kind}"] = theirs[f"vit.layernorm.{kind}"]
        state[f"classifier.{kind}"] = theirs[f"classifier.{kind}"]
    ours.load_state_dict(state, strict=True)
    return ours.eval(), vit.eval()


def test_qkv_equals_transformers_vit_after_copying_weights():
    ours, vit = vit_pair()
    pixels = torch.randn(3, 3, 8, 8)
    labels = torch.tensor([1, 4, 9])
    mine, theirs = ours(pixel_values=pixels, labels=labels), vit(pixel_values=pixels, labels=labels)
    torch.testing.assert_close(mine.logits, theirs.logits)
    torch.testing.assert_close(mine.loss, theirs.loss)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in vit.parameters())
    # interpolate_pos_encoding resizes the learned table as ViT does
    big = torch.randn(2, 3, 12, 12)
    torch.testing.assert_close(
        ours(pixel_values=big, interpolate_pos_encoding=True).logits,
        vit(pixel_values=big, interpolate_pos_encoding=True).logits,
    )


def test_vit_paper_parameter_counts_next_to_vit_base():
    with torch.device("meta"):
        base = sum(p.numel() for p in ViTForImageClassification(ViTConfig(num_labels=1000)).parameters())
        counts = {
            v: sum(
                p.numel()
                for p in QKVShareForImageClassification(QKVShareConfig.from_preset("vit-paper", v)).parameters()
            )
            for v in ("QKV", "Q-K=V", "Q=K=V", "(Q=K=V)+", "Q-MQA")
        }
    projection = 768 * 768 + 768  # one d x d linear with bias, 12 layers
    assert base == counts["QKV"] == 86_567_656
    assert counts["Q-K=V"] == base - 12 * projection == 79_480_552
    assert counts["Q=K=V"] == base - 24 * projection
    assert counts["(Q=K=V)+"] == counts["Q=K=V"] + 12 * (50 + 1)  # m=50 weights + 1 bias per layer
    assert counts["Q-MQA"] == base - 12 * (2 * projection - (768 * 64 + 64))  # no v_proj; k_proj one head of 12


@pytest.mark.parametrize("variant", EVERY_VARIANT)
def test_forward_backward_every_mode(variant):
    config = tiny_vit(variant, attn_implementation="eager")
    model = QKVShareForImageClassification(config)
    pixels, labels = torch.randn(3, 1, 8, 8), torch.tensor([0, 3, 9])
    out = model(pixel_values=pixels, labels=labels, output_attentions=True)
    assert out.logits.shape == (3, 10) and out.attentions[0].shape == (3, 4, 17, 17)  # class token + 16 patches
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, labels))
    out.loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    attention = model.model.layers[0].self_attn
    assert hasattr(attention, "v_proj") == (config.projection_sharing in ("none", "qk"))
    assert hasattr(attention, "q_proj") == (config.projection_sharing in ("none", "kv"))
    assert (attention.attention_map_pe is not None) == variant.endswith("+")
    # bidirectional: the class token (position 0) reads the last patch
    changed = pixels.clone()
    changed[:, :, -2:, -2:] += 1.0
    assert (model(pixel_values=changed).logits - out.logits).abs().max() > 1e-4


def test_mean_pooling_and_fixed_2d_positions():
    config = tiny_vit("Q-K=V", pooling="mean", patch_position_embedding_type="sincos2d")
    model = QKVShareForImageClassification(config).eval()
    assert model.embeddings.cls_token is None and model.embeddings.position_embeddings is None  # nothing unused
    pixels = torch.randn(2, 1, 8, 8)
    hidden = model(pixel_values=pixels, output_hidden_states=True).hidden_states
    assert hidden[0].shape == (2, 16, 64)  # no class token
    torch.testing.assert_close(
        model(pixel_values=pixels).logits, model.classifier(model.model.norm(hidden[-1]).mean(1))
    )
    # the 2D encoding: patch (r, c) gets sin/cos of r in the first half of the channels and of c in the second
    positions = model.embeddings(pixels) - model.embeddings.projection(pixels).flatten(2).transpose(1, 2)
    one = torch.tensor(1.0)
    torch.testing.assert_close(positions[0, 6, :2], torch.stack((one.sin(), one.cos())))  # row 1 ...
    torch.testing.assert_close(positions[0, 6, 32:34], torch.stack(((2 * one).sin(), (2 * one).cos())))  # column 2
    assert model(pixel_values=torch.randn(1, 1, 12, 12)).logits.shape == (1, 10)  # any grid size


def test_plus_with_m50_sdpa_equals_eager():
    config = QKVShareConfig.from_preset("vit-small", "(Q=K=V)+", hidden_size=32, num_attention_heads=2)
    assert config.attention_map_pe_dim == 50  # the paper's ViT
    assert QKVShareConfig.from_preset("tiny", "(Q=K=V)+").attention_map_pe_dim == 10
    torch.manual_seed(0)
    sdpa = QKVShareForImageClassification._from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    eager = QKVShareForImageClassification._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    eager.load_state_dict(sdpa.state_dict())
    pixels = torch.randn(3, 3, 8, 8)
    torch.testing.assert_close(sdpa(pixel_values=pixels).logits, eager(pixel_values=pixels).logits)


def test_bad_inputs_and_fields_raise_value_errors():
    model = QKVShareForImageClassification(tiny_vit())
    with pytest.raises(ValueError, match=r"pixel_values must have shape \(batch, num_channels=1, height, width\)"):
        model(pixel_values=torch.randn(2, 3, 8, 8))
    with pytest.raises(ValueError, match="learned position table is for image_size=8.*interpolate_pos_encoding"):
        model(pixel_values=torch.randn(2, 1, 12, 12))
    with pytest.raises(ValueError, match="multiples of patch_size=2"):
        model(pixel_values=torch.randn(2, 1, 7, 7), interpolate_pos_encoding=True)
    with pytest.raises(ValueError, match="is_causal=True: QKVShareForImageClassification is a bidirectional"):
        QKVShareForImageClassification(tiny_vit(is_causal=True))
    with pytest.raises(ValueError, match="pooling='max' is not supported; allowed values: 'cls', 'mean'"):
        tiny_vit(pooling="max")
    with pytest.raises(ValueError, match="patch_position_embedding_type='rope' is not supported"):
        tiny_vit(patch_position_embedding_type="rope")
    with pytest.raises(ValueError, match="image_size=10 is not a multiple of patch_size=4"):
        tiny_vit(image_size=10, patch_size=4)
    with pytest.raises(ValueError, match="built without token embeddings"):
        model.model(input_ids=torch.zeros(1, 3, dtype=torch.long))


def test_qv_ka_is_a_vision_variant():
    # `qkvshare vision --variants QV-Ka` was refused with "pass head_dim", an argument the command does not have.
    args = vision_run.VisionArgs(variants=["QV-Ka", "(QV-Ka)+"], hidden_size=32, heads=2, seeds=[0])
    vision_run.validate(args)
    for task, m in (("classify", 50), ("sets", vision_run.SET_ATTENTION_MAP_PE_DIM)):
        cells = vision_run.make_cells(dataclasses.replace(args, task=task), "digits", 2)
        configs = [vision_run.build_config(cell, 10, 8) for cell in cells]
        assert [(c.variant, c.key_context_dim, c.attention_map_pe_dim) for c in configs] == [
            ("QV-Ka", 16, 0),
            ("(QV-Ka)+", 16, m),
        ], task


def test_save_load_auto_and_pipeline(tmp_path):
    from PIL import Image
    from transformers import pipeline

    config = QKVShareConfig.from_preset("vit-small", "Q-K=V", hidden_size=32, num_attention_heads=2)
    config.id2label = {i: f"digit {i}" for i in range(10)}
    config.label2id = {v: k for k, v in config.id2label.items()}
    model = QKVShareForImageClassification(config).eval()
    model.save_pretrained(tmp_path)
    image_processor(8).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForImageClassification"] == "modeling_qkvshare.QKVShareForImageClassification"
    loaded = AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    assert type(loaded) is QKVShareForImageClassification and loaded.config.variant == "Q-K=V"
    pixels = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(loaded(pixel_values=pixels).logits, model(pixel_values=pixels).logits, rtol=0, atol=0)

    images = [Image.fromarray((torch.rand(8, 8) * 255).to(torch.uint8).numpy(), mode="L") for _ in range(2)]
    classify = pipeline("image-classification", model=str(tmp_path), device="cpu")
    predictions = classify(images, top_k=3)
    processed = image_processor(8)([im.convert("RGB") for im in images], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        probabilities = model(pixel_values=processed).logits.softmax(-1)
    for prediction, expected in zip(predictions, probabilities):
        top = expected.topk(3)
        assert [p["label"] for p in prediction] == [f"digit {i}" for i in top.indices.tolist()]
        torch.testing.assert_close(torch.tensor([p["score"] for p in prediction]), top.values, rtol=1e-5, atol=1e-6)


def test_trainer_trains_the_image_model(tmp_path):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = QKVShareForImageClassification(tiny_vit("Q=K=V"))
    data = [{"pixel_values": torch.randn(1, 8, 8), "labels": i % 10} for i in range(16)]
    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    before = model.classifier.weight.detach().clone()
    trainer = Trainer(model=model, args=arguments, train_dataset=data, eval_dataset=data)
    trainer.train()
    assert not torch.equal(before, model.classifier.weight)
    model.eval()
    with torch.no_grad():
        pixels = torch.stack([d["pixel_values"] for d in data])
        expected = torch.nn.functional.cross_entropy(model(pixel_values=pixels).logits, torch.arange(16) % 10)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(float(expected), rel=1e-5)


# ----- the set anomaly task -----
@pytest.mark.parametrize("variant", ["QKV", "Q=K-V", "Q-K=V", "Q=K=V", "Q-MQA", "(Q=K=V)+"])
def test_set_model_is_permutation_equivariant_without_plus(variant):
    config = (
        QKVShareConfig.from_preset("vit-small", variant, hidden_size=32, num_attention_heads=2, attention_map_pe_dim=10)
        if variant.endswith("+")
        else QKVShareConfig.from_preset("vit-small", variant, hidden_size=32, num_attention_heads=2)
    )
    model = SetAnomalyModel(config, feature_dim=12).eval()
    features, labels = torch.randn(4, 10, 12), torch.tensor([0, 3, 7, 9])
    permutation = torch.randperm(10)
    with torch.no_grad():
        logits, loss = model(features, labels)
        permuted, _ = model(features[:, permutation])
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, labels))
    if variant.endswith("+"):  # the attention-map encoding depends on the item order
        assert (permuted - logits[:, permutation]).abs().max() > 1e-3
    else:
        torch.testing.assert_close(permuted, logits[:, permutation])


def test_make_sets_puts_one_odd_item_among_nine_of_one_class():
    labels = torch.arange(60) % 4  # 4 classes of 15
    sets, odd = make_sets(labels, torch.Generator().manual_seed(0))
    assert sets.shape == (60, 10)
    for i, (members, position) in enumerate(zip(sets, odd)):
        assert members[position] == i
        others = torch.cat((members[:position], members[position + 1 :]))
        assert len(set(others.tolist())) == 9 and len(set(labels[others].tolist())) == 1
        assert labels[others[0]] != labels[i]
    with pytest.raises(ValueError, match="at least 2 classes with 9 items each"):
        make_sets(torch.arange(20) % 4, torch.Generator())


# ----- the command -----
def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_cli_on_digits_resumes_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "run"
    tiny_budget = ["--output_dir", str(out), "--epochs", "1", "--max_train", "120", "--max_test", "40"]
    tiny_budget += ["--hidden_size", "16", "--heads", "2", "--workers", "1", "--map_images", "2"]
    assert command("vision")([*tiny_budget, "--variants", "QKV", "(Q=K=V)+", "--seeds", "0"]) == 0
    rows = read_rows(out / "results.csv")
    assert [r["variant"] for r in rows] == ["QKV", "(Q=K=V)+"] and {r["test_size"] for r in rows} == {"40"}
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 for r in rows)
    assert (out / "accuracy.png").stat().st_size > 0 and (out / "attention_maps.png").stat().st_size > 0
    assert (out / "models" / "classify_QKV_s0" / "preprocessor_config.json").exists()
    capsys.readouterr()
    # resume: the finished cells are skipped, a new seed trains only its own cells
    assert command("vision")([*tiny_budget, "--variants", "QKV", "(Q=K=V)+", "--seeds", "0", "1", "--no_plots"]) == 0
    assert "trained 2 cells, skipped 2 finished ones" in capsys.readouterr().out
    rows = read_rows(out / "results.csv")
    assert sorted((r["variant"], r["seed"]) for r in rows) == sorted(
        [("QKV", "0"), ("(Q=K=V)+", "0"), ("QKV", "1"), ("(Q=K=V)+", "1")]
    )
    table = (out / "table.md").read_text()
    assert "| QKV |" in table and "| 2 |" in table and ".767-.772" in table
    # bad input: exit status 2 and one message naming it, before any work
    for argv, message in (
        (["--variants", "Q=K=V+"], "variant='Q=K=V+' is not a known variant"),
        (["--task", "detect"], "--task 'detect' is not supported; choose one of classify, sets"),
        (["--dataset", "imagefolder"], "--dataset imagefolder needs --data_dir"),
        (["--pooling", "max"], "--pooling 'max' is not supported"),
        (["--hidden_size", "30", "--heads", "4"], "--hidden_size 30 is not divisible by --heads 4"),
        (["--dataset", str(tmp_path / "missing")], f"--dataset {tmp_path / 'missing'}: could not load it"),
    ):
        assert command("vision")([*argv, "--output_dir", str(tmp_path / "bad")]) == 2
        captured = capsys.readouterr()
        assert message in captured.err and "Traceback" not in captured.err
    assert not (tmp_path / "bad").exists()


def test_sets_task_on_digits(tmp_path, capsys):
    argv = ["--task", "sets", "--output_dir", str(tmp_path), "--epochs", "1", "--max_train", "300", "--max_test"]
    argv += ["200", "--hidden_size", "16", "--heads", "2", "--workers", "1", "--no_plots", "--seeds", "0"]
    assert command("vision")([*argv, "--variants", "Q-K=V", "(Q=K=V)+"]) == 0
    rows = read_rows(tmp_path / "results.csv")
    assert [r["task"] for r in rows] == ["sets", "sets"] and {r["test_size"] for r in rows} == {"200"}
    assert "set accuracy" in (tmp_path / "table.md").read_text()


def test_set_features_from_a_local_backbone(tmp_path):
    from PIL import Image
    from transformers import ViTModel

    from qkvshare.vision.sets import extract_features

    backbone = ViTModel(
        ViTConfig(
            image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    ).eval()
    backbone.save_pretrained(tmp_path)
    image_processor(8).save_pretrained(tmp_path)
    images = [Image.new("RGB", (8, 8), (30 * i, 0, 255 - 30 * i)) for i in range(3)]
    features = extract_features(images, str(tmp_path), image_size=8, feature_dim=5, batch_size=2)
    with torch.no_grad():
        expected = backbone(pixel_values=image_processor(8)(images, return_tensors="pt")["pixel_values"]).pooler_output
    torch.testing.assert_close(features, expected)
    pixels = extract_features(images, "pixels", image_size=8, feature_dim=5)
    assert pixels.shape == (3, 5) and torch.equal(pixels, extract_features(images, "pixels", 8, 5))  # fixed seed


def local_dataset(tmp_path):
    """A datasets.Dataset of 12x12 RGB images with Image and ClassLabel features, train and test splits."""
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)

    def split(n):
        images = [Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)) for _ in range(n)]
        features = datasets.Features({"img": datasets.Image(), "fine": datasets.ClassLabel(names=["a", "b", "c"])})
        return datasets.Dataset.from_dict({"img": images, "fine": [i % 3 for i in range(n)]}, features=features)

    path = tmp_path / "local_ds"
    datasets.DatasetDict({"train": split(30), "test": split(9)}).save_to_disk(str(path))
    return path


def test_hugging_face_dataset_path_on_local_data(tmp_path, capsys):
    path = local_dataset(tmp_path)
    splits = load_images(str(path))  # image and label columns detected from the features
    assert len(splits.train_images) == 30 and len(splits.test_images) == 9 and splits.class_names == ["a", "b", "c"]
    assert splits.train_y.tolist()[:4] == [0, 1, 2, 0] and splits.native_size == 12
    with pytest.raises(ValueError, match="--image_column: 'picture' is not a column; the columns are img, fine"):
        load_images(str(path), image_column="picture")
    # an image folder (one sub-folder per class), without a test split: 20% of train held out
    from PIL import Image

    for label in ("cat", "dog"):
        (tmp_path / "folder" / label).mkdir(parents=True)
        for i in range(5):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / "folder" / label / f"{i}.png")
    folder = load_images("imagefolder", data_dir=str(tmp_path / "folder"))
    assert (len(folder.train_images), len(folder.test_images)) == (8, 2) and folder.class_names == ["cat", "dog"]
    # the command end to end on the saved dataset (patch 12 / 4 = 3 -> 16 patches)
    argv = ["--dataset", str(path), "--output_dir", str(tmp_path / "out"), "--epochs", "1", "--hidden_size", "16"]
    argv += ["--heads", "2", "--workers", "1", "--no_plots", "--seeds", "0", "--variants", "Q-MQA"]
    assert command("vision")(argv) == 0
    (row,) = read_rows(tmp_path / "out" / "results.csv")
    assert (row["train_size"], row["test_size"], row["variant"]) == ("30", "9", "Q-MQA")
    assert command("vision")([*argv, "--label_column", "nope"]) == 2
    assert "--label_column: 'nope' is not a column" in capsys.readouterr().err
