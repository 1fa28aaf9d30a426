"""Skeleton parsing: the leading numbered list, robust to what small models write around it; none -> fallback."""

import pytest

from accelgen.skeleton.expand import shared_prefix_length
from accelgen.skeleton.prompts import MAX_POINTS, assemble_answer, check_question, parse_points, point_prompt_ids


def test_a_clean_skeleton_gives_its_points():
    assert parse_points("1. Plan ahead\n2. Set a budget\n3. Book early") == ["Plan ahead", "Set a budget", "Book early"]


def test_a_messy_skeleton_gives_its_points():
    messy = ("Sure! Here is the skeleton:\n\n1) **Plan ahead.**\n\n- 2. Set a budget:\n**3.** Book early\n"
             "These points cover it.\n4. Not part of the list")
    assert parse_points(messy) == ["Plan ahead", "Set a budget", "Book early"]


def test_the_list_ends_where_the_numbering_breaks():
    assert parse_points("1. One\n2. Two\n4. Four\n3. Three") == ["One", "Two"]


def test_no_list_or_a_single_point_falls_back():
    assert parse_points("Just write the code directly.") == []
    assert parse_points("1. Only one point") == []
    assert parse_points("") == []


def test_a_skeleton_cut_by_its_budget_drops_its_unfinished_last_point():
    assert parse_points("1. One\n2. Two\n3. Thr", complete=False) == ["One", "Two"]
    assert parse_points("1. One\n2. Two\n3. Three\n", complete=False) == ["One", "Two", "Three"]


def test_at_most_ten_points_are_kept():
    skeleton = "\n".join(f"{index}. Point {index}" for index in range(1, 15))
    assert len(parse_points(skeleton)) == MAX_POINTS


def test_the_answer_is_each_point_with_its_expansion():
    assert assemble_answer(["Plan", "Budget"], [" Early.\n", " Low."]) == "1. Plan: Early.\n2. Budget: Low."


def test_an_empty_question_is_refused():
    with pytest.raises(ValueError, match="question is empty"):
        check_question("  \n")
    with pytest.raises(TypeError, match="must be text"):
        check_question(["a"])


def test_point_prompts_share_the_question_and_the_skeleton(tokenizer):
    points = ["Plan", "Budget", "Book"]
    prompts = [point_prompt_ids(tokenizer, "How do I travel cheaply?", points, index) for index in (1, 2, 3)]
    shared = tokenizer.decode(prompts[0][: shared_prefix_length(prompts)])
    assert "How do I travel cheaply?" in shared and "1. Plan\n2. Budget\n3. Book" in shared
    assert tokenizer.decode(prompts[1]).endswith("2. Budget:")


def test_the_shared_prefix_leaves_each_prompt_a_token_of_its_own():
    assert shared_prefix_length([[5, 6, 7, 8], [5, 6, 9]]) == 2
    assert shared_prefix_length([[5, 6], [5, 6, 7]]) == 1
    assert shared_prefix_length([[1, 2], [3, 4]]) == 0
