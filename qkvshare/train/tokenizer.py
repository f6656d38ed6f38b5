"""Tokenizers for pretraining: any Hugging Face tokenizer, or a byte-level BPE trained on the corpus.

Design notes
- The trained tokenizer is GPT-2's scheme (byte-level pre-tokenizer and decoder, so every string round-trips)
  with one special token, `<|endoftext|>`, used as EOS (the document separator in packing), BOS and PAD
  (PAD only for batched generation; training never pads).
- It is returned as a `PreTrainedTokenizerFast`, saved next to the model with `save_pretrained`, so
  `AutoTokenizer.from_pretrained(model_dir)` and lm-eval load it with no extra code.
- The model's vocabulary follows the tokenizer, rounded up to a multiple of 64 (as GPT-2's 50257 -> 50304).
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
# Byte-level BPE starts from 256 byte symbols plus the special token; leave room for some merges.
MIN_BPE_VOCAB = 320


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with `tokenizers` on `texts` (deterministic for a given text order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, MIN_BPE_VOCAB),
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN, model_max_length=10**6
    )


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """A Hugging Face tokenizer by hub name or local path; it must define an EOS token (the document separator)."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"tokenizer {name_or_path!r} has no EOS token, which packing needs between documents; "
            "use a tokenizer with one, or omit --tokenizer_name to train a byte-level BPE."
        )
    if tokenizer.pad_token_id is None:  # for batched generation only; training never pads
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def padded_vocab_size(tokenizer: PreTrainedTokenizerBase, multiple: int = 64) -> int:
    """`len(tokenizer)` rounded up to a multiple of `multiple` (fast matmuls; GPT-2's 50257 -> 50304)."""
    return -(-len(tokenizer) // multiple) * multiple
