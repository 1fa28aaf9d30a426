"""EAGLE drafting from a head trained for a few steps: token-for-token greedy decoding with drafts partly and
fully accepted, cut by max_new_tokens and stop strings; sampling keeps the target distribution; the head's
cache only ever keeps pairs of true features; clear errors for missing or unfit heads."""

import pytest
import torch

import accelgen
from accelgen.drafters.eagle import EagleScorer
from accelgen.heads.eagle import EagleHead, new_head
from accelgen.models.runner import ModelRunner
from accelgen.train.eagle import EagleConfig, collect_features, train_eagle
from accelgen.train.layerskip import packed_windows

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]


def trained_head(model, windows, folder, steps=80):
    """A head trained for a few steps on windows (count, n) of the model's own text, saved in folder."""
    features, choices = collect_features(model, windows)
    head, _ = train_eagle(model, windows, features, choices, EagleConfig(steps=steps, batch_size=8, learning_rate=1e-2,
                                                                         ce_weight=1.0, noise=0.0, draft_vocab=4096))
    head.save(folder)
    return str(folder)


@pytest.fixture(scope="module")
def head_folder(tiny_target, tokenizer, tmp_path_factory, own_continuations):
    """Trained on the tiny target's greedy continuations of variants of PROMPT."""
    texts = [tokenizer.decode(PROMPT + tokens) for tokens in
             own_continuations(tiny_target, tokenizer, [[start] + PROMPT[1:] for start in range(5, 21)], 50)]
    windows = packed_windows(tokenizer, texts, seq_len=56, count=16)
    return trained_head(tiny_target, windows, tmp_path_factory.mktemp("eagle"))


@pytest.mark.parametrize("options", [{}, {"width": 2, "depth": 3, "max_nodes": 6},
                                     {"paths": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}])
def test_trained_head_is_lossless_with_partial_acceptance(tiny_target, tokenizer, head_folder, assert_lossless, options):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "eagle", 40, heads=head_folder, **options)
    assert 0 < result.stats["accepted_draft_tokens"] < result.stats["draft_tokens"]
    assert result.stats["mean_accepted_tokens"] > 1.2


def test_untrained_head_is_lossless(tiny_target, tokenizer, assert_lossless, tmp_path):
    new_head(tiny_target).save(tmp_path)
    assert_lossless(tiny_target, tokenizer, PROMPT, "eagle", 16, heads=str(tmp_path), width=3, depth=2, max_nodes=5)


def test_whole_drafts_are_accepted_on_a_cycle(cycling_model, tokenizer, cycle_prompt, greedy, assert_lossless, tmp_path):
    text = cycle_prompt + greedy(cycling_model, tokenizer, cycle_prompt, 60).token_ids
    folder = trained_head(cycling_model, torch.tensor([text[start : start + 40] for start in range(0, 40, 3)]),
                          tmp_path, steps=60)
    result = assert_lossless(cycling_model, tokenizer, cycle_prompt, "eagle", 30, heads=folder, width=2, depth=4,
                             max_nodes=8)
    assert max(result.stats["accepted_per_step"]) == 4  # a whole path down the tree


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_max_new_tokens_smaller_than_the_tree(tiny_target, tokenizer, head_folder, assert_lossless, budget):
    assert_lossless(tiny_target, tokenizer, PROMPT, "eagle", budget, heads=head_folder)


def test_a_stop_string_inside_a_draft(tiny_target, tokenizer, head_folder):
    plain = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=40)
    stop = tokenizer.decode(plain.token_ids[12:14])
    expected = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=40, stop=stop)
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="eagle", max_new_tokens=40, stop=stop,
                               heads=head_folder)
    assert (result.text, result.finish_reason) == (expected.text, "stop")


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(sampling_model, assert_samples_target, tmp_path):
    new_head(sampling_model).save(tmp_path)  # untrained: it guesses the previous position's distribution
    assert_samples_target("eagle", [1, 4, 6], heads=str(tmp_path), width=2, depth=2, max_nodes=4)


def test_the_head_cache_keeps_only_true_features(tiny_target, head_folder, assert_reordered):
    """After a proposal the head's cache holds the committed pairs only; catching up later gives the same root
    logits as catching up at once."""
    head = EagleHead.load(head_folder, tiny_target)
    context = torch.tensor(PROMPT + [300, 301, 302, 303])
    runners, scorers = [], []
    for _ in range(2):
        runner = ModelRunner(tiny_target)
        runner.keep_hidden = True  # as the loop does for a method that reads the target's hidden states
        scorer = EagleScorer(runner, head)
        runners.append(runner)
        scorers.append(scorer)
    runners[0].forward(context[:6])  # in two steps, with a tree drafted in between
    scorers[0].root_logits(context[:7].tolist())
    scorers[0].score([1, 2, 3], [-1, 0, -1], [0, 2])
    assert scorers[0].fed == 6 and accelgen.cache.cache_length(scorers[0].cache) == 6
    runners[0].forward(context[6:9])
    stepwise = scorers[0].root_logits(context.tolist())
    runners[1].forward(context[:9])  # at once
    at_once = scorers[1].root_logits(context.tolist())
    assert_reordered(stepwise, at_once)


def test_a_draft_vocabulary_leaves_other_tokens_out(tiny_target, head_folder):
    head = EagleHead.load(head_folder, tiny_target)
    runner = ModelRunner(tiny_target)
    runner.keep_hidden = True
    scorer = EagleScorer(runner, head)
    runner.forward(torch.tensor(PROMPT[:-1]))
    logits = scorer.root_logits(PROMPT)
    outside = torch.ones(len(logits), dtype=torch.bool)
    outside[head.vocab] = False
    assert len(head.vocab) == 4096 and bool(torch.isinf(logits[outside]).all()) and bool(torch.isfinite(logits[head.vocab]).all())


def test_bad_input_is_named(tiny_target, tokenizer, make_tiny_model, head_folder, tmp_path):
    with pytest.raises(ValueError, match="needs a trained EAGLE head.*heads ship only for the embedded smollm2-135m"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="eagle")
    with pytest.raises(FileNotFoundError, match="no eagle head in .*accelgen train eagle"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="eagle", heads=str(tmp_path))
    other = make_tiny_model("qwen2", seed=0, vocab_size=1024)
    with pytest.raises(ValueError, match="eagle head .* do not fit this model: vocabulary 49152, the model's is 1024"):
        accelgen.generate(other, tokenizer, [5, 17, 23], method="eagle", heads=head_folder)
    with pytest.raises(ValueError, match="dynamic tree needs width, depth and max_nodes >= 1"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="eagle", heads=head_folder, width=0)


# --- EAGLE-3 heads -------------------------------------------------------------------------------------------

from accelgen.heads.eagle3 import new_eagle3_head
from accelgen.train.eagle import collect_layer_states, target_layers_for


def trained_eagle3_head(model, windows, folder, steps=30):
    """An EAGLE-3 head trained for a few steps (unrolled over 3) on windows (count, n), saved in folder."""
    states, choices = collect_layer_states(model, windows, target_layers_for(model))
    head, _ = train_eagle(model, windows, states, choices, EagleConfig(steps=steps, batch_size=8, learning_rate=1e-2,
                                                                       draft_vocab=4096, recipe="eagle3", ttt_steps=3))
    head.save(folder)
    return str(folder)


@pytest.fixture(scope="module")
def four_layers(make_tiny_model):
    return make_tiny_model("qwen2", seed=0, layers=4)


@pytest.fixture(scope="module")
def eagle3_folder(four_layers, tokenizer, tmp_path_factory, own_continuations):
    """Trained on the 4-layer tiny model's greedy continuations of variants of PROMPT."""
    texts = [tokenizer.decode(PROMPT + tokens) for tokens in
             own_continuations(four_layers, tokenizer, [[start] + PROMPT[1:] for start in range(5, 21)], 50)]
    windows = packed_windows(tokenizer, texts, seq_len=56, count=16)
    return trained_eagle3_head(four_layers, windows, tmp_path_factory.mktemp("eagle3"))


@pytest.mark.parametrize("options", [{}, {"width": 2, "depth": 3, "max_nodes": 6},
                                     {"paths": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}])
def test_a_trained_eagle3_head_is_lossless_with_partial_acceptance(four_layers, tokenizer, eagle3_folder,
                                                                   assert_lossless, options):
    result = assert_lossless(four_layers, tokenizer, PROMPT, "eagle", 40, heads=eagle3_folder, **options)
    assert 0 < result.stats["accepted_draft_tokens"] < result.stats["draft_tokens"]
    assert result.stats["mean_accepted_tokens"] > 1.5


def test_an_untrained_eagle3_head_is_lossless(four_layers, tokenizer, assert_lossless, tmp_path):
    new_eagle3_head(four_layers, torch.arange(0, 49152, 3)).save(tmp_path)
    assert_lossless(four_layers, tokenizer, PROMPT, "eagle", 16, heads=str(tmp_path), width=3, depth=2, max_nodes=5)


def test_an_eagle3_head_accepts_whole_drafts_on_a_cycle(cycling_model, tokenizer, cycle_prompt, greedy,
                                                        assert_lossless, tmp_path):
    text = cycle_prompt + greedy(cycling_model, tokenizer, cycle_prompt, 60).token_ids
    folder = trained_eagle3_head(cycling_model, torch.tensor([text[start : start + 40] for start in range(0, 40, 3)]),
                                 tmp_path, steps=40)
    result = assert_lossless(cycling_model, tokenizer, cycle_prompt, "eagle", 30, heads=folder, width=2, depth=4,
                             max_nodes=8)
    assert max(result.stats["accepted_per_step"]) == 4  # a whole path down the tree


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_eagle3_with_max_new_tokens_smaller_than_the_tree(four_layers, tokenizer, eagle3_folder, assert_lossless,
                                                          budget):
    assert_lossless(four_layers, tokenizer, PROMPT, "eagle", budget, heads=eagle3_folder)


def test_eagle3_stops_at_eos_inside_a_draft(four_layers, tokenizer, eagle3_folder):
    """An EOS the target chooses inside an accepted draft ends the output there, as in greedy decoding."""
    plain = accelgen.generate(four_layers, tokenizer, PROMPT, max_new_tokens=40)
    eos = plain.token_ids[9]  # a token of the output taken as EOS: generation stops at its first occurrence
    expected = accelgen.generate(four_layers, tokenizer, PROMPT, max_new_tokens=40, eos_token_id=eos)
    result = accelgen.generate(four_layers, tokenizer, PROMPT, method="eagle", max_new_tokens=40, eos_token_id=eos,
                               heads=eagle3_folder)
    assert result.token_ids == expected.token_ids and result.finish_reason == expected.finish_reason == "stop"


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_with_an_eagle3_head_keeps_the_target_distribution(sampling_model, assert_samples_target, tmp_path):
    new_eagle3_head(sampling_model).save(tmp_path)  # untrained: the logit lens at the model's last layer input
    assert_samples_target("eagle", [1, 4, 6], heads=str(tmp_path), width=2, depth=2, max_nodes=4)


def test_the_runner_keeps_the_layers_the_head_reads_and_rolls_them_back(four_layers):
    """The runner's kept layer states equal a plain forward's hidden states at those layers, through a tree
    forward and the keep() of an accepted path."""
    runner = ModelRunner(four_layers)
    runner.keep_layers = (1, 2, 3)
    assert not runner.batches  # a forward that keeps states runs alone
    context = torch.tensor(PROMPT + [300, 301])
    runner.forward(context[:6])
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root 300, two children
    runner.forward(torch.tensor([300, 301, 999]), tree=tree)
    runner.keep(6, [0, 1])  # the root and its first child
    with torch.no_grad():
        states = four_layers(context[None], output_hidden_states=True).hidden_states
    expected = torch.cat([states[index][0] for index in (1, 2, 3)], dim=-1)
    assert runner.layer_hidden.shape == (8, 3 * 64) and torch.allclose(runner.layer_hidden, expected, atol=1e-4)
    assert runner.hidden is None  # the final states are not kept unless asked for


def test_an_eagle3_head_reads_layers_not_final_features(four_layers, tokenizer, eagle3_folder):
    """Built by the loop, its drafter has the runner keep the three layers instead of the final features."""
    sequence = accelgen.generate(four_layers, tokenizer, PROMPT, method="eagle", max_new_tokens=5,
                                 heads=eagle3_folder)
    assert sequence.stats["target_forwards"] >= 1
    from accelgen.loop import Sequence

    started = Sequence.start(four_layers, tokenizer, PROMPT, method="eagle", heads=eagle3_folder)
    assert started.target.keep_layers == (1, 2, 3) and not started.target.keep_hidden


def test_an_eagle3_head_for_another_model_is_refused(make_tiny_model, tokenizer, eagle3_folder):
    other = make_tiny_model("qwen2", seed=0, layers=2)
    with pytest.raises(ValueError, match="eagle head .* do not fit this model: layer count 4, the model's is 2"):
        accelgen.generate(other, tokenizer, PROMPT, method="eagle", heads=eagle3_folder)


# --- the head shipped for the embedded SmolLM2 ---------------------------------------------------------------

SMOLLM_PROMPT = [{"role": "user", "content": "Write a Python function that returns the sum of a list of numbers."}]


def test_the_shipped_head_drafts_for_the_embedded_smollm2_and_is_exact(smollm, assert_lossless):
    """No heads= given: the head shipped for smollm2-135m drafts, its drafts partly accepted, and the output is
    greedy decoding's token for token (fp32)."""
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, SMOLLM_PROMPT, "eagle", 48, draft_budget="method")
    assert result.stats["draft_tokens"] > 0 and result.stats["mean_accepted_tokens"] > 1.2, result.stats


def test_a_head_the_user_gives_wins_over_the_shipped_one(smollm, monkeypatch, tmp_path):
    model, tokenizer = smollm
    new_eagle3_head(model, torch.arange(0, 4096)).save(tmp_path)

    def not_asked(*args):
        raise AssertionError("the shipped head was looked up though heads= was given")

    monkeypatch.setattr("accelgen.drafters.eagle.shipped_head", not_asked)
    result = accelgen.generate(model, tokenizer, SMOLLM_PROMPT, method="eagle", heads=str(tmp_path), max_new_tokens=4)
    assert len(result.token_ids) == 4
