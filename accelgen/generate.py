"""The generation loop: propose → score → verify → commit, the same for every method.

Invariant between steps: the target's KV cache holds every committed token except the last one, the *root*
of the next draft. Each step feeds the tokens the cache lacks (the whole prompt at first, then just the root)
and the draft nodes in one forward, so the root's logits predict the first draft token; plain decoding is
simply the step with an empty draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from accelgen.draft import Draft, tree_attention
from accelgen.models.runner import ModelRunner
from accelgen.registry import get_method
from accelgen.sampling import SamplingConfig, logits_to_probs
from accelgen.stopping import Output
from accelgen.verify import verify_greedy, verify_speculative_sampling


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (an EOS that ended generation included)
    text: str  # decoded new text, cut before a stop string
    finish_reason: str  # "stop" (EOS or stop string) or "length" (max_new_tokens or context limit)
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason, "stats": self.stats}


@dataclass
class Chunk:
    token_ids: list[int]  # tokens committed by one step
    text: str  # text that became final with them (may be empty while a character or stop string is pending)


class GenerationStream:
    """Iterate for Chunks as steps commit tokens; `.result` holds the GenerationResult once exhausted."""

    def __init__(self, steps: Iterator):
        self._steps = steps
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Chunk]:
        self.result = yield from self._steps


class Stats:
    def __init__(self):
        self.target_forwards = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_step: list[int] = []
        self.draft_seconds = 0.0
        self.start = time.perf_counter()

    def record(self, draft: Draft, accepted: int) -> None:
        self.target_forwards += 1
        self.draft_tokens += len(draft)
        self.accepted_tokens += accepted
        self.accepted_per_step.append(accepted)

    def as_dict(self, new_tokens: int) -> dict:
        seconds = time.perf_counter() - self.start
        return {
            "new_tokens": new_tokens,
            "target_forwards": self.target_forwards,
            "mean_accepted_tokens": new_tokens / self.target_forwards if self.target_forwards else 0.0,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "draft_tokens": self.draft_tokens,
            "accepted_draft_tokens": self.accepted_tokens,
            "accepted_per_step": self.accepted_per_step,
            "draft_seconds": self.draft_seconds,
            "seconds": seconds,
            "tokens_per_second": new_tokens / seconds if seconds > 0 else 0.0,
        }


def generate(
    model,
    tokenizer,
    prompt,
    *,
    method: str = "autoregressive",
    draft_model=None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: list[str] | str | None = None,
    stream: bool = False,
    **method_options,
) -> GenerationResult | GenerationStream:
    """Generate up to max_new_tokens after prompt with the named method.

    prompt: text, token ids (list or 1-D tensor), or chat messages [{"role": ..., "content": ...}, ...]
    (rendered with the tokenizer's chat template). Greedy when temperature is 0. Returns a GenerationResult,
    or with stream=True a GenerationStream of Chunks whose `.result` is set at the end.
    """
    spec = get_method(method)
    options = spec.check_options(method_options)
    if "draft_model" in spec.needs and draft_model is None:
        raise ValueError(f"method {method!r} needs a draft model: pass draft_model= (CLI: --draft)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    sampling = SamplingConfig(temperature, top_k, top_p)
    if not sampling.greedy and not spec.can_sample:
        raise ValueError(f"method {method!r} supports greedy decoding only (temperature 0)")
    generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
    prompt_ids = encode_prompt(tokenizer, prompt)
    target = ModelRunner(model)
    if len(prompt_ids) >= target.max_positions:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens; the model's context holds {target.max_positions}")
    make_verifier = spec.make_verifier or default_verifier
    verify = make_verifier(sampling, **options)
    drafter = spec.make_drafter(model, draft_model=draft_model, tokenizer=tokenizer, sampling=sampling,
                                generator=generator, **options)
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    output = Output(tokenizer, eos_token_ids(model, tokenizer), stop, max_new_tokens)
    steps = GenerationStream(_steps(target, drafter, verify, prompt_ids, output, generator))
    if stream:
        return steps
    for _ in steps:
        pass
    return steps.result


def default_verifier(sampling: SamplingConfig, **_options):
    """Greedy match at temperature 0, else speculative sampling (exact on chains, and on trees of i.i.d. siblings)."""
    if sampling.greedy:
        return lambda draft, target_logits, generator: verify_greedy(draft, target_logits)
    return lambda draft, target_logits, generator: verify_speculative_sampling(
        draft, logits_to_probs(target_logits, sampling), generator)


def _steps(target: ModelRunner, drafter, verify, prompt_ids: list[int], output: Output, generator):
    """The loop. Yields a Chunk per step; returns the GenerationResult."""
    stats = Stats()
    context = torch.tensor(prompt_ids, dtype=torch.long)
    while not output.done:
        # 1. propose: never draft past max_new_tokens (the step adds one token of its own) or the context
        room = min(output.max_new_tokens - len(output.token_ids), target.max_positions - len(context)) - 1
        started = time.perf_counter()
        draft = drafter.propose(context, room).truncated(max(room, 0)) if room > 0 else Draft.empty()
        stats.draft_seconds += time.perf_counter() - started
        # 2. score: the uncached tokens (ending with the root) + every draft node in one target forward
        uncached = context[target.length :]  # (p,) the prompt on the first step, afterwards the root alone
        prefix = len(context) - 1  # cache positions before the root
        tree = None if draft.is_chain else tree_attention(draft.parents, prefix=len(uncached))
        target_logits = target.forward(torch.cat([uncached, draft.tokens]), tree, logits_for_last=len(draft) + 1)
        # target_logits: (n+1, vocab), row 0 at the root, row i+1 after node i
        # 3. verify
        verdict = verify(draft, target_logits, generator)
        # 4. commit: the cache keeps the root and the accepted path; the next token becomes the new root
        target.keep(prefix, [0] + [node + 1 for node in verdict.accepted])
        drafter.update(draft, verdict, target_logits)
        stats.record(draft, len(verdict.accepted))
        committed = []
        for token in verdict.new_tokens(draft):
            committed.append(token)
            if output.add(token):
                break
        context = torch.cat([context, torch.tensor(committed, dtype=torch.long)])
        if len(context) >= target.max_positions:
            output.finish_reason = output.finish_reason or "length"
        yield Chunk(committed, output.stream_delta())
    close = getattr(drafter, "close", None)  # optional: release per-request state (e.g. a shared trie's prompt branches)
    if close is not None:
        close()
    return GenerationResult(output.token_ids, output.text, output.finish_reason, stats.as_dict(len(output.token_ids)))


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of a text, id list/tensor or chat-message prompt; an empty prompt starts from BOS if there is one."""
    if isinstance(prompt, torch.Tensor):
        ids = prompt.reshape(-1).tolist()
    elif isinstance(prompt, str):
        ids = tokenizer(prompt).input_ids if prompt else []
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
    elif isinstance(prompt, (list, tuple)):
        ids = [int(t) for t in prompt]
    else:
        raise TypeError(f"prompt must be text, token ids or chat messages, not {type(prompt).__name__}")
    if not ids:
        if tokenizer.bos_token_id is None:
            raise ValueError("empty prompt: this tokenizer has no BOS token to start from; give at least one token")
        ids = [tokenizer.bos_token_id]
    return ids


def eos_token_ids(model, tokenizer) -> set[int]:
    """EOS ids from the model's generation config and the tokenizer (chat models often have several)."""
    ids = set()
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
