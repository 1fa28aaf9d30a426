"""Host reads per decoding step: how often a step makes the host wait for values the device computed
(accelgen/host_reads.py counts them on the CPU). A step of plain decoding reads once (its token); a draft model's
chain at most twice (its tokens, then the verdict); a token tree once per level at most, plus the verdict. Each
bound holds for every step, greedy and sampled (seeded and not); a failure names the lines that read."""

from collections import Counter

import pytest
import torch

import accelgen
from accelgen.heads.eagle import new_head
from accelgen.heads.medusa import MedusaHeads
from accelgen.host_reads import count_host_reads

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12, 5, 17, 923] * 3
NEW_TOKENS = 20
SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 1.0, "seed": 0}, "unseeded": {"temperature": 1.0}}


def reads_per_step(model, tokenizer, method, **options) -> tuple[list[int], Counter]:
    """(the host reads of each step of a generation, where they were made)."""
    per_step = []
    with count_host_reads("cpu", where=True) as reads:
        stream = accelgen.generate(model, tokenizer, PROMPT, method=method, max_new_tokens=NEW_TOKENS, stream=True,
                                   **options)
        before = 0
        for _ in stream:
            per_step.append(reads.count - before)
            before = reads.count
    return per_step, Counter(reads.places)


def assert_reads_at_most(bound: int, model, tokenizer, method, **options) -> list[int]:
    per_step, places = reads_per_step(model, tokenizer, method, **options)
    assert per_step and max(per_step) <= bound, (
        f"{method} {options}: up to {max(per_step)} host reads in a step, more than {bound}; per step {per_step}; "
        f"made at {places.most_common(8)}")
    return per_step


@pytest.fixture(scope="module")
def eagle_head(tiny_target, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("eagle")
    new_head(tiny_target).save(folder)  # untrained: its drafts are partly accepted by chance at most
    return str(folder)


@pytest.fixture(scope="module")
def medusa_heads(tiny_target, tmp_path_factory) -> str:
    """Three random heads (as tests/drafters/test_medusa.py builds them): trees of every depth, rarely accepted."""
    heads = MedusaHeads(3, tiny_target.config.hidden_size, tiny_target.config.vocab_size)
    with torch.no_grad():
        for index, block in enumerate(heads.blocks):
            block.weight.copy_(torch.randn(block.weight.shape, generator=torch.Generator().manual_seed(index)))
    folder = tmp_path_factory.mktemp("medusa")
    heads.save(folder)
    return str(folder)


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("method", ["autoregressive", "pld"])
def test_plain_and_model_free_steps_read_once(tiny_target, tokenizer, method, sampling):
    assert_reads_at_most(1, tiny_target, tokenizer, method, **SAMPLINGS[sampling])


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("drafts", ["accepted", "rejected"])
def test_a_draft_models_chain_reads_twice(tiny_target, tiny_draft, tokenizer, drafts, sampling):
    """Its tokens once after drafting, the verdict once: the target drafting for itself has every token accepted,
    the unrelated model almost none."""
    draft_model = tiny_target if drafts == "accepted" else tiny_draft
    assert_reads_at_most(2, tiny_target, tokenizer, "speculative", draft_model=draft_model, gamma=5,
                         **SAMPLINGS[sampling])


def test_a_stop_rule_reads_each_drafted_token(tiny_target, tokenizer):
    """The counter sees per-token reads where there are some: a confidence threshold (one that never stops)
    reads each token's stop decision back."""
    per_step, _ = reads_per_step(tiny_target, tokenizer, "speculative", draft_model=tiny_target, gamma=5,
                                 confidence_threshold=1e-9)
    assert max(per_step) == (5 - 1) + 2  # (the last token's is not read: drafting ends there anyway)


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("options, levels", [
    ({}, 1),  # static trees ([2, 2, 1, 1]) read their tokens once
    ({"paths": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}, 1),
    ({"dynamic": True, "width": 3, "depth": 4, "max_nodes": 12}, 4),  # dynamic ones once per level
])
def test_draft_model_trees_read_once_per_level(tiny_target, tokenizer, options, levels, sampling):
    assert_reads_at_most(levels + 1, tiny_target, tokenizer, "specinfer", draft_model=tiny_target, **options,
                         **SAMPLINGS[sampling])


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_trees_drawn_without_replacement_read_their_support_per_level(tiny_target, tokenizer, sampling):
    assert_reads_at_most(4 + 1, tiny_target, tokenizer, "mcsd", draft_model=tiny_target, branching=[4, 2, 1, 1],
                         **SAMPLINGS[sampling])


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("options, levels", [({"width": 3, "depth": 3, "max_nodes": 8}, 3),
                                             ({"paths": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}, 1)])
def test_eagle_trees_read_once_per_level(tiny_target, tokenizer, eagle_head, options, levels, sampling):
    assert_reads_at_most(levels + 1, tiny_target, tokenizer, "eagle", heads=eagle_head, **options,
                         **SAMPLINGS[sampling])


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("method, options, levels", [
    ("medusa", {}, 1),  # the heads guess every depth at once: a static tree reads once
    ("blockwise", {}, 1),
    ("medusa", {"width": 2, "max_nodes": 6}, 3),
])
def test_medusa_trees_read_once_per_level(tiny_target, tokenizer, medusa_heads, method, options, levels, sampling):
    assert_reads_at_most(levels + 1, tiny_target, tokenizer, method, heads=medusa_heads, **options,
                         **SAMPLINGS[sampling])
