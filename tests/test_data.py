"""Tests of training data, tokenizers and the one override syntax (issue 9): duplicate documents never straddle a
split, bad data files and tokenizers fail naming the file/line or the name, `save_to_disk` folders load, and
`key=value` overrides parse the same everywhere and reject unknown keys. Tiny data, CPU, no network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from commands import command

from qkvshare.analysis.common import parse_overrides as analysis_overrides
from qkvshare.train.data import check_data_file, is_validation_file, load_corpus, stdlib_corpus, unique_documents
from qkvshare.train.model import parse_config_overrides
from qkvshare.train.tokenizer import CHAT_TEMPLATE, load_tokenizer, train_bpe_tokenizer
from qkvshare_settings.overrides import format_overrides, parse_overrides
from qkvshare_settings.train import DataArguments, TrainingSetupError

train_main = command("train")

DOCS = [f"document {i}: " + "alpha beta gamma " * (i % 4 + 1) for i in range(40)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def assert_disjoint_and_complete(corpus, texts: list[str]) -> None:
    """No text on both sides, none twice, and every distinct text somewhere."""
    assert not set(corpus.train) & set(corpus.validation)
    everything = corpus.train + corpus.validation
    assert len(everything) == len(set(everything)) and set(everything) == set(texts)


# ----------------------------------------------------------------------------------------------------------------
# Item 7: duplicates are dropped before any split
# ----------------------------------------------------------------------------------------------------------------
def test_embedded_corpus_split_drops_identical_files(tmp_path):
    """Two byte-identical files whose paths hash to opposite sides (Debian's `_sysconfigdata_*.py` case)."""
    val_name = next(f"v{i}.py" for i in range(1000) if is_validation_file(f"v{i}.py", 50))
    train_name = next(f"t{i}.py" for i in range(1000) if not is_validation_file(f"t{i}.py", 50))
    texts = [f"x = {i}\n" for i in range(12)]
    for i, text in enumerate(texts):
        (tmp_path / f"m{i}.py").write_text(text)
    twin = "CONFIG = {'abiflags': ''}\n"
    (tmp_path / val_name).write_text(twin)
    (tmp_path / train_name).write_text(twin)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "copy.py").write_text(texts[0])  # a third copy, in a sub-package
    corpus = stdlib_corpus(50, root=tmp_path)
    assert_disjoint_and_complete(corpus, [*texts, twin])
    assert "2 duplicate document(s) dropped" in corpus.description
    # The first path in sorted order decides: deterministic whatever else the machine holds.
    first = min(val_name, train_name)
    assert (twin in corpus.validation) == is_validation_file(first, 50)
    assert stdlib_corpus(50, root=tmp_path).train == corpus.train


def test_percentage_split_of_local_and_hub_data_drops_duplicates(tmp_path):
    # Document 0 opens the file (run_clm's split puts it in validation) and comes back twice later.
    texts = [DOCS[0], *DOCS[1:20], DOCS[0], DOCS[5], DOCS[0]]
    corpus = load_corpus(
        DataArguments(train_file=str(write_jsonl(tmp_path / "c.jsonl", texts)), validation_split_percentage=10)
    )
    assert_disjoint_and_complete(corpus, texts)
    assert corpus.validation == DOCS[0:2] and corpus.train == DOCS[2:20]
    assert "3 duplicate document(s) dropped" in corpus.description
    (tmp_path / "hub").mkdir()
    write_jsonl(tmp_path / "hub" / "train.jsonl", texts)
    hub = load_corpus(DataArguments(dataset_name=str(tmp_path / "hub"), validation_split_percentage=10))
    assert hub.train == corpus.train and hub.validation == corpus.validation
    assert unique_documents(["a", "b", "a", "c", "b"]) == (["a", "b", "c"], 2)


def test_streaming_training_skips_documents_held_out_for_validation(tmp_path):
    (tmp_path / "hub").mkdir()
    write_jsonl(tmp_path / "hub" / "train.jsonl", [*DOCS[:10], DOCS[1], *DOCS[10:20], DOCS[3]])
    args = DataArguments(dataset_name=str(tmp_path / "hub"), streaming=True, streaming_validation_documents=5)
    corpus = load_corpus(args, seed=0)
    trained = [row["text"] for row in corpus.train]
    assert corpus.validation == DOCS[:5] and sorted(trained) == sorted(DOCS[5:20])


# ----------------------------------------------------------------------------------------------------------------
# One override syntax; unknown keys rejected
# ----------------------------------------------------------------------------------------------------------------
def test_override_syntax_string_or_items_yaml_and_json_values():
    expected = {
        "hidden_size": 128,
        "layer_projection_sharing": ["none", "kv"],
        "tie_word_embeddings": False,
        "head_dim": None,
        "norm_eps": 1e-5,
        "kv_tie_point": "pre_rope",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    text = (
        "hidden_size=128, layer_projection_sharing=[none,kv],tie_word_embeddings=false,head_dim=null,"
        "norm_eps=1e-5,kv_tie_point=pre_rope,rope_parameters={rope_type: default, rope_theta: 1.0e4}"
    )
    assert parse_overrides(text, "--x") == expected
    items = [
        "hidden_size=128",
        'layer_projection_sharing=["none", "kv"]',
        "tie_word_embeddings=false",
        "head_dim=null,norm_eps=1e-05",
        'kv_tie_point="pre_rope"',
        'rope_parameters={"rope_type": "default", "rope_theta": 10000.0}',
    ]
    assert parse_overrides(items, "--x") == expected  # JSON values, several items, commas inside one item
    assert parse_overrides(format_overrides(expected), "--x") == expected  # written back and read again
    assert parse_overrides("a='x,y',b=yes,c=don't,d=0x10", "--x") == {"a": "x,y", "b": "yes", "c": "don't", "d": 16}
    assert parse_overrides(None, "--x") == {} and parse_overrides([], "--x") == {} and parse_overrides("", "--x") == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hidden_size", "item 'hidden_size' is not key=value"),
        ("=3", "item '=3' is not key=value"),
        ("hidden size=3", "item 'hidden size=3' is not key=value"),
        ("head_dim=", "item 'head_dim=' has no value; write head_dim=null"),
        ("hidden_size=1,hidden_size=2", "gives 'hidden_size' twice"),
        ("layer_projection_sharing=[none,kv", "missing a closing ']'"),
        ("layer_projection_sharing=none,kv]", "unbalanced ']'"),
        ("kv_tie_point=pre: rope", "reads as a YAML dict"),
        ("rope_parameters={a: [}", "unbalanced '}'"),
    ],
)
def test_bad_override_items_name_the_flag_the_item_and_an_example(text, message):
    with pytest.raises(ValueError, match="--config_overrides") as err:
        parse_overrides(text, "--config_overrides")
    assert message in str(err.value)
    with pytest.raises(TrainingSetupError) as train_err:
        parse_config_overrides(text)
    assert message in str(train_err.value)
    with pytest.raises(ValueError, match="--override") as analysis_err:
        analysis_overrides([text])
    assert message in str(analysis_err.value)


def test_train_and_analysis_overrides_agree_and_reject_unknown_keys(capsys, tmp_path):
    text = "hidden_size=96,layer_projection_sharing=[none,kv],kv_tie_point=pre_rope"
    assert (
        parse_config_overrides(text)
        == analysis_overrides([text])
        == analysis_overrides(text.split(",")[:1] + ["layer_projection_sharing=[none,kv]", "kv_tie_point=pre_rope"])
    )
    with pytest.raises(TrainingSetupError, match=r"'projection_shareing'.*'projection_sharing'"):
        parse_config_overrides("num_hidden_layers=2,projection_shareing=kv")
    with pytest.raises(ValueError, match=r"'hiden_size'.*'hidden_size'"):
        analysis_overrides(["hiden_size=3"])
    # On the command line: exit 2 with the message, before any data or model is touched.
    argv = ["--config_overrides", "projection_shareing=kv", "--output_dir", str(tmp_path / "out")]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert "projection_shareing" in err and "projection_sharing" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------------------
# Bad data files fail naming the file and the line, before tokenizing
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "c.txt",
            b"first doc\n\nsecond \xe9t\xe9 doc\n",
            r"not valid UTF-8 at line 3 \(byte offset 18: b'\\xe9t\\xe9 '\)",
        ),
        ("c.txt", b"text\n\x00\x01\x02 binary\n", r"NUL byte at line 2 \(byte offset 5\)"),
        ("c.jsonl", b'{"text": "a"}\n{"text": "b",}\n', r"line 2 is not valid JSON"),
        ("c.jsonl", b'{"text": "a"}\n\n["b"]\n', r"line 3 is a JSON list, not an object"),
        ("c.jsonl", b'{"text": "a"}\n{"text": 3}\n', r"line 2: 'text' is a int, not a string"),
        ("c.jsonl", b'{"text": "a"}\n{"body": "b"}\n', r"line 2 has no 'text' key while other lines have one"),
        ("c.jsonl", b'{"text": "caf\xe9"}\n', r"not valid UTF-8 at line 1 \(byte offset 13"),
        ("c.json", b'[{"text": "a"},\n {"text": "b"}\n {"text": "c"}]\n', r"not valid JSON \(line 3, column 2"),
        ("c.parquet", b"PK\x03\x04 a zip file, not parquet", r"is not a Parquet file"),
    ],
)
def test_bad_training_file_names_file_and_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TrainingSetupError, match=message) as err:
        load_corpus(DataArguments(train_file=str(path)))
    assert f"--train_file {str(path)!r}" in str(err.value)

    class PerplexityInputError(ValueError):  # perplexity reuses the check with its own error type
        pass

    with pytest.raises(PerplexityInputError, match=message):
        check_data_file(path, "--validation_file", "text", error=PerplexityInputError)


def test_good_files_pass_and_other_bad_sources_are_named(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(tmp_path / "ok.parquet"))
    datasets.Dataset.from_dict({"text": list(range(3))}).to_parquet(str(tmp_path / "ints.parquet"))
    (tmp_path / "ok.json").write_text(json.dumps([{"text": d} for d in DOCS], indent=1))
    (tmp_path / "ok.txt").write_text("\n\n".join(DOCS), encoding="utf-8")
    for name in ("ok.parquet", "ok.json", "ok.txt"):
        check_data_file(tmp_path / name, "--train_file")
    assert load_corpus(DataArguments(train_file=str(tmp_path / "ok.parquet"))).train == DOCS[2:]
    with pytest.raises(TrainingSetupError, match="column 'text' holds int64, not text"):
        check_data_file(tmp_path / "ints.parquet", "--train_file")
    with pytest.raises(TrainingSetupError, match=r"--validation_file .*ok.txt.* is not in the format of --train_file"):
        load_corpus(DataArguments(train_file=str(tmp_path / "ok.json"), validation_file=str(tmp_path / "ok.txt")))
    bad_validation = tmp_path / "val.jsonl"
    bad_validation.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(TrainingSetupError, match=r"--validation_file .*val.jsonl' line 2 is not valid JSON"):
        load_corpus(
            DataArguments(train_file=str(write_jsonl(tmp_path / "t.jsonl", DOCS)), validation_file=str(bad_validation))
        )
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "part-2.jsonl").write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(TrainingSetupError, match=r"--dataset_name .*part-2.jsonl' is not valid UTF-8 at line 2"):
        load_corpus(DataArguments(dataset_name=str(tmp_path / "hub")))


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("v.txt", "  \n\n \t\n", "the file is empty or has only whitespace"),
        ("v.jsonl", '{"text": "  "}\n\n{"text": null}\n', "the file is empty or has no line with a non-empty 'text'"),
    ],
)
def test_a_validation_file_without_text_is_named_not_the_training_corpus(tmp_path, name, content, says):
    suffix = Path(name).suffix

    def write_docs(path: Path) -> Path:
        if suffix == ".jsonl":
            return write_jsonl(path, DOCS)
        path.write_text("\n\n".join(DOCS))
        return path

    (tmp_path / name).write_text(content)
    train = write_docs(tmp_path / f"train{suffix}")
    with pytest.raises(TrainingSetupError) as err:
        load_corpus(DataArguments(train_file=str(train), validation_file=str(tmp_path / name)))
    assert str(err.value) == (
        f"--validation_file {str(tmp_path / name)!r} holds no text ({says}); point it at a file with documents."
    )
    # One file without text in a data folder is fine: the folder's other files hold the documents.
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / name).write_text(content)
    write_docs(tmp_path / "folder" / f"docs{suffix}")
    assert sorted(load_corpus(DataArguments(dataset_name=str(tmp_path / "folder"))).train) == sorted(DOCS[2:])


# ----------------------------------------------------------------------------------------------------------------
# --dataset_name: a Dataset.save_to_disk folder
# ----------------------------------------------------------------------------------------------------------------
def test_dataset_name_accepts_save_to_disk_folders(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": DOCS, "id": list(range(40))}).save_to_disk(str(tmp_path / "one"))
    corpus = load_corpus(DataArguments(dataset_name=str(tmp_path / "one")))
    assert corpus.validation == DOCS[:2] and corpus.train == DOCS[2:]  # one split, used as train: run_clm's split
    streamed = load_corpus(
        DataArguments(dataset_name=str(tmp_path / "one"), streaming=True, streaming_validation_documents=4), seed=1
    )
    assert streamed.validation == DOCS[:4] and sorted(r["text"] for r in streamed.train) == sorted(DOCS[4:])
    splits = {
        "train": datasets.Dataset.from_dict({"text": DOCS[:30]}),
        "validation": datasets.Dataset.from_dict({"text": DOCS[30:]}),
    }
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dict"))
    both = load_corpus(DataArguments(dataset_name=str(tmp_path / "dict")))
    assert both.train == DOCS[:30] and both.validation == DOCS[30:]


# ----------------------------------------------------------------------------------------------------------------
# Tokenizers: named ones fail clearly; the trained one has the model's length and a chat template
# ----------------------------------------------------------------------------------------------------------------
def test_bad_tokenizer_names_fail_naming_them(tmp_path):
    (tmp_path / "model_only").mkdir()
    (tmp_path / "model_only" / "config.json").write_text("{}")
    (tmp_path / "file.json").write_text("{}")
    cases = {
        str(tmp_path / "missing"): "does not exist as a folder",
        str(tmp_path / "model_only"): "holds no tokenizer files (none of tokenizer.json",
        str(tmp_path / "file.json"): "is a file; pass the folder that holds it",
        "qkvshare-tests/no-such-tokenizer": "could not load tokenizer 'qkvshare-tests/no-such-tokenizer' (OSError",
    }
    for name, message in cases.items():
        with pytest.raises(TrainingSetupError) as err:
            load_tokenizer(name)
        assert f"{name!r}" in str(err.value) and message in str(err.value)
        assert "omit --tokenizer_name to train a byte-level BPE" in str(err.value)


def test_missing_tokenizer_on_the_command_line_exits_2(tmp_path, capsys):
    argv = [
        "--train_file",
        str(write_jsonl(tmp_path / "c.jsonl", DOCS)),
        "--output_dir",
        str(tmp_path / "out"),
        "--tokenizer_name",
        str(tmp_path / "no_tokenizer"),
        "--report_to",
        "none",
        "--use_cpu",
        "true",
    ]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert f"tokenizer {str(tmp_path / 'no_tokenizer')!r} does not exist" in err and "Traceback" not in err


def test_trained_tokenizer_has_model_length_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = train_bpe_tokenizer(DOCS, 320, model_max_length=128)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.model_max_length == loaded.model_max_length == 128
    assert loaded.chat_template == CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "alpha?"},
        {"role": "assistant", "content": "beta gamma"},
    ]
    text = loaded.apply_chat_template(messages, tokenize=False)
    assert text == "system\nBe brief.<|endoftext|>user\nalpha?<|endoftext|>assistant\nbeta gamma<|endoftext|>"
    ids = loaded.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    assert ids["input_ids"] == loaded(text, add_special_tokens=False)["input_ids"]
    assistant = [t for t, m in zip(ids["input_ids"], ids["assistant_masks"]) if m]
    assert loaded.decode(assistant) == "beta gamma<|endoftext|>"  # TRL's assistant_only_loss marks exactly this
    prompt = loaded.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "system\nBe brief.<|endoftext|>user\nalpha?<|endoftext|>assistant\n" and text.startswith(prompt)
    # A TRL-style conversational dataset ("messages" rows) maps through the template.
    import datasets

    rows = datasets.Dataset.from_dict({"messages": [messages, messages[1:]]})
    rendered = rows.map(lambda row: {"text": loaded.apply_chat_template(row["messages"], tokenize=False)})
    assert rendered["text"] == [text, "user\nalpha?<|endoftext|>assistant\nbeta gamma<|endoftext|>"]


def test_recipe_config_overrides_mapping_keeps_nulls_and_lists(tmp_path):
    """A recipe's `config_overrides` mapping reaches the config with its YAML types (null stays None, lists stay
    lists), not as the strings 'None' / "['none', 'kv']"."""
    from qkvshare_settings.train import load_yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "config_overrides:\n  head_dim: null\n  layer_projection_sharing: [none, kv]\n  norm_eps: 1.0e-6\n"
    )
    text = load_yaml(str(recipe))["config_overrides"]
    assert parse_config_overrides(text) == {
        "head_dim": None,
        "layer_projection_sharing": ["none", "kv"],
        "norm_eps": 1e-6,
    }
