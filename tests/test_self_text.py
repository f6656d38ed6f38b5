"""Tests of `qkvshare.convert.self_text` (issue 23, item 1): text the source model writes itself. Tiny random Llama
models with a small BPE tokenizer that has a chat template; fp32, CPU."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qkvshare.convert import self_text
from qkvshare.convert.self_text import (
    SelfTextSettings,
    estimate_self_text,
    generate_self_text,
    instruction_topics,
    instructions,
    shard_kind,
)
from qkvshare.train.tokenizer import train_bpe_tokenizer

# small and quick: 4 samples of at most 12 new tokens a shard
FAST = dict(batch_size=4, max_new_tokens=12, greedy_tokens=2)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: these models are too small to gain from two, and lose much on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    texts = [text for _, text in instructions()] * 2
    return train_bpe_tokenizer(texts, 320, model_max_length=256)


def tiny_llama(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(tokenizer)


def ids_of(result) -> list[list[int]]:
    return [sample.ids for sample in result.samples]


def test_same_seed_same_text_other_seed_other_text(model, tokenizer):
    settings = SelfTextSettings(seed=3, **FAST)
    first = generate_self_text(model, tokenizer, settings, None, 150, progress=False)
    again = generate_self_text(model, tokenizer, settings, None, 150, progress=False)
    other = generate_self_text(model, tokenizer, SelfTextSettings(seed=4, **FAST), None, 150, progress=False)
    assert first.tokens >= 150 and ids_of(first) == ids_of(again)
    assert [s.text for s in first.samples] == [s.text for s in again.samples]
    assert ids_of(first) != ids_of(other)
    # a smaller request is a prefix of a larger one (the same shards)
    small = generate_self_text(model, tokenizer, settings, None, 40, progress=False)
    assert ids_of(small) == ids_of(first)[: len(small.samples)]


def test_the_progress_bar_counts_up_to_the_tokens_asked_for(model, tokenizer, monkeypatch):
    shown = []

    class Recording(self_text.tqdm):
        def update(self, n=1):
            super().update(n)
            shown.append(self.n)

    monkeypatch.setattr(self_text, "tqdm", Recording)
    result = generate_self_text(model, tokenizer, SelfTextSettings(seed=2, **FAST), None, 30, progress=True)
    # the one shard writes more than 30 tokens; the bar stops at 30 (past its total, tqdm drops the bar and the %)
    assert result.tokens > 30 and shown and max(shown) == 30


def test_resume_after_a_kill_equals_an_uninterrupted_run(model, tokenizer, tmp_path):
    settings = SelfTextSettings(seed=1, chat_fraction=0.5, **FAST)
    whole = generate_self_text(model, tokenizer, settings, tmp_path / "whole", 600, progress=False)
    assert whole.shards >= 4

    class Killed(Exception):
        pass

    def kill_after_two(index: int) -> None:
        if index == 1:
            raise Killed

    work = tmp_path / "killed"
    with pytest.raises(Killed):
        generate_self_text(model, tokenizer, settings, work, 600, progress=False, on_shard=kill_after_two)
    assert sorted(p.name for p in work.glob("shard-*.json")) == ["shard-000000.json", "shard-000001.json"]
    (work / "shard-000002.json.tmp").write_text('{"index": 2, "samp')  # a write cut short by the kill
    resumed = generate_self_text(model, tokenizer, settings, work, 600, progress=False)
    assert resumed.generated_shards == whole.shards - 2
    assert ids_of(resumed) == ids_of(whole)
    assert [s.text for s in resumed.samples] == [s.text for s in whole.samples]
    # everything cached: nothing generated, the same text
    again = generate_self_text(model, tokenizer, settings, work, 600, progress=False)
    assert again.generated_shards == 0 and ids_of(again) == ids_of(whole)


def test_a_work_folder_of_other_settings_or_another_source_is_refused(model, tokenizer, tmp_path):
    settings = SelfTextSettings(**FAST)
    generate_self_text(model, tokenizer, settings, tmp_path, 20, progress=False)
    other = SelfTextSettings(**(FAST | {"temperature": 0.9}))
    with pytest.raises(ValueError, match=r"other settings or another source \(settings.temperature: 0.7 then, 0.9 now"):
        generate_self_text(model, tokenizer, other, tmp_path, 20, progress=False)
    with pytest.raises(ValueError, match=r"source.weights_sha256"):
        generate_self_text(tiny_llama(tokenizer, seed=5), tokenizer, settings, tmp_path, 20, progress=False)


def test_a_tokenizer_without_a_chat_template_gives_continuations_and_says_so(model, tokenizer, caplog):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with caplog.at_level(logging.WARNING, logger="qkvshare.convert.self_text"):
        result = generate_self_text(model, plain, SelfTextSettings(**FAST), None, 60, progress=False)
    assert "has no chat template" in caplog.text and "plain continuations only" in caplog.text
    assert not result.chat and {s.kind for s in result.samples} == {"continuation"}
    assert "no chat answers" in result.describe()


def test_the_mix_ratio_gives_the_expected_counts_and_splits(model, tokenizer):
    assert [shard_kind(i, 0.25) for i in range(8)] == ["chat"] + ["continuation"] * 3 + ["chat"] + ["continuation"] * 3
    settings = SelfTextSettings(chat_fraction=0.25, validation_fraction=0.25, **FAST)
    result = generate_self_text(model, tokenizer, settings, None, 1200, progress=False)
    n = result.shards
    assert n >= 8 and len(result.samples) == 4 * n
    chat_shards = math.ceil(n / 4)  # a quarter of the shards, the first one first
    counts = result.counts()
    assert counts["chat"] == 4 * chat_shards and counts["continuation"] == 4 * (n - chat_shards)
    # a quarter of each kind validates (every fourth sample of the kind)
    assert counts["validation"] == (4 * chat_shards) // 4 + (4 * (n - chat_shards)) // 4
    chat = [s for s in result.samples if s.kind == "chat"]
    assert all(s.prompt and s.text.startswith("user\n" + s.prompt + tokenizer.eos_token) for s in chat)
    assert not {s.prompt for s in chat if s.split == "train"} & {s.prompt for s in chat if s.split == "validation"}
    assert all(s.prompt is None for s in result.samples if s.kind == "continuation")
    assert len(result.documents("train")) + len(result.documents("validation")) <= len(result.samples)
    blocks = result.blocks(tokenizer, "train", 64, 16)
    assert blocks.shape == (4, 16) and blocks.dtype == torch.long
    everything_chat = generate_self_text(model, tokenizer, SelfTextSettings(chat_fraction=1, **FAST), None, 50)
    assert {s.kind for s in everything_chat.samples} == {"chat"}


def test_the_built_in_prompts_are_broad_and_hold_out_the_knowledge_test():
    prompts = instructions()
    topics = instruction_topics()
    assert len(prompts) >= 500 and len(topics) >= 15 and min(topics.values()) >= 15
    assert len({text for _, text in prompts}) == len(prompts)
    held_out = re.compile(
        r"\bcapital\b|\bcurrenc|official language|national language|languages? (is|are) spoken|which continent"
        r"|what continent|money (is )?used in",
        re.IGNORECASE,
    )
    assert not [text for _, text in prompts if held_out.search(text)]
    assert {"science", "history", "geography", "writing", "cooking", "maths", "code_python", "reasoning"} <= set(topics)


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "chat_fraction",
            1.5,
            r"SelfTextSettings.chat_fraction=1.5 is outside the allowed range: a number in \[0, 1\]",
        ),
        ("batch_size", 0, r"SelfTextSettings.batch_size=0 .* an integer in \[1, 1024\]"),
        ("top_p", 0.0, r"SelfTextSettings.top_p=0.0 .* \(0, 1\]"),
        ("first_token", "random", r"SelfTextSettings.first_token='random' .* 'model' or 'uniform'"),
        ("max_new_tokens", 2.5, r"SelfTextSettings.max_new_tokens=2.5 .* an integer in \[8, 32768\]"),
    ],
)
def test_bad_settings_name_the_field_the_value_and_the_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        SelfTextSettings(**{field: value})


def test_impossible_requests_are_refused_before_any_work(model, tokenizer, tmp_path, monkeypatch):
    settings = SelfTextSettings(**FAST)
    with pytest.raises(ValueError, match="would take about .* more than the 1 s allowed"):
        generate_self_text(model, tokenizer, settings, tmp_path, 10**7, progress=False, max_seconds=1)
    probes = []
    monkeypatch.setattr(self_text, "_probe_rate", lambda *args: probes.append(args) or 1.0)
    with pytest.raises(ValueError, match="of memory besides the model, more than 80% of the"):
        generate_self_text(model, tokenizer, settings, tmp_path, 10**12, progress=False)
    assert not probes  # refused before the probe ran
    assert not list(tmp_path.glob("shard-*.json"))
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        generate_self_text(model, tokenizer, SelfTextSettings(max_new_tokens=1000), None, 10, progress=False)
    with pytest.raises(ValueError, match="tokens=0: ask for a positive number"):
        generate_self_text(model, tokenizer, settings, None, 0, progress=False)
    monkeypatch.undo()
    estimate = estimate_self_text(model, tokenizer, settings, 1000, tmp_path / "new")
    assert estimate.tokens_per_second > 0 and estimate.seconds > 0 and "tokens/s" in estimate.summary()
    assert not (tmp_path / "new").exists()  # an estimate writes nothing
    assert json.loads((tmp_path / "manifest.json").read_text())["settings"]["batch_size"] == 4


def test_a_loop_is_cut_after_its_first_copy():
    text = list(range(100, 140))
    assert self_text._periodic_tail(text + [1, 2, 3] * 10) == 43
    assert self_text._periodic_tail(text + [7] * 30) == 41
    assert self_text._periodic_tail(text + [1, 2, 3] * 3) is None  # 9 tokens: shorter than MIN_LOOP_SPAN
    assert self_text._periodic_tail(list(range(200))) is None


@pytest.mark.parametrize("vocab", [300, 5000])  # the nucleus within the top-256 candidates, and past them
def test_sampling_stays_in_the_exact_nucleus(vocab):
    settings = SelfTextSettings(top_p=0.5, temperature=1.0, repetition_penalty=1.0)
    sampler = self_text._Sampler(settings, vocab, [0])
    logits = torch.linspace(4.0, 0.0, vocab) if vocab == 300 else torch.linspace(0.5, 0.0, vocab)
    probs = torch.softmax(logits, -1)
    nucleus = int(((probs.cumsum(-1) - probs) < 0.5).sum())  # logits are sorted: the nucleus is a prefix
    assert (nucleus < 256) == (vocab == 300)
    plan = self_text._Plan(0, "chat", "train", "?")
    rows = [self_text._Row(plan, [1], torch.Generator().manual_seed(k)) for k in range(200)]
    picks = sampler(logits.expand(200, vocab), rows)
    assert max(picks) < nucleus and len(set(picks)) > min(20, nucleus // 4)


def test_bf16_writes_what_the_model_loaded_in_bf16_writes_and_leaves_the_model_as_it_is(model, tokenizer, tmp_path):
    """`bf16=True` generates with a bf16 copy of the weights: token for token what transformers' own bf16 load of the
    same weights generates, while the model passed in keeps its float32 weights and its identity."""
    from transformers import AutoModelForCausalLM

    before = {k: v.clone() for k, v in model.state_dict().items()}
    settings = SelfTextSettings(seed=3, **FAST)
    in_bf16 = dataclasses.replace(settings, bf16=True)
    bf16 = generate_self_text(model, tokenizer, in_bf16, None, 150, progress=False)
    copy.deepcopy(model).save_pretrained(tmp_path / "m")  # saving writes into the config: not the shared model's
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    reference = generate_self_text(loaded, tokenizer, settings, None, 150, progress=False)
    assert ids_of(bf16) == ids_of(reference) and bf16.settings == in_bf16
    assert all(torch.equal(before[k], v) and v.dtype == torch.float32 for k, v in model.state_dict().items())
    assert bf16.source == self_text.source_identity(model, tokenizer)  # the text is the float32 source's, in bf16


def test_bf16_copy_keeps_tied_weights_tied_and_buffers_as_they_are(tokenizer):
    source = tiny_llama(tokenizer)
    source.config.tie_word_embeddings = True
    source.tie_weights()
    assert source.lm_head.weight is source.model.embed_tokens.weight
    copied = self_text.bf16_copy(source)
    assert copied.lm_head.weight is copied.model.embed_tokens.weight
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in copied.parameters())
    assert source.model.embed_tokens.weight.dtype == torch.float32
    assert {k: b.dtype for k, b in copied.named_buffers()} == {k: b.dtype for k, b in source.named_buffers()}
    assert self_text._copied_bytes(source) == 2 * sum(p.numel() for p in source.parameters())  # tied: counted once
    assert self_text.bf16_copy(copied) is copied  # already bf16: no second copy


def test_the_precision_is_part_of_the_folder_and_a_folder_from_before_it_continues_in_float32(
    model, tokenizer, tmp_path
):
    settings = SelfTextSettings(seed=1, **FAST)
    first = generate_self_text(model, tokenizer, settings, tmp_path, 40, progress=False)
    manifest = tmp_path / "manifest.json"
    held = json.loads(manifest.read_text())
    assert held["settings"]["bf16"] is False and self_text.folder_settings(tmp_path)["bf16"] is False
    del held["settings"]["bf16"]  # a folder written before the setting existed
    manifest.write_text(json.dumps(held))
    assert self_text.folder_settings(tmp_path)["bf16"] is False
    again = generate_self_text(model, tokenizer, settings, tmp_path, 80, progress=False)
    assert ids_of(again)[: len(first.samples)] == ids_of(first)
    with pytest.raises(ValueError, match=r"other settings or another source \(settings.bf16: False then, True now"):
        generate_self_text(model, tokenizer, dataclasses.replace(settings, bf16=True), tmp_path, 80, progress=False)
    assert self_text.folder_settings(tmp_path / "none") is None


def test_bf16_counts_its_copy_of_the_weights_in_the_memory_check(model, tokenizer, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    settings = SelfTextSettings(**FAST)
    in_bf16 = dataclasses.replace(settings, bf16=True)
    copy.deepcopy(model).save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    # the same bf16 cache and buffers as a model loaded in bf16, plus the copy of the weights (2 bytes each)
    extra = self_text.generation_memory(model, in_bf16, 50, 1000) - self_text.generation_memory(
        loaded, settings, 50, 1000
    )
    assert extra == 2 * sum(p.numel() for p in model.parameters()) > 0
    assert self_text.generation_memory(loaded, in_bf16, 50, 1000) == self_text.generation_memory(
        loaded, settings, 50, 1000
    )
    monkeypatch.setattr(self_text, "available_bytes", lambda: 1000)
    with pytest.raises(ValueError, match=r"besides the model \(its bf16 copy of the weights included: bf16=False"):
        generate_self_text(model, tokenizer, in_bf16, None, 20, progress=False)
    with pytest.raises(ValueError, match=r"besides the model, more than"):
        generate_self_text(model, tokenizer, settings, None, 20, progress=False)
