"""Does llama.cpp run what `qkvshare export --format gguf` writes? Its greedy tokens against the model's own.

    pip install llama-cpp-python gguf        # builds llama.cpp from source (cmake and a C++ compiler): minutes
    python benchmarks/export_llama_cpp.py                             # random small-preset models, every variant
    python benchmarks/export_llama_cpp.py --model_dir outputs/tiny    # trained model directories too

Not part of CI: llama-cpp-python builds llama.cpp from source (tests/test_export_llama.py checks the files with
transformers' GGUF reader instead). For each variant that is exactly a Llama model (QKV, GQA, Q=K-V, pre-RoPE
Q-K=V, Q-MQA and Q=K=V, a per-layer mix, Q=K=V with random biases), the script saves a random model of the `small` preset's shape with a
byte-level BPE trained on the embedded corpus (the tokenizer `qkvshare train` trains), and any `--model_dir` as
it is; runs `qkvshare export --format gguf` for each `--dtypes`; loads the file with llama-cpp-python; and decodes
greedily (the argmax of llama.cpp's logits, token by token) after prompts cut from the corpus' validation text.
Our tokens come from the QKVShare model with its one-tensor cache (for float16, its weights rounded to float16 and
run in float32, as the command's own check does); llama.cpp runs float32 files with a float32 KV cache and float16
files with its default float16 cache. The table: variant, GGUF dtype, our tokens and llama.cpp's
(the first prompt's), whether all prompts' tokens are equal, the largest |logit difference| over the prompts'
positions, whether llama.cpp's tokenizer splits the prompts' text into our tokenizer's ids, and where tokens first
differ with the margin between our two best logits there (a margin within the dtype's logit differences is a tie
that rounding decides, not a wrong model).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import qkvshare_cli  # noqa: E402
from qkvshare import QKVShareConfig, QKVShareForCausalLM  # noqa: E402
from qkvshare.analysis.common import markdown_table  # noqa: E402
from qkvshare.export import reference_tokens  # noqa: E402
from qkvshare.train.data import stdlib_corpus  # noqa: E402
from qkvshare.train.tokenizer import padded_vocab_size, train_bpe_tokenizer  # noqa: E402

PRE = {"kv_tie_point": "pre_rope"}
# (label, variant, overrides) of the random models: the variants that are exactly Llama
VARIANTS = [
    ("QKV", "QKV", {}),
    ("GQA-2", "GQA-2", {}),
    ("Q=K-V", "Q=K-V", {}),
    ("Q-K=V pre-RoPE", "Q-K=V", PRE),
    ("Q-MQA pre-RoPE", "Q-MQA", PRE),
    ("Q=K=V pre-RoPE", "Q=K=V", PRE),
    ("mixed Q=K=V/Q-K=V/Q=K-V/QKV pre-RoPE", "QKV", {"layer_projection_sharing": ["qkv", "kv", "qk", "none"], **PRE}),
    ("Q=K=V pre-RoPE, biases", "Q=K=V", {"attention_bias": True, "mlp_bias": True, **PRE}),
]
DTYPES = {"float32": torch.float32, "float16": torch.float16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", action="append", default=[], help="a trained QKVShare model directory (repeatable)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="GGUF weight types")
    p.add_argument("--prompts", type=int, default=3, help="prompts per model, cut from validation documents")
    p.add_argument("--prompt_tokens", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=24)
    p.add_argument("--tokenizer_documents", type=int, default=300, help="training documents the BPE is trained on")
    p.add_argument("--init_std", type=float, default=0.08, help="initializer_range of the random models")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    p.add_argument("--no_random", action="store_true", help="only the --model_dir models")
    return p.parse_args()


def random_models(work: Path, args: argparse.Namespace) -> list[tuple[str, Path]]:
    """Random small-preset models of every Llama variant, saved with one BPE tokenizer trained on the corpus."""
    corpus = stdlib_corpus()
    tokenizer = train_bpe_tokenizer(sorted(corpus.train)[: args.tokenizer_documents], 4096, model_max_length=512)
    vocab = padded_vocab_size(tokenizer)
    dirs = []
    for label, variant, overrides in VARIANTS:
        config = QKVShareConfig.from_preset(
            "small", variant, vocab_size=vocab, initializer_range=args.init_std, **overrides
        )
        torch.manual_seed(0)
        path = work / f"random-{len(dirs)}"
        model = QKVShareForCausalLM._from_config(config)
        with torch.no_grad():  # biases start at zero: random ones, so that llama.cpp's use of them is tested
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    parameter.normal_(0.0, args.init_std)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs.append((f"{label} (random)", path))
    return dirs


def prompts(model_dir: Path, args: argparse.Namespace) -> tuple[list[str], list[list[int]]]:
    """`--prompts` texts from the corpus' validation documents, each `--prompt_tokens` tokens of the model's
    tokenizer, and their ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts, ids = [], []
    for document in sorted(stdlib_corpus().validation):
        tokens = tokenizer(document, add_special_tokens=False, verbose=False)["input_ids"][: args.prompt_tokens]
        text = tokenizer.decode(tokens)
        if len(tokens) == args.prompt_tokens and tokenizer(text, add_special_tokens=False)["input_ids"] == tokens:
            texts.append(text)  # a cut whose text re-tokenizes to the same ids: a fair tokenizer check
            ids.append(tokens)
        if len(ids) == args.prompts:
            break
    return texts, ids


def llama_cpp_greedy(llm, prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy tokens after `prompt` (argmax of its logits, one token per step) and its prompt logits."""
    llm.reset()
    llm.eval(prompt)
    prompt_logits = np.array(llm.scores[: len(prompt)])
    tokens = []
    for _ in range(new_tokens):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    return tokens, prompt_logits


def compare(label: str, model_dir: Path, dtype: str, work: Path, args: argparse.Namespace) -> dict:
    from llama_cpp import GGML_TYPE_F32, Llama

    output = work / f"{model_dir.name}-{dtype}.gguf"
    started = time.perf_counter()
    status = qkvshare_cli.main(
        ["export", str(model_dir), "--format", "gguf", "--dtype", dtype, "--output", str(output), "--check_tokens", "0"]
    )
    if status:
        raise SystemExit(f"qkvshare export failed for {model_dir} (exit {status})")
    export_seconds = time.perf_counter() - started
    model = QKVShareForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.to(DTYPES[dtype]).float()  # the GGUF's weights, run in float32
    # float32 files run with a float32 KV cache (llama.cpp's default is float16), so the rows test the file exactly
    cache = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if dtype == "float32" else {}
    llm = Llama(model_path=str(output), n_ctx=0, logits_all=True, verbose=False, n_threads=args.threads, **cache)
    texts, prompt_ids = prompts(model_dir, args)
    ours_all, theirs_all, gap, tokenizer_equal, differences = [], [], 0.0, True, []
    for n, (text, ids) in enumerate(zip(texts, prompt_ids), 1):
        prompt = torch.tensor([ids])
        ours = reference_tokens(model, prompt, args.new_tokens)[0].tolist()
        theirs, their_logits = llama_cpp_greedy(llm, ids, args.new_tokens)
        with torch.no_grad():
            our_logits = model(prompt).logits[0].numpy()
        gap = max(gap, float(np.abs(our_logits - their_logits).max()))
        tokenizer_equal &= llm.tokenize(text.encode(), add_bos=False, special=False) == ids
        ours_all.append(ours)
        theirs_all.append(theirs)
        if ours != theirs:  # where, and how close our top two logits were there (a tie within the precision?)
            step = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            with torch.no_grad():
                top = model(torch.tensor([ids + ours[:step]])).logits[0, -1].topk(2).values
            differences.append(f"prompt {n} token {step + 1}: our top-2 margin {float(top[0] - top[1]):.1e}")
    equal = sum(o == t for o, t in zip(ours_all, theirs_all))
    return {
        "variant": label,
        "GGUF": f"{dtype} ({output.stat().st_size / 2**20:.1f} MiB, {export_seconds:.1f} s)",
        "our tokens (prompt 1)": " ".join(map(str, ours_all[0][:12])) + " ...",
        "llama.cpp tokens (prompt 1)": " ".join(map(str, theirs_all[0][:12])) + " ...",
        "equal": f"{'yes' if equal == len(ours_all) else 'NO'} ({equal}/{len(ours_all)} prompts)",
        "max |logit diff|": f"{gap:.1e}",
        "tokenizer equal": "yes" if tokenizer_equal else "NO",
        "first difference": "; ".join(differences) or "-",
    }


def main() -> None:
    args = parse_args()
    import llama_cpp

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="qkvshare-llama-cpp-"))
    try:
        dirs = [] if args.no_random else random_models(work, args)
        dirs += [(f"{Path(d).name} (trained)", Path(d)) for d in args.model_dir]
        rows = [compare(label, path, dtype, work, args) for label, path in dirs for dtype in args.dtypes]
    finally:
        shutil.rmtree(work)
    print(
        f"\nllama-cpp-python {llama_cpp.__version__}; {args.prompts} prompts of {args.prompt_tokens} tokens, "
        f"{args.new_tokens} greedy tokens each\n"
    )
    print(markdown_table(list(rows[0]), [list(row.values()) for row in rows]))


if __name__ == "__main__":
    main()
