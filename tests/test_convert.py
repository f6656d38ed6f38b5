"""Tests of issue 11: `QKVShareConfig.from_llama`, `qkvshare convert` (exact copy, mean-pooled heads, the
calibrated K=V fit and its fold into o_proj, cached decoding, save/load), `qkvshare train --init_from`, and every
bad input. Tiny random Llama / Qwen2 models, fp32, CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from commands import command
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import qkvshare_cli
from qkvshare import QKVShareCache, QKVShareConfig
from qkvshare.convert import (
    calibration_ids,
    convert,
    fit_head_maps,
    fold_into_o_proj,
    plan_conversion,
    save_converted,
)
from qkvshare.train.tokenizer import train_bpe_tokenizer

train_main = command("train")

VOCAB, HEADS, HEAD_DIM = 384, 4, 16


def llama(kv_heads: int = HEADS, seed: int = 0, layers: int = 2, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        **{"max_position_embeddings": 128, **overrides},
    )
    return LlamaForCausalLM(config).eval()


def ids(batch: int = 4, length: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def o_proj_output(model, layer: int, input_ids: torch.Tensor) -> torch.Tensor:
    """The attention output (after o_proj) of one layer in a full forward."""
    captured = []
    handle = model.model.layers[layer].self_attn.o_proj.register_forward_hook(lambda m, a, out: captured.append(out))
    with torch.no_grad():
        model(input_ids)
    handle.remove()
    return captured[0]


@pytest.fixture(scope="module")
def source_dir(corpus, tmp_path_factory) -> Path:
    """A saved tiny GQA Llama with its own (BPE) tokenizer, as a user's checkpoint directory."""
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    tokenizer = train_bpe_tokenizer(texts, 320, model_max_length=128)
    model = llama(kv_heads=2, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    out = tmp_path_factory.mktemp("source") / "llama"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_heads", [HEADS, 2])
def test_none_conversion_gives_the_source_logits(kv_heads):
    source = llama(kv_heads)
    model, record = convert(source)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, source(x).logits, rtol=0, atol=0)
    assert model.config.num_key_value_heads == kv_heads and record.method is None and record.head_pooling is None


def test_qwen2_biases_copy_exactly_and_calibrate_with_an_intercept():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    source = Qwen2ForCausalLM(config).eval()
    for layer in source.model.layers:  # random biases (init leaves them zero), so the test sees them
        for name in ("q_proj", "k_proj", "v_proj"):
            torch.nn.init.normal_(getattr(layer.self_attn, name).bias, std=0.5)
    copy, _ = convert(source)
    assert copy.config.attention_bias and not copy.model.layers[0].self_attn.o_proj.bias.any()
    with torch.no_grad():
        torch.testing.assert_close(copy(ids()).logits, source(ids()).logits, rtol=0, atol=1e-6)
    _, record = convert(source, "Q-K=V", calibration_ids=ids())
    assert all(c < k for c, k in zip(record.layer_errors["calibrated"], record.layer_errors["key"]))


def test_mean_pooled_heads_equal_the_hand_computed_mean():
    source = llama(kv_heads=HEADS)
    mqa, record = convert(source, "GQA-2")
    qmqa, _ = convert(source, "Q-MQA", "key")
    for i, layer in enumerate(source.model.layers):
        for name in ("k_proj", "v_proj"):
            w = getattr(layer.self_attn, name).weight.view(HEADS, HEAD_DIM, -1)
            expected = torch.stack([(w[0] + w[1]) / 2, (w[2] + w[3]) / 2]).view(2 * HEAD_DIM, -1)
            torch.testing.assert_close(getattr(mqa.model.layers[i].self_attn, name).weight, expected)
        w_k = layer.self_attn.k_proj.weight.view(HEADS, HEAD_DIM, -1)
        torch.testing.assert_close(qmqa.model.layers[i].self_attn.k_proj.weight, w_k.mean(0))
        torch.testing.assert_close(qmqa.model.layers[i].self_attn.q_proj.weight, layer.self_attn.q_proj.weight)
    assert record.head_pooling == "mean" and mqa.config.variant == "GQA-2"
    # From a GQA-2 source to MQA: the two source heads, each serving two query heads, weigh equally.
    gqa = llama(kv_heads=2)
    mqa, _ = convert(gqa, "MQA")
    w = gqa.model.layers[0].self_attn.v_proj.weight.view(2, HEAD_DIM, -1)
    torch.testing.assert_close(mqa.model.layers[0].self_attn.v_proj.weight, (w[0] + w[1]) / 2)


def test_least_squares_fit_recovers_a_linear_map_and_folds_exactly():
    torch.manual_seed(0)
    heads, n = 3, 200
    features = torch.randn(n, heads * HEAD_DIM)
    maps = torch.randn(heads, HEAD_DIM, HEAD_DIM)
    shift = torch.randn(heads, HEAD_DIM)
    targets = (torch.einsum("nhd,hde->nhe", features.view(n, heads, HEAD_DIM), maps) + shift).reshape(n, -1)
    fitted = fit_head_maps(features, targets, heads, ridge=0.0, intercept=True)
    torch.testing.assert_close(fitted[:, :HEAD_DIM].float(), maps, rtol=0, atol=1e-4)
    torch.testing.assert_close(fitted[:, HEAD_DIM].float(), shift, rtol=0, atol=1e-4)
    o_proj = torch.nn.Linear(heads * HEAD_DIM, 8)
    expected = o_proj(targets)
    fold_into_o_proj(o_proj, fitted)
    torch.testing.assert_close(o_proj(features), expected, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def calibrated_qmqa():
    """A GQA-2 source, its calibrated Q-MQA conversion (pooled head, pre-RoPE tie) and the calibration tokens."""
    source, calibration = llama(kv_heads=2), ids(4, 48)
    model, record = convert(source, "Q-MQA", calibration_ids=calibration)
    return source, model, record, calibration


def test_calibrated_kv_beats_key_on_the_calibration_data(calibrated_qmqa):
    source, calibrated, record, calibration = calibrated_qmqa
    key, _ = convert(source, "Q-MQA", "key", kv_tie_point="pre_rope")
    assert record.method == "calibrated" and calibrated.config.kv_tie_point == "pre_rope"
    assert len(record.layer_errors["calibrated"]) == 2
    for name in ("key", "value"):
        assert all(c < e for c, e in zip(record.layer_errors["calibrated"], record.layer_errors[name])), name
    # Independently of the record: layer 0 sees the source's own input in a full forward.
    reference = o_proj_output(source, 0, calibration)
    errors = {
        name: float((o_proj_output(model, 0, calibration) - reference).norm() / reference.norm())
        for name, model in (("calibrated", calibrated), ("key", key))
    }
    assert errors["calibrated"] < errors["key"]
    assert errors["calibrated"] == pytest.approx(record.layer_errors["calibrated"][0], rel=1e-4)
    assert errors["key"] == pytest.approx(record.layer_errors["key"][0], rel=1e-4)
    # Q-K=V (the source's own key/value heads) too, by the record.
    _, record = convert(source, "Q-K=V", calibration_ids=calibration)
    assert all(c < k for c, k in zip(record.layer_errors["calibrated"], record.layer_errors["key"]))


def test_calibrated_model_decodes_exactly_with_the_tied_cache(calibrated_qmqa):
    _, calibrated, _, calibration = calibrated_qmqa
    prompt = calibration[:2, :9]
    out = calibrated.generate(prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.cache, QKVShareCache) and all(layer.values is None for layer in out.cache.layers)
    cache, sequence = QKVShareCache(calibrated.config), prompt
    with torch.no_grad():
        logits = calibrated(sequence, cache=cache, use_cache=True).logits[:, -1]
        for _ in range(4):
            torch.testing.assert_close(logits, calibrated(sequence).logits[:, -1], rtol=0, atol=1e-5)
            step = logits.argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, step], dim=1)
            logits = calibrated(step, cache=cache, use_cache=True).logits[:, -1]
    assert torch.equal(sequence, out.sequences)


def test_cli_convert_saves_a_model_directory_that_loads_back(source_dir, corpus, tmp_path, capsys):
    out = tmp_path / "converted"
    argv = ["convert", str(source_dir), "--variant", "Q-K=V", "--output_dir", str(out)]
    argv += ["--calibration_file", str(corpus), "--calibration_tokens", "512", "--calibration_block_size", "64"]
    assert qkvshare_cli.main(argv) == 0
    assert "mean attention-output error (calibrated)" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_qkvshare.QKVShareForCausalLM"
    assert config["projection_sharing"] == "kv" and config["num_key_value_heads"] == 2
    assert (out / "model.safetensors").is_file() and (out / "modeling_qkvshare.py").is_file()
    record = json.loads((out / "conversion.json").read_text())
    assert record["method"] == "calibrated" and record["calibration_tokens"] == 512 and record["variant"] == "Q-GQA-2"
    assert record["source"] == str(source_dir) and len(record["layer_errors"]["value"]) == 2
    assert record["calibration"] == "sequential" and len(record["layer_errors"]["drift"]) == 2
    # The same conversion in memory, from the same tokens, gives the saved model's logits.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(source_dir).get_vocab()
    from qkvshare.convert import calibration_texts

    calib = calibration_ids(tokenizer, calibration_texts(str(corpus))[0], 512, 64)
    in_memory, _ = convert(LlamaForCausalLM.from_pretrained(source_dir), "Q-K=V", calibration_ids=calib)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    x = calib[:2, :20]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, in_memory(x).logits, rtol=0, atol=1e-5)
    # A second conversion into it is refused unless asked to replace it.
    assert qkvshare_cli.main(argv) == 2
    assert "is not empty" in capsys.readouterr().err


def test_init_from_training_lowers_the_loss(source_dir, corpus, tmp_path):
    converted = tmp_path / "converted"
    source = LlamaForCausalLM.from_pretrained(source_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    model, record = convert(source, "Q-MQA", "key")
    save_converted(model, record, converted, tokenizer)
    losses = []
    argv = [
        *("--init_from", str(converted), "--train_file", str(corpus), "--output_dir", str(tmp_path / "run")),
        *("--use_cpu", "true", "--block_size", "32", "--per_device_train_batch_size", "4", "--max_steps", "6"),
        *("--learning_rate", "3e-3", "--warmup_steps", "1", "--logging_steps", "3", "--max_eval_samples", "2"),
        *("--validation_split_percentage", "20", "--report_to", "none", "--disable_tqdm", "true"),
        *("--sample_max_new_tokens", "0", "--save_steps", "3", "--eval_steps", "6"),
    ]
    assert train_main(argv, on_step=lambda step, loss, m: losses.append(loss)) == 0
    assert sum(losses[-2:]) / 2 < losses[0] - 0.3, losses  # 5.96 -> 5.54 (seeded)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["vocab_size"] == VOCAB and saved["projection_sharing"] == "kv" and saved["num_key_value_heads"] == 1
    assert AutoTokenizer.from_pretrained(tmp_path / "run").get_vocab() == tokenizer.get_vocab()
    # Resuming the run continues from its checkpoint (the --init_from weights are not reloaded over it).
    resumed = []
    argv_more = [a if a != "6" else "7" for a in argv] + ["--resume_from_checkpoint", "latest"]
    assert train_main(argv_more, on_step=lambda step, loss, m: resumed.append(step)) == 0
    assert resumed == [7]


# --------------------------------------------------------------------------------------------------------------
def test_from_llama_maps_shapes_variants_and_windows(caplog):
    d = llama(kv_heads=2).config.to_dict()
    config = QKVShareConfig.from_llama(d)
    assert (config.num_key_value_heads, config.head_dim, config.norm_eps) == (2, HEAD_DIM, 1e-5)
    assert QKVShareConfig.from_llama(d, "Q-K=V").variant == "Q-GQA-2"  # keeps the source's key/value heads
    assert QKVShareConfig.from_llama(d, "Q-MQA", kv_tie_point="pre_rope").kv_tie_point == "pre_rope"
    legacy = dict(d, rope_parameters=None, rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert QKVShareConfig.from_llama(legacy).rope_parameters == {
        "rope_type": "linear",
        "factor": 2.0,
        "rope_theta": 5e5,
    }
    mistral = dict(d, model_type="mistral", sliding_window=64)
    assert QKVShareConfig.from_llama(mistral).max_position_embeddings == 64
    with pytest.raises(ValueError, match=r"'projection_shareing' \(did you mean 'projection_sharing'\?\)"):
        QKVShareConfig.from_llama(d, projection_shareing="kv")


BAD_CONVERSIONS = {
    "architecture": ({"model_type": "gpt2"}, None, {}, r"model_type='gpt2'.*supported architectures: llama, mistral"),
    "Q=K on GQA": (
        None,
        "Q=K-V",
        {},
        r"variant='Q=K-V' needs 4 key/value heads.*needs num_key_value_heads == num_attention",
    ),
    "more kv heads": (None, "GQA-4", {}, r"needs 4 key/value heads but the source has 2"),
    "plus map": (None, "(Q-K=V)+", {}, r"'\+' attention-map encoding"),
    "method without K=V": (None, "MQA", {"method": "value"}, r"variant='MQA' \(MQA\) has no K=V layer"),
    "shape override": (None, "Q-K=V", {"hidden_size": 32}, r"hidden_size would change the shape"),
}


@pytest.mark.parametrize("case", BAD_CONVERSIONS)
def test_bad_conversions_are_refused_before_any_work(case):
    config, variant, kwargs, message = BAD_CONVERSIONS[case]
    with pytest.raises(ValueError, match=message):
        plan_conversion(config or llama(kv_heads=2).config, variant, **kwargs)


def test_missing_or_too_small_calibration_set_is_refused():
    source = llama(kv_heads=2)
    with pytest.raises(ValueError, match="methods 'calibrated' and 'transfer' need calibration text"):
        convert(source, "Q-K=V")
    with pytest.raises(ValueError, match=r"has 40 tokens .* at least 68 tokens"):
        convert(source, "Q-K=V", calibration_ids=ids(2, 20))
    with pytest.raises(ValueError, match=r"outside the source's vocabulary \[0, 384\)"):
        convert(source, "Q-K=V", calibration_ids=ids(4, 32) + VOCAB)


def test_cli_bad_inputs_exit_2_with_one_paragraph(source_dir, corpus, tmp_path, capsys):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    tiny_text = tmp_path / "tiny.txt"
    tiny_text.write_text("def f(): pass\n")
    out = str(tmp_path / "out")
    cases = {
        "supported architectures: llama, mistral, qwen2": [str(gpt2), "--variant", "Q-K=V"],
        "needs 4 key/value heads but the source has 2": [str(source_dir), "--variant", "GQA-4"],
        "--calibration_file 'missing.txt' does not exist": [
            str(source_dir),
            *("--variant", "Q-K=V", "--calibration_file", "missing.txt"),
        ],
        "too few to fit": [str(source_dir), "--variant", "Q-K=V", "--calibration_file", str(tiny_text)],
        "does not exist; pass a model directory": ["nowhere", "--variant", "MQA"],
    }
    for message, argv in cases.items():
        assert qkvshare_cli.main(["convert", *argv, "--output_dir", out]) == 2, message
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1, err
    assert not Path(out).exists()


def test_cli_convert_fills_fields_left_out_of_config_json_as_transformers_does(tmp_path, capsys):
    # LlamaConfig defaults num_attention_heads to 32, so a config.json may leave it out; transformers then loads 32
    # heads, and so must convert (it ended in a KeyError).
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=32 * 4, intermediate_size=64, num_hidden_layers=1, num_key_value_heads=8)
    source = LlamaForCausalLM(LlamaConfig(num_attention_heads=32, **shape)).eval()
    src = tmp_path / "llama"
    source.save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    del config["num_attention_heads"]
    (src / "config.json").write_text(json.dumps(config))
    assert LlamaForCausalLM.from_pretrained(src).config.num_attention_heads == 32
    out = tmp_path / "converted"
    assert qkvshare_cli.main(["convert", str(src), "--variant", "QKV", "--output_dir", str(out)]) == 0, (
        capsys.readouterr()
    )
    converted = AutoModelForCausalLM.from_pretrained(out)
    assert (converted.config.num_attention_heads, converted.config.num_key_value_heads) == (32, 8)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(converted(x).logits, source(x).logits, rtol=0, atol=0)
    from qkvshare.analysis.common import config_from_model_dir

    assert config_from_model_dir(src).num_attention_heads == 32  # `qkvshare costs/bench --model_dir` read it alike


def test_cli_convert_refuses_a_source_without_weights_or_with_a_bad_config(tmp_path, capsys):
    empty = tmp_path / "no-weights"
    LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1).save_pretrained(empty)
    bad = tmp_path / "bad-heads"
    bad.mkdir()
    config = json.loads((empty / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(config, num_attention_heads=3)))
    out = tmp_path / "out"
    cases = {
        empty: f"model directory {str(empty)!r} has no weights",
        bad: f"{bad / 'config.json'} is not a valid llama config: ",
    }
    for source, message in cases.items():
        assert qkvshare_cli.main(["convert", str(source), "--variant", "QKV", "--output_dir", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1, err
    assert "hidden size (64) is not a multiple of the number of attention heads (3)" in err
    assert not out.exists()


def test_init_from_bad_inputs(source_dir, corpus, tmp_path, capsys):
    converted = tmp_path / "converted"
    model, record = convert(LlamaForCausalLM.from_pretrained(source_dir), "Q-K=V", "key")
    save_converted(model, record, converted)  # no tokenizer saved
    other = tmp_path / "other-tokenizer"
    train_bpe_tokenizer(["completely different text " * 50], 300).save_pretrained(other)
    base = ["--train_file", str(corpus), "--output_dir", str(tmp_path / "run"), "--use_cpu", "true"]
    cases = {
        "holds no tokenizer; pass --tokenizer_name": ["--init_from", str(converted)],
        "does not match the vocabulary of --init_from": [
            *("--init_from", str(_with_tokenizer(converted, source_dir, tmp_path))),
            *("--tokenizer_name", str(other)),
        ],
        "--variant cannot be combined with --init_from": ["--init_from", str(converted), "--variant", "MQA"],
        "model_type='llama' model, not a QKVShare one": ["--init_from", str(source_dir)],
    }
    for message, argv in cases.items():
        assert train_main([*argv, *base]) == 2, message
        assert message in capsys.readouterr().err


def _with_tokenizer(converted: Path, source_dir: Path, tmp_path: Path) -> Path:
    """A copy of `converted` with the source's tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    target = tmp_path / "with-tokenizer"
    shutil.copytree(converted, target)
    AutoTokenizer.from_pretrained(source_dir).save_pretrained(target)
    return target


# --------------------------------------------------------------------------------------------------------------
def last_layer_output(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The residual stream after the last decoder layer (before the final norm) in a full forward."""
    captured = []
    handle = model.model.layers[-1].register_forward_hook(lambda m, a, out: captured.append(out))
    with torch.no_grad():
        model(input_ids)
    handle.remove()
    return captured[0]


def test_sequential_calibration_lowers_the_final_hidden_state_error():
    """Fitting layer l on the converted model's own hidden states corrects the drift of the layers below: the
    stream after the last of 4 layers ends closer to the source's than with fits on the source's hidden states."""
    source, calibration = llama(kv_heads=2, layers=4), ids(4, 48)
    reference = last_layer_output(source, calibration)
    final = {}
    for name in ("independent", "sequential"):
        model, record = convert(source, "Q-K=V", calibration_ids=calibration, calibration=name)
        assert record.calibration == name and len(record.layer_errors["drift"]) == 4
        final[name] = float((last_layer_output(model, calibration) - reference).norm() / reference.norm())
        # the record's drift is the converted model's own stream, as a full forward computes it
        assert record.layer_errors["drift"][-1] == pytest.approx(final[name], rel=1e-4)
    assert final["sequential"] < 0.92 * final["independent"], final  # 0.213 vs 0.243 (seeded)
    with pytest.raises(ValueError, match=r"calibration='greedy' is not a calibration; use one of sequential"):
        convert(source, "Q-K=V", calibration_ids=calibration, calibration="greedy")


# --------------------------------------------------------------------------------------------------------------
# Writing the model directory is all or nothing (issue 19)
# --------------------------------------------------------------------------------------------------------------
def _write_weights_then(error: BaseException):
    """A save_converted that writes the weights and config, then fails as a full disk or a kill would."""
    from qkvshare.convert.io import save_converted as real

    def save(model, record, folder, tokenizer=None, dtype="float32"):
        model.save_pretrained(folder)
        raise error

    return save, real


def test_a_failed_write_keeps_the_previous_conversion(source_dir, tmp_path, monkeypatch, capsys):
    import qkvshare.convert.io as command

    out = tmp_path / "converted"
    argv = ["convert", str(source_dir), "--variant", "Q-MQA", "--method", "key", "--output_dir", str(out)]
    assert qkvshare_cli.main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    failing, _ = _write_weights_then(OSError(28, "No space left on device"))
    monkeypatch.setattr(command, "save_converted", failing)
    assert (
        qkvshare_cli.main([*argv[:-4], "--variant", "Q-K=V", "--method", "key", *argv[-2:], "--overwrite_output_dir"])
        == 1
    )
    err = capsys.readouterr().err
    assert "No space left on device" in err and f"the previous model directory {str(out)!r} is unchanged" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted"]  # no partial folder left beside it


def test_a_conversion_killed_while_saving_leaves_no_model_directory(source_dir, tmp_path, monkeypatch):
    import qkvshare.convert.io as command

    out = tmp_path / "converted"
    argv = ["convert", str(source_dir), "--variant", "Q-MQA", "--method", "key", "--output_dir", str(out)]
    killed, real = _write_weights_then(KeyboardInterrupt())
    monkeypatch.setattr(command, "save_converted", killed)
    assert qkvshare_cli.main(argv) == 130  # Ctrl-C: "qkvshare convert: interrupted.", no traceback
    assert not out.exists()  # nothing there would load as a model without its tokenizer and conversion.json
    monkeypatch.setattr(command, "save_converted", real)
    assert qkvshare_cli.main(argv) == 0  # the same command then converts (the partial folder is cleared)
    assert (out / "conversion.json").is_file() and (out / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted"]
