"""Config validation and ecosystem fit: unknown keys, wrong types and values, token ids that fit the vocabulary,
the tensor-parallel plan of every variant, and `auto_map` listing every head for `trust_remote_code` users.
Tiny configs, fp32, CPU."""

import dataclasses
import json
import logging
import math
import subprocess
import sys

import pytest
import torch
from test_train import _free_port, run_ranks
from torch import nn
from transformers import AutoConfig
from transformers.distributed.parallel_utils import _get_parameter_plan

from qkvshare import (
    AUTO_MODEL_CLASSES,
    QKVShareConfig,
    QKVShareForCausalLM,
    QKVShareForTokenClassification,
)
from qkvshare.configuration_qkvshare import ARCHITECTURE_STYLES


def tiny(variant: str | None = None, **overrides) -> QKVShareConfig:
    return QKVShareConfig.from_preset("tiny", variant, **overrides)


# ---------------------------------------------------------------- unknown keys
def test_misspelt_preset_override_is_rejected_with_the_closest_field():
    with pytest.raises(ValueError) as caught:
        tiny(projection_shareing="kv")
    assert str(caught.value) == (
        "QKVShareConfig.from_preset('tiny'): unknown config field 'projection_shareing' "
        "(did you mean 'projection_sharing'?); fix the spelling."
    )


def test_check_field_names_names_the_source_every_unknown_key_and_lists_fields_when_nothing_is_close():
    with pytest.raises(ValueError) as caught:
        QKVShareConfig.check_field_names(["hidden_size", "num_hiden_layers", "zzz"], "--config_overrides")
    message = str(caught.value)
    assert message.startswith(
        "--config_overrides: unknown config fields 'num_hiden_layers' (did you mean 'num_hidden_layers'?), 'zzz'; "
    )
    assert "(valid fields: architectures, attention_bias," in message and "rms_norm_eps" in message
    assert "'hidden_size'" not in message.split(";")[0]  # a valid name is not reported


def test_every_field_and_post_init_keyword_is_a_valid_name():
    fields = [field.name for field in dataclasses.fields(QKVShareConfig)]
    assert {"pad_token_id", "dtype", "id2label", "projection_sharing", "linear_attention_normalize"} <= set(fields)
    QKVShareConfig.check_field_names(
        [*fields, "rope_theta", "rms_norm_eps", "torch_dtype", "num_labels", "attn_implementation"], "test"
    )


def test_preset_accepts_llama_names_and_transformers_keywords():
    config = tiny(rope_theta=500000.0, rms_norm_eps=1e-6, pad_token_id=0, torch_dtype="bfloat16", num_labels=3)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    assert config.norm_eps == 1e-6 and config.pad_token_id == 0
    assert config.dtype is torch.bfloat16 and config.num_labels == 3
    assert tiny(dtype="float16", attn_implementation="eager").dtype is torch.float16
    assert tiny(attn_implementation="eager")._attn_implementation == "eager"


def test_plain_config_and_from_pretrained_keep_extra_keys(tmp_path):
    # Hub configs carry keys this class does not know: transformers keeps them as attributes, and so do we.
    assert QKVShareConfig(some_hub_key=5).some_hub_key == 5
    tiny().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(saved | {"some_hub_key": [1, 2]}))
    assert QKVShareConfig.from_pretrained(tmp_path).some_hub_key == [1, 2]


# ---------------------------------------------------------------- wrong types and values
BAD_VALUES = [
    (dict(hidden_size="64"), "hidden_size='64' has type str, but hidden_size must be int."),
    (dict(vocab_size=12.5), "vocab_size=12.5 has type float, but vocab_size must be int."),
    (dict(is_causal="no"), "is_causal='no' has type str, but is_causal must be bool."),
    (dict(num_attention_heads=True), "num_attention_heads=True has type bool, but num_attention_heads must be int."),
    (
        dict(layer_projection_sharing=["kv", 3]),
        "layer_projection_sharing=['kv', 3] has type list[int | str], but layer_projection_sharing must be "
        "list[str] | None.",
    ),
    (dict(norm_eps="1e-5"), "norm_eps='1e-5' has type str, but norm_eps must be float."),
    (
        dict(attention_dropout=None),
        "attention_dropout=None has type NoneType, but attention_dropout must be int | float.",
    ),
    (dict(hidden_act="gelu_fancy"), "hidden_act='gelu_fancy' is not supported; allowed values: 'gelu', 'gelu_10',"),
    (dict(attention_dropout=1.0), "attention_dropout=1.0 must be in [0, 1): the probability of dropping"),
    (dict(attention_dropout=-0.1), "attention_dropout=-0.1 must be in [0, 1)"),
    (dict(norm_eps=0.0), "norm_eps=0.0 must be > 0: it keeps the norm's division finite"),
    (dict(norm_eps=-1e-5), "norm_eps=-1e-05 must be > 0"),
    (dict(norm_eps=math.nan), "norm_eps=nan must be > 0"),
    (dict(initializer_range=-1.0), "initializer_range=-1.0 must be >= 0: the standard deviation of the initial"),
]


@pytest.mark.parametrize("build", ["from_preset", "constructor"])
@pytest.mark.parametrize("kwargs,message", BAD_VALUES)
def test_bad_field_raises_plain_value_error_naming_field_value_and_allowed(build, kwargs, message):
    with pytest.raises(ValueError) as caught:
        tiny(**kwargs) if build == "from_preset" else QKVShareConfig(**kwargs)
    assert type(caught.value) is ValueError  # not huggingface_hub's StrictDataclass* errors
    assert str(caught.value).startswith(message)


def test_bad_assignment_and_bad_edit_raise_value_error(tmp_path):
    config = tiny()
    with pytest.raises(ValueError, match="^hidden_size='128' has type str, but hidden_size must be int.$"):
        config.hidden_size = "128"
    assert config.hidden_size == 64
    config.attention_dropout = 1.5  # a valid type: the value is checked by validate(), which save_pretrained runs
    for call in (config.validate, lambda: config.save_pretrained(tmp_path)):
        with pytest.raises(ValueError) as caught:
            call()
        assert type(caught.value) is ValueError and str(caught.value).startswith("attention_dropout=1.5 must be in")


def test_ints_are_accepted_where_llama_takes_numbers():
    config = tiny(attention_dropout=0, linear_attention_decay=1, hidden_act="gelu_new")
    assert (config.attention_dropout, config.linear_attention_decay, config.hidden_act) == (0, 1, "gelu_new")


# ---------------------------------------------------------------- token ids
def test_preset_token_ids_outside_an_overridden_vocabulary_are_dropped(caplog):
    with caplog.at_level(logging.WARNING, logger="qkvshare.configuration_qkvshare"):
        config = QKVShareConfig.from_preset("llama-300m", "Q-GQA-4", vocab_size=32000)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (None, None, None)
    assert "preset 'llama-300m' has eos_token_id=50256, outside vocab_size=32000: set to None" in caplog.text
    # Ids that fit are kept: the paper vocabulary, a larger one, and tiny's ids in a smaller one.
    assert QKVShareConfig.from_preset("paper-300m").eos_token_id == 50256
    assert QKVShareConfig.from_preset("paper-300m", vocab_size=50432).bos_token_id == 50256
    assert (tiny(vocab_size=10).bos_token_id, tiny(vocab_size=10).eos_token_id) == (1, 2)
    # Explicit ids win and are kept.
    config = QKVShareConfig.from_preset("llama-300m", vocab_size=32000, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(vocab_size=32000, eos_token_id=50256),
            "eos_token_id=50256 does not fit vocab_size=32000: token ids must be in [0, 31999]; pass your "
            "tokenizer's id, or None for no eos token.",
        ),
        (dict(eos_token_id=[2, 128]), "eos_token_id=[2, 128] does not fit vocab_size=128"),
        (dict(pad_token_id=-1), "pad_token_id=-1 does not fit vocab_size=128"),
        (dict(vocab_size=64, bos_token_id=64), "bos_token_id=64 does not fit vocab_size=64"),
    ],
)
def test_explicit_token_id_outside_the_vocabulary_raises(kwargs, message):
    with pytest.raises(ValueError) as caught:
        tiny(**kwargs)
    assert str(caught.value).startswith(message)


# ---------------------------------------------------------------- tensor-parallel plan
TP_CONFIGS = {
    "QKV": tiny("QKV"),
    "Q=K-V": tiny("Q=K-V"),
    "Q-K=V/pre": tiny("Q-K=V", kv_tie_point="pre_rope"),
    "Q=K=V": tiny("Q=K=V"),
    "Q-GQA-2": tiny("Q-GQA-2"),
    "(Q=K=V)+/gpt2": tiny("(Q=K=V)+", **ARCHITECTURE_STYLES["gpt2"]),
    "mix none/qkv": tiny(layer_projection_sharing=["none", "qkv"]),
    "mix kv/qk": tiny(layer_projection_sharing=["kv", "qk"]),
    "linear kernel": tiny("Q=K=V", attention_kernel="linear", position_embedding_type="learned"),
}
ROWWISE = ("o_proj", "down_proj")


@pytest.mark.parametrize("name", list(TP_CONFIGS))
def test_tp_plan_matches_the_parameters_and_covers_every_linear(name):
    config = TP_CONFIGS[name]
    model = QKVShareForCausalLM(config)
    plan = model.tp_plan
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.embed_tokens"] == "embedding_rowwise"
    # transformers' test_tp_plan_matches_params: every rule matches a parameter or a module.
    parameters = {n for n, _ in model.named_parameters()}
    modules = {n for n, _ in model.named_modules()}
    for rule in plan:
        assert any(_get_parameter_plan(p, {rule: ""}, is_weight=True) is not None for p in parameters) or any(
            _get_parameter_plan(m, {rule: ""}, is_weight=False) is not None for m in modules
        ), rule
    # Every attention and MLP linear gets Llama's style (the "+" map and linear-kernel attention stay replicated).
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    assert linears
    for module_name in linears:
        style = _get_parameter_plan(f"{module_name}.weight", plan)
        if module_name.endswith("attention_map_pe") or (name == "linear kernel" and ".self_attn." in module_name):
            assert style is None, module_name
        else:
            assert style == ("rowwise" if module_name.endswith(ROWWISE) else "colwise"), module_name


def test_tp_plan_of_a_per_layer_mix_and_of_a_plain_mlp():
    assert TP_CONFIGS["mix none/qkv"].base_model_tp_plan == {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    assert TP_CONFIGS["(Q=K=V)+/gpt2"].base_model_tp_plan == {
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    assert TP_CONFIGS["Q-K=V/pre"].layer_projections(0) == ("q_proj", "k_proj", "o_proj")


def test_tp_plan_is_derived_not_serialized(tmp_path):
    config = tiny(layer_projection_sharing=["kv", "qkv"])
    config.save_pretrained(tmp_path)
    assert "base_model_tp_plan" not in json.loads((tmp_path / "config.json").read_text())
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.base_model_tp_plan == config.base_model_tp_plan
    assert "layers.*.self_attn.v_proj" not in loaded.base_model_tp_plan
    with pytest.raises(ValueError, match="the plan is derived from the config's layers"):
        config.base_model_tp_plan = {}


TP_SCRIPT = """
import json, os, sys, torch
import qkvshare
from transformers import AutoModelForCausalLM
results = {}
for name in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(name, tp_plan="auto").eval()
    with torch.no_grad():
        logits = model(torch.arange(3, 19)[None]).logits
    k_proj = model.model.layers[0].self_attn.k_proj.weight
    results[name] = {"logits": logits.tolist(), "local_rows": k_proj.to_local().shape[0]}
if int(os.environ["RANK"]) == 0:
    print(json.dumps(results))
"""


def test_tensor_parallel_on_two_cpu_ranks_gives_the_unsharded_logits(tmp_path):
    """The plan run for real: 2 gloo ranks shard each variant's projections and reproduce the unsharded logits."""
    configs = ["Q=K=V", "Q-GQA-2", "mix none/qkv", "(Q=K=V)+/gpt2"]
    expected = {}
    for name in configs:
        torch.manual_seed(0)
        model = QKVShareForCausalLM(TP_CONFIGS[name]).eval()
        path = str(tmp_path / name.replace("/", "-").replace(" ", "-"))
        model.save_pretrained(path)
        with torch.no_grad():
            expected[path] = (model(torch.arange(3, 19)[None]).logits, model.config.num_key_value_heads * 16)
    (tmp_path / "tp.py").write_text(TP_SCRIPT)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
    ]
    run = run_ranks([*command, str(tmp_path / "tp.py"), *expected], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for path, (logits, k_rows) in expected.items():
        assert results[path]["local_rows"] == k_rows // 2  # k_proj really is split across the two ranks
        torch.testing.assert_close(torch.tensor(results[path]["logits"]), logits, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- auto_map
EXPECTED_AUTO_MAP = {
    "AutoConfig": "configuration_qkvshare.QKVShareConfig",
    "AutoModel": "modeling_qkvshare.QKVShareModel",
    "AutoModelForCausalLM": "modeling_qkvshare.QKVShareForCausalLM",
    "AutoModelForSequenceClassification": "modeling_qkvshare.QKVShareForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_qkvshare.QKVShareForTokenClassification",
    "AutoModelForImageClassification": "modeling_qkvshare.QKVShareForImageClassification",
}
# The heads a language-model checkpoint loads as (the image head needs an image config: is_causal=False).
TEXT_HEADS = {auto: name for auto, name in AUTO_MODEL_CLASSES.items() if auto != "AutoModelForImageClassification"}

HEADS_SCRIPT = """
import json, sys
sys.modules["qkvshare"] = None  # the package is not installed here: `import qkvshare` fails
import torch
import transformers
path, results = sys.argv[1], {}
for auto_name in sys.argv[2:]:
    model = getattr(transformers, auto_name).from_pretrained(path, trust_remote_code=True).eval()
    with torch.no_grad():
        hidden = model.base_model(torch.arange(3, 11)[None]).last_hidden_state
    results[auto_name] = {"class": type(model).__name__, "module": type(model).__module__, "hidden": hidden.tolist()}
    if auto_name == "AutoModelForCausalLM":
        out = model.generate(torch.arange(3, 11)[None], max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        results["generate"] = {"cache": type(out.cache).__name__, "tokens": out.sequences.tolist()}
results["imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "qkvshare" and sys.modules[m] is not None)
print(json.dumps(results))
"""


def test_auto_map_lists_every_head_and_each_loads_and_generates_without_the_package(tmp_path):
    """trust_remote_code in a process without the package: every head loads from the checkpoint's copied code,
    and the causal LM generates with it."""
    torch.manual_seed(0)
    model = QKVShareForCausalLM(tiny("Q-K=V", kv_tie_point="pre_rope")).eval()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"] == EXPECTED_AUTO_MAP
    with torch.no_grad():
        expected = model.model(torch.arange(3, 11)[None]).last_hidden_state
    tokens = model.generate(torch.arange(3, 11)[None], max_new_tokens=6, do_sample=False).tolist()
    run = subprocess.run(
        [sys.executable, "-c", HEADS_SCRIPT, str(tmp_path), *TEXT_HEADS],
        capture_output=True,
        text=True,
        cwd=tmp_path.parent,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert results.pop("imported") == []
    # generate() with the checkpoint's own code: its one-tensor cache, the tokens of the installed package.
    assert results.pop("generate") == {"cache": "QKVShareCache", "tokens": tokens}
    assert {auto: result["class"] for auto, result in results.items()} == TEXT_HEADS
    for auto_name, result in results.items():
        assert result["module"].startswith("transformers_modules."), auto_name
        # The checkpoint's weights, not a fresh init: every head's base model gives the saved model's states.
        torch.testing.assert_close(torch.tensor(result["hidden"]), expected, rtol=1e-5, atol=1e-5)


FIRST_HEAD_SCRIPT = """
import sys
sys.modules["qkvshare"] = None  # the package is not installed here
import transformers
model = getattr(transformers, sys.argv[2]).from_pretrained(sys.argv[1], trust_remote_code=True, num_labels=3)
print(type(model).__name__, model.score.out_features)
"""


@pytest.mark.parametrize("auto_name", ["AutoModelForSequenceClassification", "AutoModelForTokenClassification"])
def test_classification_head_is_the_first_load_of_a_fresh_process(tmp_path, auto_name):
    """transformers' generic heads build their base model with `AutoModel.from_config(config)`, without
    trust_remote_code: as the first load of a process without the package, that must still find the model."""
    QKVShareForCausalLM(tiny("Q-K=V")).save_pretrained(tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", FIRST_HEAD_SCRIPT, str(tmp_path), auto_name],
        capture_output=True,
        text=True,
        cwd=tmp_path.parent,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-2:] == [AUTO_MODEL_CLASSES[auto_name], "3"]


def test_auto_map_from_any_head_and_only_with_the_model_code(tmp_path):
    QKVShareForTokenClassification(tiny(is_causal=False)).save_pretrained(tmp_path / "encoder")
    assert json.loads((tmp_path / "encoder" / "config.json").read_text())["auto_map"] == EXPECTED_AUTO_MAP
    # A config saved alone carries no modeling file: its auto_map must not point to one.
    tiny().save_pretrained(tmp_path / "config-only")
    saved = json.loads((tmp_path / "config-only" / "config.json").read_text())
    assert saved["auto_map"] == {"AutoConfig": "configuration_qkvshare.QKVShareConfig"}
    assert not (tmp_path / "config-only" / "modeling_qkvshare.py").exists()
