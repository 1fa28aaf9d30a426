"""Method options are checked against the type of their declared default, in one place (accelgen/registry.py)."""

import pytest

import accelgen
from accelgen.registry import parse_option_value


def test_every_method_takes_its_own_defaults():
    for spec in accelgen.list_methods():
        assert spec.check_options(dict(spec.options)) == spec.options


@pytest.mark.parametrize("method, options", [
    ("speculative", {"gamma": 3, "gamma_schedule": "heuristic", "confidence_threshold": 0}),  # an int for a float
    ("pld", {"draft_length": 4}), ("pld", {"draft_length": "auto"}),  # a word default stands for a count
    ("lookahead-decoding", {"max_nodes": None}),
    ("calm", {"threshold": "calibrated"}), ("calm", {"threshold": 1}), ("free", {"threshold": 0.5}),
    ("self-speculative", {"skip": {"skip_attention": [1], "skip_mlp": []}}), ("self-speculative", {"skip": "default"}),
    ("specinfer", {"branching": (2, 1), "dynamic": True}),
    ("rest", {"datastore": "some/folder"}),  # a None default: a path or an object, checked by the method
])
def test_options_of_the_declared_type_pass(method, options):
    assert accelgen.get_method(method).check_options(options).items() >= options.items()


@pytest.mark.parametrize("method, options, message", [
    ("speculative", {"gamma": "five"}, "speculative: gamma must be an integer, got 'five'"),
    ("speculative", {"gamma": 4.0}, "gamma must be an integer, got 4.0"),  # never truncated
    ("speculative", {"gamma": True}, "gamma must be an integer, got True"),  # a bool is no count
    ("specdec", {"tau": float("nan")}, "specdec: tau must be a finite number, got nan"),
    ("specdec", {"tau": "1"}, "tau must be a finite number, got '1'"),
    ("rest", {"context": 1}, "rest: context must be true or false, got 1"),
    ("specinfer", {"branching": 2}, "branching must be a list, got 2"),
    ("pld", {"max_ngram": "["}, "pld: max_ngram must be an integer, got '\\['"),
    ("pld", {"draft_length": 2.5}, "draft_length must be text or an integer, got 2.5"),
    ("medusa", {"max_nodes": "auto"}, "max_nodes must be an integer, got 'auto'"),  # its default is a count
    ("calm", {"threshold": "auto"}, "calm: threshold must be a finite number or 'calibrated', got 'auto'"),
])
def test_options_of_another_type_are_refused_by_name(method, options, message):
    with pytest.raises(ValueError, match=message):
        accelgen.get_method(method).check_options(options)


def test_command_line_values_are_parsed_by_the_options_type():
    assert parse_option_value("8") == 8 and parse_option_value("[2, 2]") == [2, 2] and parse_option_value("[") == "["
    assert parse_option_value("2024", (str,)) == "2024"  # a word option: text, though it reads as a number
    assert parse_option_value("8", (str, int)) == 8 and parse_option_value("auto", (str, int)) == "auto"
    assert parse_option_value("8", (int,)) == 8
