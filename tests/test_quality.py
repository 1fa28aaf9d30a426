from accelgen.quality import matching_prefix, token_agreement


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
