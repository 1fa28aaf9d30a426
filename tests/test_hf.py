"""accelgen.hf: the transformers-shaped drop-in returns what `model.generate` returns (fp32, greedy: identical)."""

import copy

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    TextIteratorStreamer,
)

import accelgen
from accelgen import hf

PROMPTS = [[5, 17, 923, 4410, 77, 12], [7, 300, 12], [9, 9, 40, 41, 9, 9, 40, 41, 9]]


def left_padded(rows, pad=0):
    """What a tokenizer with padding_side="left" returns: input_ids and attention_mask, (batch, longest)."""
    width = max(map(len, rows))
    input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows])
    attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.fixture(scope="module")
def batch():
    return left_padded(PROMPTS)


@pytest.mark.parametrize("accelgen_arguments", [{}, {"method": "pld"}, {"method": "speculative", "gamma": 3}],
                         ids=["autoregressive", "pld", "speculative"])
def test_greedy_sequences_are_model_generates(tiny_target, batch, accelgen_arguments):
    arguments = dict(accelgen_arguments)
    if arguments.get("method") == "speculative":
        arguments["draft_model"] = tiny_target
    expected = tiny_target.generate(**batch, do_sample=False, max_new_tokens=10)
    assert torch.equal(hf.generate(tiny_target, **batch, max_new_tokens=10, **arguments), expected)
    one = torch.tensor([PROMPTS[0]])
    assert torch.equal(hf.generate(tiny_target, one, max_new_tokens=10, **arguments),
                       tiny_target.generate(one, do_sample=False, max_new_tokens=10))


@pytest.mark.parametrize("hf_arguments", [{"prompt_lookup_num_tokens": 3}, {"assistant_model": "target"},
                                          {"assistant_model": "random"}], ids=["lookup", "self-assistant", "random-assistant"])
def test_transformers_own_speedups_give_the_same_sequences(tiny_target, tiny_draft, batch, hf_arguments):
    arguments = {name: {"target": tiny_target, "random": tiny_draft}.get(value, value)
                 for name, value in hf_arguments.items()}
    one = {"input_ids": batch["input_ids"][:1], "attention_mask": batch["attention_mask"][:1]}  # HF: batch of 1 only
    expected = tiny_target.generate(**one, do_sample=False, max_new_tokens=10, **arguments)
    assert torch.equal(hf.generate(tiny_target, **one, max_new_tokens=10, **arguments), expected)
    assert torch.equal(hf.generate(tiny_target, **batch, max_new_tokens=10, **arguments),
                       tiny_target.generate(**batch, do_sample=False, max_new_tokens=10))


def test_generation_configs_as_transformers_reads_them(tiny_target, batch):
    model = copy.deepcopy(tiny_target)
    model.generation_config.max_new_tokens = 3
    for arguments in ({}, {"generation_config": GenerationConfig(max_new_tokens=5)}, {"max_new_tokens": 4},
                      {"generation_config": GenerationConfig(max_length=14)}):
        expected = model.generate(**batch, **arguments)
        assert torch.equal(hf.generate(model, **batch, **arguments), expected), arguments
    # transformers' own default: max_length 20, counted from the padded width
    assert torch.equal(hf.generate(tiny_target, **batch), tiny_target.generate(**batch))


def test_rows_that_end_early_are_padded_as_transformers_pads_them(tiny_target, batch):
    first_rows = tiny_target.generate(**batch, max_new_tokens=8)
    model = copy.deepcopy(tiny_target)
    model.generation_config.eos_token_id = int(first_rows[0, -6])  # row 0 ends after its third new token
    model.generation_config.pad_token_id = 1
    expected = model.generate(**batch, max_new_tokens=8)
    assert (expected[0, -5:] == 1).all()
    assert torch.equal(hf.generate(model, **batch, max_new_tokens=8), expected)


def test_return_dict_with_scores(tiny_target, batch, assert_reordered):
    arguments = dict(max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    expected = tiny_target.generate(**batch, **arguments)
    output = hf.generate(tiny_target, **batch, method="pld", **arguments)
    assert type(output) is type(expected) and torch.equal(output.sequences, expected.sequences)
    assert len(output.scores) == len(expected.scores) == 6
    for scores, expected_scores in zip(output.scores, expected.scores):
        assert scores.shape == expected_scores.shape == (3, tiny_target.config.vocab_size)
        assert_reordered(scores, expected_scores)
    plain = hf.generate(tiny_target, **batch, max_new_tokens=6, return_dict_in_generate=True)
    assert torch.equal(plain.sequences, expected.sequences) and plain.scores is None


@pytest.mark.parametrize("processing", [{"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2},
                                        {"min_new_tokens": 4, "bad_words_ids": [[18088], [2640]]}],
                         ids=["repetition_penalty", "no_repeat_ngram_size", "min_new_tokens+bad_words_ids"])
def test_logits_processing_is_transformers(tiny_target, batch, processing):
    expected = tiny_target.generate(**batch, max_new_tokens=12, **processing)
    assert torch.equal(hf.generate(tiny_target, **batch, max_new_tokens=12, **processing), expected)
    assert torch.equal(hf.generate(tiny_target, **batch, max_new_tokens=12, method="speculative",
                                   assistant_model=tiny_target, **processing), expected)


def test_transformers_logits_processors_run_row_by_row(tiny_target, batch):
    processors = LogitsProcessorList([NoRepeatNGramLogitsProcessor(2)])
    expected = tiny_target.generate(**batch, max_new_tokens=12, logits_processor=processors)
    assert torch.equal(hf.generate(tiny_target, **batch, max_new_tokens=12, method="pld", logits_processor=processors),
                       expected)
    assert torch.equal(expected, tiny_target.generate(**batch, max_new_tokens=12, no_repeat_ngram_size=2))


def test_text_iterator_streamer(tiny_target, tokenizer):
    input_ids = torch.tensor([PROMPTS[0]])
    streamers = [TextIteratorStreamer(tokenizer, skip_prompt=True) for _ in range(2)]
    expected = tiny_target.generate(input_ids, max_new_tokens=12, streamer=streamers[0])
    output = hf.generate(tiny_target, input_ids, max_new_tokens=12, streamer=streamers[1], method="pld")
    assert torch.equal(output, expected)
    assert "".join(streamers[1]) == "".join(streamers[0]) == tokenizer.decode(expected[0, len(PROMPTS[0]):])


def test_wrap_swaps_model_generate(tiny_target, batch):
    wrapped = hf.wrap(tiny_target, method="speculative", draft_model=tiny_target, gamma=4)
    assert wrapped.config is tiny_target.config
    assert torch.equal(wrapped.generate(**batch, max_new_tokens=9), tiny_target.generate(**batch, max_new_tokens=9))


def test_stop_strings_need_a_tokenizer(smollm):
    model, tokenizer = smollm
    input_ids = tokenizer("The three most important ideas in the history of science are", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="stop_strings needs tokenizer="):
        hf.generate(model, input_ids, max_new_tokens=20, stop_strings=["science"])
    plain = model.generate(input_ids, max_new_tokens=20)
    word = tokenizer.decode(plain[0, input_ids.shape[1]:]).split()[2]
    expected = model.generate(input_ids, max_new_tokens=20, stop_strings=[word], tokenizer=tokenizer)
    assert torch.equal(hf.generate(model, input_ids, max_new_tokens=20, stop_strings=[word], tokenizer=tokenizer),
                       expected)


@pytest.mark.parametrize("arguments, message", [
    ({"num_beams": 2}, "cannot honour num_beams=2 .*beam search"),
    ({"generation_config": GenerationConfig(num_return_sequences=2, do_sample=True)}, "num_return_sequences=2"),
    ({"max_length": 5}, "max_length=5 is shorter than the 9-token input"),
    ({"gama": 3, "method": "speculative"}, "has no option 'gama'"),
])
def test_clear_errors(tiny_target, batch, arguments, message):
    with pytest.raises(ValueError, match=message):
        hf.generate(tiny_target, **batch, draft_model=tiny_target, **arguments)


def test_accelgen_exports_the_drop_in():
    assert accelgen.hf.generate is hf.generate


def test_sampling_with_a_seed_is_reproducible(tiny_target, batch):
    greedy = hf.generate(tiny_target, **batch, max_new_tokens=8)
    sampled = [hf.generate(tiny_target, **batch, max_new_tokens=8, do_sample=True, seed=5, method="pld")
               for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1]) and not torch.equal(sampled[0], greedy)
    # a temperature without do_sample is greedy, as in transformers
    assert torch.equal(hf.generate(tiny_target, **batch, max_new_tokens=8, temperature=0.7), greedy)
