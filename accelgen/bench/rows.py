"""What the benchmark runs: Hugging Face's own generate() variants (the baseline and its peers) and every
registered accelgen method, each timed the same way on the same pre-tokenized prompt.

One run returns a record: the new tokens, the wall time around the call, and what can honestly be said about
its target forwards. For accelgen methods that is the loop's own stats; for HF's generate() a forward
pre-hook on the target counts its forwards and reads the KV-cache length at each one, from which the tokens
committed per forward follow (HF keeps the same invariant as accelgen: every committed token is cached except
the newest). On a GPU every clock is read after the device has finished its queued work (hardware.synchronize).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field

import torch
from transformers import CompileConfig

from accelgen.hardware import synchronize, timed
from accelgen.bench.llamacpp import OPTIONS as LLAMACPP_OPTIONS
from accelgen.bench.llamacpp import PEERS as LLAMACPP_PEERS
from accelgen.bench.llamacpp import LlamaCppPeers
from accelgen.bench.records import generation_record
from accelgen.errors import InputError
from accelgen.prompts import eos_token_ids
from accelgen.models.loading import check_weights
from accelgen.method_options import base_method, parse_variant
from accelgen.loop import generate
from accelgen.registry import LOOP_OPTIONS, list_methods, merge_options

BASELINE = "hf-greedy"
# Needs every benchmark prompt meets by itself: `llma` copies from reference documents, and with none given
# the prompt is the reference (as in retrieval-augmented generation, where the documents are in the prompt).
PROMPT_RESOURCES = {"references"}
LOSSLESS = ("greedy-exact", "distribution-exact")


@dataclass(frozen=True)
class BenchMethod:
    name: str
    source: str  # "hf" (a transformers generate() variant) or "accelgen" (a registered method)
    family: str
    lossless: str  # a key of accelgen.registry.LOSSLESS_CLASSES
    needs: tuple[str, ...] = ()
    options: dict = field(default_factory=dict)  # option name -> default value
    summary: str = ""
    can_sample: bool = True
    draft: str | None = None  # a draft model of this row's own (variant option draft=PATH), instead of --draft
    weights: str | None = None  # the target in a weight format of this row's own (variant option weights=FORMAT)
    draft_weights: str | None = None  # the draft's format for this row (variant option draft_weights=FORMAT)
    fixed: tuple[str, ...] = ()  # options a variant's name sets: -o for the base method does not override them

    @property
    def registered_name(self) -> str:
        """The method this row runs: its name without a variant's options."""
        return base_method(self.name)

    @property
    def claims_lossless(self) -> bool:
        return self.lossless in LOSSLESS

    def check_options(self, options: dict) -> dict:
        if self.source != "accelgen":  # accelgen's loop options (cache=, compile=) are not HF's or llama.cpp's
            stray = sorted(set(options) & set(LOOP_OPTIONS) - set(self.options))
            if stray:
                raise InputError(f"method {self.name!r} has no option {', '.join(map(repr, stray))}; its options "
                                 f"are: {', '.join(sorted(self.options)) or 'none'}")
        return merge_options(self.name, self.options, options)

    def given_options(self, options: dict[str, dict]) -> dict:
        """This row's share of the run's -o options: those for its method (every variant gets them, e.g.
        -o rest.datastore=PATH) except what the variant's name sets, then those for the row itself."""
        for_method = {key: value for key, value in options.get(self.registered_name, {}).items() if key not in self.fixed}
        return {**for_method, **options.get(self.name, {})}


# HF's defaults for these options, written out so the report shows the values used.
HF_METHODS = {
    BASELINE: BenchMethod(BASELINE, "hf", "baseline", "distribution-exact",
                          summary="transformers model.generate(do_sample=False): the speedup denominator"),
    "hf-assisted": BenchMethod(
        "hf-assisted", "hf", "speculative", "distribution-exact", needs=("draft_model",),
        options={"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.4},
        summary="transformers generate(assistant_model=draft)",
    ),
    "hf-prompt-lookup": BenchMethod(
        "hf-prompt-lookup", "hf", "speculative", "distribution-exact",
        options={"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2},
        summary="transformers generate(prompt_lookup_num_tokens=10)",
    ),
}
# HF's fastest path: the same three on its static cache, the forward compiled where transformers compiles it
# (compile "auto": its own rule, on a GPU; True forces it on any device, False keeps it eager)
STATIC_ROWS = {"hf-static": BASELINE, "hf-static-assisted": "hf-assisted", "hf-static-prompt-lookup": "hf-prompt-lookup"}
STATIC_SUMMARIES = {
    "hf-static": "transformers generate(cache_implementation='static'), its forward compiled as transformers does",
    "hf-static-assisted": "hf-assisted on transformers' static cache, its forward compiled as transformers does",
    "hf-static-prompt-lookup": "hf-prompt-lookup on transformers' static cache, its forward compiled as transformers does",
}
HF_METHODS.update({
    name: dataclasses.replace(HF_METHODS[dynamic], name=name, options={**HF_METHODS[dynamic].options, "compile": "auto"},
                              summary=STATIC_SUMMARIES[name])
    for name, dynamic in STATIC_ROWS.items()
})


# llama.cpp's own loop on the same GGUF files (accelgen/bench/llamacpp.py)
LLAMACPP_METHODS = {
    name: BenchMethod(name, "llamacpp", "baseline" if name == "llamacpp" else "speculative", "distribution-exact",
                      needs=("draft_model",) if name == "llamacpp-draft" else (), options=dict(LLAMACPP_OPTIONS[name]),
                      summary=summary, can_sample=False,
                      weights="gguf", draft_weights="gguf" if name == "llamacpp-draft" else None)
    for name, summary in LLAMACPP_PEERS.items()
}


def available_methods() -> dict[str, BenchMethod]:
    """HF and llama.cpp peers and every registered accelgen method, by name."""
    methods = {**HF_METHODS, **LLAMACPP_METHODS}
    for spec in list_methods():
        if spec.name in methods:
            raise InputError(f"accelgen method {spec.name!r} clashes with a benchmark baseline name")
        methods[spec.name] = BenchMethod(spec.name, "accelgen", spec.family, spec.lossless, tuple(spec.needs),
                                         dict(spec.options), spec.summary, spec.can_sample)
    return methods


def variant(methods: dict[str, BenchMethod], name: str) -> BenchMethod:
    """The method called `name`: a known one, or a variant base@option=value+option=value of one."""
    base_name = base_method(name)
    if base_name not in methods:
        raise InputError(f"unknown method {base_name!r}; available: {', '.join(methods)}")
    _, values = parse_variant(name)
    if not values:
        return methods[base_name]
    base = methods[base_name]
    # draft=PATH gives the row a draft model of its own, e.g. to compare a distilled draft with the original;
    # weights=FORMAT and draft_weights=FORMAT load the row's target and draft in formats of their own
    draft = values.pop("draft", None)
    weights, draft_weights = values.pop("weights", base.weights), values.pop("draft_weights", base.draft_weights)
    if draft is not None and "draft_model" not in base.needs:
        raise InputError(f"method variant {name!r}: {base_name} takes no draft model")
    for given in (weights, draft_weights):
        check_weights(given)
    if base.source != "accelgen" and (weights != base.weights or draft_weights != base.draft_weights):
        raise InputError(f"method variant {name!r}: {base_name} runs in its own weight format")
    return dataclasses.replace(base, name=name, options=base.check_options(values),
                               draft=None if draft is None else str(draft), fixed=tuple(values),
                               weights=weights, draft_weights=draft_weights)


def unmet_needs(method: BenchMethod, resources: set[str], options: dict) -> list[str]:
    """Needs neither provided by the run (e.g. a draft model, or "heads:eagle": a head shipped for the run's model)
    nor given as an option of the same name (with -o, or in a variant's name: consistent-ee@heads=FOLDER)."""
    given = {**method.options, **options, "draft_model": method.draft}
    return [need for need in method.needs if need not in resources and f"{need}:{method.registered_name}" not in
            resources and given.get(need) is None]


def resolve_methods(
    names: list[str] | None,
    resources: set[str],
    temperature: float,
    options: dict[str, dict] | None = None,
) -> tuple[list[BenchMethod], list[str]]:
    """The methods to run, hf-greedy first, and notes on what was added or skipped.

    names None: every method whose needs are met (and that can sample, when temperature > 0).
    Named methods that cannot run are an error, as are options for methods not in the run.
    """
    options = options or {}
    methods = available_methods()
    notes = []
    if names is None:
        chosen = []
        for method in methods.values():
            unmet = unmet_needs(method, resources, options.get(method.name, {}))
            if unmet:
                notes.append(f"skipping {method.name}: needs {', '.join(unmet)}")
            elif temperature > 0 and not method.can_sample:
                notes.append(f"skipping {method.name}: greedy only")
            else:
                chosen.append(method)
    else:
        chosen = [variant(methods, name) for name in dict.fromkeys(names)]
        for method in chosen:
            unmet = unmet_needs(method, resources, method.given_options(options))
            if unmet:
                hint = " (pass --draft)" if "draft_model" in unmet else ""
                raise InputError(f"method {method.name!r} needs {', '.join(unmet)}{hint}")
            if temperature > 0 and not method.can_sample:
                raise InputError(f"method {method.name!r} supports greedy decoding only (temperature 0)")
        if BASELINE not in names:
            chosen.insert(0, methods[BASELINE])
            notes.append(f"added {BASELINE}: every speedup is measured against it")
    chosen.sort(key=lambda method: method.name != BASELINE)  # stable: baseline first, the rest as given
    stray = sorted(set(options) - {name for method in chosen for name in (method.name, method.registered_name)})
    if stray:
        raise InputError(f"options given for {', '.join(map(repr, stray))}, which is not among the methods run")
    return chosen, notes


def run_method(
    method: BenchMethod,
    model,
    tokenizer,
    prompt_ids: list[int],
    *,
    draft_model,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    options: dict,
    peers: LlamaCppPeers | None = None,
    max_cache_len: int | None = None,
) -> dict:
    """Generate once and time it; a record of new tokens, seconds and forward statistics. max_cache_len: the
    positions HF's static cache holds for every prompt of the run (None: sized per call)."""
    if method.source == "llamacpp":
        return peers.run(method, options, prompt_ids, max_new_tokens)
    if method.source == "hf":
        return run_hf(method, model, tokenizer, prompt_ids, draft_model=draft_model, max_new_tokens=max_new_tokens,
                      temperature=temperature, seed=seed, options=options, max_cache_len=max_cache_len)
    return run_accelgen(method, model, tokenizer, prompt_ids, draft_model=draft_model, max_new_tokens=max_new_tokens,
                        temperature=temperature, seed=seed, options=options)


def run_accelgen(method, model, tokenizer, prompt_ids, *, draft_model, max_new_tokens, temperature, seed, options) -> dict:
    if "references" in method.needs and not options.get("references"):
        options = {**options, "references": [prompt_ids]}  # benchmark prompts carry no documents: see PROMPT_RESOURCES
    result, seconds = timed(model.device, lambda: generate(
        model, tokenizer, prompt_ids, method=method.registered_name, draft_model=draft_model,  # `auto` may use it
        max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, **options))
    stats = result.stats
    return generation_record(
        result.token_ids, seconds, result.finish_reason, target_forwards=stats["target_forwards"],
        committed_per_step=[accepted + 1 for accepted in stats["accepted_per_step"]],
        draft_tokens=stats["draft_tokens"], accepted_draft_tokens=stats["accepted_draft_tokens"],
        draft_seconds=stats["draft_seconds"],
        mean_layers=stats.get("mean_layers"),  # early exit: layers a decoded token went through
        hit_rate=stats.get("hit_rate"),  # ppd: tokens whose first layers a candidate had run
        compute=stats.get("compute"),  # ppd: layer-rows run, relative to plain decoding
        choice=stats.get("choice"),  # auto: the method it delegated to, and why
    )


def run_hf(method, model, tokenizer, prompt_ids, *, draft_model, max_new_tokens, temperature, seed, options,
           max_cache_len=None) -> dict:
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    kwargs = hf_generate_kwargs(method, model, tokenizer, draft_model, max_new_tokens, temperature, options,
                                max_cache_len)
    draft_timer = ForwardTimer(kwargs["assistant_model"]) if "assistant_model" in kwargs else None
    static = method.registered_name in STATIC_ROWS
    counter = PreparedInputsCounter(model) if static else ForwardCounter(model)
    torch.manual_seed(seed)  # HF samples from torch's global generator
    try:
        output, seconds = timed(model.device, lambda: model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), **kwargs))
    finally:
        counter.remove()
        if draft_timer:
            draft_timer.remove()
    token_ids = output[0, len(prompt_ids):].tolist()
    finish_reason = "stop" if token_ids and token_ids[-1] in kwargs["eos_token_id"] else "length"
    # HF does not report how many tokens it drafted
    return generation_record(token_ids, seconds, finish_reason, target_forwards=counter.forwards,
                             committed_per_step=counter.committed_per_step(len(prompt_ids), len(token_ids)),
                             draft_seconds=draft_timer.seconds if draft_timer else None,
                             **({"compiled": counter.compiled} if static else {}))


def hf_generate_kwargs(method, model, tokenizer, draft_model, max_new_tokens, temperature, options,
                       max_cache_len=None) -> dict:
    eos = sorted(eos_token_ids(model, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)  # plain sampling, like accelgen's
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    options = dict(options)
    if method.registered_name in STATIC_ROWS:
        kwargs.update(static_kwargs(options.pop("compile"), max_cache_len))
    row = STATIC_ROWS.get(method.registered_name, method.registered_name)  # the dynamic-cache row it extends
    if row == "hf-assisted":
        kwargs["assistant_model"] = assistant_with_options(draft_model, options)
    elif row == "hf-prompt-lookup":
        kwargs.update(options)
    return kwargs


def static_kwargs(compile, max_cache_len: int | None) -> dict:
    """generate()'s arguments for HF's static cache, sized once for the whole run (a cache of another size is
    another shape, which transformers would compile again), its forward compiled as `compile` says: "auto"
    transformers' own rule (on cuda, xpu, neuron or tpu), True on any device, False never."""
    kwargs = {"cache_implementation": "static"}
    if max_cache_len is not None:
        kwargs["max_cache_len"] = max_cache_len
    if compile is True:
        config = CompileConfig()
        config._compile_all_devices = True  # transformers' own switch for compiling on the CPU ("for testing")
        kwargs["compile_config"] = config
    elif compile is False:
        kwargs["disable_compile"] = True
    elif compile != "auto":
        raise InputError(f"compile={compile!r}: choose 'auto', true or false")
    return kwargs


def static_cache_length(longest_prompt: int, max_new_tokens: int, options: dict[str, dict]) -> int:
    """The positions HF's static rows hold: every prompt of the run with its new tokens in one size (a new size is a
    new shape, which transformers would compile again), and room for a draft verified past the last new token
    (transformers 5.24's prompt lookup writes its draft past max_length: a cache of exactly that size overflows)."""
    drafts = [row_options.get(name, 0) for row, row_options in options.items() if base_method(row) in STATIC_ROWS
              for name in ("num_assistant_tokens", "prompt_lookup_num_tokens")]
    return longest_prompt + max_new_tokens + max(drafts, default=0) + 1


def static_path_refusal(method: BenchMethod) -> str | None:
    """Why the installed transformers cannot run this static row (None when it can): its assisted generation and
    prompt lookup roll the cache back after each verification, which older static caches could not do."""
    if method.registered_name not in STATIC_ROWS or STATIC_ROWS[method.registered_name] == BASELINE:
        return None
    from transformers import cache_utils

    if getattr(getattr(cache_utils, "StaticLayer", None), "is_croppable", False) is not True:
        return (f"transformers {transformers_version()} cannot roll its static cache back, so it refuses assisted "
                "generation and prompt lookup there")
    return None


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def assistant_with_options(draft_model, options: dict):
    """A shallow copy of the draft model (weights shared) with its own generation config holding the assisted
    generation options: HF reads them from the assistant and may write them back ("heuristic" schedule), so a
    fresh copy per call keeps prompts independent and leaves the caller's model untouched."""
    assistant = copy.copy(draft_model)
    assistant.generation_config = copy.deepcopy(draft_model.generation_config)
    for name, value in options.items():
        setattr(assistant.generation_config, name, value)
    return assistant


# A shallow copy of a module shares its hook dictionaries, so a hook set on the target also fires for an assistant
# copied from the same model object; each hook below therefore checks which module is running.


class ForwardCounter:
    """Counts a model's forwards and notes the KV-cache length each one starts from."""

    def __init__(self, model):
        self.model = model
        self.forwards = 0
        self.cache_lengths: list[int | None] = []
        self._handle = model.register_forward_pre_hook(self._before, with_kwargs=True)

    def _before(self, module, args, kwargs):
        if module is self.model:
            self._note(kwargs)

    def _note(self, kwargs: dict) -> None:
        self.forwards += 1
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # its name in newer / older transformers
        # (a static cache's length is a tensor: read once the step before has finished, it waits for nothing)
        self.cache_lengths.append(int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else None)

    def remove(self) -> None:
        self._handle.remove()

    def committed_per_step(self, prompt_length: int, new_tokens: int) -> list[int] | None:
        """Tokens committed by each forward: forward i (i >= 1) starts with the newest committed token uncached,
        so the sequence held prompt + ... up to cache_length + 1 tokens then. None if the cache was not seen."""
        later = self.cache_lengths[1:]
        if not self.forwards or any(length is None for length in later):
            return None
        boundaries = [prompt_length] + [length + 1 for length in later] + [prompt_length + new_tokens]
        steps = [end - start for start, end in zip(boundaries, boundaries[1:])]
        return steps if all(step >= 1 for step in steps) else None


class PreparedInputsCounter(ForwardCounter):
    """ForwardCounter for HF's static path, where the target's forward may be compiled: a hook would be traced into
    the compiled graph. Each of its forwards follows one prepare_inputs_for_generation call, outside the graph and
    given the same cache; and `compiled` says whether generate() took transformers' compiled forward."""

    WRAPPED = ("prepare_inputs_for_generation", "get_compiled_call")

    def __init__(self, model):
        self.model = model
        self.forwards = 0
        self.cache_lengths = []
        self.compiled = False
        prepare, get_compiled_call = model.prepare_inputs_for_generation, model.get_compiled_call

        def counted(*args, **kwargs):
            self._note(kwargs)
            return prepare(*args, **kwargs)

        def compiled(*args, **kwargs):
            self.compiled = True
            return get_compiled_call(*args, **kwargs)

        # instance attributes shadow the class's methods until removed (the model is otherwise left untouched)
        model.prepare_inputs_for_generation, model.get_compiled_call = counted, compiled

    def remove(self) -> None:
        for name in self.WRAPPED:
            vars(self.model).pop(name, None)


class ForwardTimer:
    """Total wall time spent inside a model's forwards (the draft model's share of an HF assisted run)."""

    def __init__(self, model):
        self.model = model
        self.seconds = 0.0
        self._started = 0.0
        self._handles = [model.register_forward_pre_hook(self._before), model.register_forward_hook(self._after)]

    def _before(self, module, args):
        if module is self.model:
            synchronize(module.device)  # the target's queued work is not the draft's
            self._started = time.perf_counter()

    def _after(self, module, args, output):
        if module is self.model:
            synchronize(module.device)
            self.seconds += time.perf_counter() - self._started

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
