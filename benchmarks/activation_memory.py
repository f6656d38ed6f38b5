"""Peak memory of `qkvshare.convert.transfer.source_activations` (what stages (a) and (b) of `convert --method
transfer` hold) against what `activation_bytes` says they hold, on SmolLM2-135M-Instruct.

    python benchmarks/activation_memory.py --tokens 16384
    python benchmarks/activation_memory.py --tokens 16384 --transfer_module OLD.py   # another version of the module

`--transfer_module` loads `source_activations` from a file (e.g. `git show REV:qkvshare/convert/transfer.py > OLD.py`)
to compare versions in one environment. Prints one table row: tokens, GiB held by the result, growth of the
process' peak resident memory, and their ratio. Not part of CI (needs the model: benchmarks/knowledge_data.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import knowledge_data as data  # noqa: E402
from convert_knowledge import source_dir  # noqa: E402

from qkvshare.analysis.common import markdown_table  # noqa: E402
from qkvshare.model_dir import load_source  # noqa: E402


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="tokens in blocks of 512")
    p.add_argument("--transfer_module", default=None, help="a file holding another version of transfer.py")
    p.add_argument("--cache_dir", default=str(data.DEFAULT_CACHE))
    args = p.parse_args()
    if args.transfer_module:
        spec = importlib.util.spec_from_file_location("other_transfer", args.transfer_module)
        module = importlib.util.module_from_spec(spec)
        sys.modules["other_transfer"] = module
        spec.loader.exec_module(module)
    else:
        import qkvshare.convert.transfer as module
    source = load_source(str(source_dir("smollm2", Path(args.cache_dir).expanduser())[0]))
    ids = torch.randint(
        0, source.config.vocab_size, (args.tokens // 512, 512), generator=torch.Generator().manual_seed(0)
    )
    before = peak_gib()
    acts = module.source_activations(source, ids, 2)
    growth = peak_gib() - before
    held = sum(t.numel() * t.element_size() for t in acts.inputs + acts.outputs) / 2**30
    version = args.transfer_module or "this checkout"
    headers = ["version", "tokens", "GiB held", "peak growth GiB", "peak / held"]
    print(markdown_table(headers, [[version, ids.numel(), f"{held:.2f}", f"{growth:.2f}", f"{growth / held:.2f}"]]))


if __name__ == "__main__":
    main()
