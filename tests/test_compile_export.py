"""torch.compile, torch.export, ExecuTorch and ONNX with the static tied cache; beam search and assisted decoding with
it; `qkvshare export`. Tiny models (2 layers, hidden 32, fp32, CPU); every compiled or exported program is built once
per module (fixtures) and compared with eager decoding.

Compilation uses the "eager" dynamo backend: it traces the whole graph exactly as inductor would receive it (a host
sync or a data-dependent branch fails `fullgraph=True`), without inductor's C++ build (minutes on 2 cores).
"""

import copy

import pytest
import torch
import transformers.integrations.sdpa_attention
from test_core import VOCAB, tiny
from transformers import CompileConfig

import qkvshare_cli
from qkvshare import QKVShareCache, QKVShareForCausalLM, QKVShareStaticCache, TiedStaticLayer
from qkvshare.export import (
    FunctionalDecoderStep,
    OnnxDecoder,
    StaticCacheDecoder,
    executorch_step,
    export_decoder,
    greedy_generate,
    reference_tokens,
    to_executorch,
    to_onnx,
)
from qkvshare.modeling_qkvshare import grouped_decode_sdpa

SLOTS = 16  # max_cache_len
PROMPT, NEW = 5, 6
WIDE = dict(hidden_size=32, initializer_range=0.3)  # large weights: greedy tokens vary, so equal tokens mean something
# Between them: the four modes, both tie points, "+", GQA and MQA, RoPE and learned positions.
MODELS = {
    "tied": tiny(layer_projection_sharing=["none", "kv"], num_key_value_heads=2, **WIDE),  # QKV + Q-GQA, post-RoPE
    "plus": tiny("(Q=K=V)+", layer_projection_sharing=["qk", "qkv"], kv_tie_point="pre_rope", **WIDE),
    "learned": tiny(
        layer_projection_sharing=["none", "kv"], num_key_value_heads=1, position_embedding_type="learned", **WIDE
    ),
    # QV-Ka with RoPE: its cache holds G (one head of d_ctx channels) and V, keys recomputed and rotated on read.
    # One layer: each exported model costs about 25 s of lowering here.
    "qvka": tiny("QV-Ka", num_hidden_layers=1, **WIDE),
}


def build(name: str, seed: int = 0) -> QKVShareForCausalLM:
    torch.manual_seed(seed)
    return QKVShareForCausalLM._from_config(copy.deepcopy(MODELS[name]), attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def eager_tokens(model, prompt: torch.Tensor) -> torch.Tensor:
    expected = reference_tokens(model, prompt, NEW)  # eager, dynamic tied cache, no stop at end-of-sequence
    assert expected.unique().numel() > 2  # the tokens vary: equal tokens are a real check
    return expected


# ----------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("name", list(MODELS))
def test_decode_step_compiles_to_one_graph_and_matches_eager(name, prompt):
    assert QKVShareForCausalLM._can_compile_fullgraph
    model = build(name)
    caches = [QKVShareStaticCache(model.config, max_cache_len=SLOTS) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(prompt, cache=cache, use_cache=True)  # prefill, eager (as generate() does)
        step = torch.compile(
            lambda ids, cache: model(ids, cache=cache, use_cache=True).logits, fullgraph=True, backend="eager"
        )
        token = prompt[:, -1:]
        for _ in range(3):
            compiled, eager = step(token, caches[0]), model(token, cache=caches[1], use_cache=True).logits
            torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)  # same ops, maybe other kernels
            token = eager[:, -1:].argmax(-1)
    assert caches[0].get_seq_length() == PROMPT + 3
    for ours, theirs in zip(caches[0].layers, caches[1].layers):
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=0, atol=1e-5)


def test_grouped_decode_sdpa_equals_attention_over_repeated_heads():
    torch.manual_seed(0)
    batch, heads, kv_heads, slots, dim = 2, 6, 2, 9, 8
    query = torch.randn(batch, heads, 1, dim)
    key, value = torch.randn(batch, kv_heads, slots, dim), torch.randn(batch, kv_heads, slots, dim)
    filled = torch.arange(slots) < 7
    masks = {
        "bool, shared by the heads": filled.expand(batch, 1, 1, slots),
        "float, per head (ALiBi)": torch.randn(batch, heads, 1, slots).masked_fill(~filled, torch.finfo().min),
    }
    for name, mask in masks.items():
        full_key, full_value = key.repeat_interleave(3, dim=1), value.repeat_interleave(3, dim=1)
        expected = torch.nn.functional.scaled_dot_product_attention(query, full_key, full_value, attn_mask=mask)
        out = grouped_decode_sdpa(query, key, value, mask, dim**-0.5)
        assert out.shape == (batch, 1, heads, dim), name
        torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=1e-6, msg=name)


def test_compiled_grouped_decode_step_reads_the_cache_without_repeating_it(prompt, monkeypatch):
    """transformers' sdpa copies the cache to every query head while dynamo traces (`repeat_kv`); ours must not."""
    model = build("learned")  # one key/value head for 4 query heads in its tied layer
    cache = QKVShareStaticCache(model.config, max_cache_len=SLOTS)
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
        expected = model(prompt[:, -1:], cache=copy.deepcopy(cache), use_cache=True).logits

        def refuse(*args, **kwargs):
            raise AssertionError("repeat_kv called on the decode path")

        monkeypatch.setattr(transformers.integrations.sdpa_attention, "repeat_kv", refuse)
        step = torch.compile(
            lambda ids: model(ids, cache=cache, use_cache=True).logits, fullgraph=True, backend="eager"
        )
        torch.testing.assert_close(step(prompt[:, -1:]), expected, rtol=0, atol=1e-5)


def test_generate_with_static_cache_and_compile_gives_the_eager_tokens(prompt):
    model = build("tied")
    expected = model.generate(prompt, max_new_tokens=NEW, do_sample=False, cache_implementation="static")
    model.generation_config.compile_config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    model.generation_config.compile_config._compile_all_devices = True  # transformers compiles on GPUs only else
    out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, cache_implementation="static")
    assert hasattr(model, "_compiled_call")  # the decode steps ran compiled
    assert torch.equal(out, expected) and out.shape[1] > PROMPT + 2


def test_learned_position_check_runs_on_the_host_under_compile(prompt):
    model = build("learned")
    limit = model.config.max_position_embeddings
    cache = QKVShareStaticCache(model.config, max_cache_len=limit + 1)
    step = torch.compile(lambda ids: model(ids, cache=cache, use_cache=True), fullgraph=True, backend="eager")
    # Under fullgraph, dynamo reports the ValueError raised while tracing as an observed exception, message kept.
    with pytest.raises(Exception) as err:
        step(prompt)
    message = f"max_cache_len={limit + 1} is beyond max_position_embeddings={limit}"
    chain = [err.value, err.value.__cause__, err.value.__context__]
    assert any(message in str(e) for e in chain if e is not None), [str(e)[:300] for e in chain]
    with pytest.raises(ValueError, match=f"position {limit} is beyond max_position_embeddings={limit}"):
        model(prompt[:, :1], position_ids=torch.tensor([[limit]]))  # eager: the positions themselves are checked


# ----------------------------------------------------------------------------- pytree registration, torch.export
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_caches_flatten_and_rebuild_exactly(static, prompt):
    model = build("plus")  # pre-RoPE ties and "+": the positions are part of the cache
    cache = QKVShareStaticCache(model.config, max_cache_len=SLOTS) if static else QKVShareCache(model.config)
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
    leaves, spec = torch.utils._pytree.tree_flatten(cache)
    rebuilt = torch.utils._pytree.tree_unflatten([None if t is None else t.clone() for t in leaves], spec)
    assert type(rebuilt) is type(cache) and rebuilt.layout == cache.layout
    assert int(rebuilt.get_seq_length()) == PROMPT and rebuilt.nbytes() == cache.nbytes()
    tied_values = rebuilt.layers[1].keys if static else None  # a static tied layer's values are its keys
    assert rebuilt.layers[1].values is tied_values and torch.equal(rebuilt.positions, cache.positions)
    token = torch.tensor([[7]])
    with torch.no_grad():
        torch.testing.assert_close(model(token, cache=rebuilt).logits, model(token, cache=cache).logits, rtol=0, atol=0)
    # torch.export.save writes the spec through the dumpable context; it must read back equal.
    dumped = torch.utils._pytree.treespec_dumps(spec)
    assert torch.utils._pytree.treespec_loads(dumped) == spec


def test_early_initialization_gives_qv_ka_layers_their_context_and_value_shapes():
    # torch.export needs the static buffers allocated up front; transformers' early initialization gives every
    # layer the (heads, head_dim) of its arguments, which is not the shape of QV-Ka's G (one head, d_ctx channels).
    config = tiny("QV-Ka-2", **WIDE)  # d_ctx = 2 x head_dim: G differs from V in heads and channels
    cache = QKVShareStaticCache(config, max_cache_len=SLOTS)
    cache.early_initialization(2, config.num_key_value_heads, config.head_dim, torch.float32, "cpu")
    d_ctx, heads, dim = config.key_context_dim, config.num_key_value_heads, config.head_dim
    assert [(layer.keys.shape, layer.values.shape) for layer in cache.layers] == [
        ((2, 1, SLOTS, d_ctx), (2, heads, SLOTS, dim))
    ] * config.num_hidden_layers
    assert cache.positions.shape == (2, SLOTS)  # with RoPE its keys are rotated on read at the cached positions


def test_torch_export_of_prefill_and_decode_takes_the_static_tied_cache(prompt):
    model = build("plus")

    def fresh():
        cache = QKVShareStaticCache(model.config, max_cache_len=SLOTS)
        cache.early_initialization(1, model.config.num_key_value_heads, model.config.head_dim, torch.float32, "cpu")
        return cache

    token = torch.tensor([[9]])
    with torch.no_grad():
        prefill = torch.export.export(model, (), {"input_ids": prompt, "cache": fresh(), "use_cache": True})
        cache, reference = fresh(), fresh()
        prefill.module()(input_ids=prompt, cache=cache, use_cache=True)
        model(prompt, cache=reference, use_cache=True)
        decode = torch.export.export(model, (), {"input_ids": token, "cache": cache, "use_cache": True})
        out = decode.module()(input_ids=token, cache=cache, use_cache=True)
        expected = model(token, cache=reference, use_cache=True)
    torch.testing.assert_close(out.logits, expected.logits, rtol=0, atol=1e-6)
    assert type(out.cache) is QKVShareStaticCache and int(cache.get_seq_length()) == PROMPT + 1
    for i, (layer, ref) in enumerate(zip(cache.layers, reference.layers)):  # one buffer per tied layer, as eager's
        tied = model.config.is_kv_tied(i)
        assert isinstance(layer, TiedStaticLayer) == tied and (layer.values is layer.keys) == tied
        for mine, theirs in ((layer.keys, ref.keys), (layer.values, ref.values)):
            if mine is not None:
                torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    assert torch.equal(cache.positions, reference.positions)


# ----------------------------------------------------------------------------- ExecuTorch and ONNX programs
@pytest.fixture(scope="module", params=["plus", "qvka"])
def programs(request, tmp_path_factory):
    """For two models ("plus": an untied Q=K-V layer and a tied Q=K=V layer, pre-RoPE tie, "+"; "qvka": QV-Ka's
    context-and-value cache; lowering costs about 35 s a two-layer model here, so "plus" carries both the tied layer
    and "+"): its eager tokens, and the same decoding through an ExportedProgram, an ExecuTorch program (portable
    kernels: the quickest to lower; XNNPACK is measured by `qkvshare export`) and an ONNX model."""
    model = build(request.param)
    decoder = StaticCacheDecoder(model, max_cache_len=SLOTS)
    program = export_decoder(decoder)
    onnx_path = tmp_path_factory.mktemp("onnx") / "model.onnx"
    functional = FunctionalDecoderStep(StaticCacheDecoder(model, max_cache_len=SLOTS))
    to_onnx(functional, onnx_path)
    return dict(
        model=model,
        decoder=decoder,
        exported=program.module(),
        executorch=executorch_step(to_executorch(program, backend="portable")),
        onnx=OnnxDecoder(onnx_path, functional.state_names, functional.initial_state),
    )


@pytest.mark.parametrize("runner", ["decoder", "exported", "executorch", "onnx"])
def test_exported_programs_generate_the_eager_tokens(programs, runner, prompt):
    expected = eager_tokens(programs["model"], prompt)
    assert torch.equal(greedy_generate(programs[runner], prompt, NEW), expected)
    assert torch.equal(greedy_generate(programs[runner], prompt, NEW), expected)  # a new prompt restarts at slot 0


def test_export_wrapper_holds_one_buffer_per_tied_layer(programs):
    decoder = programs["decoder"]
    config = decoder.model.config
    buffers = {name for name, _ in decoder.named_buffers() if name.startswith("cache_")}
    layers = range(config.num_hidden_layers)
    values = {f"cache_{i}_values" for i in layers}
    assert values & buffers == {f"cache_{i}_values" for i in layers if not config.is_kv_tied(i)}
    positions = 8 if config.needs_key_positions else 0
    assert decoder.cache_bytes_per_token() == config.kv_cache_bytes_per_token(4) + positions


# ----------------------------------------------------------------------------- beam search, assisted decoding
def test_beam_search_and_assisted_decoding_with_the_static_tied_cache():
    # transformers 5.24 runs both with a static cache for Llama; ours must give what the dynamic tied cache gives.
    model, assistant = build("plus"), build("plus", seed=1)  # another assistant: some drafts are rejected (crop)
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    beams = [model.generate(ids, num_beams=2, cache_implementation=c, **kwargs) for c in ("static", None)]
    assert type(beams[0].cache) is QKVShareStaticCache and torch.equal(beams[0].sequences, beams[1].sequences)
    plain = model.generate(ids[:1], **kwargs).sequences
    for kw in (dict(assistant_model=assistant), dict(prompt_lookup_num_tokens=2)):  # a draft model, n-gram drafts
        out = model.generate(ids[:1], cache_implementation="static", **kw, **kwargs)
        assert type(out.cache) is QKVShareStaticCache and torch.equal(out.sequences, plain)


def test_custom_4d_mask_of_shared_prefix_equals_separate_sequences():
    # transformers' common test (it runs only for models with `_can_compile_fullgraph`): three continuations of one
    # prefix packed in one row with a 4D mask and repeated positions give each continuation's own logits.
    model = build("plus")
    ids = torch.tensor([[10, 11, 12, 20], [10, 11, 12, 21], [10, 11, 12, 22]])
    packed = torch.tensor([[10, 11, 12, 20, 21, 22]])
    allowed = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 1, 0],
            [1, 1, 1, 0, 0, 1],
        ]
    )
    mask = (allowed == 0).float()[None, None] * torch.finfo(torch.float32).min
    with torch.no_grad():
        separate = model(ids).logits[:, -1]
        shared = model(packed, attention_mask=mask, position_ids=torch.tensor([[0, 1, 2, 3, 3, 3]])).logits[0, -3:]
    torch.testing.assert_close(shared, separate, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- qkvshare export
def test_export_command_refuses_bad_input_before_any_work(tmp_path, monkeypatch, capsys):
    learned, window = tmp_path / "learned", tmp_path / "window"
    build("learned").save_pretrained(learned)
    weights = (learned / "model.safetensors").read_bytes()
    QKVShareForCausalLM._from_config(tiny(sliding_window=4, **WIDE)).save_pretrained(window)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama/config.json").write_text('{"model_type": "llama"}')
    read_only, locked = tmp_path / "read-only", tmp_path / "locked.onnx"
    read_only.mkdir()
    locked.write_bytes(b"kept")
    cases = [
        ([tmp_path / "none", "--format", "onnx"], "has no config.json: not a Hugging Face model directory"),
        ([learned, "--format", "tflite"], "argument --format: invalid choice: 'tflite'"),
        ([tmp_path / "llama", "--format", "onnx"], "holds a 'llama' model, not a QKVShare one"),
        ([learned, "--format", "onnx", "--max_cache_len", "129"], "beyond max_position_embeddings=128"),
        ([learned, "--format", "onnx", "--output", tmp_path / "no/x.onnx"], "directory does not exist"),
        # the export's faults: each ran the export (or part of it) before
        ([learned, "--format", "onnx", "--output", learned / "model.safetensors"], "is one of the files of the model"),
        ([learned, "--format", "executorch", "--output", learned / "model.onnx"], "is among the files of the model"),
        ([learned, "--format", "onnx", "--output", read_only / "x.onnx"], "is read-only; choose a writable place"),
        ([learned, "--format", "onnx", "--output", locked], "is a read-only file; make it writable"),
        (
            [learned, "--format", "onnx", "--max_cache_len", "2"],
            "--max_cache_len 2 is too short: the token check needs 5",
        ),
        ([learned, "--format", "onnx", "--max_cache_len", "1", "--check_tokens", "0"], "traces a 2-token prefill"),
        ([window, "--format", "executorch"], "has sliding-window attention (sliding_window=4, layers 0, 1)"),
    ]

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(QKVShareForCausalLM, "from_pretrained", refuse)
    read_only.chmod(0o555)
    locked.chmod(0o444)
    try:
        for argv, message in cases:
            assert qkvshare_cli.main(["export", *map(str, argv)]) == 2, argv
            err = capsys.readouterr().err
            assert message in err and "Traceback" not in err, (argv, err)
    finally:
        read_only.chmod(0o755)
        locked.chmod(0o644)
    monkeypatch.setitem(__import__("sys").modules, "executorch", None)  # the extra not installed
    assert qkvshare_cli.main(["export", str(learned), "--format", "executorch"]) == 2
    assert 'pip install "qkvshare[export]"' in capsys.readouterr().err
    assert not list(learned.glob("model.pte")) + list(learned.glob("model.onnx")) + list(read_only.iterdir())
    assert (learned / "model.safetensors").read_bytes() == weights and locked.read_bytes() == b"kept"


def test_export_command_writes_an_onnx_model_with_the_cache_bytes(tmp_path, capsys):
    build("tied").save_pretrained(tmp_path)
    output = tmp_path / "tied.onnx"
    assert (
        qkvshare_cli.main(
            ["export", str(tmp_path), "--format", "onnx", "--max_cache_len", "16", "--output", str(output)]
        )
        == 0
    )
    out = capsys.readouterr().out
    config = MODELS["tied"]
    per_token = config.kv_cache_bytes_per_token(4)  # fp32: K and V of layer 0, the one tied tensor of layer 1
    assert f"wrote {output} (onnx): {output.stat().st_size:,} bytes" in out
    assert f"cache: {per_token:,} bytes per token (theory {per_token:,}" in out
    assert f"{per_token * 16:,} bytes of cache buffers in all (1 x 16 token slots)" in out
    assert "greedy tokens of the written program vs the model (8 after a 4-token prompt): identical" in out
