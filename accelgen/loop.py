"""The generation loop: propose → score → verify → commit, the same for every method.

Invariant between steps: the target's KV cache holds every committed token except the last one, the *root*
of the next draft. Each step feeds the tokens the cache lacks (the whole prompt at first, then just the root)
and the draft nodes in one forward, so the root's logits predict the first draft token; plain decoding is
simply the step with an empty draft.

A `Sequence` holds one request's state between steps (plan → forward → commit); `generate` runs one sequence
alone, the server's engine (accelgen/server/engine.py) runs many through batched forwards.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from accelgen.draft import Draft, keep_accepted, tree_attention
from accelgen.drafters.base import BuildContext
from accelgen.drafters.budget import budgeted
from accelgen.errors import InputError
from accelgen.settings import Settings, generation_settings
from accelgen.models.batch import batched_forward, forward_alone, forward_together
from accelgen.models.engines import runner_for
from accelgen.models.runner import ModelRunner
from accelgen.registry import check_option, get_method
from accelgen.processors import build_pipeline
from accelgen.prompts import encode_prompt, eos_token_ids, prompt_rows
from accelgen.sampling import PositionNoise, SamplingConfig, sampling_scores
from accelgen.stopping import Output
from accelgen.structured import grammar_constraint
from accelgen.verify import default_verifier, verify_gumbel


# "method": drafts as long as the method's options say; "measured": capped each step at the length the measured
# costs (accelgen/costs.py) predict fastest, down to none, so that speculation never loses to plain decoding
# (drafters that already follow the measured costs, e.g. gamma_schedule="cost" or max_nodes="auto", keep theirs);
# "auto": the method's own default (`MethodSpec.draft_budget`), "method" where the request fixes the draft length
DRAFT_BUDGETS = ("auto", "method", "measured")
# options that, set in a request to other than their defaults (gamma=4, gamma_schedule="heuristic"), fix its draft
# length: draft_budget="auto" then keeps the method's lengths
FIXED_LENGTH_OPTIONS = ("gamma", "gamma_schedule")
# the types generate()'s own arguments take (float: a finite number, an int too), checked as method options are
ARGUMENT_TYPES = {"max_new_tokens": (int,), "temperature": (float,), "top_k": (int,), "top_p": (float,),
                  "seed": (int, type(None))}


@dataclass
class TokenLogprob:
    """A committed token's log-probability and the top alternatives, from the target's processed distribution at
    its position (log_softmax of `GenerationResult.scores`' row: processors applied, and when sampling also
    temperature, top-k and top-p, as transformers' output_scores)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first; tokens the processing excluded are left out

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(pair) for pair in self.top]}


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (an EOS that ended generation included)
    text: str  # decoded new text, cut before a stop string
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_new_tokens or context limit) or "abort" (cut short)
    stats: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids when requested (logprobs=k), else None
    scores: torch.Tensor | None = None  # (new_tokens, vocab) float32 processed target scores, with output_scores=True

    def to_dict(self) -> dict:
        result = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                  "stats": self.stats}
        if self.logprobs is not None:
            result["logprobs"] = [entry.to_dict() for entry in self.logprobs]
        return result


@dataclass
class Chunk:
    token_ids: list[int]  # tokens committed by one step
    text: str  # text that became final with them (may be empty while a character or stop string is pending)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids when logprobs were requested


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
    method: str | None = None,
    draft_model=None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: list[str] | str | None = None,
    stream: bool = False,
    generation_config=None,
    attention_mask=None,
    streamer=None,
    **options,
) -> GenerationResult | GenerationStream | list[GenerationResult]:
    """Generate up to max_new_tokens after prompt with the named method.

    prompt: text, token ids (list or 1-D tensor), or chat messages [{"role": ..., "content": ...}, ...]
    (rendered with the tokenizer's chat template). Or several prompts: a list of them, or a (batch, L) tensor of
    token ids with its attention_mask (left or right padding; without a mask, pad_token_id tells the padding).
    Several prompts run together through batched forwards, each row exactly as if alone, and give a list of
    GenerationResults. Greedy when temperature is 0.

    Arguments left out (None) are read as transformers reads them (accelgen/hf.py): from generation_config (a
    transformers GenerationConfig), then model.generation_config, else accelgen's defaults (128 new tokens,
    greedy, autoregressive). transformers' names work too (do_sample, max_length, eos_token_id, stop_strings,
    repetition_penalty, assistant_model = method speculative, prompt_lookup_num_tokens = method pld, ...); one
    accelgen cannot honour (num_beams=4) is an error. streamer: a transformers streamer (TextStreamer,
    TextIteratorStreamer), put the prompt and then each step's tokens. Returns a GenerationResult, or with
    stream=True a GenerationStream of Chunks whose `.result` is set at the end.
    """
    settings = generation_settings(model, generation_config, dict(
        method=method, draft_model=draft_model, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, stop=stop, **options))
    pad_token_id = settings.pad_token_id if settings.pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
    eos = set(settings.eos_token_ids) if settings.eos_token_ids is not None else eos_token_ids(model, tokenizer)
    prompts, several = prompt_rows(prompt, attention_mask, pad_token_id, eos)
    if several and (stream or streamer is not None):
        raise InputError("stream=True and streamer= take one prompt (as transformers' streamers do); "
                         "several prompts give a list of results")
    sequences = start_sequences(model, tokenizer, prompts, settings)
    if several:
        return run_together(sequences)
    steps = _steps(sequences[0])
    if streamer is not None:
        steps = fed_to(streamer, sequences[0].context, steps)
    steps = GenerationStream(steps)
    if stream:
        return steps
    for _ in steps:
        pass
    return steps.result


def start_sequences(model, tokenizer, prompts: list, settings: Settings) -> list["Sequence"]:
    """A started Sequence per prompt (all or none: a bad prompt releases those started before it)."""
    sequences = []
    try:
        for prompt in prompts:
            arguments = settings.arguments
            if settings.max_length is not None:  # transformers' limit on prompt + new tokens
                prompt = encode_prompt(tokenizer, prompt)
                arguments = {**arguments, "max_new_tokens": new_tokens_within(settings.max_length, len(prompt))}
            if settings.eos_token_ids is not None:  # eos_token_id given: exactly those end generation
                arguments = {**arguments, "eos_ids": set(settings.eos_token_ids)}
            sequence = Sequence.start(model, tokenizer, prompt, **arguments)
            sequences.append(sequence)
    except BaseException:
        for sequence in sequences:
            sequence.finish()
        raise
    return sequences


def new_tokens_within(max_length: int, prompt_tokens: int) -> int:
    check_option("max_length", max_length, (int,))
    if max_length < prompt_tokens:
        raise InputError(f"max_length={max_length} (prompt + new tokens) is shorter than the {prompt_tokens}-token "
                         "prompt: pass max_new_tokens")
    return max_length - prompt_tokens


def run_together(sequences: list["Sequence"]) -> list[GenerationResult]:
    """Step several sequences together as the server's engine does: their draft models in lockstep
    (forward_together), one batched target forward, then each verifies and commits alone, on its own KV cache,
    so that each decodes exactly as it would alone. Returns their results in order."""
    try:
        while active := [sequence for sequence in sequences if not sequence.done]:
            steps = forward_together([sequence.planning() for sequence in active])
            failed = next((step for step in steps if isinstance(step, Exception)), None)
            if failed is not None:
                raise failed
            logits = batched_forward([sequence.target for sequence in active],
                                     [step.forward_args for step in steps])
            for sequence, step, rows in zip(active, steps, logits):
                sequence.commit(step, rows)
    finally:
        results = [sequence.finish() for sequence in sequences]  # (also releases them when a step failed)
    return results


def fed_to(streamer, prompt_ids: torch.Tensor, steps):
    """The steps, each one's tokens also put to a transformers streamer: first the prompt_ids (n,) as a (1, n)
    batch, as transformers does (TextStreamer(skip_prompt=True) skips it), and end() when done or abandoned."""
    streamer.put(prompt_ids[None])
    try:
        while True:
            try:
                chunk = next(steps)
            except StopIteration as done:
                return done.value
            if chunk.token_ids:
                streamer.put(torch.tensor(chunk.token_ids))
            yield chunk
    finally:
        streamer.end()


def _steps(sequence: "Sequence"):
    """The loop for one sequence. Yields a Chunk per step; returns the GenerationResult."""
    while not sequence.done:
        step = sequence.plan()
        target_logits = sequence.target.forward(*step.forward_args)
        yield sequence.commit(step, target_logits)
    return sequence.finish()


@dataclass
class Step:
    """What one sequence feeds the target in one step: its uncached tokens (ending with the root) + the draft."""

    input_ids: torch.Tensor  # (m,) long
    draft: Draft
    tree: torch.Tensor | None  # (m, m) bool attention pattern when the draft is a tree, None for a chain
    logits_for_last: int  # rows of logits needed: the root and every draft node (and the appended embeddings)
    prefill_only: bool = False  # a chunk of a long prompt, before the root: nothing to verify or commit
    # (a, d) embeddings fed after the draft (`Drafter.drafts_in_verify`: BiTA, SPACE), tree then (m + a, m + a)
    appended: torch.Tensor | None = None

    @property
    def forward_args(self) -> tuple:
        """ModelRunner.forward's arguments for this step (the appended embeddings only where there are some)."""
        plain = (self.input_ids, self.tree, self.logits_for_last)
        return plain if self.appended is None else (*plain, self.appended)


class Sequence:
    """One request between steps: its committed context, KV cache (in `target`), drafter, verifier and output.

    A step is `plan` (propose a draft), a target forward over `Step.input_ids` (alone, or batched with other
    sequences by the server), then `commit` (verify, roll the cache back to the accepted path, emit tokens).
    """

    # given a seed: its draft lengths follow no clock, and the server runs its forwards as if it were alone
    # (server/engine.py), so that its tokens do not depend on timings or on other requests
    seeded = False

    def __init__(self, target: ModelRunner, drafter, verify, prompt_ids: list[int], output: Output, generator, *,
                 sampling: SamplingConfig | None = None, per_position: bool = False, logprobs: int | None = None,
                 output_scores: bool = False):
        """sampling: its processors process every target row before verification; per_position: verify with
        sampling.noise (seeded lossless sampling, verify_gumbel) instead of `verify`; logprobs / output_scores:
        record, per committed token, its log-probability and top alternatives / its processed scores."""
        self.target = target
        self.drafter = drafter
        self.verify = verify
        self.output = output
        self.generator = generator
        self._tokens = torch.tensor(prompt_ids, dtype=torch.long)  # (capacity,) the context, then room to grow
        self._length = len(prompt_ids)
        self.prompt_tokens = len(prompt_ids)
        self.stats = Stats()
        self.sampling = sampling or SamplingConfig()
        self.per_position = per_position
        self.top_logprobs = logprobs
        self.output_scores = output_scores
        self.token_logprobs: list[TokenLogprob] = []
        self.scores: list[torch.Tensor] = []  # (tokens of a step, vocab) each

    @classmethod
    def start(cls, model, tokenizer, prompt, *, method: str = "autoregressive", draft_model=None,
              max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
              seed: int | None = None, stop: list[str] | str | None = None, repetition_penalty: float = 1.0,
              presence_penalty: float = 0.0, frequency_penalty: float = 0.0, no_repeat_ngram_size: int = 0,
              min_new_tokens: int = 0, bad_words_ids: list[list[int]] | None = None,
              logits_processors: list | None = None, logprobs: int | None = None, output_scores: bool = False,
              response_format: dict | None = None, eos_ids: set[int] | None = None, cache: str = "auto",
              compile: bool | str = "auto", **method_options) -> "Sequence":
        """Check the request and build its sequence (arguments as `generate`); raises ValueError on bad input.

        Processing (docs/sampling-and-constraints.md): repetition_penalty, no_repeat_ngram_size, min_new_tokens
        (EOS banned before) and bad_words_ids as transformers applies them; presence_penalty / frequency_penalty
        as OpenAI's (over generated tokens); logits_processors: callables (context_ids (n,) long, logits (vocab,)
        float32) -> logits; response_format: OpenAI's {"type": "text" | "json_object" | "json_schema", ...}.
        logprobs=k records each committed token's log-probability and top k alternatives; output_scores=True
        the processed scores. With a seed, lossless methods sample per position (verify_gumbel).
        eos_ids: the tokens that end generation (None: the model's and the tokenizer's, `eos_token_ids`);
        min_new_tokens bans them and the grammar of response_format ends with them. cache: the target's KV cache,
        "auto" (static with CUDA graphs on a GPU, else dynamic), "static" or "dynamic" (models/engines.py);
        compile: the static cache's forwards through torch.compile, "auto" (on a GPU), True or False."""
        spec = get_method(method)
        draft_budget = chosen_draft_budget(spec, method_options.pop("draft_budget", "auto"), method_options)
        options = spec.check_options(method_options)
        spec.check_needs(draft_model=draft_model)
        drafting, verifying, running = spec.split_options(options)
        sampling = checked_sampling(spec, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                    top_p=top_p, seed=seed)
        check_recording(logprobs, output_scores)
        stop = stop_strings(stop)
        generator = seeded_generator(model, seed)
        prompt_ids = encode_prompt(tokenizer, prompt)
        target = target_runner(spec, model, running, cache, compile)
        check_prompt(prompt_ids, target)
        eos = set(eos_ids) if eos_ids is not None else eos_token_ids(model, tokenizer)
        constraint = grammar_constraint(response_format, tokenizer, target.vocab_size, eos, len(prompt_ids))
        processors = build_pipeline(
            prompt_length=len(prompt_ids), eos_token_ids=eos, vocab_size=target.vocab_size,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
            min_new_tokens=min_new_tokens, bad_words_ids=bad_words_ids, logits_processors=logits_processors,
            constraint=constraint)
        noise = position_noise(spec, sampling, seed, target.vocab_size)
        per_position = noise is not None
        sampling = dataclasses.replace(sampling, processors=processors, noise=noise)
        verify = spec.verifier.make(sampling, verifying) if spec.verifier else default_verifier(sampling)
        build = BuildContext(model, target, draft_model, tokenizer, sampling, generator)
        drafter = method_drafter(spec, build, drafting, draft_budget)
        if seed is not None and drafter.draft_budget is not None:
            drafter.draft_budget.learn_cost = False  # the drafting cost stays as measured once, not as timed now
        output = Output(tokenizer, eos, stop, max_new_tokens)
        sequence = cls(target, drafter, verify, prompt_ids, output, generator, sampling=sampling,
                       per_position=per_position, logprobs=logprobs, output_scores=output_scores)
        sequence.seeded = seed is not None
        return sequence

    @property
    def done(self) -> bool:
        return self.output.done

    @property
    def context(self) -> torch.Tensor:
        """(L,) long: the prompt and every committed token. A view: the tokens it shows never change."""
        return self._tokens[: self._length]

    def _extend_context(self, tokens: list[int]) -> None:
        """Append committed tokens; the buffer doubles when full, so a step costs its own tokens, not the context."""
        end = self._length + len(tokens)
        if end > len(self._tokens):
            grown = torch.empty(max(end, 2 * len(self._tokens)), dtype=torch.long)
            grown[: self._length] = self.context
            self._tokens = grown
        self._tokens[self._length : end] = torch.tensor(tokens, dtype=torch.long)
        self._length = end

    @property
    def drafts_with_a_model(self) -> bool:
        """Whether its drafts take model forwards that a server can batch (drafters offering `draft_steps`)."""
        return self.drafter.batches_draft_forwards

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
            if self.drafter.drafts_with_target:
                draft = draft_with_target(self.target, self.drafter, self.context, room)
            elif self.drafter.batches_draft_forwards:
                draft = yield from self.drafter.draft_steps(self.context, room)
            else:
                draft = self.drafter.propose(self.context, room)
            draft = draft.truncated(room)
        self.stats.draft_seconds += time.perf_counter() - started
        uncached = self.context[self.target.length :]  # the drafting forward (PaSS) may have cached the prompt
        tree = None if draft.is_chain else tree_attention(draft.parents, prefix=len(uncached))
        # a draft model's tokens may stay on its device: the host's part joins them there, without a read
        input_ids = torch.cat([uncached.to(draft.tokens.device, non_blocking=True), draft.tokens])
        # BiTA / SPACE: mask embeddings after the draft's nodes, read for the next draft (none when no step follows)
        if room > 0 and self.drafter.drafts_in_verify \
                and len(self.context) + len(draft) + self.drafter.mask_depth < self.target.max_positions:
            appended, tree = self.drafter.mask_inputs(draft, prefix=len(uncached))
            return Step(input_ids, draft, tree, len(draft) + 1 + len(appended), appended=appended)
        return Step(input_ids, draft, tree, logits_for_last=len(draft) + 1)

    def commit(self, step: Step, target_logits: torch.Tensor) -> Chunk:
        """Verify the step's draft against target_logits (logits_for_last, vocab): row 0 at the root, row i+1
        after node i. The cache keeps the root and the accepted path; the next token becomes the new root."""
        if step.prefill_only:
            return Chunk([], "")
        draft = step.draft
        mask_rows = target_logits[len(draft) + 1 :]  # (a, vocab): the appended embeddings' rows, if any
        target_logits = target_logits[: len(draft) + 1]
        scores = self.processed(draft, target_logits)
        if self.per_position:
            verdict = verify_gumbel(draft, scores, self.sampling, first_position=len(self.context))
        else:
            verdict = self.verify(draft, scores, self.generator)
        keep_accepted(self.target, len(self.context) - 1, verdict)
        self.drafter.update(draft, verdict, target_logits)  # the model's own logits: drafters learn the model
        if self.drafter.drafts_in_verify:
            self.drafter.read_masks(draft, verdict, mask_rows)
        self.stats.record(draft, len(verdict.accepted))
        committed = []
        for token in verdict.new_tokens(draft):
            committed.append(token)
            if self.output.add(token):
                break
        logprobs = self.record(scores, verdict.kept_rows(), committed)  # the row that chose each committed token
        self._extend_context(committed)
        if len(self.context) >= self.target.max_positions:
            self.output.finish_reason = self.output.finish_reason or "length"
        return Chunk(committed, self.output.stream_delta(), logprobs)

    def processed(self, draft: Draft, target_logits: torch.Tensor) -> torch.Tensor:
        """target_logits (n+1, vocab) after the request's processors, each row with its own tree path's context
        (the logits themselves when there are none: no per-row work on the plain path)."""
        processors = self.sampling.processors
        return target_logits if processors is None else processors.tree_rows(self.context, draft, target_logits)

    def record(self, scores: torch.Tensor, rows: list[int], tokens: list[int]) -> list[TokenLogprob] | None:
        """Keep what was asked of the committed tokens, from the rows that chose them (rows[i] of the step's
        (n+1, vocab) processed logits for tokens[i]; rows may run past a stop)."""
        if self.top_logprobs is None and not self.output_scores:
            return None
        scores = sampling_scores(scores[rows[: len(tokens)]], self.sampling)
        if self.output_scores:
            self.scores.append(scores)
        if self.top_logprobs is None:
            return None
        entries = token_logprobs(scores, tokens, self.top_logprobs)
        self.token_logprobs.extend(entries)
        return entries

    def finish(self) -> GenerationResult:
        """Release per-request drafter state and return the result (also for a sequence cut short)."""
        self.drafter.close()  # e.g. a shared trie's prompt branches
        self.target.close()  # e.g. a static cache's slot, for the next sequence
        output = self.output
        stats = self.stats.as_dict(len(output.token_ids))
        stats.update(self.target.describe())  # early exit: the layers decoding went through
        choice = self.drafter.describe()  # what a policy (`auto`) chose, and why
        if choice is not None:
            stats["choice"] = choice
        logprobs = self.token_logprobs if self.top_logprobs is not None else None
        scores = None
        if self.output_scores:
            scores = torch.cat(self.scores) if self.scores else torch.empty(0, self.target.vocab_size)
        return GenerationResult(output.token_ids, output.text, output.finish_reason or "abort", stats, logprobs, scores)


def chosen_draft_budget(spec, draft_budget: str, request_options: dict) -> str:
    """The draft budget the request runs with, "method" or "measured" (DRAFT_BUDGETS): "auto" is the method's
    default, unless the request's options fix the draft length (FIXED_LENGTH_OPTIONS set to other than their
    defaults: gamma=4 rather than "auto"), which it then keeps."""
    if draft_budget not in DRAFT_BUDGETS:
        raise InputError(f"unknown draft_budget {draft_budget!r}; choose one of {', '.join(DRAFT_BUDGETS)}")
    if draft_budget != "auto":
        return draft_budget
    defaults = spec.options
    fixed = any(name in defaults and request_options.get(name, defaults[name]) != defaults[name]
                for name in FIXED_LENGTH_OPTIONS)
    return "method" if fixed else spec.draft_budget


def checked_sampling(spec, **arguments) -> SamplingConfig:
    """The request's sampling settings, each of generate()'s own arguments checked (ARGUMENT_TYPES)."""
    for name, value in arguments.items():
        check_option(name, value, ARGUMENT_TYPES[name])
    if arguments["max_new_tokens"] < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {arguments['max_new_tokens']}")
    sampling = SamplingConfig(arguments["temperature"], arguments["top_k"], arguments["top_p"])
    if not sampling.greedy and not spec.can_sample:
        raise InputError(f"method {spec.name!r} supports greedy decoding only (temperature 0)")
    return sampling


def position_noise(spec, sampling: SamplingConfig, seed: int | None, vocab_size: int) -> PositionNoise | None:
    """Seeded sampling with a lossless method samples per position (verify_gumbel), so that the tokens do not
    depend on the drafts; None otherwise."""
    per_position = seed is not None and not sampling.greedy and spec.lossless == "distribution-exact"
    return PositionNoise(seed, vocab_size) if per_position else None


def check_recording(logprobs, output_scores) -> None:
    """What a request may ask recorded per committed token: logprobs None or k >= 0, output_scores a bool."""
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise InputError(f"logprobs must be None or an integer >= 0 (how many top alternatives), got {logprobs!r}")
    if not isinstance(output_scores, bool):
        raise InputError(f"output_scores must be true or false, got {output_scores!r}")


def stop_strings(stop) -> list[str]:
    """stop as a list of strings (one string, a list of them, or None)."""
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(text, str) for text in stop):
        raise InputError(f"stop must be a string or a list of strings, got {stop!r}")
    return stop


def seeded_generator(model, seed: int | None) -> torch.Generator:
    """A generator on the model's device (torch refuses a CPU generator for CUDA probabilities), seeded with
    `seed` (None: a fresh random seed)."""
    generator = torch.Generator(getattr(model, "device", "cpu"))
    generator.manual_seed(seed if seed is not None else torch.seed())
    return generator


def target_runner(spec, model, running, cache: str, compile: bool | str = "auto") -> ModelRunner:
    """The runner holding the target's KV cache: the method's own (early exits), else the engine's for `cache`
    and `compile`."""
    if spec.runner and not isinstance(model, torch.nn.Module):
        raise InputError(f"method {spec.name!r} runs the model's layers itself and needs a PyTorch model; load it "
                         "in a PyTorch format (weights=bf16, int8, int4 or fp32), not with the llama.cpp engine")
    if spec.runner and cache == "static":
        raise InputError(f"method {spec.name!r} keeps the KV cache its own way; it cannot take cache='static'")
    if spec.runner and compile is True:
        raise InputError(f"method {spec.name!r} runs the model's layers itself; it cannot take compile=True")
    target = spec.runner.make(model, running) if spec.runner else runner_for(model, cache, compile)
    target.keep_hidden = spec.reads_target_hidden
    return target


def check_prompt(prompt_ids: list[int], target: ModelRunner) -> None:
    """A prompt the target can read: shorter than its context, every token id in its vocabulary."""
    if len(prompt_ids) >= target.max_positions:
        raise InputError(f"prompt has {len(prompt_ids)} tokens; the model's context holds {target.max_positions}")
    outside = [token for token in prompt_ids if not 0 <= token < target.vocab_size]
    if outside:
        raise InputError(f"prompt token id {outside[0]} is outside the model's vocabulary (0..{target.vocab_size - 1})")


def method_drafter(spec, build: BuildContext, drafting, draft_budget: str):
    """The method's drafter, capped each step by the measured costs where draft_budget is "measured" and it does
    not follow them already. (A drafter that drafts with the target, or within its verifying forward, pays a target
    forward whatever its length: no budget applies.)"""
    drafter = spec.drafter.make(build, drafting)
    if draft_budget == "measured" and drafter.draft_budget is None and not drafter.drafts_with_target \
            and not drafter.drafts_in_verify:
        drafter = budgeted(drafter, build.target_model, build.draft_model if spec.needs_draft_model else None)
    return drafter


@torch.inference_mode()
def draft_with_target(target: ModelRunner, drafter, context: torch.Tensor, max_nodes: int) -> Draft:
    """The draft of a drafter that drafts with the target (`Drafter.drafts_with_target`, PaSS): one target forward
    over the tokens its cache lacks (the root, on the first step the prompt too) and the drafter's look-ahead
    embeddings, whose rows the drafter reads. The cache then keeps what comes before the root (the prompt is read
    once); the step's own forward reads the root again. context: (L,) long, prompt + committed tokens."""
    cached = target.length
    uncached = context[cached:]  # (u,)
    appended = drafter.lookahead(max_nodes)  # (k, d)
    logits = target.forward(uncached, logits_for_last=1 + len(appended), appended=appended)  # (1 + k, vocab)
    target.keep(cached, list(range(len(uncached) - 1)))
    return drafter.draft_from(logits)


def token_logprobs(scores: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """scores (c, vocab) float32, the committed tokens (c) -> their TokenLogprobs with the top `top` alternatives
    (alternatives the processing excluded, at -inf, left out)."""
    logprobs = torch.log_softmax(scores, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    best = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
    entries = []
    for token, logprob, values, ids in zip(tokens, chosen, best.values.tolist(), best.indices.tolist()):
        alternatives = [(i, value) for i, value in zip(ids, values) if value != float("-inf")]
        entries.append(TokenLogprob(token, logprob, alternatives))
    return entries
