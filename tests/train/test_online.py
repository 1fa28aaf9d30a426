"""`online`: the draft learns between requests from the positions the target rejected, decoding stays exact,
and acceptance rises over a stream of requests of one kind."""

import pytest
import torch
from fastapi.testclient import TestClient

import accelgen
from accelgen.server.app import ServerConfig, create_app
from accelgen.server.engine import Engine
from accelgen.train.online import OnlineLearner, moving_average

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILY = [[5, 17, 92, 44, 77, 12], [5, 17, 92, 44, 77, 13]]  # two prompts of one kind, alternating
LEARNING = dict(update_steps=8, learning_rate=1e-2, gamma=4)  # fast learning, for tiny models


@pytest.fixture
def draft(make_tiny_model):
    """A fresh unrelated random draft (float32) for each test: online decoding changes it in place."""
    return make_tiny_model("llama", seed=1, vocab_size=1024)


def run(target, draft, tokenizer, prompt, learner, max_new_tokens=24, **options):
    return accelgen.generate(target, tokenizer, prompt, method="online", draft_model=draft,
                             max_new_tokens=max_new_tokens, learner=learner, **{**LEARNING, **options})


def test_every_request_is_exact_while_the_draft_is_updated(sharp_target, draft, tokenizer, greedy):
    learner = OnlineLearner()
    before = [p.clone() for p in draft.model.layers.parameters()]
    for prompt in FAMILY * 3:
        result = run(sharp_target, draft, tokenizer, prompt, learner, interval=2)
        assert result.token_ids == greedy(sharp_target, tokenizer, prompt, 24).token_ids
    assert len(learner.updates) == 3
    assert any(not torch.equal(old, new) for old, new in zip(before, draft.model.layers.parameters()))


def test_rejections_fill_the_buffer_which_trains_and_empties_every_interval(sharp_target, draft, tokenizer):
    learner = OnlineLearner()
    first = run(sharp_target, draft, tokenizer, FAMILY[0], learner, interval=3)
    assert len(learner.buffer) == 1 and 0 < learner.buffered <= first.stats["target_forwards"]
    # each recorded position: the context the draft saw, and the sharp_target's top choice there is the token
    # greedy decoding committed after it
    committed = FAMILY[0] + first.token_ids
    rejections = learner.buffer[0]
    assert rejections.tokens == committed[: len(rejections.tokens)]
    assert [int(ids[0]) for ids in rejections.target_ids] == [committed[p + 1] for p in rejections.positions]
    run(sharp_target, draft, tokenizer, FAMILY[1], learner, interval=3)
    assert len(learner.buffer) == 2 and learner.updates == []
    buffered = learner.buffered
    run(sharp_target, draft, tokenizer, FAMILY[0], learner, interval=3)
    assert learner.buffer == [] and learner.requests == 3
    assert [(u["after_request"], u["requests_buffered"]) for u in learner.updates] == [(3, 3)]
    assert learner.updates[0]["positions"] > buffered
    assert learner.updates[0]["loss_last_step"] < learner.updates[0]["loss_first_step"]


def test_the_buffer_keeps_its_newest_positions(sharp_target, draft, tokenizer):
    learner = OnlineLearner()
    for prompt in FAMILY:
        run(sharp_target, draft, tokenizer, prompt, learner, interval=5, buffer_size=3)
    assert learner.buffered == 3
    assert len(learner.buffer[-1].positions) == 3  # the second request's last rejections


def test_acceptance_rises_over_requests_of_one_kind(sharp_target, draft, tokenizer):
    learner = OnlineLearner()
    acceptance = [run(sharp_target, draft, tokenizer, prompt, learner, interval=1).stats["acceptance_rate"]
                  for prompt in FAMILY * 4]
    assert acceptance[0] < 0.05  # an unrelated random draft
    assert sum(acceptance[-3:]) / 3 > 0.15, acceptance
    assert len(learner.updates) == 8


def test_a_fresh_learner_per_call_without_the_option(sharp_target, draft, tokenizer):
    before = [p.clone() for p in draft.parameters()]
    accelgen.generate(sharp_target, tokenizer, FAMILY[0], method="online", draft_model=draft, max_new_tokens=8)
    assert all(torch.equal(old, new) for old, new in zip(before, draft.parameters()))  # one request < interval 5


@pytest.mark.parametrize("options, message", [
    ({"interval": 0}, "interval must be an integer >= 1, got 0"),
    ({"buffer_size": -1}, "buffer_size must be an integer >= 1"),
    ({"update_steps": 1.5}, "update_steps must be an integer, got 1.5"),
    ({"learning_rate": 0}, "learning_rate must be a number > 0"),
    ({"divergence": "jsd"}, "unknown divergence 'jsd'"),
    ({"train_layers": 3}, "train_layers must be between 1 and the draft's 2 layers"),
    ({"learner": "shared"}, "learner must be an OnlineLearner, not str"),
    ({"window": 3}, "has no option 'window'"),
])
def test_bad_options_get_clear_errors(sharp_target, draft, tokenizer, options, message):
    with pytest.raises(ValueError, match=message):
        accelgen.generate(sharp_target, tokenizer, FAMILY[0], method="online", draft_model=draft, max_new_tokens=4, **options)


def test_a_learner_trains_one_float32_draft(sharp_target, draft, make_tiny_model, tokenizer):
    learner = OnlineLearner()
    run(sharp_target, draft, tokenizer, FAMILY[0], learner, max_new_tokens=4, interval=5)
    with pytest.raises(ValueError, match="trains another draft model"):
        run(sharp_target, make_tiny_model("llama", seed=2, vocab_size=1024), tokenizer, FAMILY[0], learner, interval=5)
    with pytest.raises(ValueError, match="trains train_layers=None, not 1"):
        run(sharp_target, draft, tokenizer, FAMILY[0], learner, interval=5, train_layers=1)
    with pytest.raises(ValueError, match="float32"):
        run(sharp_target, make_tiny_model("llama", seed=2, vocab_size=1024).to(torch.bfloat16), tokenizer, FAMILY[0],
            OnlineLearner(), interval=5)


def test_the_server_keeps_one_learner_for_its_life(sharp_target, draft, tokenizer):
    """interval 2: a learner per request would never update the draft; the server's one does after two."""
    config = ServerConfig(model_name="tiny", model=sharp_target, tokenizer=tokenizer, draft_model=draft, method="online",
                          methods={"online": {"interval": 2, **LEARNING}}, max_tokens=64)
    before = [p.clone() for p in draft.model.layers.parameters()]
    with TestClient(create_app(config, Engine(max_batch=2))) as client:
        for number, prompt in enumerate(FAMILY):
            reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
            assert reply["choices"][0]["text"] == accelgen.generate(sharp_target, tokenizer, prompt, max_new_tokens=12).text
            changed = any(not torch.equal(old, new) for old, new in zip(before, draft.model.layers.parameters()))
            assert changed == (number == 1)
    bfloat16 = ServerConfig(model_name="tiny", model=sharp_target, tokenizer=tokenizer, draft_model=draft.to(torch.bfloat16),
                            method="online")
    with pytest.raises(ValueError, match="float32"):
        create_app(bfloat16)


def test_moving_average():
    assert moving_average([0.0, 1.0, 0.5, 0.5], 2) == [0.0, 0.5, 0.75, 0.5]
