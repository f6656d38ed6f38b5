"""How much of its source a causal LM keeps: perplexity, KL to the source, greedy agreement, and asked questions.

Everything here runs on text and questions the caller provides (token blocks, prompts, questions with gold
answers); the module knows no dataset. It is meant for a converted model (`qkvshare convert`) and its source, but
any two Hugging Face causal LMs with the same tokenizer can be compared.

- `score_blocks(model, blocks, source=None)`: one forward of each model per batch of token blocks gives the model's
  perplexity, with a source also the source's perplexity, the mean KL(source || model) of the next-token
  distributions and the share of positions where both put their highest probability on the same token (the
  source's log-probabilities can be given instead, computed once for several models: `reference_log_probs`).
  `block_perplexity` and `kl_to_source` are its two most asked fields.
- `greedy_agreement(source, model, prompts, new_tokens)`: both models continue each prompt greedily for exactly
  `new_tokens` tokens (end-of-sequence suppressed, so both write the same number); per prompt the first position
  where they differ (`new_tokens` when they never do) and the share of positions holding the same token.
- `ask(model, tokenizer, questions)`: greedy answers through the tokenizer's chat template (one user message, the
  generation prompt added), batched with left padding; a tokenizer without a chat template gets plain
  "Question: ...\\nAnswer:" prompts, which the result says (`prompt_style`) and a warning repeats.
- `choose(model, tokenizer, questions, stems, choices)`: the same questions as multiple choice: after the prompt and
  the start of an answer (`stems`, e.g. "The capital of Libya is"), which of the `choices` the model finds most
  likely (summed log-probability of its tokens per character, lm-eval's `acc_norm`). No text is generated, so a
  change of wording that leaves the answer as it was does not count (`answer_agreement` compares two models' scores).
- `is_correct(answer, aliases)`, `score_answers`, `answer_agreement`: an answer is correct when, normalised (case,
  accents, punctuation; `normalize_answer`), it contains one of the gold aliases as a whole word or phrase; the
  agreement of a model's correctness with its source's (both correct, both wrong, ...) and the share of the
  source's correct answers the model keeps.

Why not `qkvshare.evaluation.perplexity`: it scores sliding windows over one packed stream (the `qkvshare perplexity`
command's definition), not blocks. Here one forward of each model per batch gives the perplexity, the KL and the
top-1 agreement, in memory bounded by one batch's logits (or, with `reference_log_probs`, by the reference, float16
by default). `qkvshare convert` records its stages' KL to the source with these functions too. This module imports
no optional package.
"""

from __future__ import annotations

import math
import unicodedata
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

PLAIN_PROMPT = "Question: {question}\nAnswer:"
CHAT_STYLE = "chat template"
PLAIN_STYLE = "plain 'Question: ...\\nAnswer:' prompts (the tokenizer has no chat template)"

TokenPrompt = Sequence[int] | torch.Tensor


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


# ----------------------------------------------------------------------------------------------------------------
# token blocks: perplexity, KL to the source, top-1 agreement
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class BlockScores:
    """What `score_blocks` measures on `tokens` scored positions (every position of every block but the last).

    `mean_nll` is in nats per token and `perplexity` is its exponential. The `source_*`, `kl` and
    `top1_agreement` fields are None without a source (or its reference): `kl` is the mean over positions of
    KL(source || model) = sum_v p_source(v) (log p_source(v) - log p_model(v)) in nats, and `top1_agreement` the
    share of positions where the two models' most probable next tokens are the same.
    """

    tokens: int
    mean_nll: float
    perplexity: float
    source_mean_nll: float | None = None
    source_perplexity: float | None = None
    kl: float | None = None
    top1_agreement: float | None = None

    @property
    def perplexity_ratio(self) -> float | None:
        """The model's perplexity over the source's (1 when it keeps everything the source predicts)."""
        return None if self.source_perplexity is None else self.perplexity / self.source_perplexity


def _check_blocks(blocks: torch.Tensor) -> None:
    if blocks.dim() != 2 or blocks.shape[1] < 2 or blocks.shape[0] < 1:
        raise ValueError(
            f"blocks must be a (number of blocks, length >= 2) tensor of token ids; got shape {tuple(blocks.shape)}."
        )
    if blocks.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"blocks must hold integer token ids; got {blocks.dtype}.")


@torch.no_grad()
def score_blocks(
    model: Any,
    blocks: torch.Tensor,
    source: Any = None,
    batch_size: int = 4,
    progress: str | None = "blocks",
    reference: torch.Tensor | None = None,
) -> BlockScores:
    """Perplexity of `model` on `blocks`, and with `source` also the source's, the KL and the top-1 agreement.

    `blocks` is (n, L) token ids without padding: in each row the tokens before position t predict token t, so
    L - 1 positions per row are scored (the trainer's convention: `qkvshare.train.data.PackedBlocks` rows). Both
    models see the same batches in fp32 logits; results are sums in float64 divided by the scored positions, so
    they do not depend on `batch_size`. `progress` is the progress bar's label (None: no bar).

    `reference`, instead of `source`: the source's next-token log-probabilities on `blocks[:, :-1]`, (n, L - 1,
    vocabulary), computed once and reused for several models (in float16 it takes half the memory and changes a
    KL by about 1e-3 nats: fine for comparing models, not for asserting 0).
    Raises `ValueError` for a badly shaped `blocks` or `reference`, both `source` and `reference`, and when a
    loss is not finite.
    """
    _check_blocks(blocks)
    if reference is not None:
        if source is not None:
            raise ValueError("pass the source or its reference log-probabilities, not both.")
        if reference.shape[:2] != (blocks.shape[0], blocks.shape[1] - 1):
            raise ValueError(
                f"reference has shape {tuple(reference.shape)}; blocks {tuple(blocks.shape)} need "
                f"({blocks.shape[0]}, {blocks.shape[1] - 1}, vocabulary)."
            )
    device = _device(model)
    sums = {"nll": 0.0, "source_nll": 0.0, "kl": 0.0, "top1": 0.0}
    scored = 0
    starts = range(0, len(blocks), batch_size)
    for start in tqdm(starts, desc=progress, unit="batch", disable=progress is None or len(starts) < 2):
        batch = blocks[start : start + batch_size].to(device=device, dtype=torch.long)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        own = F.log_softmax(model(input_ids=inputs, use_cache=False).logits.float(), dim=-1)
        sums["nll"] -= own.gather(-1, targets[..., None]).double().sum().item()
        if source is not None or reference is not None:
            if reference is not None:
                ref = reference[start : start + batch_size].to(device=device, dtype=torch.float32)
            else:
                ref = F.log_softmax(source(input_ids=inputs, use_cache=False).logits.float(), dim=-1)
            sums["source_nll"] -= ref.gather(-1, targets[..., None]).double().sum().item()
            sums["kl"] += (ref.exp() * (ref - own)).sum(-1).double().sum().item()
            sums["top1"] += (ref.argmax(-1) == own.argmax(-1)).sum().item()
        scored += targets.numel()
    if not all(math.isfinite(v) for v in sums.values()):
        raise ValueError(f"a loss is not finite ({sums}): a model's logits hold NaN or inf, or a target got p = 0.")
    mean = sums["nll"] / scored
    scores = BlockScores(tokens=scored, mean_nll=mean, perplexity=math.exp(mean))
    if source is not None or reference is not None:
        scores.source_mean_nll = sums["source_nll"] / scored
        scores.source_perplexity = math.exp(scores.source_mean_nll)
        scores.kl = max(0.0, sums["kl"] / scored)  # a model against itself can sum to -1e-12 in float32
        scores.top1_agreement = sums["top1"] / scored
    return scores


@torch.no_grad()
def reference_log_probs(
    source: Any,
    blocks: torch.Tensor,
    batch_size: int = 4,
    dtype: torch.dtype = torch.float16,
    progress: str | None = "source log-probabilities",
) -> tuple[torch.Tensor, BlockScores]:
    """The source's next-token log-probabilities on `blocks[:, :-1]` in `dtype`, on the CPU (the `reference` of
    `score_blocks`), and the source's own `BlockScores` from the same forward (its perplexity in float32).

    Memory: blocks x (length - 1) x vocabulary x 2 bytes in float16 (0.8 GB for 16 blocks of 512 tokens of a
    49,152-token vocabulary)."""
    _check_blocks(blocks)
    device = _device(source)
    out: torch.Tensor | None = None  # allocated once the vocabulary is known: no second copy at the end
    nll, scored = 0.0, 0
    starts = range(0, len(blocks), batch_size)
    for start in tqdm(starts, desc=progress, unit="batch", disable=progress is None or len(starts) < 2):
        batch = blocks[start : start + batch_size].to(device=device, dtype=torch.long)
        log_probs = F.log_softmax(source(input_ids=batch[:, :-1], use_cache=False).logits.float(), dim=-1)
        nll -= log_probs.gather(-1, batch[:, 1:, None]).double().sum().item()
        scored += batch[:, 1:].numel()
        if out is None:
            out = torch.empty((len(blocks), blocks.shape[1] - 1, log_probs.shape[-1]), dtype=dtype)
        out[start : start + len(batch)] = log_probs.to(device="cpu", dtype=dtype)
    if not math.isfinite(nll):
        raise ValueError("the source's loss is not finite: its logits hold NaN or inf, or a target got p = 0.")
    assert out is not None
    return out, BlockScores(tokens=scored, mean_nll=nll / scored, perplexity=math.exp(nll / scored))


def block_perplexity(model: Any, blocks: torch.Tensor, batch_size: int = 4) -> float:
    """Token-weighted perplexity of `model` on `blocks` (`score_blocks` without a source)."""
    return score_blocks(model, blocks, batch_size=batch_size).perplexity


def kl_to_source(source: Any, model: Any, blocks: torch.Tensor, batch_size: int = 4) -> float:
    """Mean KL(source || model) per scored position of `blocks`, in nats (`score_blocks`' `kl`)."""
    kl = score_blocks(model, blocks, source=source, batch_size=batch_size).kl
    assert kl is not None
    return kl


# ----------------------------------------------------------------------------------------------------------------
# greedy generation from token prompts, batched with left padding
# ----------------------------------------------------------------------------------------------------------------
def _as_list(prompt: TokenPrompt) -> list[int]:
    ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
    if not ids:
        raise ValueError("a prompt is empty: every prompt needs at least one token.")
    return [int(i) for i in ids]


def left_padded(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (n, longest prompt): each prompt right-aligned after `pad_token_id`s."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def eos_token_ids(model: Any, tokenizer: Any = None) -> list[int]:
    """The end-of-sequence ids of the model's generation config and of the tokenizer, deduplicated, in order."""
    found: list[int] = []
    generation_config = getattr(model, "generation_config", None)
    for value in (getattr(generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if i is not None and int(i) not in found:
                found.append(int(i))
    return found


@torch.no_grad()
def greedy_generate(
    model: Any,
    prompts: Sequence[TokenPrompt],
    max_new_tokens: int,
    pad_token_id: int,
    eos_token_ids: Sequence[int] = (),
    exact_length: bool = False,
    batch_size: int = 8,
    progress: str | None = "generate",
) -> list[list[int]]:
    """The greedy new tokens of `model` after each prompt, in the order of `prompts`.

    Prompts are sorted by length and batched with left padding (so a batch wastes little), then put back in order.
    With `exact_length` every prompt gets exactly `max_new_tokens` tokens (`eos_token_ids` suppressed);
    otherwise a continuation stops at, and excludes, its first token in `eos_token_ids`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
    token_lists = [_as_list(p) for p in prompts]
    order = sorted(range(len(token_lists)), key=lambda i: (len(token_lists[i]), i))
    eos = [int(i) for i in eos_token_ids]
    settings: dict[str, Any] = {"do_sample": False, "max_new_tokens": max_new_tokens, "pad_token_id": pad_token_id}
    if exact_length:
        # suppress_tokens masks them at every step, eos_token_id=None never stops: exactly max_new_tokens tokens
        settings |= {"suppress_tokens": eos or None, "eos_token_id": None}
    else:
        settings["eos_token_id"] = eos or None
    settings |= {"temperature": None, "top_p": None, "top_k": None}  # the model's sampling defaults do not apply
    device = _device(model)
    out: list[list[int]] = [[] for _ in token_lists]
    starts = range(0, len(order), batch_size)
    for start in tqdm(starts, desc=progress, unit="batch", disable=progress is None or len(starts) < 2):
        rows = order[start : start + batch_size]
        ids, mask = left_padded([token_lists[i] for i in rows], pad_token_id)
        generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **settings)
        for row, i in enumerate(rows):
            new = generated[row, ids.shape[1] :].tolist()
            if not exact_length:
                new = new[: next((k for k, t in enumerate(new) if t in eos), len(new))]
            out[i] = new
    return out


# ----------------------------------------------------------------------------------------------------------------
# greedy continuation agreement
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ContinuationAgreement:
    """`greedy_agreement`'s result over `len(first_difference)` prompts of `new_tokens` new tokens each.

    `first_difference[i]` is the first position (0-based, among the new tokens) where the model's greedy token
    differs from the source's, `new_tokens` when none does; `equal_share[i]` the share of the `new_tokens`
    positions holding the same token in both (positions after a difference count too: a continuation that falls
    back into step scores for it). `source_tokens` and `model_tokens` are the continuations themselves.
    """

    new_tokens: int
    first_difference: list[int]
    equal_share: list[float]
    source_tokens: list[list[int]] = field(repr=False)
    model_tokens: list[list[int]] = field(repr=False)

    @property
    def mean_first_difference(self) -> float:
        return sum(self.first_difference) / len(self.first_difference)

    @property
    def mean_equal_share(self) -> float:
        return sum(self.equal_share) / len(self.equal_share)

    @property
    def identical_share(self) -> float:
        """The share of prompts whose whole continuation equals the source's."""
        return sum(d == self.new_tokens for d in self.first_difference) / len(self.first_difference)


def compare_continuations(source_tokens: Sequence[Sequence[int]], model_tokens: Sequence[Sequence[int]]):
    """(first differing position, share of equal positions) of each pair of equally long continuations."""
    firsts, shares = [], []
    for ref, own in zip(source_tokens, model_tokens, strict=True):
        if len(ref) != len(own) or not ref:
            raise ValueError(
                f"continuations to compare must be non-empty and equally long; got {len(ref)}, {len(own)}."
            )
        equal = [a == b for a, b in zip(ref, own)]
        firsts.append(equal.index(False) if False in equal else len(equal))
        shares.append(sum(equal) / len(equal))
    return firsts, shares


def greedy_continuations(
    model: Any,
    prompts: Sequence[TokenPrompt],
    new_tokens: int,
    pad_token_id: int,
    suppressed: Sequence[int] = (),
    batch_size: int = 8,
    progress: str | None = "continuations",
) -> list[list[int]]:
    """Exactly `new_tokens` greedy tokens after each prompt, the `suppressed` (end-of-sequence) ids never chosen:
    `greedy_generate` with `exact_length`, what `greedy_agreement` compares."""
    return greedy_generate(model, prompts, new_tokens, pad_token_id, suppressed, True, batch_size, progress)


def greedy_agreement(
    source: Any,
    model: Any,
    prompts: Sequence[TokenPrompt],
    new_tokens: int = 32,
    pad_token_id: int | None = None,
    batch_size: int = 8,
    source_tokens: Sequence[Sequence[int]] | None = None,
    suppressed: Sequence[int] | None = None,
) -> ContinuationAgreement:
    """Agreement of the greedy continuations of `model` and `source` on token `prompts` (see `ContinuationAgreement`).

    Both write exactly `new_tokens` tokens (`greedy_continuations`): the `suppressed` ids (default: the
    end-of-sequence ids of both generation configs) are never chosen, so a model that would stop does not end the
    comparison (on held-out text, where the prompt is the start of a document, stopping is rare). `pad_token_id`
    only fills the left padding (default: the source's pad, else its EOS, else 0). `source_tokens`, the source's
    continuations from an earlier `greedy_continuations` with the same settings, skips the source's generation.
    """
    if not prompts:
        raise ValueError("greedy_agreement needs at least one prompt.")
    if pad_token_id is None:
        config = source.generation_config
        pad_token_id = next((i for i in (config.pad_token_id, *eos_token_ids(source)) if i is not None), 0)
    if suppressed is None:
        suppressed = list(dict.fromkeys(eos_token_ids(source) + eos_token_ids(model)))
    if source_tokens is None:
        source_tokens = greedy_continuations(
            source, prompts, new_tokens, pad_token_id, suppressed, batch_size, "source continuations"
        )
    model_tokens = greedy_continuations(
        model, prompts, new_tokens, pad_token_id, suppressed, batch_size, "model continuations"
    )
    firsts, shares = compare_continuations(source_tokens, model_tokens)
    return ContinuationAgreement(new_tokens, firsts, shares, [list(t) for t in source_tokens], model_tokens)


# ----------------------------------------------------------------------------------------------------------------
# questions: asking through the chat template, scoring against gold aliases and against the source
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Answers:
    """`ask`'s result: the decoded answers in the order of the questions, and how they were asked."""

    texts: list[str]
    prompt_style: str

    @property
    def chat_template(self) -> bool:
        return self.prompt_style == CHAT_STYLE


def question_prompts(tokenizer: Any, questions: Sequence[str], use_chat_template: bool | None = None):
    """(token prompts, prompt style) for `questions`: one user message each through the tokenizer's chat template
    with the generation prompt, or `PLAIN_PROMPT` when the tokenizer has none (or `use_chat_template` is False).

    The chat template writes its own special tokens, so its text is tokenized without adding more; a plain prompt
    gets the tokenizer's usual special tokens (a BOS where the tokenizer adds one).
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template and not has_template:
        raise ValueError("use_chat_template=True, but the tokenizer has no chat template.")
    chat = has_template if use_chat_template is None else use_chat_template
    if chat:
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions
        ]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return ids, CHAT_STYLE
    if use_chat_template is None:
        warnings.warn(
            "the tokenizer has no chat template: questions are asked as plain 'Question: ...\\nAnswer:' prompts "
            "and each answer is cut at its first line break.",
            stacklevel=3,
        )
    ids = tokenizer([PLAIN_PROMPT.format(question=q) for q in questions])["input_ids"]
    return ids, PLAIN_STYLE


def ask(
    model: Any,
    tokenizer: Any,
    questions: Sequence[str],
    max_new_tokens: int = 32,
    batch_size: int = 16,
    use_chat_template: bool | None = None,
    progress: str | None = "questions",
) -> Answers:
    """Greedy answers of `model` to `questions` (at most `max_new_tokens` tokens each), see `question_prompts`.

    An answer ends at the first end-of-sequence token of the model's generation config or the tokenizer (a chat
    model's end of turn), and a plain-prompted answer also at its first line break after some text (what follows
    is usually the next invented "Question:"). Special tokens are dropped from the decoded text.
    """
    if not questions:
        return Answers([], CHAT_STYLE if use_chat_template is not False else PLAIN_STYLE)
    prompts, style = question_prompts(tokenizer, questions, use_chat_template)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    new = greedy_generate(
        model,
        prompts,
        max_new_tokens,
        pad_token_id=pad if pad is not None else 0,
        eos_token_ids=eos_token_ids(model, tokenizer),
        batch_size=batch_size,
        progress=progress,
    )
    texts = [tokenizer.decode(tokens, skip_special_tokens=True).strip() for tokens in new]
    if style == PLAIN_STYLE:
        texts = [text.split("\n", 1)[0].strip() for text in texts]
    return Answers(texts, style)


def normalize_answer(text: str) -> str:
    """`text` case-folded, without accents, every punctuation or symbol character a space, spaces collapsed:
    "Bogotá, D.C." -> "bogota d c"."""
    decomposed = unicodedata.normalize("NFKD", text.casefold())
    kept = []
    for ch in decomposed:
        kind = unicodedata.category(ch)
        if kind == "Mn":  # a combining accent
            continue
        kept.append(" " if kind[0] in "PSZC" else ch)
    return " ".join("".join(kept).split())


def is_correct(answer: str, aliases: Sequence[str]) -> bool:
    """Whether the normalised `answer` contains a normalised alias as a whole word or phrase ("Rome" is not found
    in "Romeo", nor "Niger" in "Nigeria"). Empty aliases never match."""
    padded = f" {normalize_answer(answer)} "
    return any(norm and f" {norm} " in padded for norm in map(normalize_answer, aliases))


def score_answers(answers: Sequence[str], gold: Sequence[Sequence[str]]) -> list[bool]:
    """`is_correct` of each answer against its gold aliases."""
    if len(answers) != len(gold):
        raise ValueError(f"{len(answers)} answers for {len(gold)} gold alias lists.")
    return [is_correct(answer, aliases) for answer, aliases in zip(answers, gold)]


@dataclass
class AnswerAgreement:
    """How a model's correctness follows its source's on the same questions (`answer_agreement`).

    `kept` is the share of the source's correct answers that the model also gets right (None when the source got
    none); `same_answer` counts answers equal to the source's after `normalize_answer`.
    """

    questions: int
    model_correct: int
    source_correct: int
    both_correct: int
    both_wrong: int
    model_only: int
    source_only: int
    same_answer: int | None = None

    @property
    def accuracy(self) -> float:
        return self.model_correct / self.questions

    @property
    def source_accuracy(self) -> float:
        return self.source_correct / self.questions

    @property
    def kept(self) -> float | None:
        return self.both_correct / self.source_correct if self.source_correct else None


def answer_agreement(
    model_correct: Sequence[bool],
    source_correct: Sequence[bool],
    model_answers: Sequence[str] | None = None,
    source_answers: Sequence[str] | None = None,
) -> AnswerAgreement:
    """Counts of the four cases (both correct, both wrong, only the model, only the source) over the questions,
    and with both answer lists the number of equal normalised answers."""
    if len(model_correct) != len(source_correct) or not model_correct:
        raise ValueError(f"need equally many, and some, scores; got {len(model_correct)} and {len(source_correct)}.")
    pairs = list(zip(map(bool, model_correct), map(bool, source_correct)))
    same = None
    if model_answers is not None and source_answers is not None:
        if len(model_answers) != len(source_answers) or len(model_answers) != len(pairs):
            raise ValueError("the answer lists must be as long as the score lists.")
        same = sum(normalize_answer(a) == normalize_answer(b) for a, b in zip(model_answers, source_answers))
    return AnswerAgreement(
        questions=len(pairs),
        model_correct=sum(m for m, _ in pairs),
        source_correct=sum(s for _, s in pairs),
        both_correct=sum(m and s for m, s in pairs),
        both_wrong=sum(not m and not s for m, s in pairs),
        model_only=sum(m and not s for m, s in pairs),
        source_only=sum(s and not m for m, s in pairs),
        same_answer=same,
    )


@dataclass
class Choices:
    """`choose`'s result: per question the index of the chosen answer and every choice's summed log-probability."""

    picks: list[int]
    log_probs: list[list[float]]
    prompt_style: str


@torch.no_grad()
def choice_log_probs(
    model: Any,
    contexts: Sequence[Sequence[int]],
    choices: Sequence[Sequence[Sequence[int]]],
    progress: str | None = None,
) -> list[list[float]]:
    """Per context, the summed log-probability of each of its choices' tokens following it (teacher-forced). The
    context runs once; its cache is repeated for the choices, which run together right-padded (padding follows
    every scored token, so it changes none)."""
    if len(contexts) != len(choices):
        raise ValueError(f"{len(contexts)} contexts for {len(choices)} lists of choices.")
    for q, (ctx, chs) in enumerate(zip(contexts, choices)):
        if not len(ctx) or not chs or not all(len(ch) for ch in chs):
            raise ValueError(f"question {q}: every context and every choice needs at least one token.")
    device = _device(model)
    out: list[list[float]] = []
    for ctx, chs in tqdm(list(zip(contexts, choices)), desc=progress, disable=progress is None, leave=False):
        first = model(input_ids=torch.tensor([list(ctx)], device=device), use_cache=True, logits_to_keep=1)
        cache = first.cache
        cache.batch_repeat_interleave(len(chs))
        ids = torch.zeros(len(chs), max(len(ch) for ch in chs), dtype=torch.long)
        for r, ch in enumerate(chs):
            ids[r, : len(ch)] = torch.tensor(list(ch))
        logits = model(input_ids=ids.to(device), cache=cache, use_cache=True).logits.float().cpu()
        opening = F.log_softmax(first.logits[0, -1].float().cpu(), dim=-1)  # predicts each choice's first token
        scores = []
        for r, ch in enumerate(chs):
            rest = F.log_softmax(logits[r, : len(ch) - 1], dim=-1).gather(-1, torch.tensor(list(ch[1:]))[:, None])
            scores.append(float(opening[ch[0]] + rest.sum()))
        out.append(scores)
    return out


def choose(
    model: Any,
    tokenizer: Any,
    questions: Sequence[str],
    stems: Sequence[str],
    choices: Sequence[Sequence[str]],
    use_chat_template: bool | None = None,
    progress: str | None = "choices",
) -> Choices:
    """Multiple choice: each question asked as `ask` asks it (`question_prompts`), the answer begun with its stem,
    then each choice (a space before it) scored by `choice_log_probs`; the pick is the highest log-probability per
    character of the choice (so a long name is not penalised for its length)."""
    if not (len(questions) == len(stems) == len(choices)):
        raise ValueError(f"{len(questions)} questions, {len(stems)} stems and {len(choices)} lists of choices.")
    for q, chs in enumerate(choices):
        if not chs or not all(c.strip() for c in chs):
            raise ValueError(f"question {q} ({questions[q]!r}): every question needs choices, and each some text.")
    prompts, style = question_prompts(tokenizer, questions, use_chat_template)
    space = "" if style == CHAT_STYLE else " "  # a plain prompt ends with "Answer:"
    contexts = [
        list(p) + tokenizer(space + stem, add_special_tokens=False)["input_ids"] for p, stem in zip(prompts, stems)
    ]
    tokens = [[tokenizer(" " + c, add_special_tokens=False)["input_ids"] for c in chs] for chs in choices]
    scores = choice_log_probs(model, contexts, tokens, progress)
    picks = [
        max(range(len(chs)), key=lambda i, chs=chs, lp=lp: lp[i] / len(chs[i])) for chs, lp in zip(choices, scores)
    ]
    return Choices(picks, scores, style)
