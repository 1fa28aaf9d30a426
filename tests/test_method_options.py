"""The one grammar of method options on the command line: name=value, method.name=value, variants and lists."""

import pytest

from accelgen.method_options import base_method, parse_method_options, parse_options, parse_variant, split_list


def test_method_lists_keep_bracketed_option_values_whole():
    assert split_list("a, specinfer@paths=[[0],[1],[0,0]]+dynamic=false,b") == [
        "a", "specinfer@paths=[[0],[1],[0,0]]+dynamic=false", "b"]
    assert split_list("") is None


def test_parse_method_options():
    assert parse_method_options(["speculative.gamma=8", "speculative.gamma_schedule=heuristic", "hf-assisted.num-assistant-tokens=5"]) == {
        "speculative": {"gamma": 8, "gamma_schedule": "heuristic"}, "hf-assisted": {"num_assistant_tokens": 5}}
    with pytest.raises(ValueError, match="method.name=value"):
        parse_method_options(["gamma=8"])
    # values follow the option's declared type: auto's workload is a word, even one that reads as a number
    assert parse_method_options(["auto.workload=2024", "pld.max_ngram=2"]) == {
        "auto": {"workload": "2024"}, "pld": {"max_ngram": 2}}


def test_the_three_forms_type_a_value_alike():
    """auto's workload is a word and pld's max_ngram a number, whichever form names them."""
    import accelgen

    assert parse_options(["workload=2024"], accelgen.get_method("auto").options) == {"workload": "2024"}
    assert parse_variant("auto@workload=2024") == ("auto", {"workload": "2024"})
    assert parse_variant("pld@max-ngram=2+min_ngram=1") == ("pld", {"max_ngram": 2, "min_ngram": 1})
    assert parse_options(["max-ngram=2"], accelgen.get_method("pld").options) == {"max_ngram": 2}


def test_a_plain_name_is_its_own_method():
    assert parse_variant("speculative") == ("speculative", {})
    assert base_method("specdec@beta=2+tau=0.5") == "specdec" and base_method("specdec") == "specdec"


@pytest.mark.parametrize("parse, text, message", [
    (lambda text: parse_options([text], {}), "gamma", "must look like name=value"),
    (lambda text: parse_options([text], {}), "=8", "must look like name=value"),
    (lambda text: parse_method_options([text]), "speculative.=8", "must look like method.name=value"),
    (lambda text: parse_variant(text), "specdec@beta", "name=value joined by"),
])
def test_a_pair_without_a_name_and_value_is_named(parse, text, message):
    with pytest.raises(ValueError, match=message) as error:
        parse(text)
    assert repr(text) in str(error.value)
