"""Seeded requests are reproducible: the same seeded request gives the same tokens every time, alone and beside
other requests, whatever the timings (server/engine.py runs a seeded request as if alone).

The logits a row gets depend on the shape of the forward that computed it (a batch, a wider draft: another
summation order, about 1e-6 apart on the tiny float32 model), so a near-tie could flip a sampled token. The tests
therefore compare the target scores each committed token was chosen from bit for bit (output_scores=True), which
any change of shape shows, and not only the tokens, which would hide it most of the time.
"""

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

import accelgen
from accelgen.drafters import budget as budget_module
from accelgen.loop import Sequence
from accelgen.server.engine import Engine, Request
from accelgen.server.speculation import ForwardCosts, Goodput

SEEDED = dict(max_new_tokens=12, temperature=0.9, top_k=50, seed=7, output_scores=True)
PROMPT = [8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10]  # repetitive: prompt lookup drafts
METHODS = [("pld", {}), ("speculative", {}), ("auto", {})]
# other traffic: unseeded sampling, greedy, another seed, a long prompt fed in chunks
NEIGHBOURS = [
    ([5, 17, 923, 4010, 77, 12], dict(method="speculative", temperature=1.0, max_new_tokens=16)),
    ([8, 9, 10, 8, 9, 10, 8, 9], dict(method="pld", max_new_tokens=16)),
    ([1000, 20, 3000], dict(method="autoregressive", temperature=0.7, seed=3, max_new_tokens=8)),
    (list(range(300, 340)), dict(method="speculative", gamma=2, max_new_tokens=6)),
]


class Collector:
    def __init__(self):
        self.result = None
        self.error = None

    def __call__(self, event):
        if isinstance(event, accelgen.GenerationResult):
            self.result = event
        elif isinstance(event, Exception):
            self.error = event


VOCAB = 4096  # every token id below is in it; a small vocabulary keeps the per-position noise quick


@pytest.fixture(scope="module")
def target(make_tiny_model):
    return make_tiny_model("qwen2", seed=0, vocab_size=VOCAB)


@pytest.fixture
def cheap_draft(make_tiny_model, measured_costs):
    """The target with its weights moved by 5% noise (a draft accepted part of the time), measured 5 times cheaper
    than the target, so that the measured budget drafts and its draft lengths vary with what it learns."""
    draft = make_tiny_model("qwen2", seed=0, vocab_size=VOCAB)
    draft.config._name_or_path = "near-copy"  # its own costs (costs.model_key)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weights in draft.parameters():
            weights.add_(torch.randn(weights.shape, generator=noise) * 0.05 * weights.std())
    measured_costs({draft: (0.002, {1: 1.0})})
    return draft


def submit(engine, model, tokenizer, prompt, **kwargs) -> Collector:
    collector = Collector()
    engine.submit(Request(Sequence.start(model, tokenizer, prompt, **kwargs), collector,
                          method=kwargs.get("method", "")))
    return collector


def run_until_idle(engine: Engine) -> None:
    for _ in range(1000):
        if not engine.load:
            return
        engine.step()
    raise AssertionError("engine did not finish")


def goodput() -> Goodput:
    """The server's default policy over costs that follow every timed forward, as on a real machine: its caps then
    change with the timings and the batch."""
    costs = {batch: {1: 0.01 * batch, 2: 0.011 * batch, 3: 0.012 * batch, 5: 0.014 * batch} for batch in (1, 2, 4, 8)}
    return Goodput(ForwardCosts(costs), ForwardCosts({batch: {1: 0.002 * batch} for batch in (1, 2, 4, 8)}),
                   max_draft=6)


def noisy_clock(seed: int):
    """A perf_counter whose steps jitter as a loaded machine's timings do (0.1 to 50 ms between readings)."""
    jitter = random.Random(seed)
    readings = itertools.accumulate(jitter.uniform(1e-4, 5e-2) for _ in itertools.count())
    return lambda: next(readings)


def same_result(actual, expected) -> None:
    assert actual.token_ids == expected.token_ids
    assert torch.equal(actual.scores, expected.scores)  # the very logits, bit for bit, not only the tokens


@pytest.mark.parametrize("method,options", METHODS, ids=[method for method, _ in METHODS])
def test_seeded_generation_alone_ignores_the_clock(target, cheap_draft, tokenizer, method, options, monkeypatch):
    """Alone, each run with clock readings as jittery as a busy machine's: the same drafts, tokens and scores (the
    drafting cost the budget learns from timings is frozen under a seed)."""
    results = []
    for run in range(2):
        monkeypatch.setattr(budget_module, "time", SimpleNamespace(perf_counter=noisy_clock(run)))
        results.append(accelgen.generate(target, tokenizer, PROMPT, method=method, draft_model=cheap_draft,
                                         **options, **SEEDED | {"max_new_tokens": 24}))
    for result in results[1:]:
        same_result(result, results[0])
        assert result.stats["accepted_per_step"] == results[0].stats["accepted_per_step"]
        assert result.stats["draft_tokens"] == results[0].stats["draft_tokens"]
    assert results[0].stats["draft_tokens"] > 0  # it did draft


@pytest.mark.parametrize("method,options", METHODS, ids=[method for method, _ in METHODS])
def test_seeded_request_is_the_same_alone_and_beside_others(target, cheap_draft, tokenizer, method, options):
    """The same seeded request served alone several times, then beside concurrent requests that join at different
    steps, by the Goodput policy whose caps follow the timings: every time exactly the result of generate() alone."""
    seeded = dict(method=method, draft_model=cheap_draft, **options, **SEEDED)
    expected = accelgen.generate(target, tokenizer, PROMPT, **seeded)
    engine = Engine(max_batch=6, prefill_chunk=16, speculation=goodput())
    for _ in range(2):  # alone, one after the other
        collector = submit(engine, target, tokenizer, PROMPT, **seeded)
        run_until_idle(engine)
        same_result(collector.result, expected)
    for delay in (0, 2):  # beside the other traffic, joining at another step each time
        others = [submit(engine, target, tokenizer, prompt, draft_model=cheap_draft, **kwargs)
                  for prompt, kwargs in NEIGHBOURS]
        for _ in range(delay):
            engine.step()
        twins = [submit(engine, target, tokenizer, PROMPT, **seeded) for _ in range(2)]
        run_until_idle(engine)
        assert all(c.error is None and c.result.finish_reason == "length" for c in others + twins)
        for collector in twins:
            same_result(collector.result, expected)


def test_unseeded_requests_still_share_the_batched_forward(target, cheap_draft, tokenizer, monkeypatch):
    """Only seeded requests forward alone: the others keep sharing one batched forward."""
    from accelgen.server import engine as engine_module

    batch_sizes = []
    real_forward = engine_module.batched_forward
    monkeypatch.setattr(engine_module, "batched_forward",
                        lambda runners, blocks: batch_sizes.append(len(runners)) or real_forward(runners, blocks))
    engine = Engine(max_batch=4, prefill_chunk=0, speculation=goodput())
    for prompt, kwargs in NEIGHBOURS[:2]:
        submit(engine, target, tokenizer, prompt, draft_model=cheap_draft, **kwargs)
    submit(engine, target, tokenizer, PROMPT, method="pld", **SEEDED)
    engine.step()  # the prompts: the two unseeded together, the seeded one alone
    assert sorted(batch_sizes) == [1, 2]
