"""generate() with logits processors, logprobs and output_scores: autoregressive equals transformers' own
generate with the same settings, and lossless methods (chains and trees) equal autoregressive (fp32, tiny models)."""

import pytest
import torch

import accelgen

PROMPT = [5, 17, 923, 4410, 77, 12]
PENALTIES = dict(repetition_penalty=1.3, no_repeat_ngram_size=2)
NEW_TOKENS = 30
# a 64-token vocabulary: random models repeat tokens and bigrams within a few tokens there (with 49152 they seldom
# do), so that every penalty changes the output
SMALL_PROMPT = [5, 17, 42, 44, 7, 12]


def hf_generate(model, prompt, max_new_tokens=NEW_TOKENS, eos=(2,), **settings):
    """transformers' greedy generate: (new tokens, (new tokens, vocab) scores)."""
    output = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                            eos_token_id=list(eos), pad_token_id=eos[0], output_scores=True,
                            return_dict_in_generate=True, **settings)
    return output.sequences[0, len(prompt):].tolist(), torch.cat(output.scores)


@pytest.fixture(scope="module")
def small(make_tiny_model):
    """(target, unrelated draft) of a 64-token vocabulary."""
    return make_tiny_model("qwen2", seed=0, vocab_size=64), make_tiny_model("llama", seed=1, vocab_size=64)


@pytest.fixture(scope="module")
def penalised(small, tokenizer):
    return accelgen.generate(small[0], tokenizer, SMALL_PROMPT, max_new_tokens=NEW_TOKENS, **PENALTIES).token_ids


@pytest.mark.parametrize("settings", [dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2), PENALTIES])
def test_autoregressive_with_penalties_equals_hf(small, tokenizer, settings):
    result = accelgen.generate(small[0], tokenizer, SMALL_PROMPT, max_new_tokens=NEW_TOKENS, **settings)
    assert result.token_ids == hf_generate(small[0], SMALL_PROMPT, **settings)[0]
    plain = accelgen.generate(small[0], tokenizer, SMALL_PROMPT, max_new_tokens=NEW_TOKENS).token_ids
    assert result.token_ids != plain, "the penalty must change this output, or the test proves nothing"


@pytest.mark.parametrize("method, options", [
    ("speculative", dict(gamma=4)),  # the draft model drafts through the same processors: all accepted
    ("speculative-unrelated", dict(gamma=4)),
    ("pld", {}),
    ("specinfer", dict(draft_budget="method")),  # a tree: rows of several paths, processed each with its own path
])
def test_lossless_methods_with_penalties_equal_autoregressive(small, tokenizer, penalised, method, options):
    target, unrelated = small
    draft_model = unrelated if method == "speculative-unrelated" else target
    result = accelgen.generate(target, tokenizer, SMALL_PROMPT, method=method.removesuffix("-unrelated"),
                               draft_model=draft_model, max_new_tokens=NEW_TOKENS, **PENALTIES, **options)
    assert result.token_ids == penalised
    if method in ("speculative", "specinfer"):  # drafts of the target itself: several tokens accepted per step
        assert max(result.stats["accepted_per_step"]) >= 2


@pytest.fixture(scope="module")
def early_eos_target(make_tiny_model, tokenizer):
    """A tiny target whose third greedy token is declared an EOS, so that min_new_tokens has something to do."""
    model = make_tiny_model("qwen2", seed=0, vocab_size=64)
    third = accelgen.generate(model, tokenizer, SMALL_PROMPT, max_new_tokens=3).token_ids[2]
    model.generation_config.eos_token_id = [2, third]
    return model, third


def test_min_new_tokens_and_bad_words_equal_hf(early_eos_target, tokenizer):
    model, eos = early_eos_target
    plain = accelgen.generate(model, tokenizer, SMALL_PROMPT, max_new_tokens=NEW_TOKENS).token_ids
    assert len(plain) == 3 and plain[-1] == eos
    first, second = plain[0], plain[1]
    settings = dict(min_new_tokens=8, bad_words_ids=[[second], [first, 60]])
    result = accelgen.generate(model, tokenizer, SMALL_PROMPT, max_new_tokens=NEW_TOKENS, **settings)
    expected, _ = hf_generate(model, SMALL_PROMPT, eos=(2, eos), **settings)
    assert result.token_ids == expected
    assert len(result.token_ids) >= 8 and second not in result.token_ids
    speculative = accelgen.generate(model, tokenizer, SMALL_PROMPT, method="speculative", draft_model=model,
                                    max_new_tokens=NEW_TOKENS, **settings)
    assert speculative.token_ids == expected


def test_presence_frequency_and_user_processors_keep_methods_exact(small, tokenizer):
    def odd_tokens_only(context_ids, logits):  # a user's processor: (context (n,), logits (vocab,)) -> logits
        logits[0::2] = float("-inf")
        return logits

    settings = dict(presence_penalty=1.5, frequency_penalty=0.5, logits_processors=[odd_tokens_only],
                    max_new_tokens=NEW_TOKENS)
    target = small[0]
    expected = accelgen.generate(target, tokenizer, SMALL_PROMPT, **settings).token_ids
    assert all(token % 2 for token in expected)
    for method in ("speculative", "specinfer"):
        result = accelgen.generate(target, tokenizer, SMALL_PROMPT, method=method, draft_model=target, **settings)
        assert result.token_ids == expected


def test_logprobs_and_scores_equal_hf_scores(small, tokenizer, assert_reordered):
    target = small[0]
    expected_tokens, hf_scores = hf_generate(target, SMALL_PROMPT, max_new_tokens=12, **PENALTIES)
    hf_logprobs = torch.log_softmax(hf_scores, dim=-1)
    for method in ("autoregressive", "speculative"):
        result = accelgen.generate(target, tokenizer, SMALL_PROMPT, method=method, draft_model=target,
                                   max_new_tokens=12, logprobs=3, output_scores=True, **PENALTIES)
        assert result.token_ids == expected_tokens
        assert result.scores.shape == hf_scores.shape and result.scores.dtype == torch.float32
        finite = hf_scores > float("-inf")
        assert torch.equal(result.scores > float("-inf"), finite)
        assert_reordered(result.scores[finite], hf_scores[finite])
        for position, entry in enumerate(result.logprobs):
            assert entry.token_id == expected_tokens[position]
            assert entry.logprob == pytest.approx(float(hf_logprobs[position, entry.token_id]), abs=1e-4)
            best = hf_logprobs[position].topk(3)
            assert [token for token, _ in entry.top] == best.indices.tolist()
            assert [value for _, value in entry.top] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_logprobs_stream_per_chunk(tiny_target, tokenizer):
    stream = accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=tiny_target,
                               max_new_tokens=10, logprobs=0, stream=True)
    chunks = list(stream)
    assert all(len(chunk.logprobs) == len(chunk.token_ids) and all(e.top == [] for e in chunk.logprobs)
               for chunk in chunks)
    assert [entry for chunk in chunks for entry in chunk.logprobs] == stream.result.logprobs
    assert stream.result.to_dict()["logprobs"][0]["token_id"] == stream.result.token_ids[0]


def test_nothing_requested_records_nothing(tiny_target, tokenizer):
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=3)
    assert result.logprobs is None and result.scores is None and "logprobs" not in result.to_dict()
    empty = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=0, output_scores=True, logprobs=2)
    assert empty.scores.shape == (0, tiny_target.config.vocab_size) and empty.logprobs == []


@pytest.mark.parametrize("settings, message", [
    (dict(logprobs=-1), "logprobs must be None or an integer >= 0"),
    (dict(logprobs=True), "logprobs must be None or an integer >= 0"),
    (dict(output_scores="yes"), "output_scores must be true or false"),
    (dict(repetition_penalty=-2.0), "repetition_penalty must be > 0"),
    (dict(bad_words_ids=[[10 ** 9]]), "not a token id of this model"),
])
def test_bad_arguments_are_clear_errors(tiny_target, tokenizer, settings, message):
    with pytest.raises(ValueError, match=message):
        accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=2, **settings)


def test_sampled_scores_are_tempered_and_filtered(tiny_target, tokenizer):
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=4, temperature=0.5, top_k=5, seed=1,
                               output_scores=True, logprobs=1)
    assert ((result.scores > float("-inf")).sum(dim=-1) == 5).all()
    for entry, row in zip(result.logprobs, result.scores):
        assert entry.logprob == pytest.approx(float(torch.log_softmax(row, -1)[entry.token_id]), abs=1e-5)
    with torch.no_grad():
        first = tiny_target(torch.tensor([PROMPT])).logits[0, -1] / 0.5
    best = first.topk(5)
    torch.testing.assert_close(result.scores[0, best.indices], best.values, rtol=1e-4, atol=1e-4)


# --- seeded sampling: per-position noise ---------------------------------------------------------------------


@pytest.mark.parametrize("settings", [dict(temperature=0.8, top_p=0.95), dict(temperature=1.2, top_k=20, **PENALTIES)])
def test_a_seed_gives_the_same_tokens_whatever_the_method_and_draft_length(small, tokenizer, settings):
    target, unrelated = small
    settings = dict(max_new_tokens=20, seed=7, **settings)
    expected = accelgen.generate(target, tokenizer, SMALL_PROMPT, **settings).token_ids
    runs = [("speculative", dict(draft_model=target, gamma=gamma)) for gamma in (1, 4, 8)]
    runs += [("speculative", dict(draft_model=unrelated, gamma=4, gamma_schedule="heuristic")), ("pld", {}),
             ("specinfer", dict(draft_model=target))]
    for method, options in runs:
        result = accelgen.generate(target, tokenizer, SMALL_PROMPT, method=method, **options, **settings)
        assert result.token_ids == expected, (method, options)
        if options.get("draft_model") is target and options.get("gamma", 1) > 1:
            # the draft model draws with the target's noise: its own drafts are accepted whole
            assert max(result.stats["accepted_per_step"]) >= 2
    other_seed = accelgen.generate(target, tokenizer, SMALL_PROMPT, **settings | dict(seed=8)).token_ids
    assert other_seed != expected


def test_a_seed_gives_the_same_tokens_alone_and_in_a_batch(small, tokenizer):
    target, unrelated = small
    settings = dict(max_new_tokens=16, temperature=1.0, seed=11, repetition_penalty=1.2)
    alone = accelgen.generate(target, tokenizer, SMALL_PROMPT, **settings).token_ids
    batched = accelgen.generate(target, tokenizer, [SMALL_PROMPT, [9, 8, 7]], method="speculative",
                                draft_model=unrelated, gamma=3, **settings)
    assert batched[0].token_ids == alone
