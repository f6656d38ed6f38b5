"""The package version: the one place it is written.

pyproject.toml reads it statically (`[tool.setuptools.dynamic] version = {attr = "qkvshare.version.__version__"}`,
which setuptools parses without importing the package), `qkvshare/__init__.py` re-exports it and `qkvshare
--version` prints it. Keep it a plain string literal so that static parsing keeps working.
"""

__version__ = "0.3.0"
