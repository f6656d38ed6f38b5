"""Tests of `qkvshare serve` (issue 18): transformers' OpenAI-compatible server with a QKVShare model, asked with
the real `openai` client on 127.0.0.1.

One server process for the module (a module fixture starts `qkvshare serve` on a free port and kills it at
teardown), serving a tiny Q-K=V model with a byte-level BPE tokenizer and its chat template. The model's weights
are drawn with a large init scale so greedy decoding gives varied tokens (the default scale repeats one token),
and its generation config suppresses the tokens that do not decode to printable ASCII and EOS: every greedy answer
then has exactly the asked number of tokens and decodes the same in one piece or streamed token by token.
"""

from __future__ import annotations

import json
import re
import string
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from qkvshare import QKVShareConfig, QKVShareForCausalLM
from qkvshare.train.tokenizer import train_bpe_tokenizer
from qkvshare_cli import main as cli

openai = pytest.importorskip("openai")  # the 'serve' extra (in 'dev')
from qkvshare.serve import serve_in_subprocess  # noqa: E402

TEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "A student pushes a box across the floor, and friction slows it down.",
    "Rinse the spoon with warm soapy water, then dry it with a towel.",
]
NEW_TOKENS = 12
STARTUP_SECONDS = 120  # bound on the server's start (imports torch, transformers, fastapi; loads the model)
REQUEST_SECONDS = 60  # bound on one request (the client's timeout)
PRINTABLE = set(string.printable) - set("\t\n\r\x0b\x0c")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A saved tiny Q-K=V causal LM with its tokenizer (and chat template), as a training run leaves it."""
    tok = train_bpe_tokenizer(TEXTS * 5, 320, model_max_length=256)
    config = QKVShareConfig.from_preset(
        "tiny",
        variant="Q-K=V",
        vocab_size=len(tok),
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = QKVShareForCausalLM(config)
    unprintable = [i for i in range(len(tok)) if not set(tok.decode([i])) <= PRINTABLE or i == tok.eos_token_id]
    model.generation_config.suppress_tokens = unprintable
    model.generation_config.do_sample = False
    path = tmp_path_factory.mktemp("serve") / "tiny-qkev"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy text of `generate()` in this process, for chat messages or a plain prompt."""
    from transformers import AutoTokenizer

    model = QKVShareForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)

    def generate(content: str, chat: bool = True, **settings) -> tuple[str, int]:
        if chat:
            inputs = tok.apply_chat_template(
                [{"role": "user", "content": content}],
                add_generation_prompt=True,
                return_dict=True,
                return_tensors="pt",
            )
        else:
            inputs = tok(content, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, **settings)
        prompt_len = inputs["input_ids"].shape[1]
        return tok.decode(out[0, prompt_len:], skip_special_tokens=True), prompt_len

    return generate


# The two ways the server generates: one `generate()` at a time (QKVShareCache), or transformers' continuous
# batching on the tied paged cache (a small pool: 16 blocks of 16 tokens).
MODES = {
    "generate": [],
    "continuous batching": ["--continuous_batching", "--cb_page_size", "16", "--cb_num_blocks", "16"],
}


@pytest.fixture(scope="module", params=list(MODES))
def server(request, model_dir, tmp_path_factory):
    """`qkvshare serve MODEL_DIR` in a subprocess on a free port, in each mode in turn (one process at a time):
    yields (mode, base URL, startup log); stopped at teardown."""
    log_path = tmp_path_factory.mktemp("serve-log") / "server.log"
    flags = ["--dtype", "float32", "--device", "cpu", *MODES[request.param]]
    with serve_in_subprocess(model_dir, flags, log_path, STARTUP_SECONDS, env={"OMP_NUM_THREADS": "1"}) as (url, _):
        yield request.param, url, log_path.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", timeout=REQUEST_SECONDS, max_retries=0)


def chat(client, model_dir, content: str, **kwargs):
    messages = [{"role": "user", "content": content}]
    args = {"max_tokens": NEW_TOKENS, "temperature": 0, **kwargs}
    return client.chat.completions.create(model=str(model_dir), messages=messages, **args)


def test_startup_log_gives_the_tied_cache_size(server, model_dir):
    mode, _, log = server
    config = QKVShareConfig.from_pretrained(model_dir)
    tied = config.kv_cache_bytes_per_token(4)  # fp32: the two tied layers hold one tensor each
    both = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert tied * 2 == both  # every layer is tied: half of K and V
    line = f"KV cache: {tied:,} bytes/token (Q-K=V: 2 tied layers, one tensor each; K and V in every layer would "
    assert f"{line}hold {both:,}; torch.float32)" in log
    pool = re.search(
        r"Paged cache \(continuous batching\): 16 blocks of 16 tokens = 256 tokens in ([\d,]+) bytes; "
        r"K and V in every layer would fit 128 tokens in these pages",
        log,
    )
    assert (pool is not None) == (mode == "continuous batching"), log
    if pool is not None:  # the pages (one tensor per tied layer) and transformers' two trash sectors
        assert 256 * tied <= int(pool.group(1).replace(",", "")) < 256 * tied * 1.25


@pytest.mark.parametrize(
    "fields, held, extra",
    [
        (dict(layer_projection_sharing=["kv", "none"]), "1 tied layer, one tensor each; 1 layer with K and V", 0),
        (dict(variant="Q-K=V", kv_tie_point="pre_rope"), "2 tied layers, one tensor each; token positions kept", 8),
        (dict(variant="QV-Ka"), "2 QV-Ka layers with V and the context G; token positions kept", 8),
    ],
)
def test_startup_log_names_what_each_layout_holds(fields, held, extra):
    """The measured bytes are the config's formula (one tensor per tied layer) plus 8 bytes of int64 positions."""
    from qkvshare.serve import cache_summary

    config = QKVShareConfig.from_preset("tiny", **fields)
    model = QKVShareForCausalLM(config).eval()
    line = cache_summary(model)
    assert line.startswith(f"KV cache: {config.kv_cache_bytes_per_token(4) + extra:,} bytes/token ({config.variant}: ")
    assert f": {held}; K and V in every layer would hold 1,024; torch.float32)" in line


def test_startup_log_of_linear_attention_gives_the_constant_state():
    from qkvshare.serve import PREFILL_TOKENS, cache_summary

    config = QKVShareConfig.from_preset(
        "tiny", variant="Q=K=V", attention_kernel="linear", position_embedding_type="none"
    )
    model = QKVShareForCausalLM(config).eval()
    state = config.num_hidden_layers * config.num_attention_heads * (config.head_dim**2 + config.head_dim) * 4
    assert cache_summary(model, PREFILL_TOKENS) == cache_summary(model, 2 * PREFILL_TOKENS)  # whatever the length
    assert cache_summary(model).startswith(f"KV cache: {state:,} bytes per sequence, whatever its length (Q=K=V: ")


def test_models_lists_the_served_directory(client, model_dir):
    assert [m.id for m in client.models.list().data] == [str(model_dir)]


def test_chat_greedy_text_equals_generate(client, model_dir, reference):
    expected, prompt_len = reference(TEXTS[0])
    answer = chat(client, model_dir, TEXTS[0])
    assert answer.choices[0].message.content == expected
    assert len(set(expected)) > 3  # varied text, not one repeated token
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_len, NEW_TOKENS)
    assert answer.choices[0].finish_reason == "length"


def test_streamed_chunks_join_to_the_same_text(client, model_dir, reference):
    expected, _ = reference(TEXTS[1])
    chunks = [c.choices[0].delta.content for c in chat(client, model_dir, TEXTS[1], stream=True) if c.choices]
    pieces = [c for c in chunks if c]
    assert "".join(pieces) == expected
    assert len(pieces) > 1  # streamed, not one piece


def test_completions_and_responses_endpoints(client, model_dir, reference):
    expected, _ = reference(TEXTS[2], chat=False)
    answer = client.completions.create(model=str(model_dir), prompt=TEXTS[2], max_tokens=NEW_TOKENS, temperature=0)
    assert answer.choices[0].text == expected
    expected, _ = reference(TEXTS[2])
    answer = client.responses.create(
        model=str(model_dir), input=TEXTS[2], max_output_tokens=NEW_TOKENS, temperature=0, stream=False
    )
    assert answer.output_text == expected


def test_two_concurrent_requests_both_complete(client, model_dir, reference):
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda text: chat(client, model_dir, text), TEXTS[:2]))
    assert [a.choices[0].message.content for a in answers] == [reference(text)[0] for text in TEXTS[:2]]


def test_a_setting_continuous_batching_would_not_apply_is_refused_there(server, client, model_dir, reference):
    """frequency_penalty is transformers' repetition_penalty: applied per request by generate(); continuous batching
    would generate with the server's one config instead, so there it is a 400 saying so."""
    if server[0] == "generate":
        answer = chat(client, model_dir, TEXTS[0], frequency_penalty=0.5)
        assert answer.choices[0].message.content == reference(TEXTS[0], repetition_penalty=1.5)[0]
        return
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, model_dir, TEXTS[0], frequency_penalty=0.5)
    assert "repetition_penalty=1.5 (the server's: 1.0)" in caught.value.message
    assert "Leave these fields out, or serve without --continuous_batching." in caught.value.message
    neutral = chat(client, model_dir, TEXTS[0], frequency_penalty=0, temperature=0)  # what the server does anyway
    assert neutral.choices[0].message.content == reference(TEXTS[0])[0]


@pytest.mark.parametrize(
    "kwargs, status, message",
    [
        ({"model": "no-such-model"}, 400, "Server is pinned to"),
        ({"temperature": -1}, 400, "temperature=-1 (must be a number from 0 to 2"),
        ({"max_tokens": 0}, 400, "max_tokens=0 (must be a whole number >= 1)"),
        ({"top_p": "high"}, 400, "top_p='high' (must be a number in (0, 1])"),
        ({"messages": "hello"}, 400, "messages='hello' (must be a non-empty list of messages"),
        ({"extra_body": {"no_such_field": 1}}, 422, "Unexpected fields in the request: {'no_such_field'}"),
    ],
)
def test_bad_request_gets_an_http_error_with_a_message_and_the_server_keeps_serving(
    client, model_dir, reference, kwargs, status, message
):
    args = {"model": str(model_dir), "messages": [{"role": "user", "content": TEXTS[0]}], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**args)
    assert caught.value.status_code == status
    assert message in caught.value.message  # the client shows the server's message
    assert chat(client, model_dir, TEXTS[0]).choices[0].message.content == reference(TEXTS[0])[0]


def test_body_that_is_no_json_object_is_a_422_with_a_message(server):
    request = urllib.request.Request(
        f"{server[1]}/v1/chat/completions", data=b"[1, 2]", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:  # the standard library: no HTTP client package assumed
        urllib.request.urlopen(request, timeout=REQUEST_SECONDS)
    assert caught.value.code == 422
    assert "send a JSON object" in json.loads(caught.value.read())["error"]["message"]


# ----------------------------------------------------------------------------------------------------------------
# bad command lines: answered before torch is imported, no server started
# ----------------------------------------------------------------------------------------------------------------
def test_continuous_batching_refuses_what_the_paged_cache_cannot_hold_before_serving(
    tmp_path, model_dir, monkeypatch, capsys
):
    """QV-Ka caches a context and values, which the pages cannot hold: exit status 2 and the reason, nothing served."""
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the server started"))
    config = QKVShareConfig.from_pretrained(model_dir)
    qv_ka = QKVShareConfig.from_preset("tiny", variant="QV-Ka", vocab_size=config.vocab_size)
    QKVShareForCausalLM(qv_ka).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_text((model_dir / name).read_text())
    assert cli(["serve", str(tmp_path), "--continuous_batching", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "qkvshare serve: error: continuous batching: QV-Ka (key_context_dim=" in err
    assert err.rstrip().endswith("Or serve without --continuous_batching (one generate() at a time).")


def test_another_transformers_version_is_warned_about_at_startup(model_dir, monkeypatch, capsys):
    """The server builds on transformers' serving modules (not public API): another version than the tested one
    is named at startup, and the server still starts."""
    import transformers
    import uvicorn

    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: served.append(options["port"]))
    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    assert cli(["serve", str(model_dir), "--device", "cpu", "--port", "8123"]) == 0
    out, err = capsys.readouterr()
    assert "warning: this server builds on transformers' serving modules (not public API)" in err
    assert "5.99.0 is installed" in err and served == [8123] and "KV cache: " in out


def test_serve_refuses_a_directory_it_cannot_serve(tmp_path, model_dir, capsys):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert cli(["serve", str(tmp_path / "llama")]) == 2
    assert "holds a 'llama' model, not a QKVShare one" in capsys.readouterr().err
    assert cli(["serve", str(tmp_path)]) == 2
    assert "is not a model directory (no config.json there)" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert cli(["serve", str(tmp_path)]) == 2
    assert f"{str(tmp_path)!r}: config.json does not parse (" in capsys.readouterr().err
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((model_dir / "config.json").read_text())
    assert cli(["serve", str(no_tokenizer)]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    assert cli(["serve", str(model_dir), "--port", "70000"]) == 2
    assert "--port 70000: a port is 0 to 65535" in capsys.readouterr().err
