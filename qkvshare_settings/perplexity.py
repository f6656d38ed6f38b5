"""`qkvshare perplexity`: token-weighted perplexity of a causal LM on held-out text.

    qkvshare perplexity runs/qkev/final --validation_file heldout.jsonl        # or .txt / .json / .csv
    qkvshare perplexity runs/qkev/final --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 --split test

Definition (what the number means, and why):
- Documents are packed into one token stream the way training packs them: `EOS doc_1 EOS doc_2 EOS ...`.
  Every token after the leading EOS is scored (each document's tokens and its closing EOS), each exactly once.
  Nothing is padded, so no padding is ever scored: the paper's released code scored EOS padding and so
  reported inflated perplexities (docs/research.md, section 6); QKVShare never does.
- Perplexity = exp(sum of token negative log-likelihoods / number of scored tokens) over the whole set
  (token-weighted, not an average of per-document perplexities).
- A stream longer than the model's context (`--max_length`, default `max_position_embeddings`) is scored with
  a sliding window: windows of `max_length` tokens start every `stride` tokens and each scores only its
  tokens not scored before, so every token after the first window has at least `max_length - stride`
  tokens of context (the Hugging Face "perplexity of fixed-length models" recipe, without its one lost token
  per window).
- Never a silent "nan": a model whose weights hold NaN/inf is refused before scoring (exit 2, tensors named),
  and a window whose loss comes out non-finite stops the run naming the window (exit 1).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .conventions import HelpFormatter, add_model_loading_arguments


@dataclass
class PerplexityArgs:
    """Options of `qkvshare perplexity` (one field per command-line flag)."""

    model: str  # model directory or hub id
    validation_file: str | None = None  # .txt (documents = blank-line-separated paragraphs), .json/.jsonl, .csv
    dataset_name: str | None = None  # a hub dataset instead of a file
    dataset_config_name: str | None = None  # its configuration (e.g. wikitext-2-raw-v1)
    split: str = "validation"  # split of the hub dataset
    text_column: str = "text"  # column holding the documents (files other than .txt, hub datasets)
    max_length: int | None = None  # window length; default: the model's max_position_embeddings
    stride: int | None = None  # window step when the text is longer than max_length; default: max_length // 2
    batch_size: int = 4  # windows per forward pass
    max_documents: int | None = None  # score only the first N non-empty documents
    device: str | None = None  # default: cuda if available, else cpu
    dtype: str = "float32"  # float32, bfloat16, float16, auto
    tokenizer: str | None = None  # default: the tokenizer saved with the model
    trust_remote_code: bool = False  # only for hub models whose code is in neither transformers nor qkvshare
    output_file: str | None = None  # also write the result as JSON here


def parse_args(argv: list[str] | None) -> PerplexityArgs:
    """Parse the command line into `PerplexityArgs`."""
    p = argparse.ArgumentParser(prog="qkvshare perplexity", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model", help="model directory or hub id")
    p.add_argument("--validation_file", default=None, help=".txt, .json, .jsonl or .csv")
    p.add_argument("--dataset_name", default=None, help="a hub dataset instead of a file")
    p.add_argument("--dataset_config_name", default=None, help="its configuration (e.g. wikitext-2-raw-v1)")
    p.add_argument("--split", default="validation", help="split of the hub dataset")
    p.add_argument("--text_column", default="text", help="column holding the documents (not for .txt)")
    p.add_argument("--max_length", type=int, default=None, help="window length (default: max_position_embeddings)")
    p.add_argument("--stride", type=int, default=None, help="window step (default: max_length // 2)")
    p.add_argument("--batch_size", type=int, default=4, help="windows per forward pass")
    p.add_argument("--max_documents", type=int, default=None, help="score only the first N non-empty documents")
    add_model_loading_arguments(p, "default: the tokenizer saved with the model")
    p.add_argument("--output_file", default=None, help="also write the result as JSON here")
    ns = p.parse_args(argv)
    if (ns.validation_file is None) == (ns.dataset_name is None):
        p.error("give exactly one of --validation_file and --dataset_name")
    for flag in ("max_length", "stride", "batch_size", "max_documents"):
        if getattr(ns, flag) is not None and getattr(ns, flag) < 1:
            p.error(f"--{flag} must be >= 1")
    return PerplexityArgs(**vars(ns))
