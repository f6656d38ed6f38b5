"""Continuous batching on the tied paged cache (qkvshare/paged_cache_qkvshare.py): `generate_batch` gives the greedy
tokens of per-prompt `generate()` for tied (post- and pre-RoPE), grouped, mixed, "+" and ALiBi models, with prompts of
different lengths and more requests than the pages hold at once; the manager and `generate(cache_implementation=
"paged")` use the same cache; its bytes follow the formula (half of transformers' PagedAttentionCache for an all-tied
model); what it cannot serve is refused before any work. Tiny configs, fp32, CPU."""

import gc

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.generation.continuous_batching.distributed import DistributedHelper

from qkvshare import QKVShareConfig, QKVShareForCausalLM, paged_cache_qkvshare
from qkvshare.paged_cache_qkvshare import TESTED_TRANSFORMERS, QKVShareBatchingManager, QKVSharePagedCache

PAGE_SIZE, NUM_BLOCKS = 4, 6  # 24 tokens of pages: the six requests below need 88 in all, up to 20 each
PROMPT_LENGTHS = (3, 9, 5, 12, 4, 7)
NEW_TOKENS = 8
GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module", autouse=True)
def _frozen_gc():
    # transformers' manager runs gc.collect() twice per generate_batch, about 0.7 s each over the objects torch and
    # transformers create at import; frozen, those are not scanned again (the runs then take about 0.2 s).
    gc.freeze()
    yield
    gc.unfreeze()


def batching_config(**overrides) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(
        **dict(num_blocks=NUM_BLOCKS, page_size=PAGE_SIZE, max_batch_tokens=32, max_memory_percent=0.5) | overrides
    )


def tiny_lm(variant: str, attn_implementation: str = "sdpa", **overrides) -> QKVShareForCausalLM:
    # initializer_range=0.2: attention sharp enough that every greedy token depends on the cached keys (at 0.02 the
    # tiny model repeats one token whatever it attends to).
    torch.manual_seed(0)
    config = QKVShareConfig.from_preset(
        "tiny", variant=variant, attn_implementation=attn_implementation, initializer_range=0.2, **overrides
    )
    return QKVShareForCausalLM(config).eval()


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]


def generated_one_by_one(model: QKVShareForCausalLM, inputs: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of `generate()` (the dynamic QKVShareCache), one prompt at a time."""
    config = GenerationConfig(**GREEDY)
    return [model.generate(torch.tensor([p]), generation_config=config)[0, len(p) :].tolist() for p in inputs]


@pytest.mark.parametrize(
    "variant, attn_implementation, overrides",
    [
        ("Q-K=V", "sdpa", {}),  # post-RoPE tie: rotated keys in one page
        ("Q-K=V", "eager", {"kv_tie_point": "pre_rope"}),  # unrotated keys, rotated on read at rebuilt positions
        ("Q-MQA", "sdpa", {}),  # one key/value head for four query heads
        ("QKV", "sdpa", {"layer_projection_sharing": ["kv", "none"], "kv_tie_point": "pre_rope"}),  # one page, two
        ("(Q=K=V)+", "sdpa", {}),  # the "+" map's column term at the rebuilt key positions
        ("Q-K=V", "eager", {"position_embedding_type": "alibi"}),  # ALiBi's distances likewise
    ],
)
def test_generate_batch_gives_the_greedy_tokens_of_generate(variant, attn_implementation, overrides):
    model = tiny_lm(variant, attn_implementation, **overrides)
    inputs = prompts()
    expected = generated_one_by_one(model, inputs)
    outputs = model.generate_batch(
        inputs, generation_config=GenerationConfig(**GREEDY), continuous_batching_config=batching_config()
    )
    assert [output.error for output in outputs.values()] == [None] * len(inputs)
    assert [output.generated_tokens for output in outputs.values()] == expected
    assert model.config._attn_implementation == attn_implementation  # the manager restored the model's backend


def test_manager_and_paged_generate_use_the_tied_pages():
    model = tiny_lm("Q-K=V", kv_tie_point="pre_rope")
    inputs = prompts()[:2]
    expected = generated_one_by_one(model, inputs)
    generation_config = GenerationConfig(**GREEDY)
    manager = model.init_continuous_batching(generation_config, batching_config())
    assert isinstance(manager, QKVShareBatchingManager)
    manager.start()
    try:
        ids = [manager.add_request(prompt, max_new_tokens=NEW_TOKENS) for prompt in inputs]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=30)
            assert result is not None and result.error is None
            results[result.request_id] = result
        # One page per block for each of the 2 tied layers: 4 heads x 16 dims x 4 bytes a row.
        row = 4 * 16 * 4
        assert manager.cache_nbytes() == (NUM_BLOCKS + 2) * 2 * PAGE_SIZE * row  # two trash sectors of one block
    finally:
        manager.stop(block=True)
    assert [results[request_id].generated_tokens for request_id in ids] == expected
    sequences = model.generate(
        torch.tensor([inputs[0]]),
        generation_config=generation_config,
        cache_implementation="paged",
        continuous_batching_config=batching_config(),
    )
    assert sequences[0, 0].tolist() == inputs[0] + expected[0]


def test_a_shared_prefix_is_read_from_the_first_requests_pages(monkeypatch):
    # Prefix sharing hands the second request the first one's complete pages: its keys are read from them at the
    # positions rebuilt for it (pre-RoPE: unrotated keys, rotated on read).
    matched = []
    search = QKVSharePagedCache.search_prefix_match

    def recording(self, *args):
        matched.append(search(self, *args))  # tokens of the prompt found in pages already written
        return matched[-1]

    monkeypatch.setattr(QKVSharePagedCache, "search_prefix_match", recording)
    model = tiny_lm("Q-K=V", kv_tie_point="pre_rope")
    prefix = prompts()[3]  # 12 tokens: 3 pages
    inputs = [prefix + [30, 31], prefix + [40, 41, 42]]
    expected = generated_one_by_one(model, inputs)
    manager = model.init_continuous_batching(GenerationConfig(**GREEDY), batching_config())
    manager.start()
    try:
        generated = []
        for prompt in inputs:  # one after the other: the first one's pages are complete when the second comes
            manager.add_request(prompt, max_new_tokens=NEW_TOKENS)
            generated.append(manager.get_result(timeout=30).generated_tokens)
    finally:
        manager.stop(block=True)
    assert matched == [0, 12]
    assert generated == expected


def test_on_cpu_the_pool_fits_the_work_not_the_machines_memory(monkeypatch):
    """Issue 24, item 4: without a ContinuousBatchingConfig, transformers sized the pool from free memory (on CPU
    60% of the RAM: a 115k-parameter model took 11-13 GB). Now generate_batch, paged generate() and
    init_continuous_batching() on CPU get a pool that fits the work (requests x (prompt + max_new_tokens), in whole
    pages) or the stated default, whatever the machine has; a given num_blocks is kept. The "machine" here has 256 MiB
    free, so a pool sized from memory would be tens of MiB."""
    from math import ceil

    from qkvshare.compat_qkvshare import PagedAttentionMemoryHandler, WorkloadHints

    monkeypatch.setattr(PagedAttentionMemoryHandler, "get_available_memory", lambda self: 256 * 2**20)
    made = []
    init = QKVSharePagedCache.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(QKVSharePagedCache, "__init__", recording)
    model = tiny_lm("Q-K=V")
    inputs = prompts()
    outputs = model.generate_batch(inputs, generation_config=GenerationConfig(**GREEDY))
    assert [output.generated_tokens for output in outputs.values()] == generated_one_by_one(model, inputs)
    page = 32  # CPU_PAGE_SIZE
    per_request = ceil((max(PROMPT_LENGTHS) + NEW_TOKENS) / page)
    block = 2 * page * 4 * 16 * 4  # one page per tied layer: 4 heads x 16 dims x fp32 rows
    assert made[-1].nbytes() == (len(inputs) * per_request + 2) * block  # 8 blocks: 64 KiB, not tens of MiB
    assert (made[-1].page_size, made[-1].num_blocks) == (page, len(inputs) * per_request)

    from qkvshare.paged_cache_qkvshare import CPU_PAGE_SIZE, CPU_POOL_CAP_TOKENS, CPU_POOL_TOKENS, pool_for_the_work

    assert page == CPU_PAGE_SIZE
    model.generate(
        torch.tensor([inputs[0]]), generation_config=GenerationConfig(**GREEDY), cache_implementation="paged"
    )
    assert made[-1].num_blocks == 1  # one request of 11 tokens: one page
    manager = model.init_continuous_batching(GenerationConfig(**GREEDY))
    manager.start()
    try:
        assert manager.wait_for_paged_cache(30).capacity_tokens() == CPU_POOL_TOKENS  # no workload: the default
    finally:
        manager.stop(block=True)
    hints = WorkloadHints(max_prompt_length=100, max_generated_length=28, num_requests=10_000)
    sized = pool_for_the_work(model.config, None, torch.float32, "cpu", hints)
    assert sized.num_blocks * sized.page_size == CPU_POOL_CAP_TOKENS  # a large batch waits for pages
    one_long = WorkloadHints(max_prompt_length=20_000, max_generated_length=1_000, num_requests=1)
    assert pool_for_the_work(model.config, None, torch.float32, "cpu", one_long).num_blocks == ceil(21_000 / 32)
    assert pool_for_the_work(model.config, batching_config(), torch.float32, "cpu", hints).num_blocks == NUM_BLOCKS


@pytest.mark.parametrize(
    "variant, overrides, cached_tensors",
    [
        ("Q-K=V", {}, [1, 1]),
        ("Q=K=V", {}, [1, 1]),
        ("QKV", {}, [2, 2]),
        ("QKV", {"layer_projection_sharing": ["kv", "none"]}, [1, 2]),
        ("Q=K=V", {"num_hidden_layers": 3, "layer_projection_sharing": ["qkv", "qk", "kv"]}, [1, 2, 1]),
        ("Q-MQA", {}, [1, 1]),
    ],
)
def test_paged_cache_bytes_follow_the_formula_and_transformers_pages(variant, overrides, cached_tensors):
    config = QKVShareConfig.from_preset("tiny", variant=variant, attn_implementation="sdpa", **overrides)
    num_blocks = 10
    options = dict(device="cpu", distributed_helper=DistributedHelper(None, None), dtype=torch.float32)
    ours = QKVSharePagedCache(config, batching_config(num_blocks=num_blocks), **options)
    theirs = PagedAttentionCache(config, batching_config(num_blocks=num_blocks), **options)
    # A block: page_size tokens of every cached tensor, rows of (num_key_value_heads, head_dim); the pool: the
    # blocks plus transformers' two trash sectors (one block each here: blocks are multiples of 128 bytes).
    block = sum(cached_tensors) * PAGE_SIZE * config.num_key_value_heads * config.head_dim * 4
    assert ours.nbytes() == (num_blocks + 2) * block
    assert (ours.num_blocks, ours.max_tokens_read) == (num_blocks, num_blocks * PAGE_SIZE)
    # At equal page count, the fraction of transformers' pool that the tied layers leave: 0.5 when all are tied.
    assert ours.nbytes() * 2 * len(cached_tensors) == theirs.cache_tensor.nbytes * sum(cached_tensors)


@pytest.mark.parametrize(
    "variant, overrides, message",
    [
        ("Q=K=V", {"attention_kernel": "linear", "position_embedding_type": "none"}, "attention_kernel='linear'"),
        ("QV-Ka", {}, "QV-Ka (key_context_dim=16)"),
        ("Q-K=V", {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}, "sliding_window=4"),
        ("Q-K=V", {"is_causal": False}, "is_causal=False"),
        ("Q-K=V", {"attn_implementation": "flex_attention"}, "attn_implementation='flex_attention'"),
    ],
)
def test_what_the_paged_cache_cannot_serve_is_refused_before_any_work(variant, overrides, message):
    model = tiny_lm(variant, **{"attn_implementation": "sdpa"} | overrides)
    backend = model.config._attn_implementation
    with pytest.raises(ValueError, match=r"continuous batching: .*") as refused:
        model.generate_batch(
            [[3, 4, 5]], generation_config=GenerationConfig(**GREEDY), continuous_batching_config=batching_config()
        )
    assert message in str(refused.value)
    assert "model.generate()" in str(refused.value) or "attn_implementation='sdpa' or 'eager'" in str(refused.value)
    with pytest.raises(ValueError, match="continuous batching: "):
        model.init_continuous_batching(continuous_batching_config=batching_config())
    assert model.config._attn_implementation == backend  # refused before the manager switched the backend


def test_other_transformers_versions_are_refused_with_the_tested_range(monkeypatch):
    model = tiny_lm("Q-K=V")
    monkeypatch.setattr(paged_cache_qkvshare.transformers, "__version__", "5.26.0")  # the first release past the range
    with pytest.raises(ValueError, match=f"tested with transformers{TESTED_TRANSFORMERS}, but 5.26.0 is installed"):
        model.generate_batch(
            [[3, 4, 5]], generation_config=GenerationConfig(**GREEDY), continuous_batching_config=batching_config()
        )


def test_a_forward_with_a_paged_cache_it_cannot_use_is_refused():
    model = tiny_lm("Q-K=V")
    options = dict(device="cpu", distributed_helper=DistributedHelper(None, None), dtype=torch.float32)
    theirs = PagedAttentionCache(model.config, batching_config(), **options)
    with pytest.raises(ValueError, match="keeps a key and a value page for every layer; QKVShare models run"):
        model(torch.tensor([[3, 4, 5]]), cache=theirs)
    ours = QKVSharePagedCache(model.config, batching_config(), **options)
    with pytest.raises(ValueError, match="this forward has no read_index, write_index, cu_seq_lens_k"):
        model(torch.tensor([[3, 4, 5]]), cache=ours)
    other = tiny_lm("QKV")
    with pytest.raises(ValueError, match="built for a different model .*layer kinds: layer 0 'tied' vs 'key_value'"):
        other(torch.tensor([[3, 4, 5]]), cache=ours, read_index=[], write_index=[], cu_seq_lens_k={})
