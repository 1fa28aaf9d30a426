import pytest

from accelgen.quality import matching_prefix, rouge_l, token_agreement


def test_token_agreement_counts_equal_positions_over_the_longer_output():
    assert token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert token_agreement([1, 2, 3, 4], [1, 2, 9]) == 0.5  # 2 of 4: the missing token disagrees too
    assert token_agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert token_agreement([1, 2, 3, 4], [9, 2, 3, 4]) == 0.75  # positional: agreement after a difference counts
    assert token_agreement([5], []) == 0.0
    assert token_agreement([], []) == 1.0


def test_matching_prefix_is_where_the_outputs_part():
    assert matching_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert matching_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert matching_prefix([7], [8]) == 0
    assert matching_prefix([], [1]) == 0


def test_rouge_l_forgives_a_shift_that_token_agreement_does_not():
    reference, shifted = [1, 2, 3, 4], [9, 1, 2, 3]
    assert token_agreement(reference, shifted) == 0.0
    assert rouge_l(reference, shifted) == 0.75  # common subsequence 1 2 3: 3/4 of each
    assert rouge_l([1, 2, 3], [1, 2, 3]) == rouge_l([], []) == 1.0
    assert rouge_l([1, 2], [3]) == rouge_l([1], []) == 0.0
    assert rouge_l([1, 2, 3, 4], [1, 2]) == pytest.approx(2 * 0.5 / 1.5)  # precision 1, recall 1/2


def test_rouge_l_compares_token_ids_not_their_digits():
    assert rouge_l([12, 3], [1, 2, 3]) == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))  # only 3 is shared
    assert rouge_l([7] * 40, [7] * 40 + [8] * 10) == pytest.approx(2 * 0.8 / 1.8)  # precision 40/50, recall 1
