"""`qkvshare perplexity`: token-weighted perplexity of a causal LM on held-out text.

The command's documentation (`qkvshare perplexity --help`: what the number means, and why) and its arguments are
`qkvshare_settings.perplexity`; this module reads the text, packs it as training does and scores it with a sliding
window.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qkvshare.runtime import default_device
from qkvshare.train.data import check_data_file
from qkvshare_settings.extras import require
from qkvshare_settings.perplexity import PerplexityArgs

from .common import (
    EvalInputError,
    NonFiniteResultError,
    check_causal_lm,
    check_finite_weights,
    load_causal_lm,
    load_tokenizer,
)

FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def load_texts(args: PerplexityArgs) -> list[str]:
    """The non-empty documents of the file or hub dataset, in order (at most `max_documents`)."""
    datasets = require("datasets", "eval", "qkvshare perplexity")

    if args.validation_file is not None:
        path = Path(args.validation_file).expanduser()
        if not path.is_file():
            raise EvalInputError(f"--validation_file {str(path)!r} does not exist.")
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise EvalInputError(f"--validation_file must end in {', '.join(FILE_BUILDERS)}; got {path.name!r}.")
        check_data_file(path, "--validation_file", args.text_column, EvalInputError)  # the trainer's check
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


def measure_perplexity(args: PerplexityArgs) -> dict:
    """`qkvshare perplexity`: check the inputs (an `EvalInputError` before any model loads), load model and data,
    score; print and optionally save the result, and return it. A NaN or infinite result is a
    `NonFiniteResultError`."""
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
