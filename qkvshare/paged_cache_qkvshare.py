"""The paged KV cache of transformers' continuous batching for QKVShare models: tied layers keep ONE page tensor.

transformers' continuous batching (`model.generate_batch`, `model.init_continuous_batching()` and its manager,
`generate(cache_implementation="paged")`, `transformers serve`) keeps every request's cache in one memory pool cut
into pages (`PagedAttentionCache`), with a key page and a value page per layer. `QKVSharePagedCache` is that cache
with the QKVShare layout: a tied layer (Q-K=V, Q=K=V) has one page per block, read back as both key and value, an
untied layer keeps both. At equal page count a tied model's pool is half of transformers'; at equal memory it holds
twice the pages, so twice the concurrent tokens.

Design notes
- Layout, as in transformers' `FullAttentionCacheAllocator` (rows of (num_key_value_heads, head_dim), page_size rows
  per page; a block holds one request's page_size tokens for every layer): transformers' block is
  [L0 K | L0 V | L1 K | L1 V | ...]; here a tied layer has only its K page: [L0 K | L0 V | L1 KV | ...]. A page
  therefore holds page_size tokens of ONE cached tensor, and a block has as many pages as the model caches tensors
  per token (2 per untied layer, 1 per tied one). Read and write indices, block tables, sectors, prefix sharing and
  CPU offloading are transformers' own and work on this geometry unchanged.
- What a layer stores follows the other QKVShare caches (`cache_qkvshare.attend_layer`): post-RoPE ties store the
  rotated key, pre-RoPE ties the unrotated one, rotated on read at the positions of the keys read. Continuous
  batching packs requests into one row and reads each request's keys from its first token on, in order, so the key
  positions are rebuilt from the batch's cumulative key lengths (`cu_seq_lens_k`): 0..n_i - 1 per request. The "+"
  map and ALiBi take the same positions, so they work too.
- The model's forward stays one path: `cache_for_model` turns the cache given to a forward into this forward's
  `PagedBatch` (the cache plus the batch's page indices), which offers the `attend` / `update_positions` of every
  QKVShare cache. transformers passes the masks (block-diagonal causal, one row of requests) ready.
- Not supported, refused before any work by `check_continuous_batching` with the setting and what to use instead:
  the linear kernel (a constant-size state, no pages), QV-Ka (its cache holds a context and values of other widths),
  sliding windows (only full-attention pages here), bidirectional models, and attention backends other than sdpa
  and eager (flash attention's paged kernels read one K and one V page tensor per layer).
- This rests on private parts of transformers' continuous batching (the allocator geometry, the cache constructor,
  the manager's batch processor): `TESTED_TRANSFORMERS` is the range it was tested with, checked at run time.
- The page pool on CPU is sized to the work, not to the machine (`pool_for_the_work`): transformers sizes it from
  free memory, which on CPU is 60% of the RAM (a 115k-parameter model took 11-13 GB), and allocates an attention
  mask of max_batch_tokens x (pool tokens + max_batch_tokens) next to it. `init_continuous_batching` (every entry
  point) therefore fills the sizes left unset: the pool holds the batch it is given (`generate_batch`, paged
  `generate()`: requests x (prompt + max_new_tokens), rounded up to pages), or `CPU_POOL_TOKENS` without a workload,
  capped at `CPU_POOL_CAP_TOKENS` tokens and `CPU_POOL_CAP_BYTES` bytes of pages (never below one request).
  Other devices keep transformers' sizing.
- Only torch/transformers and single-dot imports of package files: `save_pretrained` copies this file into
  checkpoints with the model files.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from math import ceil, lcm
from typing import Any, NamedTuple

import torch
import transformers
from packaging.specifiers import SpecifierSet
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager, PagedAttentionCache

from .cache_qkvshare import CacheLayout, attend_layer
from .compat_qkvshare import (
    FULL_ATTENTION,
    SCHEDULER_MAPPING,
    TESTED_TRANSFORMERS,
    CachePool,
    ContinuousBatchProcessor,
    DistributedHelper,
    FIFOScheduler,
    FullAttentionCacheAllocator,
    PagedAttentionMemoryHandler,
    WorkloadHints,
    update_cb_config_after_cache_creation,
)
from .compat_qkvshare import continuous_batching_logger as logger
from .configuration_qkvshare import QKVShareConfig

# Attention backends whose continuous-batching path reads the K and V that `attend` returns ("paged|eager" is what
# transformers' manager makes of "eager").
PAGED_BACKENDS = ("sdpa", "eager", "paged|eager")

# Continuous batching on CPU, for the sizes a `ContinuousBatchingConfig` leaves unset (see `pool_for_the_work`).
CPU_PAGE_SIZE = 32  # tokens per page when no ContinuousBatchingConfig is given (transformers: 256)
CPU_MAX_BATCH_TOKENS = 256  # tokens per forward (transformers: 8192, with a mask of 8192 x pool tokens)
CPU_POOL_TOKENS = 4096  # the pool without a workload to size it (`init_continuous_batching()` alone)
CPU_POOL_CAP_TOKENS = 16384  # the largest pool sized from a workload ...
CPU_POOL_CAP_BYTES = 512 * 2**20  # ... and its largest page bytes (a larger batch waits for pages)


def pool_for_the_work(
    config: QKVShareConfig,
    continuous_batching_config: ContinuousBatchingConfig | None,
    dtype: torch.dtype,
    device: torch.device | str,
    workload_hints: WorkloadHints | None = None,
) -> ContinuousBatchingConfig:
    """The `ContinuousBatchingConfig` to batch with: on CPU, a copy with the sizes it leaves unset filled to fit the
    work rather than the machine's RAM (transformers' sizing takes 60% of it there); elsewhere `continuous_batching_config`
    (or transformers' default) as is.

    On CPU: `num_blocks` holds `workload_hints.num_requests` requests of `max_prompt_length + max_generated_length`
    tokens each, rounded up to pages (what `generate_batch` and paged `generate()` pass), or `CPU_POOL_TOKENS` without
    hints, capped at `CPU_POOL_CAP_TOKENS` and `CPU_POOL_CAP_BYTES` but never below one request; `max_batch_tokens`
    is `CPU_MAX_BATCH_TOKENS`; without a config at all, pages are `CPU_PAGE_SIZE` tokens.
    """
    if torch.device(device).type != "cpu":
        return continuous_batching_config if continuous_batching_config is not None else ContinuousBatchingConfig()
    if continuous_batching_config is None:
        sized = ContinuousBatchingConfig(page_size=CPU_PAGE_SIZE)
    else:
        sized = copy.deepcopy(continuous_batching_config)
    if sized.max_batch_tokens is None:
        sized.max_batch_tokens = CPU_MAX_BATCH_TOKENS
    if sized.num_blocks is None:
        page = sized.page_size
        block_bytes = page * config.kv_cache_bytes_per_token(dtype.itemsize)  # one page of every cached tensor
        cap = max(1, min(CPU_POOL_CAP_TOKENS // page, CPU_POOL_CAP_BYTES // block_bytes))
        if workload_hints is not None and workload_hints.max_prompt_length > 0:
            # A request without max_new_tokens may run to the model's last position.
            generated = workload_hints.max_generated_length or config.max_position_embeddings
            per_request = ceil((workload_hints.max_prompt_length + generated) / page)
            sized.num_blocks = max(per_request, min(max(1, workload_hints.num_requests) * per_request, cap))
        else:
            sized.num_blocks = min(ceil(CPU_POOL_TOKENS / page), cap)
        logger.info(
            f"QKVSharePagedCache on CPU: a pool of {sized.num_blocks} blocks of {page} tokens "
            f"({sized.num_blocks * block_bytes:,} bytes of pages) for this work; pass "
            "ContinuousBatchingConfig(num_blocks=...) to choose"
        )
    return sized


def check_continuous_batching(config: QKVShareConfig) -> None:
    """Refuse, with a ValueError naming the setting and what to use instead, a model or transformers version the tied
    paged cache cannot serve exactly. Called before any work by every continuous-batching entry point."""
    installed = transformers.__version__
    if not SpecifierSet(TESTED_TRANSFORMERS).contains(installed, prereleases=True):
        raise ValueError(
            f"continuous batching: QKVShare's paged cache builds on private parts of transformers' continuous "
            f"batching and is tested with transformers{TESTED_TRANSFORMERS}, but {installed} is installed; install "
            f'"transformers{TESTED_TRANSFORMERS}", or generate without it (model.generate() uses QKVShareCache).'
        )
    instead = "generate with model.generate() instead (its QKVShareCache holds this model's cache)"
    if config.attention_kernel == "linear":
        problem = "attention_kernel='linear' keeps a constant-size state per sequence, which has no pages"
    elif config.key_context_dim:
        problem = (
            f"QV-Ka (key_context_dim={config.key_context_dim}) caches a context of width {config.key_context_dim} and "
            "per-head values, which pages of (num_key_value_heads, head_dim) rows cannot hold"
        )
    elif "sliding_attention" in CacheLayout.for_config(config).attention_types:
        problem = f"sliding_window={config.sliding_window}: the paged cache here holds full-attention layers only"
    elif not config.is_causal:
        problem = "is_causal=False: continuous batching generates causally (its masks are causal)"
    elif config._attn_implementation not in PAGED_BACKENDS:
        problem = (
            f"attn_implementation={config._attn_implementation!r}: QKVShare models batch continuously with the sdpa "
            "and eager backends only (flash attention's paged kernels read a key and a value page per layer)"
        )
        instead = "load the model with attn_implementation='sdpa' or 'eager'"
    else:
        return
    raise ValueError(f"continuous batching: {problem}; {instead}.")


class TiedPagedAllocator(FullAttentionCacheAllocator):
    """transformers' allocator for full-attention layers, with one page per block for a tied layer.

    A page holds page_size tokens of one cached tensor (rows of (num_key_value_heads, head_dim)); a block holds, layer
    after layer, a key page and a value page for an untied layer and a single page for a tied one. So a block is
    `pages_per_block = sum of the layers' cached tensors` pages, and a token's rows are page_size apart (one row per
    token per page: transformers' row arithmetic for read and write indices applies unchanged).

    State (besides transformers'): `cached_tensors` layer -> 1 (tied) or 2; `_kv_token_views` layer -> (key rows,
    value rows) views of the pool, the same view twice for a tied layer.
    """

    supports_block_table = False  # the block-table decode path is flash attention's, which reads separate K/V pages
    rows_per_token = 1  # per page: a page is one tensor's rows

    def __init__(
        self,
        index: int,
        config: QKVShareConfig,
        num_key_value_heads: int,
        cache_dtype: torch.dtype,
        page_size: int,
        layer_indices: list[int],
        allow_block_sharing: bool,
    ) -> None:
        self.head_dim = config.head_dim
        self.num_key_value_heads = num_key_value_heads
        self.cache_dtype = cache_dtype
        self.cached_tensors = {i: config.layer_mode(i).cached_tensors for i in layer_indices}
        page_bytes = num_key_value_heads * self.head_dim * cache_dtype.itemsize * page_size
        self._before_cache_tensor_init(index, layer_indices, page_size, page_bytes, allow_block_sharing)
        # transformers counts one page per layer; here a page per cached tensor.
        self.pages_per_block = sum(self.cached_tensors.values())
        self.tokens_per_block = page_size * self.pages_per_block  # rows of a block
        self.block_physical_stride = self.rows_per_token * self.tokens_per_block
        self.bytes_per_block = page_bytes * self.pages_per_block

    def register_cache_tensor(
        self, bytes_per_sector: int, non_trash_bytes: int, cache_tensor: torch.Tensor, pool: CachePool
    ) -> None:
        """View the pool (bytes, two trash sectors first) as rows and give each layer its key and value rows."""
        self.bytes_per_sector = bytes_per_sector
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)  # block copies (forks, CPU offloading)
        row_bytes = self.num_key_value_heads * self.head_dim * self.cache_dtype.itemsize
        total_rows = (non_trash_bytes + 2 * bytes_per_sector) // row_bytes
        rows = cache_tensor.view(self.cache_dtype)[: total_rows * row_bytes // self.cache_dtype.itemsize]
        rows = rows.view(total_rows, self.num_key_value_heads, self.head_dim)  # (rows, H_kv, D)
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, rows, pool)
        self._kv_token_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        page = 0  # the page of the block where the layer's first tensor starts
        for layer_idx in self.layer_indices:
            keys = rows[page * self.tokens_per_page :]
            values = keys if self.cached_tensors[layer_idx] == 1 else rows[(page + 1) * self.tokens_per_page :]
            self._kv_token_views[layer_idx] = (keys, values)
            page += self.cached_tensors[layer_idx]
        self._kv_page_views = {}  # no block-table path (see `supports_block_table`)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        read_index: torch.Tensor,
        write_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new states (T_new, H_kv, D) at `write_index`; return the rows at `read_index` (the new states when
        nothing is read), as transformers' allocator. A tied layer writes and reads its one tensor once; the
        `value_states` it is given must be `key_states`."""
        keys, values = self._kv_token_views[layer_idx]
        keys.index_copy_(0, write_index, key_states)
        if values is not keys:
            values.index_copy_(0, write_index, value_states)
        if read_index.numel() == 0:
            return key_states, value_states
        read_keys = keys.index_select(0, read_index)  # (T_read, H_kv, D)
        return read_keys, read_keys if values is keys else values.index_select(0, read_index)

    def get_cache_for_block_table(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError(
            "TiedPagedAllocator has no block-table path (flash attention's decode kernels); continuous batching of "
            "QKVShare models runs with attn_implementation='sdpa' or 'eager'."
        )


class QKVSharePagedCache(PagedAttentionCache):
    """transformers' `PagedAttentionCache` with the QKVShare layout: one page per block for each tied layer.

    Args: those of `PagedAttentionCache` (the continuous-batching manager passes them): `config` is the model's
    `QKVShareConfig`; `continuous_batching_config.num_blocks` (whole-model blocks of page_size tokens) or, without it,
    the free memory sizes the pool, as in transformers: the same memory then holds more blocks.

    State (besides transformers'): `layout`, the `CacheLayout` it was built for (a model refuses a cache of another
    layout). `cache_tensor` is the one byte pool: two trash sectors, then `num_sectors` sectors of blocks.
    `nbytes()` gives its bytes; `bytes_per_block` those of one block (page_size tokens of every layer).
    """

    def __init__(
        self,
        config: QKVShareConfig,
        continuous_batching_config: ContinuousBatchingConfig,
        device: torch.device | str,
        distributed_helper: DistributedHelper,
        dtype: torch.dtype = torch.float16,
        model_supports_logits_to_keep: bool = False,
    ) -> None:
        # transformers' PagedAttentionCache.__init__ with our allocator (it builds its own from a fixed table).
        check_continuous_batching(config)
        self.layout: CacheLayout = CacheLayout.for_config(config)
        self.config = config
        self.dtype = dtype
        self.device = device
        self.max_blocks_per_request = continuous_batching_config.max_blocks_per_request or 0
        num_key_value_heads, kv_tp_size = config.num_key_value_heads, 1
        if distributed_helper.tp_size > 1 and distributed_helper.are_kv_heads_tp_ed():
            if num_key_value_heads % distributed_helper.tp_size != 0:
                raise ValueError(
                    f"num_key_value_heads={num_key_value_heads} must be divisible by the tensor parallel size "
                    f"{distributed_helper.tp_size}."
                )
            kv_tp_size = distributed_helper.tp_size
            num_key_value_heads //= kv_tp_size
        layers = list(range(config.num_hidden_layers))
        allocator = TiedPagedAllocator(
            index=0,
            config=config,
            num_key_value_heads=num_key_value_heads,
            cache_dtype=dtype,
            page_size=continuous_batching_config.page_size,
            layer_indices=layers,
            allow_block_sharing=continuous_batching_config.allow_block_sharing,
        )
        self.cache_allocators = {FULL_ATTENTION: allocator}
        self.layer_to_allocator = dict.fromkeys(layers, allocator)
        self.bytes_per_sector = lcm(allocator.bytes_per_block, 128)  # transformers' 128-byte alignment
        self.tokens_per_sector = (self.bytes_per_sector // allocator.bytes_per_block) * allocator.tokens_per_page
        self.bytes_per_block = allocator.bytes_per_block  # one group: a whole-model block is the allocator's block
        self.max_batch_tokens, self.num_sectors = PagedAttentionMemoryHandler(
            config=config,
            cb_config=continuous_batching_config,
            dtype=dtype,
            bytes_per_sector=self.bytes_per_sector,
            tokens_per_sector=self.tokens_per_sector,
            bytes_per_block=self.bytes_per_block,
            attn_types=[FULL_ATTENTION],
            model_supports_logits_to_keep=model_supports_logits_to_keep,
            kv_tp_size=kv_tp_size,
        ).infer_max_batch_tokens_and_num_sectors()
        if distributed_helper.tp_size > 1:  # every rank takes the smallest sizes
            sync = torch.tensor([self.max_batch_tokens, self.num_sectors], device=device, dtype=torch.int64)
            distributed_helper.tp_all_reduce_min(sync)
            self.max_batch_tokens, self.num_sectors = int(sync[0].item()), int(sync[1].item())
        non_trash_bytes = self.num_sectors * self.bytes_per_sector
        self.cache_tensor = torch.zeros(non_trash_bytes + 2 * self.bytes_per_sector, dtype=torch.uint8, device=device)
        self.pool = CachePool(self.num_sectors, 1)
        allocator.register_cache_tensor(self.bytes_per_sector, non_trash_bytes, self.cache_tensor, self.pool)
        self.allow_block_sharing = continuous_batching_config.allow_block_sharing
        self.use_prefix_sharing = allocator.use_block_sharing and self.allow_block_sharing
        self.num_blocks = non_trash_bytes // self.bytes_per_block
        self.read_cache_limit = self._infer_read_cache_limit()
        self.max_decode_fast_path_length = self._infer_max_decode_fast_path_length()
        self.max_tokens_read = allocator.tokens_per_page * allocator.num_blocks
        logger.info(
            f"QKVSharePagedCache: {self.num_blocks} blocks of {allocator.tokens_per_page} tokens, "
            f"{self.bytes_per_block} bytes each ({allocator.pages_per_block} pages for {len(layers)} layers), "
            f"{self.nbytes()} bytes in all"
        )

    def nbytes(self) -> int:
        """Bytes of the page pool, trash sectors included (as transformers' `cache_tensor`)."""
        return self.cache_tensor.nbytes

    @property
    def page_size(self) -> int:
        """Tokens per page (and per block: a block is one page of every cached tensor)."""
        return self.cache_allocators[FULL_ATTENTION].tokens_per_page

    def capacity_tokens(self) -> int:
        """Tokens the pool holds in all (its blocks times the page size): no request longer than this can run."""
        return self.num_blocks * self.page_size

    def bytes_per_token(self) -> float:
        """Bytes of pages per cached token: one row of every cached tensor (one per tied layer, two per untied one)."""
        return self.bytes_per_block / self.page_size

    def for_batch(self, layout: CacheLayout, batch: Mapping[str, Any]) -> PagedBatch:
        """This forward's view of the cache, from the forward's keyword arguments (continuous batching's
        `read_index`, `write_index`, `cu_seq_lens_k`); refuses a model of another layout or a forward without them."""
        if layout != self.layout:
            raise ValueError(
                "cache: this QKVSharePagedCache was built for a different model (cache vs model: "
                + "; ".join(self.layout.differences(layout))
                + "); continuous batching builds one per model (model.init_continuous_batching())."
            )
        missing = [name for name in ("read_index", "write_index", "cu_seq_lens_k") if batch.get(name) is None]
        if missing:
            raise ValueError(
                f"cache: a QKVSharePagedCache is read and written through continuous batching's page indices, but "
                f"this forward has no {', '.join(missing)}; run the model through model.generate_batch(...) or "
                "model.init_continuous_batching(), or pass another cache (or none)."
            )
        return PagedBatch(
            allocator=self.cache_allocators[FULL_ATTENTION],
            layout=self.layout,
            read_index=batch["read_index"][0],
            write_index=batch["write_index"][0],
            cu_seq_lens_k=batch["cu_seq_lens_k"][FULL_ATTENTION],
        )


class PagedLayer(NamedTuple):
    """One layer of one continuous-batching forward, behind the `update` of a cache layer (see `attend_layer`)."""

    allocator: TiedPagedAllocator
    layer_idx: int
    read_index: torch.Tensor
    write_index: torch.Tensor

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new states (1, H_kv, T_new, D) (a tied layer: `value_states` None) and return the keys and values
        read for the batch (1, H_kv, T_read, D), the same tensor twice for a tied layer."""
        key_rows = key_states.squeeze(0).transpose(0, 1)  # (T_new, H_kv, D), the pool's row layout
        value_rows = key_rows if value_states is None else value_states.squeeze(0).transpose(0, 1)
        keys, values = self.allocator.update(key_rows, value_rows, self.layer_idx, self.read_index, self.write_index)
        keys = keys.transpose(0, 1).unsqueeze(0)  # (1, H_kv, T_read, D)
        return keys, keys if values is keys else values.transpose(0, 1).unsqueeze(0)


class PagedBatch(NamedTuple):
    """One continuous-batching forward's view of a `QKVSharePagedCache`: what `cache_for_model` hands the layers.

    Fields: the cache's allocator and layout, and the batch's page indices (`read_index`, `write_index`: rows of the
    pool, (T_read,) and (T_new,)) and cumulative key lengths per request (`cu_seq_lens_k`, (requests + 1,)).
    """

    allocator: TiedPagedAllocator
    layout: CacheLayout
    read_index: torch.Tensor
    write_index: torch.Tensor
    cu_seq_lens_k: torch.Tensor

    def update_positions(self, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The position ids (1, T_keys) of every key the layers read in this forward, per attention type.

        Continuous batching reads each request's keys from its first token, in order (after writing the new ones), so
        the key at offset j of request i has position j: rebuilt from `cu_seq_lens_k`. When nothing is read (every
        request a whole prompt), the keys are the new tokens, at `position_ids`.
        """
        types = self.layout.present_attention_types
        read = self.read_index.numel()
        if not self.layout.track_positions or read == 0:
            return dict.fromkeys(types, position_ids)
        ends = self.cu_seq_lens_k.to(torch.long)  # (requests + 1,) cumulative key counts
        keys = torch.arange(read, device=ends.device)
        # Request of each key; keys past the last request (padding, read from the trash rows) take the last one.
        request = torch.searchsorted(ends[1:], keys, right=True).clamp_max(ends.numel() - 2)
        positions = (keys - ends[request]).to(position_ids.device)
        return dict.fromkeys(types, positions[None])  # (1, T_read)

    def attend(self, layer_idx: int, *states: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`QKVShareCacheMixin.attend` (same arguments after `layer_idx`) on the pages: store the new states as the
        layer's kind keeps them and return the keys and values of every request's tokens, packed as the batch's mask
        expects."""
        layer = PagedLayer(self.allocator, layer_idx, self.read_index, self.write_index)
        return attend_layer(self.layout.layer_kinds[layer_idx], self.layout.kv_tie_point, layer, *states)


class QKVShareBatchingManager(ContinuousBatchingManager):
    """transformers' `ContinuousBatchingManager` on a `QKVSharePagedCache`, staying on the sdpa or eager backend.

    Use it as transformers' (`add_request`, `get_result`, `request_id_iter`, `start`/`stop`, ...); create it with
    `model.init_continuous_batching(...)`. `cache_nbytes()` gives the bytes of its page pool once created.
    """

    def switch_to_cb_friendly_attn(self, model: torch.nn.Module, auto_switch_to_flash: bool = True) -> None:
        # Never to flash attention: its paged kernels read one K and one V page tensor per layer.
        super().switch_to_cb_friendly_attn(model, auto_switch_to_flash=False)

    def cache_nbytes(self) -> int | None:
        """Bytes of the page pool (`QKVSharePagedCache.nbytes`); None before the batch processor exists (it is made
        by `warmup()` or the generation loop)."""
        cache = self.paged_cache()
        return None if cache is None else cache.nbytes()

    def paged_cache(self) -> QKVSharePagedCache | None:
        """The page pool the requests of this manager are served from; None before the batch processor exists (the
        generation loop makes it when it starts)."""
        processor = self.batch_processor
        return None if processor is None else processor.cache

    def wait_for_paged_cache(self, timeout: float) -> QKVSharePagedCache:
        """The page pool, once the started generation loop has made it: a `RuntimeError` if the loop stops first (its
        error is logged) or takes longer than `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (cache := self.paged_cache()) is None:
            if not self.is_running():
                raise RuntimeError("continuous batching: the generation loop stopped while building the page pool")
            if time.monotonic() > deadline:
                raise RuntimeError(f"continuous batching: no page pool after {timeout:.0f} s")
            time.sleep(0.02)
        return cache

    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        # transformers' ContinuousBatchingManager._create_batch_processor, with a QKVSharePagedCache (no sliding
        # layers: refused before).
        if isinstance(self.batch_processor, ContinuousBatchProcessor):
            self.batch_processor.reset()
            return self.batch_processor
        supports_logits_to_keep = getattr(self.model, "_supports_logits_to_keep", None)
        cache = QKVSharePagedCache(
            config=self.model.config,
            continuous_batching_config=self.continuous_batching_config,
            device=self.model.device,
            distributed_helper=self.distributed_helper,
            dtype=self.model.dtype,
            model_supports_logits_to_keep=callable(supports_logits_to_keep) and supports_logits_to_keep(),
        )
        self._use_prefix_sharing = cache.use_prefix_sharing
        update_cb_config_after_cache_creation(
            cb_config=self.continuous_batching_config,
            num_blocks=cache.num_blocks,
            max_batch_tokens=cache.max_batch_tokens,
        )
        config = self.continuous_batching_config
        scheduler_cls = SCHEDULER_MAPPING.get(config.scheduler_type)
        if scheduler_cls is None:
            logger.warning(f"Scheduler '{config.scheduler_type}' not found. Defaulting to FIFO.")
            scheduler_cls = FIFOScheduler
        scheduler = scheduler_cls(
            cache=cache, safety_margin=config.safety_margin, max_requests_per_batch=config.max_requests_per_batch
        )
        return ContinuousBatchProcessor(
            cache=cache,
            config=self.model.config,
            generation_config=self.generation_config,
            continuous_batching_config=config,
            logit_processor=self.logit_processor,
            input_queue=self.input_queue if self.is_tp_driver else None,
            cancel_queue=self.cancel_queue if self.is_tp_driver else None,
            output_router=self.output_router,
            background_thread_status=self.background_thread_status,
            model_device=self.model.device,
            model_dtype=self.model.dtype,
            scheduler=scheduler,
            distributed_helper=self.distributed_helper,
        )


class ContinuousBatchingMixin:
    """transformers' continuous batching on the tied paged cache, for `QKVShareForCausalLM`.

    Every entry point goes through `init_continuous_batching` (transformers' `generate_batch` and
    `continuous_batching_context_manager` call it, `generate(cache_implementation="paged")` calls `generate_batch`,
    `transformers serve` calls it), so overriding it puts every one on a `QKVShareBatchingManager`.
    """

    @torch.no_grad()
    def init_continuous_batching(
        self,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        workload_hints: WorkloadHints | None = None,
    ) -> QKVShareBatchingManager:
        """A `QKVShareBatchingManager` for this model (transformers' `init_continuous_batching`, on a
        `QKVSharePagedCache`): add requests, read results. Raises a ValueError before any work for what the paged
        cache cannot serve (see `check_continuous_batching`). On CPU the sizes the config leaves unset fit the work
        (`pool_for_the_work`), not the machine's RAM."""
        check_continuous_batching(self.config)
        # The rest follows transformers' ContinuousMixin.init_continuous_batching.
        cached_manager = getattr(self, "_cached_continuous_batching_manager", None)
        if isinstance(cached_manager, QKVShareBatchingManager):
            cached_manager.switch_to_cb_friendly_attn(self)  # might have switched back in .stop
            return cached_manager
        generation_config = generation_config if generation_config is not None else self.generation_config
        if generation_config.eos_token_id is None:
            logger.warning("`eos_token_id` not set in GenerationConfig. Setting to -1 (disabled).")
            generation_config.eos_token_id = -1
        if continuous_batching_config is None:
            continuous_batching_config = getattr(generation_config, "continuous_batching_config", None)
            if isinstance(continuous_batching_config, ContinuousBatchingConfig):
                logger.warning(
                    "Passing ContinuousBatchingConfig through GenerationConfig is deprecated. Please pass it separately"
                    " using the continuous_batching_config kwarg."
                )
            else:
                continuous_batching_config = None
        continuous_batching_config = pool_for_the_work(
            self.config, continuous_batching_config, self.dtype, self.device, workload_hints
        )
        return QKVShareBatchingManager(
            model=self,
            generation_config=generation_config,
            continuous_batching_config=continuous_batching_config,
            workload_hints=workload_hints,
        )


__all__ = [
    "CPU_MAX_BATCH_TOKENS",
    "CPU_PAGE_SIZE",
    "CPU_POOL_CAP_BYTES",
    "CPU_POOL_CAP_TOKENS",
    "CPU_POOL_TOKENS",
    "TESTED_TRANSFORMERS",
    "ContinuousBatchingMixin",
    "PagedBatch",
    "QKVShareBatchingManager",
    "QKVSharePagedCache",
    "TiedPagedAllocator",
    "check_continuous_batching",
    "pool_for_the_work",
]
