"""Method options are checked against the type of their declared default, in one place (accelgen/registry.py);
each part of a method (drafter, verifier, runner) is built with its own options; the methods table
(accelgen/method_table.py) lists every method and is imported lazily."""

import sys
from dataclasses import dataclass, make_dataclass

import pytest

import accelgen
from accelgen.drafters.autoregressive import NoDrafter
from accelgen.drafters.base import BuildContext
from accelgen.drafters.draft_model import GammaOptions, SelfDraftingOptions
from accelgen.drafters.layerskip import ExitLayerOptions
from accelgen.drafters.specdec import SpecVerificationOptions
from accelgen.loop import Sequence
from accelgen.method_table import FAMILIES, METHODS
from accelgen.registry import MethodOptions, MethodSpec, Part, parse_option_value
from accelgen.verify import default_verifier


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
    ("specdec", {"gamma": "five"}, "specdec: gamma must be an integer, got 'five'"),
    ("specdec", {"gamma": 4.0}, "gamma must be an integer, got 4.0"),  # never truncated
    ("specdec", {"gamma": True}, "gamma must be an integer, got True"),  # a bool is no count
    ("speculative", {"gamma": 4.0}, "speculative: gamma must be text or an integer, got 4.0"),  # "auto" or a count
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


# --- a method's parts and their options ---------------------------------------------------------------------


def test_each_part_gets_its_own_options_only():
    spec = accelgen.get_method("specdec")
    drafting, verifying, running = spec.split_options(spec.check_options({"gamma": 3, "beta": 2}))
    assert drafting == GammaOptions(gamma=3)
    assert verifying == SpecVerificationOptions(beta=2, tau=1.0)
    assert running is None
    spec = accelgen.get_method("layerskip")
    drafting, verifying, running = spec.split_options(spec.check_options({"exit_layer": 0, "gamma": 2}))
    assert drafting == SelfDraftingOptions(gamma=2) and verifying is None and running == ExitLayerOptions(0)


def test_a_method_lists_the_options_of_all_its_parts():
    assert accelgen.get_method("specdec").options == {"gamma": 5, "beta": 3, "tau": 1.0}
    assert accelgen.get_method("layerskip").options == {"exit_layer": None, "gamma": "auto",
                                                        "gamma_schedule": "constant", "max_gamma": 32}


@dataclass(frozen=True)
class Heard(MethodOptions):
    width: int = 2


@dataclass(frozen=True)
class Judged(MethodOptions):
    strictness: float = 0.5

    def __post_init__(self):
        if not 0 <= self.strictness <= 1:
            raise ValueError(f"spy: strictness must be in [0, 1], got {self.strictness}")


@pytest.fixture
def spy_method(monkeypatch):
    """Registers `spy`: a drafter and a verifier that record the options and the build context they get."""
    received = {}

    def make_drafter(build, options):
        received["drafter"], received["build"] = options, build
        return NoDrafter()

    def make_verifier(sampling, options):
        received["verifier"] = options
        return default_verifier(sampling)

    spec = MethodSpec("spy", "test", "distribution-exact", "-", "records its parts' options",
                      Part(make_drafter, Heard), verifier=Part(make_verifier, Judged))
    monkeypatch.setitem(accelgen.registry._METHODS, spec.name, spec)  # removed again after the test
    return received


def test_the_drafter_and_the_verifier_are_built_with_their_own_options(spy_method, tiny_target, tokenizer):
    accelgen.generate(tiny_target, tokenizer, [5, 17, 923], method="spy", max_new_tokens=2, width=3)
    assert spy_method["drafter"] == Heard(width=3) and spy_method["verifier"] == Judged(strictness=0.5)


def test_the_build_context_holds_the_target_runner_the_loop_feeds(spy_method, tiny_target, tiny_draft, tokenizer):
    sequence = Sequence.start(tiny_target, tokenizer, [5, 17, 923], method="spy", draft_model=tiny_draft, seed=3)
    build = spy_method["build"]
    assert isinstance(build, BuildContext)
    assert build.target is sequence.target and build.target_model is tiny_target
    assert build.draft_model is tiny_draft and build.tokenizer is tokenizer
    assert build.sampling is sequence.sampling and build.generator is sequence.generator
    sequence.finish()


def test_triforce_gets_the_target_runner_at_construction(tiny_target, tiny_draft, tokenizer):
    sequence = Sequence.start(tiny_target, tokenizer, [5, 17, 923], method="triforce", draft_model=tiny_draft,
                              draft_budget="method")
    assert sequence.drafter.target is sequence.target
    sequence.finish()


def test_a_part_checks_its_own_values(spy_method, tiny_target, tokenizer):
    with pytest.raises(ValueError, match=r"spy: strictness must be in \[0, 1\], got 2"):
        accelgen.generate(tiny_target, tokenizer, [5, 17, 923], method="spy", strictness=2)
    with pytest.raises(ValueError, match=r"bild: rollback_threshold \(a cross-entropy\) must be a number >= 0"):
        spec = accelgen.get_method("bild")
        spec.split_options(spec.check_options({"rollback_threshold": -1}))


def test_an_unknown_option_names_the_method_and_its_options(spy_method):
    with pytest.raises(ValueError, match="method 'spy' has no option 'depth'; its options are: strictness, width"):
        accelgen.get_method("spy").check_options({"depth": 2})
    with pytest.raises(ValueError, match="method 'specdec' has no option 'alpha'; its options are: beta, gamma, tau"):
        accelgen.get_method("specdec").check_options({"alpha": 1.0})


def test_an_option_shared_by_two_parts_has_one_default():
    with pytest.raises(ValueError, match="clash: option 'width' has different defaults in its parts"):
        MethodSpec("clash", "test", "lossy", "-", "-", Part(None, Heard),
                   verifier=Part(None, make_dataclass("Wider", [("width", int, 4)], bases=(MethodOptions,), frozen=True)))


def test_the_draft_model_check_says_how_to_pass_one():
    spec = accelgen.get_method("speculative")
    spec.check_needs(draft_model=object())
    with pytest.raises(ValueError, match="method 'speculative' needs a draft model: pass --draft"):
        spec.check_needs(draft_model=None, how="--draft")
    accelgen.get_method("pld").check_needs(draft_model=None)


# --- the methods table ---------------------------------------------------------------------------------------


def test_the_table_lists_every_registered_method_with_its_family():
    specs = {spec.name: spec for spec in accelgen.list_methods()}
    assert set(specs) == set(METHODS) | {"online"}  # online is declared by accelgen/__init__.py (it trains)
    for family, methods in FAMILIES.items():
        for name, module in methods.items():
            assert specs[name].family == family
            assert specs[name].drafter.make.__module__ in (module, "accelgen.drafters.autoregressive",
                                                          "accelgen.drafters.draft_model")


def test_a_method_module_is_imported_when_its_method_is_asked_for(monkeypatch, tmp_path):
    (tmp_path / "lazy_method.py").write_text(
        "from accelgen.registry import MethodSpec, Part, register\n"
        "register(MethodSpec('lazy', 'test', 'lossy', '-', '-', Part(None)))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(accelgen.registry, "METHODS", {**METHODS, "lazy": "lazy_method"})
    monkeypatch.setattr(accelgen.registry, "_METHODS", dict(accelgen.registry._METHODS))
    monkeypatch.delitem(sys.modules, "lazy_method", raising=False)
    assert "lazy_method" not in sys.modules
    assert accelgen.get_method("lazy").family == "test" and "lazy_method" in sys.modules
    monkeypatch.delitem(sys.modules, "lazy_method")


def test_a_declared_method_is_imported_when_asked_for_and_cannot_be_declared_twice(monkeypatch, tmp_path):
    (tmp_path / "declared_method.py").write_text(
        "from accelgen.registry import MethodSpec, Part, register\n"
        "register(MethodSpec('declared', 'test', 'lossy', '-', '-', Part(None)))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(accelgen.registry, "_DECLARED", dict(accelgen.registry._DECLARED))
    monkeypatch.setattr(accelgen.registry, "_METHODS", dict(accelgen.registry._METHODS))
    monkeypatch.delitem(sys.modules, "declared_method", raising=False)
    accelgen.declare_method("declared", "declared_method")
    assert "declared_method" not in sys.modules
    assert accelgen.get_method("declared").family == "test" and "declared_method" in sys.modules
    monkeypatch.delitem(sys.modules, "declared_method")
    with pytest.raises(ValueError, match="method 'jacobi' is already declared, by accelgen.drafters.jacobi"):
        accelgen.declare_method("jacobi", "declared_method")


def test_an_unknown_method_lists_the_table():
    with pytest.raises(ValueError, match="unknown method 'nope'; available methods: auto, autoregressive, bild"):
        accelgen.get_method("nope")
