"""The processor pipeline: each tree row processed with its own path's context, on the scores' device, OpenAI's
penalties, user processors, and clear errors for bad settings."""

import pytest
import torch

from accelgen.draft import ROOT, Draft
from accelgen.processors import build_pipeline, tree_paths

VOCAB = 50
PROMPT_LENGTH = 3


def pipeline(**settings):
    return build_pipeline(prompt_length=PROMPT_LENGTH, eos_token_ids={2}, vocab_size=VOCAB, **settings)


def test_nothing_enabled_builds_no_pipeline():
    assert pipeline() is None
    assert pipeline(repetition_penalty=1.0, presence_penalty=0.0, logits_processors=[]) is None


def test_tree_paths_follow_parents():
    #  root ─ 7(0) ─ 8(1)
    #       └ 9(2) ─ 10(3)
    draft = Draft(torch.tensor([7, 8, 9, 10]), torch.tensor([ROOT, 0, ROOT, 2]))
    assert tree_paths(draft) == [[], [7], [7, 8], [9], [9, 10]]


def test_each_tree_row_is_processed_with_its_own_path():
    stages = pipeline(repetition_penalty=1.5, no_repeat_ngram_size=2, presence_penalty=0.3, frequency_penalty=0.2)
    context = torch.tensor([4, 5, 6, 7, 8])
    draft = Draft(torch.tensor([7, 8, 9, 10, 7]), torch.tensor([ROOT, 0, ROOT, 2, 1]))
    logits = torch.randn(len(draft) + 1, VOCAB, generator=torch.Generator().manual_seed(0))
    processed = stages.tree_rows(context, draft, logits)
    for row, path in enumerate(tree_paths(draft)):
        alone = stages.row(torch.cat([context, torch.tensor(path, dtype=torch.long)]), logits[row])
        torch.testing.assert_close(processed[row], alone, rtol=0, atol=0)
    assert not torch.equal(processed[1], processed[3]), "rows of different paths must differ here"
    # row 2 follows 7, 8, 7, 8: the bigram (8, 7) was seen on its path, so 7 is banned after its last 8
    # (no_repeat_ngram_size=2); row 0 also ends with 8, but its context 4 5 6 7 8 has no (8, 7)
    assert processed[2, 7] == float("-inf") and processed[0, 7] > float("-inf")


def test_presence_and_frequency_count_generated_tokens_only():
    stages = pipeline(presence_penalty=0.5, frequency_penalty=0.25)
    context = torch.tensor([11, 11, 12, 13, 13, 13, 14])  # prompt 11 11 12, generated 13 13 13 14
    logits = torch.zeros(VOCAB)
    processed = stages.row(context, logits)
    expected = torch.zeros(VOCAB)
    expected[13] = -(0.5 + 3 * 0.25)
    expected[14] = -(0.5 + 1 * 0.25)
    torch.testing.assert_close(processed, expected)


def test_user_processors_see_each_rows_context():
    seen = []

    def ban_last_token(context_ids, logits):
        seen.append(context_ids.tolist())
        logits[context_ids[-1]] = float("-inf")
        return logits

    stages = pipeline(logits_processors=[ban_last_token])
    draft = Draft(torch.tensor([20, 21]), torch.tensor([ROOT, ROOT]))
    processed = stages.tree_rows(torch.tensor([1, 2, 3]), draft, torch.zeros(3, VOCAB))
    assert sorted(seen) == [[1, 2, 3], [1, 2, 3, 20], [1, 2, 3, 21]]
    assert [int(processed[row].argmin()) for row in range(3)] == [3, 20, 21]


def test_logits_are_not_changed_in_place():
    stages = pipeline(no_repeat_ngram_size=1)
    logits = torch.zeros(2, VOCAB)
    stages.tree_rows(torch.tensor([1, 2, 3]), Draft.chain(torch.tensor([4])), logits)
    assert torch.equal(logits, torch.zeros(2, VOCAB))


def test_rows_are_processed_on_the_scores_device():
    """The host's contexts travel to the scores' device, and the processed rows stay there: on the `meta` device
    (shapes without data) as on a GPU, every stage sees ids and scores on one device."""
    devices = []

    def record(ids, row):
        devices.append((ids.device.type, row.device.type))
        return row

    stages = pipeline(repetition_penalty=1.3, presence_penalty=0.5, min_new_tokens=20, logits_processors=[record])
    draft = Draft(torch.tensor([4, 5, 6]), torch.tensor([ROOT, 0, ROOT]))
    processed = stages.tree_rows(torch.tensor([1, 2, 3, 7]), draft, torch.zeros(4, VOCAB, device="meta"))
    assert processed.device.type == "meta" and processed.shape == (4, VOCAB)
    assert set(devices) == {("meta", "meta")}


@pytest.mark.parametrize("settings, message", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number"),
    (dict(presence_penalty="high"), "presence_penalty must be a finite number"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be an integer >= 0"),
    (dict(min_new_tokens=2.5), "min_new_tokens must be an integer >= 0"),
    (dict(bad_words_ids=[[3], [VOCAB]]), "not a token id of this model"),
    (dict(bad_words_ids=[3, 4]), "bad_words_ids must be a list of token id lists"),
    (dict(bad_words_ids=[]), "bad_words_ids"),
    (dict(logits_processors=[42]), "logits_processors must hold callables"),
    (dict(logits_processors=print), "logits_processors must be a list"),
])
def test_bad_settings_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        pipeline(**settings)


def test_a_user_processor_returning_the_wrong_shape_is_named():
    stages = pipeline(logits_processors=[lambda ids, logits: logits[:3]])
    with pytest.raises(ValueError, match=r"must return a \(50,\) tensor"):
        stages.row(torch.tensor([1, 2]), torch.zeros(VOCAB))


def test_min_new_tokens_bans_eos_as_transformers_does():
    from transformers import MinNewTokensLengthLogitsProcessor

    scores = torch.randn(2, VOCAB)
    for context in (torch.tensor([[1, 2, 3, 7]] * 2), torch.tensor([[1, 2, 3, 7, 8, 9, 4, 4, 4, 4]] * 2)):
        ours = pipeline(min_new_tokens=3).stages[0](context, scores)
        theirs = MinNewTokensLengthLogitsProcessor(PROMPT_LENGTH, 3, [2])(context, scores)
        assert torch.equal(ours, theirs)
