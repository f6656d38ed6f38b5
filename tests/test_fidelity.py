"""Tests of `qkvshare.evaluation.fidelity` (issue 23, item 2): perplexity and KL on token blocks, greedy
continuation agreement, questions through the chat template (and the plain fallback), the answer scorer.

Tiny random Llama models (2 layers, width 64) and a Q-K=V conversion of one (a QKVShare model with its own cache),
fp32, CPU. Every expected number is computed independently here: full-tensor cross-entropy and KL, and greedy
tokens from a plain argmax loop over uncached, unpadded forwards.
"""

from __future__ import annotations

import ast
import copy
import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from qkvshare.convert import convert
from qkvshare.evaluation import fidelity as fd
from qkvshare.train.tokenizer import train_bpe_tokenizer

VOCAB, NEW = 320, 8
TEXTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "What is the currency of Japan? The yen is the currency of Japan.",
    "Rinse the spoon with warm soapy water, then dry it with a towel.",
]
PROMPTS = [[3, 17, 42], [7, 8, 9, 10, 11, 12], [100]]  # three lengths: batches need left padding


def llama(seed: int = 0, vocab: int = VOCAB, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        initializer_range=0.2,  # varied greedy tokens (the default scale repeats one token)
        tie_word_embeddings=False,
        **overrides,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def source() -> LlamaForCausalLM:
    return llama()


@pytest.fixture(scope="module")
def converted(source):
    """Q-K=V with the source's key as the value: a QKVShare model close to, but not equal to, the source."""
    model, _ = convert(source, "Q-K=V", "key")
    return model.eval()


@pytest.fixture(scope="module")
def blocks() -> torch.Tensor:
    return torch.randint(0, VOCAB, (5, 25), generator=torch.Generator().manual_seed(1))


def reference_greedy(model, prompt: list[int], n: int, suppressed: tuple[int, ...] = ()) -> list[int]:
    """Greedy tokens from uncached, unpadded forwards of the whole sequence."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        logits[list(suppressed)] = -math.inf
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def always(model, token: int):
    """A copy of `model` whose head adds a large bias to `token`: it writes `token` at every step."""
    out = copy.deepcopy(model)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[token] = 1e4
    out.lm_head = head
    return out


# --------------------------------------------------------------------------------------------------------------
def test_the_module_imports_no_command_line_and_no_optional_package():
    tree = ast.parse(Path(fd.__file__).read_text())
    roots = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and (not isinstance(node, ast.ImportFrom) or node.level == 0)
        for alias in node.names
    }
    assert roots == set("__future__ collections dataclasses math typing unicodedata warnings torch tqdm".split())


def test_a_model_against_itself_keeps_everything(source, blocks):
    scores = fd.score_blocks(source, blocks, source=source, batch_size=2, progress=None)
    assert scores.tokens == 5 * 24
    assert scores.kl == pytest.approx(0.0, abs=1e-6) and scores.top1_agreement == 1.0
    assert scores.perplexity == scores.source_perplexity and scores.perplexity_ratio == 1.0
    with torch.no_grad():
        logits = source(blocks[:, :-1]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten()).item()
    assert scores.mean_nll == pytest.approx(expected, rel=1e-5)
    assert fd.block_perplexity(source, blocks, batch_size=5) == pytest.approx(math.exp(expected), rel=1e-5)

    agreement = fd.greedy_agreement(source, source, PROMPTS, new_tokens=NEW, batch_size=2)
    assert agreement.first_difference == [NEW] * 3 and agreement.equal_share == [1.0] * 3
    assert agreement.identical_share == 1.0 and agreement.mean_first_difference == NEW
    assert agreement.source_tokens == [reference_greedy(source, p, NEW) for p in PROMPTS]


def test_a_converted_model_against_its_source(source, converted, blocks):
    scores = fd.score_blocks(converted, blocks, source=source, batch_size=3, progress=None)
    with torch.no_grad():
        ref = F.log_softmax(source(blocks[:, :-1]).logits, -1).flatten(0, 1)
        own = F.log_softmax(converted(blocks[:, :-1]).logits, -1).flatten(0, 1)
    expected_kl = F.kl_div(own, ref, log_target=True, reduction="batchmean").item()
    assert scores.kl > 1e-3 and scores.kl == pytest.approx(expected_kl, rel=1e-4)
    assert fd.kl_to_source(source, converted, blocks, batch_size=1) == pytest.approx(expected_kl, rel=1e-4)
    # the source's log-probabilities computed once and given instead of the source: the same numbers
    for dtype, rel in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
        reference, itself = fd.reference_log_probs(source, blocks, batch_size=3, dtype=dtype, progress=None)
        assert reference.dtype == dtype and torch.allclose(reference.float(), ref.view(5, 24, -1), atol=rel)
        assert itself.mean_nll == pytest.approx(scores.source_mean_nll, rel=1e-6) and itself.tokens == scores.tokens
        given = fd.score_blocks(converted, blocks, batch_size=2, progress=None, reference=reference)
        assert given.kl == pytest.approx(scores.kl, rel=rel) and given.top1_agreement == scores.top1_agreement
        assert given.source_mean_nll == pytest.approx(scores.source_mean_nll, rel=rel / 10)
    with pytest.raises(ValueError, match="not both"):
        fd.score_blocks(converted, blocks, source=source, reference=ref.view(5, 24, -1))
    with pytest.raises(ValueError, match="reference has shape"):
        fd.score_blocks(converted, blocks, reference=ref.view(5, 24, -1)[:, 1:])
    assert scores.top1_agreement == pytest.approx((ref.argmax(-1) == own.argmax(-1)).float().mean().item())
    assert scores.top1_agreement < 1.0
    expected_nll = -own.gather(-1, blocks[:, 1:].reshape(-1, 1)).mean().item()
    assert scores.mean_nll == pytest.approx(expected_nll, rel=1e-5) and scores.mean_nll != scores.source_mean_nll

    # the QKVShare model's cached, left-padded generation against uncached argmax loops of both models
    agreement = fd.greedy_agreement(source, converted, PROMPTS, new_tokens=NEW, batch_size=3)
    expected = [reference_greedy(converted, p, NEW) for p in PROMPTS]
    assert agreement.model_tokens == expected
    firsts = [
        next((i for i, (a, b) in enumerate(zip(s, m)) if a != b), NEW)
        for s, m in zip(agreement.source_tokens, expected)
    ]
    assert agreement.first_difference == firsts and min(firsts) < NEW
    shares = [sum(a == b for a, b in zip(s, m)) / NEW for s, m in zip(agreement.source_tokens, expected)]
    assert agreement.equal_share == shares


def test_a_model_that_repeats_the_sources_first_token_differs_where_the_source_moves_on(source):
    source_tokens = [reference_greedy(source, p, NEW) for p in PROMPTS]
    first = source_tokens[0][0]
    agreement = fd.greedy_agreement(source, always(source, first), PROMPTS, NEW, source_tokens=source_tokens)
    assert agreement.model_tokens == [[first] * NEW] * 3
    # prompt 0: the same first token, then different where the source writes something else
    expected_first = next(i for i, t in enumerate(source_tokens[0]) if t != first)
    assert expected_first >= 1 and agreement.first_difference[0] == expected_first
    assert agreement.equal_share == [tokens.count(first) / NEW for tokens in source_tokens]
    # given continuations stand for the source's: here the repeating model's, against the source generating
    again = fd.greedy_agreement(source, source, PROMPTS, new_tokens=NEW, source_tokens=agreement.model_tokens)
    assert again.model_tokens == source_tokens and again.source_tokens == agreement.model_tokens
    assert again.first_difference == agreement.first_difference and again.equal_share == agreement.equal_share


def test_end_of_sequence_stops_an_answer_or_is_suppressed_for_a_fixed_length(source):
    first = reference_greedy(source, PROMPTS[1], 1)[0]
    stopped = fd.greedy_generate(source, PROMPTS, NEW, pad_token_id=0, eos_token_ids=[first], progress=None)
    assert stopped[1] == []  # its first token is the end of sequence, which is not kept
    assert stopped[0] == reference_greedy(source, PROMPTS[0], NEW)[: len(stopped[0])] and first not in stopped[0]
    fixed = fd.greedy_generate(source, PROMPTS, NEW, 0, [first], exact_length=True, batch_size=2, progress=None)
    assert fixed == [reference_greedy(source, p, NEW, suppressed=(first,)) for p in PROMPTS]
    assert all(len(t) == NEW and first not in t for t in fixed)


def test_bad_blocks_and_prompts_are_refused(source):
    with pytest.raises(ValueError, match="shape"):
        fd.score_blocks(source, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        fd.score_blocks(source, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="empty"):
        fd.greedy_generate(source, [[1], []], 2, pad_token_id=0)
    with pytest.raises(ValueError, match="equally long"):
        fd.compare_continuations([[1, 2]], [[1]])


# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_setup():
    tokenizer = train_bpe_tokenizer(TEXTS * 5, 300, model_max_length=128)
    model = llama(seed=3, vocab=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    return model, tokenizer


def reference_answer(model, tokenizer, text: str, n: int) -> str:
    """The greedy answer to one prompt text, unbatched, stopped at EOS."""
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens = reference_greedy(model, prompt, n)
    eos = tokenizer.eos_token_id
    return tokenizer.decode(tokens[: tokens.index(eos)] if eos in tokens else tokens, skip_special_tokens=True)


def test_questions_through_the_chat_template(chat_setup):
    model, tokenizer = chat_setup
    questions = ["What is the capital of France?", "Which currency does Japan use?", "Who wrote it?"]
    prompts, style = fd.question_prompts(tokenizer, questions)
    assert style == fd.CHAT_STYLE
    assert tokenizer.decode(prompts[0]) == f"user\n{questions[0]}{tokenizer.eos_token}assistant\n"
    answers = fd.ask(model, tokenizer, questions, max_new_tokens=NEW, batch_size=2)
    assert answers.chat_template and len(answers.texts) == 3
    for question, answer in zip(questions, answers.texts):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        assert answer == reference_answer(model, tokenizer, text, NEW).strip()
    assert all(answers.texts)  # the reference has exactly NEW tokens (no EOS): the bound holds


def test_questions_without_a_chat_template_are_plain_prompts_and_say_so(chat_setup):
    model, tokenizer = chat_setup
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    questions = ["What is the capital of France?", "Who wrote Romeo and Juliet?"]
    with pytest.warns(UserWarning, match="no chat template"):
        answers = fd.ask(model, plain, questions, max_new_tokens=NEW)
    assert not answers.chat_template and "no chat template" in answers.prompt_style
    for question, answer in zip(questions, answers.texts):
        raw = reference_answer(model, plain, f"Question: {question}\nAnswer:", NEW)
        assert answer == raw.strip().split("\n", 1)[0].strip() and "\n" not in answer
    with pytest.raises(ValueError, match="no chat template"):
        fd.question_prompts(plain, questions, use_chat_template=True)
    prompts, style = fd.question_prompts(tokenizer, questions[:1], use_chat_template=False)  # asked for: no warning
    assert style == fd.PLAIN_STYLE and tokenizer.decode(prompts[0]) == f"Question: {questions[0]}\nAnswer:"


def test_multiple_choice_scores_each_choice_after_the_question_and_its_stem(chat_setup):
    """Every choice's log-probability (its context run once, the cache repeated for the choices) equals an
    unbatched, uncached forward of prompt + stem + choice summed over the choice's tokens, for a Llama and for a
    Q-K=V model with its tied cache; the pick is the best per character; a plain prompt gets a space before its
    stem."""
    llama_model, tokenizer = chat_setup
    tied, _ = convert(llama_model, "Q-K=V", "key")
    questions = ["What is the capital of France?", "Which currency does Japan use?"]
    stems = ["The capital of France is", "The currency of Japan is the"]
    choices = [["Paris", "Rome", "the spoon with warm soapy water"], ["yen", "towel"]]
    for model, (use_chat, prefix) in itertools.product((llama_model, tied.eval()), ((None, ""), (False, " "))):
        result = fd.choose(model, tokenizer, questions, stems, choices, use_chat_template=use_chat)
        prompts, _ = fd.question_prompts(tokenizer, questions, use_chat)
        for q, (prompt, stem, options) in enumerate(zip(prompts, stems, choices)):
            context = list(prompt) + tokenizer(prefix + stem, add_special_tokens=False)["input_ids"]
            expected = []
            for option in options:
                tokens = tokenizer(" " + option, add_special_tokens=False)["input_ids"]
                with torch.no_grad():
                    logits = model(torch.tensor([context + tokens])).logits[0]
                log_probs = F.log_softmax(logits[len(context) - 1 : -1].double(), -1)
                expected.append(float(log_probs[torch.arange(len(tokens)), torch.tensor(tokens)].sum()))
            assert result.log_probs[q] == pytest.approx(expected, rel=1e-5, abs=1e-5)
            per_char = [lp / len(option) for lp, option in zip(expected, options)]
            assert result.picks[q] == per_char.index(max(per_char))
    with pytest.raises(ValueError, match="2 questions, 1 stems and 2 lists of choices"):
        fd.choose(llama_model, tokenizer, questions, stems[:1], choices)
    with pytest.raises(ValueError, match=r"question 1 \('Which currency does Japan use\?'\): every question needs"):
        fd.choose(llama_model, tokenizer, questions, stems, [choices[0], ["yen", " "]])
    with pytest.raises(ValueError, match="question 0 .*: every question needs choices, and each some text"):
        fd.choose(llama_model, tokenizer, questions, stems, [[], choices[1]])
    with pytest.raises(ValueError, match="question 0: every context and every choice needs at least one token"):
        fd.choice_log_probs(llama_model, [[1, 2]], [[[]]])


# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("answer", "aliases", "correct"),
    [
        ("The capital of France is Paris.", ["Paris"], True),
        ("PARIS!!", ["paris"], True),
        ("Bogotá, D.C.", ["Bogota"], True),  # accents
        ("bogota", ["Bogotá"], True),
        ("It is Port-au-Prince", ["Port au Prince"], True),  # punctuation inside the alias
        ("the US dollar (USD)", ["United States dollar", "US dollar"], True),  # a second alias, a phrase
        ("Cote d'Ivoire", ["Côte d’Ivoire"], True),  # typographic apostrophe
        ("Romeo and Juliet", ["Rome"], False),  # a substring of a word is no match
        ("Nigeria is in Africa", ["Niger"], False),
        ("A Parisian suburb", ["Paris"], False),
        ("It is the United States", ["US dollar"], False),  # part of a phrase is no match
        ("The euros", ["euro"], False),  # a plural is a different word: callers give it as an alias
        ("Paris", [""], False),  # an empty alias never matches
        ("", ["Paris"], False),
    ],
)
def test_answer_scorer(answer, aliases, correct):
    assert fd.is_correct(answer, aliases) is correct


def test_normalisation_and_agreement_counts():
    assert fd.normalize_answer("  Bogotá,\tD.C.! ") == "bogota d c"
    assert fd.normalize_answer("ÅLAND – Mariehamn") == "aland mariehamn"
    gold = [["Paris"], ["Rome"], ["yen", "JPY"], ["Canberra"], ["Lima"]]
    model_answers = ["Paris.", "Romeo", "The yen", "Sydney", "lima"]
    source_answers = ["paris", "Rome", "JPY", "Canberra", "Quito"]
    model_ok, source_ok = fd.score_answers(model_answers, gold), fd.score_answers(source_answers, gold)
    assert model_ok == [True, False, True, False, True] and source_ok == [True, True, True, True, False]
    result = fd.answer_agreement(model_ok, source_ok, model_answers, source_answers)
    assert (result.both_correct, result.both_wrong, result.model_only, result.source_only) == (2, 0, 1, 2)
    assert result.kept == pytest.approx(2 / 4) and result.accuracy == 0.6 and result.source_accuracy == 0.8
    assert result.same_answer == 1  # "Paris." and "paris" normalise the same; "The yen" is not "JPY"
    assert fd.answer_agreement([False], [False]).kept is None
    with pytest.raises(ValueError, match="gold"):
        fd.score_answers(["a"], [])
