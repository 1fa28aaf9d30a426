"""Asking a model a multiple-choice question and reading its answer letter from the logits: the labels of
Skeleton-of-Thought's prompting router (SoT-R, Ning et al. 2023, arXiv:2307.15337, its Prompt 4) and the judged
pairwise preference between two answers (as the paper judges SoT against normal decoding).

The letter is read from one forward, as the most likely of the allowed letters at the first position of the
answer: no decoding, no parsing of free text, and the same answer every time for the same prompt.

A small model answers the router prompt with about the same probabilities whatever the question (Qwen2.5-Coder-1.5B:
A 0.38-0.51, B 0.31-0.45, C 0.11-0.29 on ShareGPT and HumanEval alike), so its raw answer is almost always "A". The
router's labels are therefore calibrated as Zhao et al. 2021 (arXiv:2102.09690, "Calibrate Before Use") do: each
letter's probability divided by the probability the model gives it for content-free questions ("N/A", "",
"[MASK]"), so that a label says which answer the question made more likely than the model's habit.
"""

from __future__ import annotations

import torch

from accelgen.errors import InputError
from accelgen.skeleton.prompts import JUDGE_LETTERS, ROUTER_LETTERS, judge_prompt_ids, router_prompt_ids


def letter_token_ids(tokenizer, letters: tuple[str, ...]) -> list[int]:
    """The one token that spells each letter; a clear error for a tokenizer that splits one."""
    ids = []
    for letter in letters:
        tokens = tokenizer(letter, add_special_tokens=False).input_ids
        if len(tokens) != 1:
            raise InputError(f"this tokenizer spells {letter!r} in {len(tokens)} tokens; asking for a letter needs one")
        ids.extend(tokens)
    return ids


@torch.inference_mode()
def letter_probabilities(model, tokenizer, prompt_ids: list[int], letters: tuple[str, ...]) -> dict[str, float]:
    """The model's next-token probabilities of each letter after prompt_ids, renormalised over the letters."""
    if not isinstance(model, torch.nn.Module):
        raise InputError("asking a model for a letter needs a PyTorch model (weights fp32, bf16, int8 or int4), "
                         "not the llama.cpp engine")
    input_ids = torch.tensor([prompt_ids], device=model.device)
    logits = model(input_ids=input_ids, logits_to_keep=1).logits[0, -1].float()  # (vocab,)
    chosen = logits[letter_token_ids(tokenizer, letters)].softmax(-1)
    return dict(zip(letters, chosen.tolist()))


CONTENT_FREE_QUESTIONS = ("N/A", "", "[MASK]")


def router_probabilities(model, tokenizer, question: str) -> dict[str, float]:
    """The model's probabilities of A ("a list of points that can be answered independently": suits SoT), B and C
    for the router prompt about `question`."""
    return letter_probabilities(model, tokenizer, router_prompt_ids(tokenizer, question), ROUTER_LETTERS)


def content_free_bias(model, tokenizer) -> dict[str, float]:
    """The model's mean router-prompt probabilities over content-free questions: its habit, whatever is asked."""
    answers = [router_probabilities(model, tokenizer, question) for question in CONTENT_FREE_QUESTIONS]
    return {letter: sum(answer[letter] for answer in answers) / len(answers) for letter in ROUTER_LETTERS}


def calibrated_label(probabilities: dict[str, float], bias: dict[str, float]) -> int:
    """1 (suits SoT) if A is the letter the question made most likely relative to the model's habit (strictly: a
    question that changed nothing is not sent to SoT), else 0.

    Example: probabilities A 0.42, B 0.42, C 0.16 with bias A 0.44, B 0.41, C 0.15  ->  B and C gained: 0
    """
    relative = {letter: probabilities[letter] / bias[letter] for letter in ROUTER_LETTERS}
    return int(all(relative["A"] > relative[letter] for letter in ROUTER_LETTERS[1:]))


def pairwise_verdict(model, tokenizer, question: str, first: str, second: str) -> tuple[str, dict[str, float]]:
    """("first", "second" or "tie": which answer the judge prefers, in the order shown; the letters' probabilities)."""
    probabilities = letter_probabilities(model, tokenizer, judge_prompt_ids(tokenizer, question, first, second),
                                         JUDGE_LETTERS)
    verdict = {"A": "first", "B": "second", "C": "tie"}[max(probabilities, key=probabilities.get)]
    return verdict, probabilities
