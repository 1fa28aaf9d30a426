"""Skeleton-of-Thought with a router (Ning et al. 2023, arXiv:2307.15337): the model first writes a short
numbered skeleton of its answer, then expands every point at once, as one batch through the generation loop's
batched forwards, so that the answer's latency is the skeleton's plus the longest point's rather than the whole
answer's. A router trained on the model's own features of the question (SoT-R) sends questions that do not
suit SoT (code, maths, step-by-step reasoning) to normal decoding.

    from accelgen.skeleton import SkeletonRouter, generate
    router = SkeletonRouter.load("routers/sot-qwen0.5b", model)
    answer = generate(model, tokenizer, "How can I sleep better?", router=router, max_new_tokens=256)
    answer.text, answer.points, answer.used_skeleton, answer.seconds

Lossy by design: the answer differs from normal decoding's; accelgen/skeleton/evaluation.py measures how much.
Modules: prompts (the paper's prompts, parsing), expand (the batched point expansion), pipeline (`generate`),
router (SoT-R's classifier), asking and labels (the router's labels and the judge), evaluation (the benchmark).
"""

from accelgen.skeleton.pipeline import SkeletonAnswer, generate
from accelgen.skeleton.router import RouterConfig, SkeletonRouter

__all__ = ["SkeletonAnswer", "generate", "RouterConfig", "SkeletonRouter"]
