"""Skeleton-of-Thought end to end (Ning et al. 2023, arXiv:2307.15337): route, outline, expand in parallel.

1. **route** (optional, SoT-R): a trained router (router.py) says whether the question suits SoT; if not, the
   answer is decoded normally.
2. **skeleton**: one generation with the paper's skeleton prompt gives a short numbered list of points; a list
   that does not parse (fewer than two points) falls back to normal decoding.
3. **expand**: every point is expanded at once, as one batch (expand.py), within the same answer budget
   (max_new_tokens split between the points), and the answer is the points with their expansions.

SoT is lossy by design: the answer is a different text from what normal decoding writes, and its quality is
measured, not assumed (accelgen/skeleton/evaluation.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from accelgen.errors import InputError
from accelgen.loop import generate as decode
from accelgen.skeleton.expand import expand_points
from accelgen.skeleton.prompts import (assemble_answer, check_question, parse_points, point_prompt_ids,
                                       skeleton_prompt_ids, SKELETON_START)

SKELETON_TOKENS = 96  # enough for 10 points of 3-5 words


@dataclass
class SkeletonAnswer:
    """What `generate` returns: the answer and how it was made."""

    text: str  # the full answer
    used_skeleton: bool  # False: decoded normally (the router said no, or no skeleton parsed)
    reason: str  # why SoT was or was not used
    skeleton: str = ""  # the skeleton stage's text ("1. ..."), "" when not run
    points: list[str] = field(default_factory=list)
    expansions: list[str] = field(default_factory=list)  # one per point
    router_accepted: bool | None = None  # None: no router
    router_score: float | None = None  # the router's probability that the question suits SoT
    seconds: dict = field(default_factory=dict)  # router, skeleton, expansion, normal, total
    tokens: dict = field(default_factory=dict)  # skeleton, expansion, normal: new tokens decoded

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def generate(model, tokenizer, question: str, *, router=None, max_new_tokens: int = 256,
             skeleton_tokens: int = SKELETON_TOKENS, **generation) -> SkeletonAnswer:
    """Answer `question` with Skeleton-of-Thought.

    router: a SkeletonRouter (router.py) for this model, or None to always try SoT. max_new_tokens: the answer's
    budget, the same as normal decoding's: each point gets max_new_tokens // points tokens (the skeleton gets
    skeleton_tokens of its own). generation: accelgen.generate's other arguments (method, draft_model,
    temperature, ...), used for every stage; any method runs, and methods that batch expand all points together.
    """
    question = check_question(question)
    if max_new_tokens < 1 or skeleton_tokens < 1:
        raise InputError(f"max_new_tokens and skeleton_tokens must be >= 1, got {max_new_tokens} and {skeleton_tokens}")
    started = time.perf_counter()
    seconds: dict = {}
    accepted, score = None, None
    if router is not None:
        accepted, score = router.accepts(model, tokenizer, question)
        seconds["router"] = time.perf_counter() - started
        if not accepted:
            return normal_answer(model, tokenizer, question, max_new_tokens, generation, started, seconds,
                                 f"the router rejected the question (score {score:.2f})", accepted, score)
    skeleton, points = outline(model, tokenizer, question, skeleton_tokens, generation)
    seconds["skeleton"] = time.perf_counter() - started - sum(seconds.values())
    if not points:
        return normal_answer(model, tokenizer, question, max_new_tokens, generation, started, seconds,
                             "no numbered list of at least two points parsed from the skeleton", accepted, score,
                             skeleton=skeleton.text)
    prompts = [point_prompt_ids(tokenizer, question, points, index) for index in range(1, len(points) + 1)]
    expanded = expand_points(model, tokenizer, prompts, max(1, max_new_tokens // len(points)), **generation)
    expansions = [result.text for result in expanded]
    seconds["expansion"] = time.perf_counter() - started - sum(seconds.values())
    seconds["total"] = time.perf_counter() - started
    tokens = {"skeleton": len(skeleton.token_ids), "expansion": sum(len(result.token_ids) for result in expanded)}
    return SkeletonAnswer(assemble_answer(points, expansions), True, f"{len(points)} points expanded together",
                          SKELETON_START + skeleton.text, points, expansions, accepted, score, seconds, tokens)


def outline(model, tokenizer, question: str, skeleton_tokens: int, generation: dict):
    """(the skeleton stage's GenerationResult, its points: [] when none parse)."""
    skeleton = decode(model, tokenizer, skeleton_prompt_ids(tokenizer, question),
                             max_new_tokens=skeleton_tokens, **generation)
    points = parse_points(SKELETON_START + skeleton.text, complete=skeleton.finish_reason != "length")
    return skeleton, points


def normal_answer(model, tokenizer, question: str, max_new_tokens: int, generation: dict, started: float,
                  seconds: dict, reason: str, accepted: bool | None, score: float | None,
                  skeleton: str = "") -> SkeletonAnswer:
    """The fallback: the question decoded normally, as a user message, with the same budget."""
    before = time.perf_counter()
    result = decode(model, tokenizer, [{"role": "user", "content": question}],
                           max_new_tokens=max_new_tokens, **generation)
    seconds = {**seconds, "normal": time.perf_counter() - before, "total": time.perf_counter() - started}
    return SkeletonAnswer(result.text, False, reason, SKELETON_START + skeleton if skeleton else "",
                          router_accepted=accepted, router_score=score, seconds=seconds,
                          tokens={"normal": len(result.token_ids)})
