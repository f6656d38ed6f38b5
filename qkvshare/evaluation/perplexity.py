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
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qkvshare.analysis.conventions import HelpFormatter, add_dtype_argument

from .common import (
    EvalInputError,
    NonFiniteResultError,
    check_causal_lm,
    check_finite_weights,
    default_device,
    load_causal_lm,
    load_tokenizer,
)

if TYPE_CHECKING:
    import torch

FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}


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
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: cuda if available)")
    add_dtype_argument(p, "float32", "weights and activations; auto: as saved")
    p.add_argument("--tokenizer", default=None, help="default: the tokenizer saved with the model")
    p.add_argument("--trust_remote_code", action="store_true", help="for hub models whose code is not installed")
    p.add_argument("--output_file", default=None, help="also write the result as JSON here")
    ns = p.parse_args(argv)
    if (ns.validation_file is None) == (ns.dataset_name is None):
        p.error("give exactly one of --validation_file and --dataset_name")
    for flag in ("max_length", "stride", "batch_size", "max_documents"):
        if getattr(ns, flag) is not None and getattr(ns, flag) < 1:
            p.error(f"--{flag} must be >= 1")
    return PerplexityArgs(**vars(ns))


def load_texts(args: PerplexityArgs) -> list[str]:
    """The non-empty documents of the file or hub dataset, in order (at most `max_documents`)."""
    from qkvshare._extras import require

    datasets = require("datasets", "eval", "qkvshare perplexity")

    if args.validation_file is not None:
        path = Path(args.validation_file).expanduser()
        if not path.is_file():
            raise EvalInputError(f"--validation_file {str(path)!r} does not exist.")
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise EvalInputError(f"--validation_file must end in {', '.join(FILE_BUILDERS)}; got {path.name!r}.")
        from qkvshare.train.data import check_data_file  # the trainer's check: not UTF-8, binary, a bad JSON line

        check_data_file(path, "--validation_file", args.text_column, EvalInputError)
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        data = datasets.load_dataset(
            builder, data_files={"validation": str(path.resolve())}, split="validation", **kwargs
        )
        source = str(path)
    else:
        try:
            data = datasets.load_dataset(args.dataset_name, args.dataset_config_name, split=args.split)
        except (OSError, ValueError, ConnectionError) as err:
            raise EvalInputError(
                f"could not load split {args.split!r} of dataset {args.dataset_name!r} "
                f"(config {args.dataset_config_name!r}): {err}. Without internet use --validation_file."
            ) from err
        source = args.dataset_name
    if args.text_column not in data.column_names:
        raise EvalInputError(
            f"{source} has no column {args.text_column!r} (columns: {', '.join(data.column_names)}); "
            "pass --text_column."
        )
    texts = [t for t in data[args.text_column] if isinstance(t, str) and t.strip()]
    if args.validation_file is not None and builder == "text":
        texts = [t.strip("\n") for t in texts]  # paragraph rows keep their separating newlines
    if args.max_documents is not None:
        texts = texts[: args.max_documents]
    if not texts:
        raise EvalInputError(f"{source} has no non-empty text in column {args.text_column!r}.")
    return texts


def pack(texts: list[str], tokenizer) -> torch.Tensor:
    """One 1-D token stream `EOS doc_1 EOS doc_2 EOS ... doc_n EOS` (no special tokens inside documents)."""
    import torch

    eos = tokenizer.eos_token_id
    if eos is None:
        raise EvalInputError("the tokenizer has no EOS token, which separates packed documents; set eos_token.")
    ids = [eos]
    # verbose=False: no "sequence length is longer than the specified maximum" warning; windows handle long texts.
    for ids_doc in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        ids += ids_doc + [eos]
    return torch.tensor(ids, dtype=torch.long)


def windows(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """Sliding windows over a stream of `n_tokens`: (begin, end, first_target), all absolute positions.

    Window `[begin, end)` is one forward pass; it scores targets `first_target .. end-1`, each predicted from
    the tokens before it inside the window. Targets are 1..n_tokens-1, each scored exactly once.
    """
    if not 1 <= stride < max_length:
        raise EvalInputError(f"--stride must be in [1, max_length - 1] = [1, {max_length - 1}], got {stride}.")
    out, begin, next_target = [], 0, 1
    while next_target < n_tokens:
        end = min(begin + max_length, n_tokens)
        out.append((begin, end, next_target))
        next_target = end
        begin += stride
    return out


def score(model, ids: torch.Tensor, max_length: int, stride: int, batch_size: int = 4) -> tuple[float, int]:
    """(sum of token NLLs in nats, number of scored tokens) of the stream `ids` under `model`.

    Windows of equal length are batched together (only the last can be shorter), so no padding exists.
    Raises `NonFiniteResultError` naming the first window whose loss is NaN or infinite.
    """
    import torch
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    spans = windows(len(ids), max_length, stride)
    nll, count = 0.0, 0
    progress = tqdm(total=len(spans), desc="perplexity windows", unit="win", disable=len(spans) < 2)
    i = 0
    while i < len(spans):
        width = spans[i][1] - spans[i][0]
        group = [spans[i]]
        while len(group) < batch_size and i + len(group) < len(spans):
            nxt = spans[i + len(group)]
            if nxt[1] - nxt[0] != width:
                break
            group.append(nxt)
        inputs = torch.stack([ids[b:e] for b, e, _ in group]).to(device)  # (B, T)
        with torch.no_grad():
            logits = model(input_ids=inputs).logits.float()  # (B, T, V)
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1)  # position t predicts token t+1
        token_nll = -logprobs.gather(-1, inputs[:, 1:, None]).squeeze(-1)  # (B, T-1)
        for row, (b, e, first) in enumerate(group):
            scored = token_nll[row, first - b - 1 :]  # targets first..end-1 sit at columns first-b-1..
            window_nll = scored.double().sum().item()
            if not math.isfinite(window_nll):
                progress.close()
                finite_logits = bool(torch.isfinite(logits[row]).all())
                cause = "a target token got probability 0" if finite_logits else "its logits hold NaN or inf"
                raise NonFiniteResultError(
                    f"the loss is not finite ({window_nll}) on the window of tokens {b}..{e - 1} of the packed "
                    f"text: {cause}, so no perplexity is reported. In float16/bfloat16 the logits can overflow: "
                    "try --dtype float32; if it persists, the model's activations overflow (a damaged model)."
                )
            nll += window_nll
            count += scored.numel()
        i += len(group)
        progress.update(len(group))
    progress.close()
    return nll, count


def perplexity(
    model, tokenizer, texts: list[str], max_length: int, stride: int | None = None, batch_size: int = 4
) -> dict[str, float | int]:
    """Token-weighted perplexity of `model` on the packed `texts` (see the module docstring)."""
    ids = pack(texts, tokenizer)
    stride = stride if stride is not None else max(1, max_length // 2)
    nll, count = score(model, ids, max_length, stride, batch_size)
    mean = nll / count
    if mean > math.log(sys.float_info.max):
        raise NonFiniteResultError(f"the perplexity overflows a float (mean NLL {mean:.1f} nats per token).")
    return {"perplexity": math.exp(mean), "mean_nll": mean, "tokens": count, "documents": len(texts)}


def context_length(config, requested: int | None) -> int:
    """The window length: `requested`, or the model's max_position_embeddings; never more than the latter."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if requested is None:
        if limit is None:
            raise EvalInputError("the model config has no max_position_embeddings; pass --max_length.")
        return int(limit)
    if limit is not None and requested > limit:
        raise EvalInputError(
            f"--max_length {requested} exceeds the model's max_position_embeddings {limit}; use <= {limit}."
        )
    if requested < 2:
        raise EvalInputError("--max_length must be at least 2 (a context token and a target).")
    return requested


def run(args: PerplexityArgs) -> dict:
    """Check the inputs, load model and data, score; print and optionally save the result."""
    config = check_causal_lm(args.model, args.trust_remote_code)
    max_length = context_length(config, args.max_length)
    stride = args.stride if args.stride is not None else max(1, max_length // 2)
    if not 1 <= stride < max_length:
        raise EvalInputError(f"--stride must be in [1, {max_length - 1}] (below --max_length), got {stride}.")
    tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
    texts = load_texts(args)
    model = load_causal_lm(args.model, args.dtype, args.device or default_device(), args.trust_remote_code)
    check_finite_weights(model, args.model)
    result = perplexity(model, tokenizer, texts, max_length, stride, args.batch_size)
    result |= {"max_length": max_length, "stride": stride, "args": asdict(args)}
    print(
        f"{args.model}: perplexity {result['perplexity']:.4f} (mean NLL {result['mean_nll']:.4f} nats over "
        f"{result['tokens']} tokens, {result['documents']} documents; window {max_length}, stride {stride})"
    )
    if args.output_file:
        Path(args.output_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_file).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of `qkvshare perplexity`; returns the exit status (2 for bad input)."""
    args = parse_args(argv)
    try:
        run(args)
    except EvalInputError as err:
        print(f"qkvshare perplexity: error: {err}", file=sys.stderr)
        return 2
    except NonFiniteResultError as err:
        print(f"qkvshare perplexity: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
