"""PaSS drafting: token-for-token greedy decoding with slots all, partly or (untrained) hardly ever right, cut by
max_new_tokens and stop strings; sampling keeps the target distribution; clear errors for missing or unfit
embeddings. (At temperature 0 the first draft token is the target's own choice, so it is always accepted.)"""

import pytest
import torch

import accelgen
from accelgen.heads.pass_embeddings import LookaheadEmbeddings
from accelgen.models.runner import ModelRunner
from accelgen.train.pass_embeddings import new_embeddings

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]


def saved(embeddings: LookaheadEmbeddings, folder) -> str:
    embeddings.save(folder)
    return str(folder)


def cycle_slots(model, tokens: list[int], folder) -> str:
    """Slots set to the embeddings of `tokens`: on the cycling model a row's logits depend on its own input alone,
    so slot i guesses what follows tokens[i]."""
    embeddings = LookaheadEmbeddings(len(tokens), model.config.hidden_size, model.config.vocab_size,
                                     layer_count=model.config.num_hidden_layers)
    with torch.no_grad():
        embeddings.vectors.copy_(model.get_input_embeddings().weight[tokens])
    return saved(embeddings, folder)


@pytest.mark.parametrize("slot_offsets, accepted", [([0, 1, 2, 3], 5), ([0, 1, 5, 2], 3)])
def test_drafts_are_accepted_wholly_or_partly_on_a_cycle(cycling_model, tokenizer, cycle_prompt, greedy,
                                                         assert_lossless, tmp_path, slot_offsets, accepted):
    """The first draft follows the prompt's last token: the root's row gives cycle[0], and slots set to cycle[0],
    cycle[1], ... guess cycle[1], cycle[2], ...: all right; slots for offsets [0, 1, 5, 2] are right twice, then
    wrong."""
    cycle = greedy(cycling_model, tokenizer, cycle_prompt, 6).token_ids
    folder = cycle_slots(cycling_model, [cycle[offset] for offset in slot_offsets], tmp_path)
    result = assert_lossless(cycling_model, tokenizer, cycle_prompt, "pass", 24, heads=folder)
    assert result.stats["accepted_per_step"][0] == accepted
    if accepted == 5:  # a whole draft and the bonus token are one period: every step but the cut last is whole
        assert result.stats["accepted_per_step"][:-1] == [5] * (len(result.stats["accepted_per_step"]) - 1)


def test_untrained_slots_are_lossless(tiny_target, tokenizer, assert_lossless, tmp_path):
    folder = saved(new_embeddings(tiny_target, 3), tmp_path)
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "pass", 30, heads=folder)
    assert 0 < result.stats["acceptance_rate"] < 1


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_max_new_tokens_smaller_than_the_draft(cycling_model, tokenizer, cycle_prompt, greedy, assert_lossless,
                                               tmp_path, budget):
    cycle = greedy(cycling_model, tokenizer, cycle_prompt, 6).token_ids
    folder = cycle_slots(cycling_model, cycle[:4], tmp_path)
    assert_lossless(cycling_model, tokenizer, cycle_prompt, "pass", budget, heads=folder)


def test_a_stop_string_inside_a_draft(cycling_model, tokenizer, cycle_prompt, greedy, tmp_path):
    cycle = greedy(cycling_model, tokenizer, cycle_prompt, 12).token_ids
    folder = cycle_slots(cycling_model, cycle[:4], tmp_path)
    stop = tokenizer.decode(cycle[8:10])  # inside the second, wholly accepted draft
    expected = accelgen.generate(cycling_model, tokenizer, cycle_prompt, max_new_tokens=30, stop=stop)
    result = accelgen.generate(cycling_model, tokenizer, cycle_prompt, method="pass", max_new_tokens=30, stop=stop,
                               heads=folder)
    assert (result.text, result.finish_reason) == (expected.text, "stop")


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(sampling_model, assert_samples_target, tmp_path):
    folder = saved(new_embeddings(sampling_model, 2), tmp_path)
    assert_samples_target("pass", [1, 4, 6], heads=folder)


def test_the_drafting_forward_leaves_the_cache_as_it_was(tiny_target, tmp_path):
    from accelgen.drafters.pass_embeddings import PassDrafter
    from accelgen.loop import draft_with_target
    from accelgen.sampling import SamplingConfig

    runner = ModelRunner(tiny_target)
    runner.forward(torch.tensor(PROMPT[:-1]))
    drafter = PassDrafter(new_embeddings(tiny_target, 3), SamplingConfig(), None)
    draft = draft_with_target(runner, drafter, torch.tensor(PROMPT), max_nodes=3)
    assert len(draft) == 3 and runner.length == len(PROMPT) - 1
    assert int(draft.tokens[0]) == int(tiny_target(torch.tensor([PROMPT])).logits[0, -1].argmax())
    fresh = ModelRunner(tiny_target)  # on the first step the prompt is read in the drafting forward, and kept
    assert draft_with_target(fresh, drafter, torch.tensor(PROMPT), max_nodes=3).tokens.tolist() == draft.tokens.tolist()
    assert fresh.length == len(PROMPT) - 1
    with pytest.raises(ValueError, match="follow a chain, not a tree"):
        runner.forward(torch.tensor([5]), tree=torch.ones(1, 1, dtype=torch.bool), appended=drafter.embeddings.vectors)


def test_bad_input_is_named(tiny_target, tokenizer, make_tiny_model, tmp_path):
    with pytest.raises(ValueError, match="pass needs trained look-ahead embeddings"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="pass")
    with pytest.raises(FileNotFoundError, match="accelgen train pass"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="pass", heads=str(tmp_path))
    other = saved(new_embeddings(make_tiny_model("qwen2", seed=0, vocab_size=1000), 2), tmp_path / "other")
    with pytest.raises(ValueError, match="pass embeddings .* do not fit this model: vocabulary 1000"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="pass", heads=other)
