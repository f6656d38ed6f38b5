"""Tokenizers for pretraining: any Hugging Face tokenizer, or a byte-level BPE trained on the corpus.

Design notes
- The trained tokenizer is GPT-2's scheme (byte-level pre-tokenizer and decoder, so every string round-trips)
  with one special token, `<|endoftext|>`, used as EOS (the document separator in packing), BOS and PAD
  (PAD only for batched generation; training never pads).
- It is returned as a `PreTrainedTokenizerFast`, saved next to the model with `save_pretrained`, so
  `AutoTokenizer.from_pretrained(model_dir)` and lm-eval load it with no extra code. Its `model_max_length` is
  the model's `max_position_embeddings` (what lm-eval and pipelines truncate to), and it carries a chat template
  (`CHAT_TEMPLATE`, built from its one special token) so `apply_chat_template` and TRL's chat datasets work.
- A named tokenizer (`--tokenizer_name`) is checked before use: a missing path, a folder without tokenizer
  files or a hub name that cannot be fetched raise `TrainingSetupError` naming it and what to pass instead.
- The model's vocabulary follows the tokenizer, rounded up to a multiple of 64 (as GPT-2's 50257 -> 50304).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from qkvshare_settings.conventions import TOKENIZER_FILES
from qkvshare_settings.train import TrainingSetupError

EOS_TOKEN = "<|endoftext|>"
# Byte-level BPE starts from 256 byte symbols plus the special token; leave room for some merges.
MIN_BPE_VOCAB = 320
# The trained tokenizer's chat format, using only its own special token: every message is
# "<role>\n<content><|endoftext|>" (ChatML's layout without extra special tokens) and the generation prompt is
# "assistant\n"; the newline keeps the content's first token apart from the role's. Rendering a conversation's prompt
# with `add_generation_prompt=True` gives a prefix of rendering the whole conversation, which TRL's
# prompt/completion datasets rely on; the `generation` block marks assistant text for
# `return_assistant_tokens_mask=True` (TRL's `assistant_only_loss`).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + eos_token -}}{%- endgeneration -%}"
    "{%- else -%}{{- message['content'] + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant\\n' -}}{%- endif -%}"
)
TOKENIZER_ADVICE = (
    "pass --tokenizer_name a Hugging Face tokenizer name (e.g. gpt2; it needs network access or the local HF "
    "cache) or a folder holding tokenizer.json or tokenizer_config.json (a saved model directory), or omit "
    "--tokenizer_name to train a byte-level BPE on the training data"
)


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, model_max_length: int | None = None
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with `tokenizers` on `texts` (deterministic for a given text order).

    `model_max_length` should be the model's `max_position_embeddings`; None leaves transformers' "no limit"
    default (then nothing warns about, or truncates, sequences the model cannot take).
    """
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
    limit = {} if model_max_length is None else {"model_max_length": model_max_length}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        **limit,
    )


def _check_tokenizer_name(name: str) -> None:
    """Fail fast, naming `name`, when it is a missing path, a file, or a folder without tokenizer files."""
    path = Path(name).expanduser()
    if path.is_file():
        raise TrainingSetupError(
            f"tokenizer {name!r} is a file; pass the folder that holds it, or: {TOKENIZER_ADVICE}."
        )
    if path.is_dir():
        if not any((path / file).is_file() for file in TOKENIZER_FILES):
            raise TrainingSetupError(
                f"tokenizer folder {name!r} holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
                f"{TOKENIZER_ADVICE}."
            )
        return
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise TrainingSetupError(
            f"tokenizer {name!r} does not exist as a folder and is not a valid hub name; check the path, or "
            f"{TOKENIZER_ADVICE}."
        ) from None


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """A Hugging Face tokenizer by hub name or local path; it must define an EOS token (the document separator).

    Raises `TrainingSetupError` naming `name_or_path` and what to pass instead when it cannot be loaded.
    """
    _check_tokenizer_name(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(Path(name_or_path).expanduser()))
    except Exception as err:  # OSError (not found, offline), ValueError (no usable files), ...: say what to do
        raise TrainingSetupError(
            f"could not load tokenizer {name_or_path!r} ({type(err).__name__}: {' '.join(str(err).split())}); {TOKENIZER_ADVICE}."
        ) from err
    if tokenizer.eos_token_id is None:
        raise TrainingSetupError(
            f"tokenizer {name_or_path!r} has no EOS token, which packing needs between documents; "
            "use a tokenizer with one, or omit --tokenizer_name to train a byte-level BPE."
        )
    if tokenizer.pad_token_id is None:  # for batched generation only; training never pads
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def padded_vocab_size(tokenizer: PreTrainedTokenizerBase, multiple: int = 64) -> int:
    """`len(tokenizer)` rounded up to a multiple of `multiple` (fast matmuls; GPT-2's 50257 -> 50304)."""
    return -(-len(tokenizer) // multiple) * multiple
