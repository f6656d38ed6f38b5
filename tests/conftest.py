"""Shared test setup: deterministic, quiet, CPU, few threads (the CI machine has 2 cores).

The README's test command runs the suite on 2 pytest-xdist workers: most of its time is subprocesses importing
torch and transformers and tiny single-threaded models, so two workers of one thread each use both cores.
"""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
# One intra-op thread per xdist worker (two workers share two cores); two threads when run serially.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A few stdlib modules as jsonl: the text of a tiny BPE tokenizer, of calibration and of short training runs."""
    root = Path(json.__file__).parent.parent
    docs = [(root / name).read_text() for name in ("bisect.py", "colorsys.py", "heapq.py", "shlex.py", "textwrap.py")]
    path = tmp_path_factory.mktemp("data") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path
