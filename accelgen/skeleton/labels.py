"""The labels SoT's router learns (Ning et al. 2023, arXiv:2307.15337, section 4.1, the prompting router): a
larger model asked, for each question, whether its answer is a list of points that can be written independently,
its answer calibrated against its answer to content-free questions (asking.py). Asking costs a forward of the
larger model per question, so the answers are cached in a JSON file, keyed by the question's text, with the
labeller's content-free answer and the seconds spent asking; a rerun asks only what it has not asked yet.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

from accelgen.atomic import read_checked, write_json_atomically
from accelgen.errors import InputError
from accelgen.skeleton.asking import calibrated_label, content_free_bias, router_probabilities
from accelgen.skeleton.prompts import ROUTER_PROMPT

SAVE_EVERY = 8  # questions labelled between two writes of the cache


def question_key(question: str) -> str:
    return hashlib.sha1(question.encode("utf-8")).hexdigest()[:16]


def prompt_key() -> str:
    """A short hash of the router prompt: labels asked with another prompt are other labels."""
    return hashlib.sha1(ROUTER_PROMPT.encode("utf-8")).hexdigest()[:12]


def read_label_cache(path: Path, labeller: str) -> dict:
    """The cache of this labeller and prompt: {"answers": {question key: {"probabilities"}}, "bias" (the
    content-free answer, None until asked), "seconds"}, empty if none yet; a clear error for a cache made by another
    labeller or prompt."""
    if not path.exists():
        return {"answers": {}, "bias": None, "seconds": 0.0}
    fix = "delete it to label again"
    content = read_checked(path, lambda file: json.loads(file.read_text(encoding="utf-8")), fix)
    if content.get("labeller") != labeller or content.get("prompt") != prompt_key():
        raise InputError(f"{path} holds labels by {content.get('labeller')!r} with router prompt "
                         f"{content.get('prompt')!r}, not by {labeller!r} with {prompt_key()!r}: pass another cache "
                         f"file or {fix}")
    return {"answers": content["answers"], "bias": content.get("bias"), "seconds": content.get("seconds", 0.0)}


def cached_labels(model, tokenizer, questions: list[str], path, labeller: str,
                  progress: Callable[[int], None] | None = None) -> list[int]:
    """Each question's label (1: suits SoT), from the answers of `model` (named `labeller`), asked where the cache
    at `path` lacks them; the cache is written atomically every SAVE_EVERY new answers and at the end.
    progress(questions done)."""
    path = Path(path)
    cache = read_label_cache(path, labeller)
    answers, fresh, started = cache["answers"], 0, time.perf_counter()
    if cache["bias"] is None:
        cache["bias"], fresh = content_free_bias(model, tokenizer), 1
    for done, question in enumerate(questions, start=1):
        key = question_key(question)
        if key not in answers:
            answers[key] = {"probabilities": router_probabilities(model, tokenizer, question)}
            fresh += 1
            if fresh % SAVE_EVERY == 0:
                write_label_cache(path, labeller, cache, time.perf_counter() - started)
        if progress is not None:
            progress(done)
    if fresh:
        write_label_cache(path, labeller, cache, time.perf_counter() - started)
    return [calibrated_label(answers[question_key(question)]["probabilities"], cache["bias"]) for question in questions]


def write_label_cache(path: Path, labeller: str, cache: dict, seconds: float) -> None:
    """The cache, with the seconds spent asking: those of earlier runs plus this run's so far."""
    write_json_atomically(path, {"labeller": labeller, "prompt": prompt_key(), "bias": cache["bias"],
                                 "seconds": cache["seconds"] + seconds, "answers": cache["answers"]})
