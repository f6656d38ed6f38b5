"""Every private part of transformers (and of torch and PEFT) that QKVShare relies on, named in one place.

Why a module of its own: these names are not public API, so a transformers release may move, rename or re-sign them
without notice. Two kinds of breakage follow, and the second is silent:
- an import or attribute that is gone fails loudly, somewhere;
- a private method QKVShare *overrides* (`GenerationMixin._prepare_cache_for_generation`, ...) that is renamed or
  re-signed is simply no longer called: generate() would quietly build transformers' two-tensor caches again.
So every such symbol is listed in `PRIVATE_SYMBOLS` with what QKVShare does with it and, for methods, the parameters
it relies on; `symbol_problem` checks one against the installed release, and the test suite checks each of them
(tests/test_compat.py), so a release that moves one fails a test that names it, not a user's run.

The private *modules* (continuous batching's internals) are imported here and only here; the model files import
those names from this module. Overrides stay where they belong (the model and cache classes), each with a comment
naming the upstream function it follows, and are listed here. `TESTED_TRANSFORMERS` is the release range all of this
was tested with; `check_transformers_version` says when another one is installed.

This is a model file: `save_pretrained` copies it into checkpoints with the modeling code (it imports nothing of the
package).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import transformers
from packaging.specifiers import SpecifierSet

# Continuous batching's internals: the paged cache and its manager (paged_cache_qkvshare.py) build on them.
from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler
from transformers.generation.continuous_batching.cache_allocators import (
    FULL_ATTENTION,
    CachePool,
    FullAttentionCacheAllocator,
)
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.initialization import update_cb_config_after_cache_creation
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, FIFOScheduler
from transformers.generation.continuous_batching.utils import WorkloadHints
from transformers.generation.continuous_batching.utils import logger as continuous_batching_logger

# The transformers releases QKVShare was tested with (its CI pins one of them).
TESTED_TRANSFORMERS = ">=5.24,<5.26"


@dataclass(frozen=True)
class PrivateSymbol:
    """One private name QKVShare relies on.

    Fields:
        path: "module:qualified.name" (a class attribute or method after the class).
        use: what QKVShare does with it and where ("overrides" means a method of ours replaces it: if it moved, ours
            would silently stop being called).
        parameters: for a method or function, the parameter names (after `self`) that QKVShare's override or call
            relies on, in order; None for other names.
    """

    path: str
    use: str
    parameters: tuple[str, ...] | None = None


PRIVATE_SYMBOLS: tuple[PrivateSymbol, ...] = (
    # ----- generation: which cache generate() builds (modeling_qkvshare.QKVShareForCausalLM)
    PrivateSymbol(
        "transformers.generation.utils:GenerationMixin._prepare_cache_for_generation",
        "overridden by QKVShareForCausalLM so that generate() builds a QKVShareCache (one tensor per tied layer)",
        ("generation_config", "model_kwargs", "generation_mode", "batch_size", "max_cache_length"),
    ),
    PrivateSymbol(
        "transformers.generation.utils:GenerationMixin._prepare_static_cache",
        "overridden by QKVShareForCausalLM so that static generation builds a QKVShareStaticCache",
        ("cache_implementation", "batch_size", "max_cache_len", "prefill_chunk_size", "model_kwargs"),
    ),
    PrivateSymbol(
        "transformers.generation.utils:GenerationMixin._get_static_cache_init_shape",
        "called by QKVShareForCausalLM._prepare_static_cache for chunked prefill, as transformers' own does",
    ),
    PrivateSymbol(
        "transformers.generation.utils:GenerationMixin._supports_logits_to_keep",
        "called by QKVShareBatchingManager._create_batch_processor, as transformers' own does",
        (),
    ),
    # ----- models and configs (modeling, validation, paged cache, bench)
    PrivateSymbol(
        "transformers.configuration_utils:PreTrainedConfig._attn_implementation",
        "read by the attention layers and checks to pick the backend, as transformers' Llama does",
    ),
    PrivateSymbol(
        "transformers.modeling_utils:PreTrainedModel._init_weights",
        "overridden by QKVSharePreTrainedModel (the documented hook for a model's own weights)",
        ("module",),
    ),
    # ----- the quantized cache: the tied layers quantize their one tensor with the backend's own functions
    PrivateSymbol(
        "transformers.cache_utils:QuantoQuantizedLayer._quantize",
        "called by TiedQuantoQuantizedLayer (cache_qkvshare.py)",
        ("tensor", "axis"),
    ),
    PrivateSymbol(
        "transformers.cache_utils:QuantoQuantizedLayer._dequantize",
        "called by TiedQuantoQuantizedLayer",
        ("qtensor",),
    ),
    PrivateSymbol(
        "transformers.cache_utils:HQQQuantizedLayer._quantize",
        "called by TiedHQQQuantizedLayer",
        ("tensor", "axis"),
    ),
    PrivateSymbol(
        "transformers.cache_utils:HQQQuantizedLayer._dequantize",
        "called by TiedHQQQuantizedLayer",
        ("qtensor",),
    ),
    PrivateSymbol(
        "transformers.cache_utils:Fp8QuantizedLayer._quantize",
        "called by TiedFp8QuantizedLayer",
        ("tensor", "scale"),
    ),
    PrivateSymbol(
        "transformers.cache_utils:Fp8QuantizedLayer._dequantize",
        "called by TiedFp8QuantizedLayer",
        ("qtensor",),
    ),
    # ----- continuous batching (paged_cache_qkvshare.py): private modules, imported above
    PrivateSymbol(
        "transformers.generation.continuous_batching.continuous_api:ContinuousBatchingManager._create_batch_processor",
        "overridden by QKVShareBatchingManager to build a QKVSharePagedCache (one page per tied layer)",
        (),
    ),
    PrivateSymbol(
        "transformers.generation.continuous_batching.continuous_api:ContinuousBatchProcessor",
        "built by QKVShareBatchingManager._create_batch_processor with the tied paged cache",
    ),
    PrivateSymbol(
        "transformers.generation.continuous_batching.cache:PagedAttentionMemoryHandler",
        "sizes the tied page pool (QKVSharePagedCache)",
    ),
    PrivateSymbol(
        "transformers.generation.continuous_batching.cache_allocators:FullAttentionCacheAllocator",
        "subclassed by TiedPagedAllocator (a page per cached tensor)",
    ),
    PrivateSymbol(
        "transformers.generation.continuous_batching.cache_allocators:CachePool",
        "the page pool TiedPagedAllocator addresses",
    ),
    PrivateSymbol(
        "transformers.generation.continuous_batching.cache_allocators:FULL_ATTENTION",
        "the attention-group key of the pool's allocators",
    ),
    PrivateSymbol(
        "transformers.generation.continuous_batching.distributed:DistributedHelper",
        "passed to the paged cache, as transformers' manager does",
    ),
    PrivateSymbol(
        "transformers.generation.continuous_batching.initialization:update_cb_config_after_cache_creation",
        "called once the tied pool exists, as transformers' manager does",
    ),
    PrivateSymbol(
        "transformers.generation.continuous_batching.scheduler:SCHEDULER_MAPPING",
        "the schedulers by name, for the batch processor",
    ),
    PrivateSymbol(
        "transformers.generation.continuous_batching.scheduler:FIFOScheduler",
        "the default scheduler, as transformers' manager picks it",
    ),
    PrivateSymbol(
        "transformers.generation.continuous_batching.utils:WorkloadHints",
        "the batch processor's workload hints; on CPU, pool_for_the_work sizes the page pool from its "
        "max_prompt_length, max_generated_length and num_requests",
    ),
    # ----- PEFT (optional): the default LoRA targets of a model type (qkvshare/__init__.py)
    PrivateSymbol(
        "peft.utils.constants:TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING",
        "register_peft_defaults adds QKVShare's attention projections, so LoraConfig() needs no target_modules",
    ),
    # ----- torch: the caches as pytree nodes for torch.export (cache_qkvshare.py, export.py)
    PrivateSymbol(
        "torch.utils._pytree:register_pytree_node",
        "registers the QKVShare caches as pytree nodes, as transformers does for DynamicCache",
    ),
    PrivateSymbol("torch.utils._pytree:GetAttrKey", "names the caches' pytree children"),
    PrivateSymbol("torch.utils._pytree:SUPPORTED_NODES", "skips a cache class registered before"),
    PrivateSymbol("torch.utils._pytree:tree_flatten_with_path", "flattens the static cache into ONNX inputs"),
    PrivateSymbol("torch.utils._pytree:tree_unflatten", "rebuilds the static cache from ONNX outputs"),
)


def resolve(path: str) -> object:
    """The object `path` ("module:qualified.name") names; `ImportError` or `AttributeError` when it is gone."""
    module, _, name = path.partition(":")
    found: object = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def symbol_problem(symbol: PrivateSymbol) -> str | None:
    """What is wrong with `symbol` in the installed releases (it is gone, or its parameters changed), as a message
    naming it, what QKVShare does with it and what to do; None when it is as QKVShare expects."""
    where = f"{symbol.path} ({symbol.use})"
    fix = (
        f"QKVShare was tested with transformers{TESTED_TRANSFORMERS} (installed: {transformers.__version__}): "
        "install a tested release, or adapt qkvshare/compat_qkvshare.py and the code that uses it."
    )
    try:
        found = resolve(symbol.path)
    except (ImportError, AttributeError) as err:
        return f"{where} is gone ({type(err).__name__}: {err}). {fix}"
    if symbol.parameters is None:
        return None
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: nothing more to check
    names = tuple(p for p in signature.parameters if p not in ("self", "cls"))
    named = tuple(n for n in names if signature.parameters[n].kind not in (inspect.Parameter.VAR_KEYWORD,))
    if named[: len(symbol.parameters)] != symbol.parameters:
        return f"{where} now takes ({', '.join(names)}), not ({', '.join(symbol.parameters)}). {fix}"
    return None


def check_transformers_version() -> str | None:
    """A warning to print when the installed transformers is outside `TESTED_TRANSFORMERS`, else None."""
    installed = transformers.__version__
    if SpecifierSet(TESTED_TRANSFORMERS).contains(installed, prereleases=True):
        return None
    return (
        f"QKVShare relies on private parts of transformers (qkvshare/compat_qkvshare.py) and was tested with "
        f"transformers{TESTED_TRANSFORMERS}; {installed} is installed. If something fails, install "
        f'"transformers{TESTED_TRANSFORMERS}".'
    )


__all__ = [
    "TESTED_TRANSFORMERS",
    "PRIVATE_SYMBOLS",
    "PrivateSymbol",
    "check_transformers_version",
    "resolve",
    "symbol_problem",
    "CachePool",
    "ContinuousBatchProcessor",
    "DistributedHelper",
    "FIFOScheduler",
    "FULL_ATTENTION",
    "FullAttentionCacheAllocator",
    "PagedAttentionMemoryHandler",
    "SCHEDULER_MAPPING",
    "WorkloadHints",
    "continuous_batching_logger",
    "update_cb_config_after_cache_creation",
]
