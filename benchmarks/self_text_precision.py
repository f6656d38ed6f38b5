"""The source's own text (`qkvshare.convert.self_text`) written with the source's float32 weights against a bf16 copy
of them (`SelfTextSettings.bf16`, `qkvshare convert --self_text_bf16`), side by side in one process: speed, and how
alike the two texts are as samples of the source.

    python benchmarks/self_text_precision.py --source smollm2 --rounds 2

Speed: shard by shard (the convert defaults: 64 samples a shard, at most 256 new tokens each), the two precisions
alternating, each in its own work folder under `--output_dir`, so a machine's noise falls on both; shard i is the
same prompts and random draws in both (chat answers and continuations alternate with the index). The table gives each
precision's new tokens per second over all its shards and their ratio.

Alike: a bf16 text is the source rounded to bf16 writing, so another sample than float32's for the same seed. What
matters is that it is a sample of the same distribution. Measured on each text's generated tokens (not its prompts),
under the float32 source: the mean negative log-likelihood per token (a text the source finds less likely would
show a higher one), the share of samples ended by the model (eos) rather than by the length limit or a loop, the
mean new tokens a sample, and on the bf16 text the mean KL(float32 source || bf16 copy) per token, how far the copy's
next-token distributions are from the source's where it wrote. Not part of CI (needs the model:
benchmarks/knowledge_data.py). Resumable: the shards in `--output_dir` are reused (their recorded seconds count).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import knowledge_data as data  # noqa: E402
from convert_knowledge import source_dir  # noqa: E402

from qkvshare.analysis.common import markdown_table  # noqa: E402
from qkvshare.convert.self_text import SelfTextSettings, bf16_copy, generate_self_text  # noqa: E402
from qkvshare.model_dir import load_source  # noqa: E402
from qkvshare.runtime import native_bf16  # noqa: E402


@torch.inference_mode()
def scores(source, copy, samples) -> dict[str, float]:
    """Under the float32 `source`: the mean NLL per generated token; with `copy`, also the mean KL(source || copy)
    per generated token."""
    nll = kl = 0.0
    count = 0
    for sample in samples:
        # the first generated token's position (a continuation's first token has no context: from its second)
        start = max(1, len(sample.ids) - sample.new_tokens)
        if start >= len(sample.ids):
            continue
        ids = torch.tensor(sample.ids)[None]
        logp = F.log_softmax(source(input_ids=ids[:, :-1]).logits.float(), dim=-1)[0, start - 1 :]
        nll -= logp.gather(-1, ids[0, start:, None]).sum().item()
        if copy is not None:
            logq = F.log_softmax(copy(input_ids=ids[:, :-1]).logits.float(), dim=-1)[0, start - 1 :]
            kl += (logp.exp() * (logp - logq)).sum().item()
        count += len(sample.ids) - start
    return {"nll": nll / count, "kl": kl / count if copy is not None else float("nan"), "tokens": count}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="smollm2", help="smollm2, qwen or a Llama-architecture model directory")
    p.add_argument("--rounds", type=int, default=2, help="shards per precision")
    p.add_argument("--output_dir", default="outputs/self-text-precision", help="the two texts' work folders")
    p.add_argument("--cache_dir", default=str(data.DEFAULT_CACHE))
    args = p.parse_args()
    src, described = source_dir(args.source, Path(args.cache_dir).expanduser())
    source = load_source(str(src)).eval()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    out = Path(args.output_dir)
    texts = {}
    for rounds in range(1, args.rounds + 1):
        for bf16 in (False, True):
            settings = SelfTextSettings(bf16=bf16)
            folder = out / ("bf16" if bf16 else "float32")
            # one token more than the shards so far hold: the next shard
            held = texts[bf16].tokens if bf16 in texts else 0
            if bf16 in texts and texts[bf16].shards >= rounds:
                continue
            texts[bf16] = generate_self_text(source, tokenizer, settings, folder, held + 1, progress=False)
            print(f"{'bf16' if bf16 else 'float32'}: {texts[bf16].shards} shard(s)", flush=True)
    copy = bf16_copy(source)
    rows = []
    for bf16, text in texts.items():
        samples = text.samples
        new = sum(s.new_tokens for s in samples)
        measured = scores(source, copy if bf16 else None, samples)
        rows.append(
            [
                "bf16 copy" if bf16 else "float32",
                text.shards,
                new,
                text.shard_seconds,
                new / text.shard_seconds,
                measured["nll"],
                sum(s.stop == "eos" for s in samples) / len(samples),
                new / len(samples),
                measured["kl"],
            ]
        )
    ratio = rows[1][4] / rows[0][4]
    headers = ["weights", "shards", "new tokens", "seconds", "new tokens/s", "NLL under the source"]
    headers += ["ended by eos", "new tokens a sample", "KL(source || copy)"]
    print(f"\nsource: {described}; bf16 on this device: {native_bf16()[1]}; threads {torch.get_num_threads()}\n")
    print(markdown_table(headers, rows))
    print(f"\nbf16 copy / float32 speed: {ratio:.2f}x")


if __name__ == "__main__":
    main()
