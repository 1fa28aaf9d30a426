"""Structured output: response_format constrains the target and the drafts; constrained speculation equals
constrained autoregressive decoding token for token, and the JSON validates against its schema."""

import json

import jsonschema
import pytest
import torch

pytest.importorskip("xgrammar", reason="structured output needs accelgen[structured]")

import accelgen  # noqa: E402
from accelgen.draft import ROOT, Draft  # noqa: E402
from accelgen.processors import LogitsPipeline, tree_paths  # noqa: E402
from accelgen.structured import grammar_constraint  # noqa: E402

PROMPT = [5, 17, 923, 4410, 77, 12]
# closed choices only: a random model would write an unconstrained string or number forever
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "ok": {"type": "boolean"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["answer", "ok", "tags"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def constrained(tiny_target, tokenizer):
    return accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=60, response_format=RESPONSE_FORMAT)


def test_constrained_output_validates_against_the_schema(constrained, tiny_target, tokenizer):
    assert constrained.finish_reason == "stop"  # the grammar ended with an EOS
    jsonschema.validate(json.loads(constrained.text), SCHEMA)
    free = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=10)
    assert free.text[:1] != "{"  # the constraint, not the model, made it JSON


@pytest.mark.parametrize("method, draft", [("speculative", "target"), ("speculative", "unrelated"), ("pld", None),
                                           ("specinfer", "target")])
def test_constrained_methods_equal_constrained_autoregressive(constrained, tiny_target, tiny_draft, tokenizer,
                                                              method, draft):
    draft_model = {"target": tiny_target, "unrelated": tiny_draft, None: None}[draft]
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method=method, draft_model=draft_model,
                               max_new_tokens=60, response_format=RESPONSE_FORMAT, draft_budget="method")
    assert result.token_ids == constrained.token_ids
    if method == "speculative" and draft == "target":  # the draft model drafts through the grammar too
        assert result.stats["mean_accepted_tokens"] > 2


def test_constrained_seeded_sampling_is_exact_across_methods(tiny_target, tokenizer):
    settings = dict(max_new_tokens=60, temperature=1.0, seed=3, response_format=RESPONSE_FORMAT)
    expected = accelgen.generate(tiny_target, tokenizer, PROMPT, **settings)
    jsonschema.validate(json.loads(expected.text), SCHEMA)
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=tiny_target,
                               gamma=6, **settings)
    assert result.token_ids == expected.token_ids


def test_json_object_keeps_to_json(tiny_target, tokenizer):
    """A random model seldom closes free JSON within a few tokens: every token it wrote must still be JSON."""
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=20,
                               response_format={"type": "json_object"})
    fresh = grammar_constraint({"type": "json_object"}, tokenizer, tiny_target.config.vocab_size, {2}, 0)
    assert fresh.move_to(result.token_ids) or result.token_ids[-1] == 2
    assert result.text.lstrip()[:1] in ("{", "[")


def test_tree_rows_are_masked_along_their_own_paths(tokenizer):
    constraint = grammar_constraint(RESPONSE_FORMAT, tokenizer, 49152, {2}, prompt_length=2)
    opening = tokenizer('{"answer": "', add_special_tokens=False).input_ids
    context = torch.tensor([7, 8] + opening)
    yes, no, broken = (tokenizer(text, add_special_tokens=False).input_ids[0] for text in ("yes", "no", "}}"))
    #  root ─ yes(0) ─ "(1)        rows: root, after yes, after yes ", after no, after }} (refused)
    #       ├ no(2)
    #       └ }}(3)
    quote = tokenizer('"', add_special_tokens=False).input_ids[0]
    draft = Draft(torch.tensor([yes, quote, no, broken]), torch.tensor([ROOT, 0, ROOT, ROOT]))
    # rows one by one, each with a fresh grammar moved along its own path, as plain decoding would see them
    masks = []
    for path in tree_paths(draft):
        alone = grammar_constraint(RESPONSE_FORMAT, tokenizer, 49152, {2}, prompt_length=2)
        row_ids = torch.cat([context, torch.tensor(path, dtype=torch.long)])[None]
        masks.append(alone(row_ids, torch.zeros(1, 49152))[0] == 0)
    processed = LogitsPipeline([constraint]).tree_rows(context, draft, torch.zeros(len(draft) + 1, 49152))
    for row, mask in enumerate(masks):
        assert torch.equal(processed[row] == 0, mask), row
    assert not bool(processed[0, broken] == 0)  # the refused draft token is masked at its parent row...
    assert bool((processed[4] == 0).all())  # ...and the row after it is left alone (it can never be accepted)
    assert bool(processed[0, yes] == 0) and bool(processed[1, quote] == 0)


@pytest.mark.parametrize("response_format, message", [
    ({"type": "xml"}, "unknown response_format type 'xml'"),
    ("json", "response_format must be a mapping"),
    ({"type": "json_schema"}, "needs \"json_schema\""),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
     "the grammar library rejected the schema: Unsupported type \"frobnicate\""),
])
def test_bad_response_formats_are_clear_errors(tiny_target, tokenizer, response_format, message):
    with pytest.raises(ValueError, match=message):
        accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=2, response_format=response_format)


def test_a_tokenizer_the_library_cannot_read_is_a_clear_error():
    class NoVocabulary:
        pass

    with pytest.raises(ValueError, match="the grammar library cannot use this tokenizer \\(NoVocabulary\\)"):
        grammar_constraint({"type": "json_object"}, NoVocabulary(), 100, {2}, 0)


def test_text_is_unconstrained(tiny_target, tokenizer):
    assert grammar_constraint({"type": "text"}, tokenizer, 49152, {2}, 0) is None
    assert grammar_constraint(None, tokenizer, 49152, {2}, 0) is None
