"""The generation loop: propose → score → verify → commit, the same for every method.

Invariant between steps: the target's KV cache holds every committed token except the last one, the *root*
of the next draft. Each step feeds the tokens the cache lacks (the whole prompt at first, then just the root)
and the draft nodes in one forward, so the root's logits predict the first draft token; plain decoding is
simply the step with an empty draft.

A `Sequence` holds one request's state between steps (plan → forward → commit); `generate` runs one sequence
alone, the server's engine (accelgen/server/engine.py) runs many through batched forwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from accelgen.costs import budgeted
from accelgen.draft import Draft, tree_attention
from accelgen.models.batch import forward_alone
from accelgen.models.runner import ModelRunner, runner_for
from accelgen.registry import check_option, get_method
from accelgen.sampling import SamplingConfig, logits_to_probs
from accelgen.stopping import Output
from accelgen.verify import verify_greedy, verify_speculative_sampling


# "method": drafts as long as the method's options say; "measured": capped each step at the length the measured
# costs (accelgen/costs.py) predict fastest, down to none, so that speculation never loses to plain decoding
# (drafters that already follow the measured costs, e.g. gamma_schedule="cost" or max_nodes="auto", keep theirs)
DRAFT_BUDGETS = ("method", "measured")
# the types generate()'s own arguments take (float: a finite number, an int too), checked as method options are
ARGUMENT_TYPES = {"max_new_tokens": (int,), "temperature": (float,), "top_k": (int,), "top_p": (float,),
                  "seed": (int, type(None))}
ONE_PROMPT = ("generate() runs one prompt; batched prompts are not supported: call it once per prompt, or serve "
              "them with `accelgen serve`, whose engine batches concurrent requests")


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (an EOS that ended generation included)
    text: str  # decoded new text, cut before a stop string
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_new_tokens or context limit) or "abort" (cut short)
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
    sequence = Sequence.start(model, tokenizer, prompt, method=method, draft_model=draft_model,
                              max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=seed, stop=stop, **method_options)
    steps = GenerationStream(_steps(sequence))
    if stream:
        return steps
    for _ in steps:
        pass
    return steps.result


def _steps(sequence: "Sequence"):
    """The loop for one sequence. Yields a Chunk per step; returns the GenerationResult."""
    while not sequence.done:
        step = sequence.plan()
        target_logits = sequence.target.forward(step.input_ids, step.tree, step.logits_for_last)
        yield sequence.commit(step, target_logits)
    return sequence.finish()


def default_verifier(sampling: SamplingConfig, **_options):
    """Greedy match at temperature 0, else speculative sampling (exact on chains, and on trees of i.i.d. siblings)."""
    if sampling.greedy:
        return lambda draft, target_logits, generator: verify_greedy(draft, target_logits)
    return lambda draft, target_logits, generator: verify_speculative_sampling(
        draft, logits_to_probs(target_logits, sampling), generator)


@dataclass
class Step:
    """What one sequence feeds the target in one step: its uncached tokens (ending with the root) + the draft."""

    input_ids: torch.Tensor  # (m,) long
    draft: Draft
    tree: torch.Tensor | None  # (m, m) bool attention pattern when the draft is a tree, None for a chain
    logits_for_last: int  # rows of logits needed: the root and every draft node
    prefill_only: bool = False  # a chunk of a long prompt, before the root: nothing to verify or commit


class Sequence:
    """One request between steps: its committed context, KV cache (in `target`), drafter, verifier and output.

    A step is `plan` (propose a draft), a target forward over `Step.input_ids` (alone, or batched with other
    sequences by the server), then `commit` (verify, roll the cache back to the accepted path, emit tokens).
    """

    def __init__(self, target: ModelRunner, drafter, verify, prompt_ids: list[int], output: Output, generator):
        self.target = target
        self.drafter = drafter
        self.verify = verify
        self.output = output
        self.generator = generator
        self.context = torch.tensor(prompt_ids, dtype=torch.long)
        self.prompt_tokens = len(prompt_ids)
        self.stats = Stats()

    @classmethod
    def start(cls, model, tokenizer, prompt, *, method: str = "autoregressive", draft_model=None,
              max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
              seed: int | None = None, stop: list[str] | str | None = None, **method_options) -> "Sequence":
        """Check the request and build its sequence (arguments as `generate`); raises ValueError on bad input."""
        spec = get_method(method)
        draft_budget = method_options.pop("draft_budget", "method")
        if draft_budget not in DRAFT_BUDGETS:
            raise ValueError(f"unknown draft_budget {draft_budget!r}; choose one of {', '.join(DRAFT_BUDGETS)}")
        options = spec.check_options(method_options)
        if "draft_model" in spec.needs and draft_model is None:
            raise ValueError(f"method {method!r} needs a draft model: pass draft_model= (CLI: --draft)")
        arguments = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        for name, value in arguments.items():
            check_option(name, value, ARGUMENT_TYPES[name])
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        sampling = SamplingConfig(temperature, top_k, top_p)
        if not sampling.greedy and not spec.can_sample:
            raise ValueError(f"method {method!r} supports greedy decoding only (temperature 0)")
        generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
        prompt_ids = encode_prompt(tokenizer, prompt)
        if spec.make_runner and not isinstance(model, torch.nn.Module):
            raise ValueError(f"method {method!r} runs the model's layers itself and needs a PyTorch model; load it "
                             "in a PyTorch format (weights=bf16, int8, int4 or fp32), not with the llama.cpp engine")
        target = spec.make_runner(model, **options) if spec.make_runner else runner_for(model)
        if len(prompt_ids) >= target.max_positions:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the model's context holds {target.max_positions}")
        outside = [token for token in prompt_ids if not 0 <= token < target.vocab_size]
        if outside:
            raise ValueError(f"prompt token id {outside[0]} is outside the model's vocabulary (0..{target.vocab_size - 1})")
        make_verifier = spec.make_verifier or default_verifier
        verify = make_verifier(sampling, **options)
        drafter = spec.make_drafter(model, draft_model=draft_model, tokenizer=tokenizer, sampling=sampling,
                                    generator=generator, **options)
        if draft_budget == "measured" and getattr(drafter, "draft_budget", None) is None:
            drafter = budgeted(drafter, model, draft_model if "draft_model" in spec.needs else None)
        attach = getattr(drafter, "attach", None)  # drafters that read the target's KV cache (`triforce`)
        if attach is not None:
            attach(target)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(text, str) for text in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        output = Output(tokenizer, eos_token_ids(model, tokenizer), stop, max_new_tokens)
        return cls(target, drafter, verify, prompt_ids, output, generator)

    @property
    def done(self) -> bool:
        return self.output.done

    @property
    def drafts_with_a_model(self) -> bool:
        """Whether its drafts take model forwards that a server can batch (drafters offering `draft_steps`)."""
        return hasattr(self.drafter, "draft_steps")

    @property
    def uncached(self) -> int:
        """Committed tokens missing from the KV cache: the root, and before the first step the whole prompt."""
        return len(self.context) - self.target.length

    def plan(self, max_draft: int | None = None, prefill_limit: int = 0) -> Step:
        """Propose this step's draft (at most max_draft nodes). With prefill_limit > 0, a longer prompt is fed
        that many tokens per step first, so that it does not stall the other sequences of a batch."""
        return forward_alone(self.planning(max_draft, prefill_limit))

    def planning(self, max_draft: int | None = None, prefill_limit: int = 0):
        """plan() as a generator of the drafter's model forwards, for drafters that offer `draft_steps`
        (see DraftModelDrafter): the server runs the drafts of a whole batch together (forward_together)."""
        uncached = self.context[self.target.length :]  # (p,) the prompt on the first step, afterwards the root alone
        if 0 < prefill_limit < len(uncached):
            return Step(uncached[:prefill_limit], Draft.empty(), None, logits_for_last=1, prefill_only=True)
        # never draft past max_new_tokens (the step adds one token of its own) or the context
        room = min(self.output.max_new_tokens - len(self.output.token_ids), self.target.max_positions - len(self.context)) - 1
        if max_draft is not None:
            room = min(room, max_draft)
        started = time.perf_counter()
        draft = Draft.empty()
        if room > 0:
            draft_steps = getattr(self.drafter, "draft_steps", None)
            if draft_steps is not None:
                draft = yield from draft_steps(self.context, room)
            else:
                draft = self.drafter.propose(self.context, room)
            draft = draft.truncated(room)
        self.stats.draft_seconds += time.perf_counter() - started
        uncached = self.context[self.target.length :]  # a drafter that runs the target itself (PaSS) may cache some
        tree = None if draft.is_chain else tree_attention(draft.parents, prefix=len(uncached))
        return Step(torch.cat([uncached, draft.tokens]), draft, tree, logits_for_last=len(draft) + 1)

    def commit(self, step: Step, target_logits: torch.Tensor) -> Chunk:
        """Verify the step's draft against target_logits (logits_for_last, vocab): row 0 at the root, row i+1
        after node i. The cache keeps the root and the accepted path; the next token becomes the new root."""
        if step.prefill_only:
            return Chunk([], "")
        draft = step.draft
        verdict = self.verify(draft, target_logits, self.generator)
        prefix = len(self.context) - 1  # cache positions before the root
        self.target.keep(prefix, [0] + [node + 1 for node in verdict.accepted])
        self.drafter.update(draft, verdict, target_logits)
        self.stats.record(draft, len(verdict.accepted))
        committed = []
        for token in verdict.new_tokens(draft):
            committed.append(token)
            if self.output.add(token):
                break
        self.context = torch.cat([self.context, torch.tensor(committed, dtype=torch.long)])
        if len(self.context) >= self.target.max_positions:
            self.output.finish_reason = self.output.finish_reason or "length"
        return Chunk(committed, self.output.stream_delta())

    def finish(self) -> GenerationResult:
        """Release per-request drafter state and return the result (also for a sequence cut short)."""
        close = getattr(self.drafter, "close", None)  # e.g. a shared trie's prompt branches
        if close is not None:
            close()
        output = self.output
        stats = self.stats.as_dict(len(output.token_ids))
        exits = getattr(self.target, "describe", None)  # early exit: the layers decoding went through
        if exits is not None:
            stats.update(exits())
        describe = getattr(self.drafter, "describe", None)  # optional: what a policy (`auto`) chose, and why
        if describe is not None:
            stats["choice"] = describe()
        return GenerationResult(output.token_ids, output.text, output.finish_reason or "abort", stats)


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of a text, id list/tensor or chat-message prompt; an empty prompt starts from BOS if there is one.
    Ids are never coerced: floats and bools are refused, not truncated, and so are several prompts at once."""
    if isinstance(prompt, torch.Tensor):
        ids = tensor_token_ids(prompt)
    elif isinstance(prompt, str):
        ids = tokenizer(prompt).input_ids if prompt else []
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
    elif isinstance(prompt, (list, tuple)):
        try:  # a list of token ids, as Python, numpy or 0-d tensor integers; torch refuses ragged or text items
            tensor = torch.tensor(prompt, dtype=None if prompt else torch.long)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"prompt must be one text, one list of token ids or one list of chat messages; "
                             f"{ONE_PROMPT}") from None
        if any(isinstance(token, bool) for token in prompt):
            raise ValueError("prompt token ids must be integers, not bools")
        ids = tensor_token_ids(tensor)
    else:
        raise TypeError(f"prompt must be text, token ids or chat messages, not {type(prompt).__name__}")
    if not ids:
        if tokenizer.bos_token_id is None:
            raise ValueError("empty prompt: this tokenizer has no BOS token to start from; give at least one token")
        ids = [tokenizer.bos_token_id]
    return ids


def tensor_token_ids(prompt: torch.Tensor) -> list[int]:
    """The ids of one prompt as a (L,) or (1, L) integer tensor (as a tokenizer returns it)."""
    if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
        raise ValueError(f"prompt token ids must be integers, got {prompt.dtype} values")
    if prompt.dim() == 2 and len(prompt) == 1:
        prompt = prompt[0]
    if prompt.dim() != 1:
        raise ValueError(f"prompt token ids have shape {tuple(prompt.shape)}, not (L,) or (1, L): {ONE_PROMPT}")
    return prompt.tolist()


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
