"""Optional dependencies ("extras"): which modules each extra provides, and one clear error when one is missing.

The core dependencies are torch, transformers and safetensors (transformers itself brings pyyaml, tqdm, numpy,
tokenizers and huggingface-hub); the model files (configuration_, modeling_, cache_, linear_attention_qkvshare.py)
need nothing else. Training, evaluation, plots and the wandb tracker are extras declared in pyproject.toml;
`EXTRAS` maps each to the modules the code imports and their requirement names there (tests/test_cli.py checks
that the two agree and that every third-party import of the package is declared).

Where it is used
- The `qkvshare` command checks a command's extras before importing it (`qkvshare_cli.main`): a missing package
  is reported at once, with the `pip install` line, exit status 2.
- Library code that imports an optional package itself calls `require` at the import, or `check_extra` before
  long work starts (e.g. plots that would only be drawn at the end of a run):
  `plt = require("matplotlib.pyplot", "plots", "qkvshare bench's plots")`.

This module imports only the standard library (it lives in `qkvshare_cli`, outside the `qkvshare` package), so
the command line loads it without importing torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# extra -> {top-level module the code imports: its requirement name in pyproject.toml}
EXTRAS: dict[str, dict[str, str]] = {
    "train": {
        "accelerate": "accelerate",
        "datasets": "datasets",
        "pyarrow": "pyarrow",  # comes with datasets; train/data.py also reads parquet files with it directly
        "tokenizers": "tokenizers",
        "tensorboard": "tensorboard",
    },
    "eval": {"lm_eval": "lm-eval", "datasets": "datasets"},
    "plots": {"matplotlib": "matplotlib"},
    "wandb": {"wandb": "wandb"},
    "vision": {"sklearn": "scikit-learn", "PIL": "pillow", "datasets": "datasets"},
    # The quanto backend of `QKVShareQuantizedCache`; transformers imports `optimum.quanto` when the cache is built.
    "quantized": {"optimum": "optimum-quanto"},
    # qkvshare serve: its FastAPI app under uvicorn (starlette and pydantic come with fastapi), and openai, the client
    # the README and the tests use (the server itself does not import it).
    "serve": {"fastapi": "fastapi", "uvicorn": "uvicorn", "openai": "openai"},
    # qkvshare export: each --format checks the modules it needs (qkvshare_settings.export.FORMAT_MODULES)
    "export": {
        "executorch": "executorch",
        "onnx": "onnx",
        "onnxscript": "onnxscript",
        "onnxruntime": "onnxruntime",
        "gguf": "gguf",
    },
}


class MissingExtraError(ModuleNotFoundError):
    """An optional package is not installed; the message names it and the extra that installs it.

    A `ModuleNotFoundError`, so code that already catches that keeps working; `name` is the missing module.
    """


def install_command(extra: str) -> str:
    """The `pip install` line for one extra (PyPI, and the editable form for a source checkout)."""
    return f'pip install "qkvshare[{extra}]" (in a source checkout: pip install -e ".[{extra}]")'


def missing_message(feature: str, packages: list[str], extra: str, hint: str = "") -> str:
    """One paragraph: what needs which missing packages, and the command that installs them."""
    names = f"{', '.join(packages[:-1])} and {packages[-1]}" if len(packages) > 1 else packages[0]
    noun, verb = ("packages", "are") if len(packages) > 1 else ("package", "is")
    text = f"The {noun} {names}, needed by {feature}, {verb} not installed. Install the {extra!r} extra: "
    return text + install_command(extra) + (f"; {hint}" if hint else "") + "."


def _check_extra_name(extra: str) -> dict[str, str]:
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; the extras are {', '.join(EXTRAS)} (see pyproject.toml).")
    return EXTRAS[extra]


def is_installed(module: str) -> bool:
    """Whether `module` can be imported here, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None  # None also when sys.modules[module] is None
    except (ImportError, ValueError):  # a broken parent package, or a module object without __spec__
        return False


def missing_packages(extra: str) -> list[str]:
    """Requirement names of `extra` whose modules are not importable here (empty when all are)."""
    return [package for module, package in _check_extra_name(extra).items() if not is_installed(module)]


def extra_providing(module: str, prefer: tuple[str, ...] = ()) -> str | None:
    """The extra that installs the top-level package of `module` (those in `prefer` first), or None."""
    top = module.partition(".")[0]
    for extra in (*prefer, *EXTRAS):
        if top in _check_extra_name(extra):
            return extra
    return None


def check_extra(extra: str, feature: str, hint: str = "") -> None:
    """Raise `MissingExtraError` unless every package of `extra` is installed; call it before long work starts.

    `feature` names what needs them (`"qkvshare train"`); `hint` is an optional way around (`"or pass
    --no_plots"`).
    """
    missing = missing_packages(extra)
    if missing:
        module = next(m for m, p in EXTRAS[extra].items() if p == missing[0])
        raise MissingExtraError(missing_message(feature, missing, extra, hint), name=module)


def require(module: str, extra: str, feature: str, hint: str = "") -> ModuleType:
    """Import `module` (e.g. `"matplotlib.pyplot"`) or raise `MissingExtraError` naming the extra to install.

    A `ModuleNotFoundError` for another module (a broken install of the package's own dependencies) is re-raised
    as is: only the package itself being absent is a missing extra.
    """
    top = module.partition(".")[0]
    packages = _check_extra_name(extra)
    if top not in packages:
        raise ValueError(f"{module!r} is not in the {extra!r} extra ({', '.join(packages)}); add it to EXTRAS.")
    try:
        importlib.import_module(top)  # the package itself first: a submodule already in sys.modules hides nothing
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.partition(".")[0] != top:
            raise
        raise MissingExtraError(missing_message(feature, [packages[top]], extra, hint), name=top) from None


__all__ = [
    "EXTRAS",
    "MissingExtraError",
    "check_extra",
    "extra_providing",
    "install_command",
    "is_installed",
    "missing_message",
    "missing_packages",
    "require",
]
