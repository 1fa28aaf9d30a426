"""Continuous batching: every request in a shared batch gets exactly the tokens it would get alone."""

import pytest

import accelgen
from accelgen import hardware
from accelgen.loop import Chunk, GenerationResult, Sequence
from accelgen.server import engine as engine_module
from accelgen.server.engine import Engine, Request
from accelgen.server.speculation import ForwardCosts, Goodput, TokenBudget

PROMPTS = [
    [5, 17, 923, 4410, 77, 12],
    [8, 9, 10, 8, 9, 10, 8, 9],  # repetitive: prompt lookup finds matches
    list(range(300, 340)),  # long: prefilled in chunks
    [1000, 20, 3000],
]


class Collector:
    def __init__(self):
        self.chunks: list[Chunk] = []
        self.result: GenerationResult | None = None
        self.error: Exception | None = None

    def __call__(self, event):
        if isinstance(event, Chunk):
            self.chunks.append(event)
        elif isinstance(event, GenerationResult):
            self.result = event
        else:
            self.error = event


def submit(engine, model, tokenizer, prompt, **kwargs) -> tuple[Request, Collector]:
    collector = Collector()
    request = Request(Sequence.start(model, tokenizer, prompt, **kwargs), collector)
    engine.submit(request)
    return request, collector


def run_until_idle(engine: Engine, max_steps: int = 500) -> int:
    steps = 0
    while engine.load and steps < max_steps:
        engine.step()
        steps += 1
    assert not engine.load, "engine did not finish"
    return steps


REQUESTS = [  # (method, options) per prompt: chains, a tree, model-free and model drafters, ragged acceptance
    ("speculative", {"gamma": 4}),  # draft = target: every draft token accepted
    ("pld", {}),
    ("specinfer", {}),
    ("autoregressive", {}),
]


class FixedCosts(ForwardCosts):
    def observe(self, batch, width, seconds):
        pass  # what this machine measures must not change what the test expects


def flat_costs() -> ForwardCosts:
    return FixedCosts({1: {1: 0.01, 64: 0.01}})  # verification free at any width: draft as much as allowed


def free_drafts() -> ForwardCosts:
    return FixedCosts({1: {1: 0.0}})


def steep_costs() -> ForwardCosts:
    return FixedCosts({1: {1: 0.01, 2: 0.02}})  # every token costs a forward: drafting never pays


@pytest.mark.parametrize("prefill_chunk,speculation", [
    (0, TokenBudget(0)), (16, TokenBudget(0)), (16, TokenBudget(12)),
    (16, Goodput(flat_costs(), free_drafts(), max_draft=6)),
    (16, Goodput(steep_costs(), free_drafts(), max_draft=6)),
], ids=["whole-prompts", "chunked", "budget-12", "goodput-flat", "goodput-steep"])
def test_batched_requests_match_each_request_alone(tiny_target, tokenizer, prefill_chunk, speculation, monkeypatch):
    batch_sizes, caps = [], []
    real_forward = engine_module.batched_forward
    monkeypatch.setattr(engine_module, "batched_forward",
                        lambda runners, blocks: batch_sizes.append(len(runners)) or real_forward(runners, blocks))
    real_draft_length = speculation.draft_length
    monkeypatch.setattr(speculation, "draft_length",
                        lambda decoding: caps.append((len(decoding), real_draft_length(decoding))) or caps[-1][1])
    engine = Engine(max_batch=3, prefill_chunk=prefill_chunk, speculation=speculation)
    submitted = []
    for prompt, (method, options) in zip(PROMPTS, REQUESTS):
        kwargs = dict(method=method, draft_model=tiny_target, max_new_tokens=24, **options)
        alone = accelgen.generate(tiny_target, tokenizer, prompt, **kwargs)
        submitted.append((alone, *submit(engine, tiny_target, tokenizer, prompt, **kwargs)))
    run_until_idle(engine)
    for alone, request, collector in submitted:
        assert collector.error is None
        assert collector.result.token_ids == alone.token_ids
        assert [t for chunk in collector.chunks for t in chunk.token_ids] == alone.token_ids
        assert "".join(chunk.text for chunk in collector.chunks) == alone.text
    assert engine.stats.finished == len(PROMPTS) and max(batch_sizes) == 3  # the fourth joined when one left
    decoding_caps = [cap for decoding, cap in caps if decoding]
    speculative = submitted[0][2].result.stats
    if isinstance(speculation, TokenBudget):
        expected = [speculation.budget // decoding - 1 if speculation.budget else None for decoding, _ in caps if decoding]
        assert decoding_caps == expected
        if not speculation.budget:
            assert speculative["mean_accepted_tokens"] > 4
    elif speculation.target(1, 2) > speculation.target(1, 1):  # drafting never pays: no drafts but the probes
        assert set(decoding_caps) <= {0, 1} and speculative["mean_accepted_tokens"] < 1.5
    else:  # free verification: the longest drafts allowed
        assert set(decoding_caps) == {6} and speculative["mean_accepted_tokens"] >= 4  # gamma 4: 5 tokens a step


def test_methods_with_a_forward_of_their_own_share_a_batch(make_tiny_model, tokenizer):
    """Early exit, LayerSkip's shared cache and PPD run their own forwards beside the batch; each request still
    gets what it gets alone, with long prompts prefilled in chunks."""
    model = make_tiny_model("qwen2", seed=5, layers=4)
    requests = [("skipdecode", {"horizon": 16}), ("layerskip", {"exit_layer": 1}), ("ppd", {}),
                ("calm", {"threshold": 0.5})]
    alone, batched = alone_and_batched(Engine(max_batch=4, prefill_chunk=16, speculation=TokenBudget(0)), model,
                                       tokenizer, requests)
    assert [result.token_ids for result in batched] == [result.token_ids for result in alone]
    assert batched[0].stats["mean_layers"] < 4  # skipdecode did skip


def alone_and_batched(engine, model, tokenizer, requests, max_new_tokens=16):
    """([each request's result alone], [its result served by engine beside the others]) for PROMPTS, requests."""
    alone, collectors = [], []
    for prompt, (method, options) in zip(PROMPTS, requests):
        kwargs = dict(method=method, max_new_tokens=max_new_tokens, **options)
        alone.append(accelgen.generate(model, tokenizer, prompt, **kwargs))
        collectors.append(submit(engine, model, tokenizer, prompt, **kwargs)[1])
    run_until_idle(engine)
    return alone, [collector.result for collector in collectors]


def test_random_draft_rejected_in_a_batch_is_still_lossless(tiny_target, tiny_draft, tokenizer):
    engine = Engine(max_batch=4, speculation=TokenBudget(0))
    expected, collectors = [], []
    for prompt in PROMPTS:
        kwargs = dict(method="speculative", draft_model=tiny_draft, max_new_tokens=16)
        expected.append(accelgen.generate(tiny_target, tokenizer, prompt, **kwargs).token_ids)
        collectors.append(submit(engine, tiny_target, tokenizer, prompt, **kwargs)[1])
    run_until_idle(engine)
    assert [c.result.token_ids for c in collectors] == expected


def test_prompts_share_a_prefill_budget_per_step(tiny_target, tokenizer):
    engine = Engine(max_batch=4, prefill_chunk=8)
    short = submit(engine, tiny_target, tokenizer, [5, 6], max_new_tokens=30)[1]
    long_prompts = [submit(engine, tiny_target, tokenizer, list(range(100 + 50 * i, 140 + 50 * i)), max_new_tokens=2)[1]
                    for i in range(2)]
    engine.step()  # the short prompt (2 tokens) and a 6-token chunk of the first long one; the second waits
    assert len(short.chunks) == 1 and long_prompts[0].result is None
    assert engine.stats.batch_size == 2
    for _ in range(4):
        engine.step()
    assert not long_prompts[0].chunks  # 6 + 4 × 8 = 38 of its 40 tokens fed: not decoding yet
    assert len(short.chunks) == 5  # while the short request streamed on every step
    run_until_idle(engine)
    assert all(c.result.finish_reason == "length" for c in [short, *long_prompts])


def test_cancelled_request_leaves_the_batch(tiny_target, tokenizer):
    engine = Engine(max_batch=2)
    kept = submit(engine, tiny_target, tokenizer, PROMPTS[0], max_new_tokens=20)[1]
    request, cancelled = submit(engine, tiny_target, tokenizer, PROMPTS[1], max_new_tokens=20)
    engine.step()
    request.cancel()
    run_until_idle(engine)
    assert cancelled.result.finish_reason == "abort" and len(cancelled.result.token_ids) == 1
    assert kept.result.finish_reason == "length" and len(kept.result.token_ids) == 20
    assert engine.stats.aborted == 1 and engine.stats.finished == 1


def test_a_failing_drafter_fails_its_own_request_only(tiny_target, tokenizer):
    engine = Engine(max_batch=2)
    good = submit(engine, tiny_target, tokenizer, PROMPTS[0], max_new_tokens=5)[1]
    request, bad = submit(engine, tiny_target, tokenizer, PROMPTS[1], max_new_tokens=5)

    def broken(context, room):
        raise RuntimeError("drafter broke")

    request.sequence.drafter.propose = broken
    run_until_idle(engine)
    assert isinstance(bad.error, RuntimeError) and bad.result is None
    assert good.result.finish_reason == "length" and engine.stats.failed == 1


def test_engine_thread_serves_and_stops(tiny_target, tokenizer):
    engine = Engine()
    engine.start()
    collector = submit(engine, tiny_target, tokenizer, PROMPTS[0], max_new_tokens=8)[1]
    engine.stop(grace_seconds=30)
    assert collector.result is not None and len(collector.result.token_ids) == 8
    with pytest.raises(RuntimeError, match="shutting down"):
        submit(engine, tiny_target, tokenizer, PROMPTS[0])


def test_requests_drafting_from_the_targets_features_share_a_batch(tiny_target, tokenizer, tmp_path):
    """EAGLE and Medusa read the target's hidden states, and PaSS drafts with a target forward, so they take
    forwards of their own beside the batch; with long prompts prefilled in chunks, the EAGLE head still sees the
    features of every chunk, and PaSS's drafting forward reads the last chunk."""
    from accelgen.heads.eagle import new_head
    from accelgen.heads.medusa import MedusaHeads
    from accelgen.train.pass_embeddings import new_embeddings

    new_head(tiny_target).save(tmp_path / "eagle")
    MedusaHeads(2, 64, 49152).save(tmp_path / "medusa")
    new_embeddings(tiny_target, 3).save(tmp_path / "pass")
    requests = [("eagle", {"heads": str(tmp_path / "eagle"), "width": 2, "depth": 2, "max_nodes": 4}),
                ("medusa", {"heads": str(tmp_path / "medusa")}), ("pass", {"heads": str(tmp_path / "pass")})]
    alone, batched = alone_and_batched(Engine(max_batch=3, prefill_chunk=4, speculation=TokenBudget(0)), tiny_target,
                                       tokenizer, requests)
    assert [result.token_ids for result in batched] == [result.token_ids for result in alone]
    assert batched[0].stats["draft_tokens"] > 0


def test_the_engine_times_forwards_after_its_device_is_done(tiny_target, tokenizer, monkeypatch):
    """Each timed forward is read between synchronizations of the engine's device (no-ops on the CPU), so that a
    GPU's asynchronous kernels are in the timings the speculation policy learns from."""
    waited = []
    monkeypatch.setattr(hardware, "synchronize", lambda device: waited.append(device))
    engine = Engine(max_batch=2, device=tiny_target.device)
    submit(engine, tiny_target, tokenizer, PROMPTS[0], max_new_tokens=3)
    engine.step()
    assert waited and set(waited) == {tiny_target.device} and len(waited) % 2 == 0  # before and after each
    assert Engine().device is None  # the CPU: nothing to wait for
