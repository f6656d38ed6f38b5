"""transformers' private parts, one test each: a release that moves, renames or re-signs one fails the test that names
it (qkvshare/compat_qkvshare.py), and nothing outside that module imports transformers' private modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from qkvshare.compat_qkvshare import PRIVATE_SYMBOLS, PrivateSymbol, check_transformers_version, symbol_problem

ROOT = Path(__file__).resolve().parents[1]
# transformers modules that are not public API (continuous batching's internals, the CLI's server)
PRIVATE_MODULES = (
    "transformers.generation.continuous_batching.cache",
    "transformers.generation.continuous_batching.cache_allocators",
    "transformers.generation.continuous_batching.continuous_api",
    "transformers.generation.continuous_batching.distributed",
    "transformers.generation.continuous_batching.initialization",
    "transformers.generation.continuous_batching.scheduler",
    "transformers.generation.continuous_batching.utils",
    "transformers.cli",
)


@pytest.mark.parametrize("symbol", PRIVATE_SYMBOLS, ids=[s.path for s in PRIVATE_SYMBOLS])
def test_private_symbol_is_where_qkvshare_expects_it(symbol):
    assert symbol_problem(symbol) is None


def test_a_moved_or_resigned_symbol_is_named_with_its_use_and_the_fix():
    gone = PrivateSymbol("transformers.generation.utils:GenerationMixin._no_such_method", "overridden by X", ())
    message = symbol_problem(gone)
    assert "GenerationMixin._no_such_method (overridden by X) is gone (AttributeError" in message
    assert "QKVShare was tested with transformers>=5.24,<5.26" in message and "compat_qkvshare.py" in message
    resigned = PrivateSymbol(
        "transformers.generation.utils:GenerationMixin._prepare_cache_for_generation", "overridden by Y", ("config",)
    )
    assert (
        "now takes (generation_config, model_kwargs, generation_mode, batch_size, max_cache_length), not (config)"
        in (symbol_problem(resigned))
    )


def test_the_tested_release_range_holds_the_installed_one():
    assert check_transformers_version() is None


def test_only_the_compat_module_imports_transformers_private_modules():
    importers = []
    for path in sorted((ROOT / "qkvshare").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if any(name == m or name.startswith(m + ".") for name in names for m in PRIVATE_MODULES):
                importers.append(path.relative_to(ROOT).as_posix())
    assert set(importers) <= {"qkvshare/compat_qkvshare.py"}
