"""Speed of one stage-(c) step (`qkvshare convert --method transfer`'s distillation) in float32 against bf16 mixed
precision (`--distill_bf16`), measured side by side in one process, on SmolLM2-135M-Instruct converted to Q-K=V.

    python benchmarks/distill_precision.py --rounds 4 --batch 4

A step is what stage (c) does per micro-batch: the student's forward and backward pass and the teacher's forward
pass under autocast (bf16) or not (float32), the KL loss (`qkvshare.train.pretrain.distillation_loss`, in float32
either way) and an AdamW step on float32 weights. The two precisions alternate round by round, so a machine's noise
falls on both; the table gives each one's median seconds a step, tokens/s, and the float32/bf16 ratio, with the
KL of the first step in each (the same weights and blocks: how far bf16 moves the loss). Not part of CI (needs the
model: benchmarks/knowledge_data.py). On a CPU without bf16 instructions (AVX512-BF16 or AMX) bf16 is emulated and
slower; the table names what this CPU has.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import knowledge_data as data  # noqa: E402
from convert_knowledge import source_dir  # noqa: E402

from qkvshare.analysis.common import markdown_table  # noqa: E402
from qkvshare.convert import convert  # noqa: E402
from qkvshare.model_dir import load_source  # noqa: E402
from qkvshare.train.pretrain import distillation_loss  # noqa: E402


def cpu_bf16_instructions() -> str:
    """The bf16 instruction sets /proc/cpuinfo names (Linux), or what is known otherwise."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    found = sorted({f for f in flags.split() if f in ("avx512_bf16", "amx_bf16", "amx_tile")})
    return ", ".join(found) or "none (bf16 emulated)"


def step(student, teacher, optimizer, ids: torch.Tensor, bf16: bool, device: str) -> float:
    """One distillation step; returns its KL."""
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        logits = student(input_ids=ids, use_cache=False).logits
        with torch.no_grad():
            teacher_logits = teacher(input_ids=ids, use_cache=False).logits
    loss = distillation_loss(logits, teacher_logits, 1.0)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="smollm2", help="smollm2, qwen or a Llama-architecture model directory")
    p.add_argument("--rounds", type=int, default=4, help="timed steps per precision (after one warm-up each)")
    p.add_argument("--batch", type=int, default=4, help="blocks of 512 tokens per step (stage (c)'s default: 4)")
    p.add_argument("--cache_dir", default=str(data.DEFAULT_CACHE))
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    src, described = source_dir(args.source, Path(args.cache_dir).expanduser())
    teacher = load_source(str(src)).to(device).eval().requires_grad_(False)
    ids = torch.randint(0, teacher.config.vocab_size, (args.batch, 512), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    runs = {}
    for bf16 in (False, True):  # each precision its own student, from the same conversion
        student, _ = convert(teacher, "Q-K=V", "key")
        student = student.to(device).train()
        optimizer = torch.optim.AdamW(student.parameters(), lr=1e-6)
        runs[bf16] = {"model": student, "optimizer": optimizer, "seconds": []}
        runs[bf16]["kl"] = step(student, teacher, optimizer, ids, bf16, device)  # warm-up, and the first step's KL
    for _ in range(args.rounds):
        for bf16, run in runs.items():
            started = time.perf_counter()
            step(run["model"], teacher, run["optimizer"], ids, bf16, device)
            if device == "cuda":
                torch.cuda.synchronize()
            run["seconds"].append(time.perf_counter() - started)
    tokens = ids.numel()
    median = {bf16: statistics.median(run["seconds"]) for bf16, run in runs.items()}
    rows = [
        [
            "bf16 autocast" if bf16 else "float32",
            f"{median[bf16]:.2f}",
            f"{tokens / median[bf16]:,.0f}",
            f"{median[False] / median[bf16]:.2f}",
            f"{run['kl']:.4f}",
        ]
        for bf16, run in runs.items()
    ]
    cpu = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{described}; {args.batch} x 512 tokens a step, {args.rounds} rounds; {cpu}")
    if device == "cpu":
        print(f"bf16 instructions: {cpu_bf16_instructions()}")
    headers = ["precision", "median s/step", "tokens/s", "speed vs float32", "first step's KL"]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
