"""transformers' private parts, one test each: a release that moves, renames or re-signs one fails the test that names
it (qkvshare/compat_qkvshare.py), and nothing outside that module imports transformers' private modules."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from qkvshare.compat_qkvshare import (
    PRIVATE_SYMBOLS,
    TESTED_TRANSFORMERS,
    PrivateSymbol,
    check_transformers_version,
    symbol_problem,
)

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
    assert f"QKVShare was tested with transformers{TESTED_TRANSFORMERS}" in message and "compat_qkvshare.py" in message
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


# Overrides whose parameters differ from upstream's on purpose, with why (upstream calls them positionally).
RENAMED_OVERRIDES = {
    "LinearAttentionStateLayer.lazy_initialization": "a recurrent state and its normalizer in place of key and value",
}
Param = inspect.Parameter


def override_problems(cls: type) -> list[str]:
    """Methods QKVShare defines over a transformers (or PEFT) method that would refuse arguments the upstream one
    takes: each upstream parameter must be taken by name (or by **kwargs), and upstream's *args / **kwargs too."""
    problems = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("qkvshare"):
            continue
        for name, ours in vars(klass).items():
            upstream = [
                k for k in cls.__mro__ if not k.__module__.startswith(("qkvshare", "torch")) and name in vars(k)
            ]
            if not inspect.isfunction(ours) or name == "__init__" or not upstream:
                continue
            theirs = inspect.unwrap(getattr(vars(upstream[0])[name], "__func__", vars(upstream[0])[name]))
            if not inspect.isfunction(theirs) or f"{klass.__name__}.{name}" in RENAMED_OVERRIDES:
                continue
            mine = inspect.signature(ours).parameters
            kinds = {p.kind for p in mine.values()}
            for p in inspect.signature(theirs).parameters.values():
                if p.kind in (Param.VAR_KEYWORD, Param.VAR_POSITIONAL):
                    missing = p.kind not in kinds
                else:
                    missing = p.name not in mine and Param.VAR_KEYWORD not in kinds
                if missing:
                    bare = p.replace(annotation=Param.empty, default=Param.empty)
                    problems.append(
                        f"{klass.__name__}.{name} does not take {bare} ({upstream[0].__qualname__}.{name} does)"
                    )
    return problems


@pytest.mark.parametrize("module", sorted(p.stem for p in (ROOT / "qkvshare").glob("*_qkvshare.py")), ids=lambda m: m)
def test_overrides_of_transformers_methods_take_every_argument_upstream_passes(module):
    # transformers 5.25 began passing generate()'s options to Cache.activate_past_recording: an override without
    # them failed every assisted decoding. A public method can be re-signed as silently as a private one.
    mod = importlib.import_module(f"qkvshare.{module}")
    classes = [c for c in vars(mod).values() if inspect.isclass(c) and c.__module__ == mod.__name__]
    assert [problem for cls in classes for problem in override_problems(cls)] == []


def test_an_override_that_misses_an_upstream_argument_is_named():
    from transformers import DynamicCache

    class Narrow(DynamicCache):
        __module__ = "qkvshare.example"

        def get_seq_length(self) -> int:  # upstream: get_seq_length(self, layer_idx=0)
            return 0

        def crop(self, tokens_to_remove: int, **kwargs) -> None:  # takes it: not named
            pass

    assert override_problems(Narrow) == ["Narrow.get_seq_length does not take layer_idx (Cache.get_seq_length does)"]
