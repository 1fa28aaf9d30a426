"""The LM head cut to a draft vocabulary: the same logits on its rows, none elsewhere, labels as indices into it,
and the vocabulary chosen by frequency."""

import torch

from accelgen.heads.lm_head import DraftLMHead, draft_vocabulary


def test_the_draft_vocabulary_is_the_most_frequent_tokens_then_the_lowest_ids():
    windows = torch.tensor([[7, 7, 7, 5, 5, 9]])
    choices = torch.tensor([[9, 9, 9, 9, 7, 5]])
    assert draft_vocabulary(windows, choices, vocab_size=20, size=5).tolist() == [0, 1, 5, 7, 9]
    assert len(draft_vocabulary(windows, choices, vocab_size=20, size=50)) == 20


def test_a_cut_head_computes_the_full_heads_rows_and_nothing_else():
    lm_head = torch.nn.Linear(8, 10)
    states = torch.randn(3, 8)
    vocab = torch.tensor([1, 4, 7])
    cut = DraftLMHead(lm_head, vocab)
    full = lm_head(states).detach()
    torch.testing.assert_close(cut.restricted(states), full[:, vocab])
    logits = cut(states)  # (3, 10): -inf outside the draft vocabulary
    torch.testing.assert_close(logits[:, vocab], full[:, vocab])
    assert torch.isinf(logits[:, [0, 2, 3, 5, 6, 8, 9]]).all()
    torch.testing.assert_close(DraftLMHead(lm_head, torch.tensor([], dtype=torch.long))(states), full)


def test_labels_index_the_draft_vocabulary_and_are_ignored_outside_it():
    cut = DraftLMHead(torch.nn.Linear(8, 10), torch.tensor([1, 4, 7]))
    assert cut.label_index(torch.tensor([[7, 1], [4, 2]])).tolist() == [[2, 0], [1, -100]]
