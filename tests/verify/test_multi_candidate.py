"""Multi-candidate verification without replacement (MCSD): exact for candidates drawn without replacement;
the i.i.d. rule applied to the same drafts is not."""

import pytest
import torch

from accelgen.draft import ROOT, Draft
from accelgen.verify import verify_speculative_sampling, verify_without_replacement
from accelgen.verify.multi_candidate import without_replacement_rows

DRAWS = 20_000
BRANCHING = [4, 3]
SHARPNESS = 4.0  # peaked draft tables: removing a drawn token changes the next draw's law a lot


def test_candidates_without_replacement_reproduce_the_target(synthetic):
    counts, exact = synthetic.first_two_tokens(verify_without_replacement, BRANCHING,
                                               synthetic.draw_without_replacement, seed=2, draws=DRAWS, sharpness=SHARPNESS)
    assert synthetic.total_variation(counts, exact) < synthetic.tv_bound(synthetic.VOCAB ** 2, DRAWS)


def test_the_iid_rule_on_candidates_without_replacement_fails(synthetic):
    counts, exact = synthetic.first_two_tokens(verify_speculative_sampling, BRANCHING,
                                               synthetic.draw_without_replacement, seed=2, draws=DRAWS // 4, sharpness=SHARPNESS)
    assert synthetic.total_variation(counts, exact) > 2 * synthetic.tv_bound(synthetic.VOCAB ** 2, DRAWS // 4)


def test_rows_remove_earlier_siblings():
    q = torch.tensor([0.5, 0.3, 0.2])
    draft = Draft(torch.tensor([0, 2, 1]), torch.tensor([ROOT, ROOT, 0]), q.repeat(3, 1))
    rows = without_replacement_rows(draft)
    torch.testing.assert_close(rows, torch.tensor([[0.5, 0.3, 0.2], [0.0, 0.6, 0.4], [0.5, 0.3, 0.2]]))


def test_clear_errors():
    q = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="repeat a token"):
        without_replacement_rows(Draft(torch.tensor([1, 1]), torch.tensor([ROOT, ROOT]), q))
    with pytest.raises(ValueError, match="needs the draft distributions"):
        verify_without_replacement(Draft(torch.tensor([1]), torch.tensor([ROOT])), q, None)
