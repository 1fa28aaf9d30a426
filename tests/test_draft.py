import pytest
import torch

from accelgen.draft import ROOT, Draft, Verdict, children, depths, tree_attention


def test_chain_is_a_width_one_tree():
    draft = Draft.chain(torch.tensor([7, 8, 9]))
    assert draft.parents.tolist() == [ROOT, 0, 1]
    assert draft.is_chain
    assert depths(draft.parents).tolist() == [1, 2, 3]
    # a chain's tree attention is plain causal attention
    assert torch.equal(tree_attention(draft.parents), torch.ones(4, 4, dtype=torch.bool).tril())


def test_tree_attention_sees_ancestors_only():
    #   root ─ a(0) ─ b(1)
    #        └ c(2) ─ d(3)
    parents = torch.tensor([ROOT, 0, ROOT, 2])
    allowed = tree_attention(parents).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 0, 0, 1, 1],
    ]
    assert depths(parents).tolist() == [1, 2, 1, 2]
    assert children(parents) == {ROOT: [0, 2], 0: [1], 1: [], 2: [3], 3: []}
    assert not Draft(torch.tensor([1, 2, 3, 4]), parents).is_chain


def test_parents_must_come_first():
    with pytest.raises(ValueError, match="after their parents"):
        Draft(torch.tensor([1, 2]), torch.tensor([1, ROOT]))
    with pytest.raises(ValueError, match="equal 1-D shapes"):
        Draft(torch.tensor([1, 2]), torch.tensor([ROOT]))


def test_truncation_keeps_a_tree_and_its_probs():
    probs = torch.rand(3, 5)
    draft = Draft.chain(torch.tensor([1, 2, 3]), probs).truncated(2)
    assert draft.tokens.tolist() == [1, 2] and torch.equal(draft.draft_probs, probs[:2])
    assert len(Draft.empty()) == 0 and Draft.empty().is_chain


def test_verdict_new_tokens_are_accepted_then_next():
    draft = Draft(torch.tensor([10, 11, 12]), torch.tensor([ROOT, ROOT, 1]))
    assert Verdict(accepted=[1, 2], next_token=99).new_tokens(draft) == [11, 12, 99]


def test_tree_attention_after_a_causal_prefix():
    """The first step feeds the prompt (prefix 3, the root last) and a two-branch draft together."""
    allowed = tree_attention(torch.tensor([ROOT, ROOT]), prefix=3).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 0, 1],
    ]


def test_tree_attention_is_built_once_per_shape():
    parents = [ROOT, 0, ROOT, 2]
    first = tree_attention(torch.tensor(parents))
    assert tree_attention(torch.tensor(parents)) is first
    assert tree_attention(torch.tensor(parents), prefix=2).shape == (6, 6)  # the first step's shape is built afresh
