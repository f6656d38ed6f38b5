"""How far a held-out perplexity ratio can be trusted: each model's perplexity over the source's on `--blocks`
held-out blocks, with a bootstrap interval over the blocks, on the first `--first` blocks (what
`convert_knowledge.py` measures by default: 16) and on all of them.

    python benchmarks/heldout_spread.py --source qwen --domain code --blocks 64 \
        --models greedy=OUT/models/ROW/model other=OUT/models/ROW2/model

The ratio is exp(mean NLL of the model - mean NLL of the source) over the scored tokens (the perplexity ratio of
`convert_knowledge.py`). The interval resamples whole blocks with replacement, the same blocks for the source and
the model (paired), `--bootstrap` times, and prints the 5th and 95th percentiles. The blocks are those of
`convert_knowledge.py` (`knowledge_data.heldout_blocks`: pip's sources for `code`, Wikipedia summaries for
`english`), so its first 16 blocks are the ones that benchmark scores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import knowledge_data as data  # noqa: E402
from convert_knowledge import checked_models, load, source_dir  # noqa: E402

from qkvshare.analysis.common import markdown_table  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="smollm2, qwen, or a model directory")
    p.add_argument("--models", nargs="+", required=True, help="LABEL=DIR of each converted model")
    p.add_argument("--domain", choices=("code", "english"), default="code")
    p.add_argument("--blocks", type=int, default=64, help="held-out blocks measured")
    p.add_argument("--first", type=int, default=16, help="the leading blocks reported on their own")
    p.add_argument("--block_size", type=int, default=512)
    p.add_argument("--bootstrap", type=int, default=2000, help="resamples of the blocks")
    p.add_argument("--cache_dir", default="~/.cache/qkvshare-bench")
    args = p.parse_args()
    if not 0 < args.first <= args.blocks:
        p.error(f"--first {args.first} must be between 1 and --blocks ({args.blocks}).")
    return args


def block_nll(model, blocks: torch.Tensor, label: str) -> torch.Tensor:
    """(blocks,) summed next-token negative log-likelihood of each block, in float64 (`score_blocks` on each block
    alone: the scoring of `convert_knowledge.py`)."""
    from qkvshare.evaluation.fidelity import score_blocks

    scores = (score_blocks(model, row[None], progress=None) for row in tqdm(blocks, desc=label, leave=False))
    return torch.tensor([s.mean_nll * s.tokens for s in scores], dtype=torch.float64)


def ratio_and_interval(model_nll: torch.Tensor, source_nll: torch.Tensor, tokens: int, resamples: int):
    """The perplexity ratio and the 5th / 95th percentiles of the ratio over blocks resampled in pairs."""
    ratio = float(torch.exp((model_nll.sum() - source_nll.sum()) / (tokens * len(model_nll))))
    g = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(model_nll), (resamples, len(model_nll)), generator=g)
    diffs = (model_nll[picks] - source_nll[picks]).sum(1) / (tokens * len(model_nll))
    low, high = torch.quantile(torch.exp(diffs), torch.tensor([0.05, 0.95], dtype=diffs.dtype)).tolist()
    return ratio, low, high


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    models = checked_models(args.models, "heldout_spread.py")
    cache = Path(args.cache_dir).expanduser()
    src, described = source_dir(args.source, cache)
    tokenizer = AutoTokenizer.from_pretrained(src)
    documents = data.code_documents(cache) if args.domain == "code" else data.wiki_documents(cache)
    blocks = data.heldout_blocks(tokenizer, documents, args.block_size, args.blocks)
    source = block_nll(load(src).eval(), blocks, "source")
    rows = []
    for label, path in models.items():
        values = block_nll(load(path).eval(), blocks, label)
        first = ratio_and_interval(values[: args.first], source[: args.first], args.block_size, args.bootstrap)
        whole = ratio_and_interval(values, source, args.block_size, args.bootstrap)
        rows.append([label, *(round(v, 3) for v in (*first, *whole))])
    n, k = args.blocks, args.first
    print(f"{described}: held-out {args.domain}, blocks of {args.block_size} tokens; 90% intervals over the blocks")
    print(markdown_table(["row", f"x {k} blocks", "5%", "95%", f"x {n} blocks", "5%", "95%"], rows))


if __name__ == "__main__":
    main()
