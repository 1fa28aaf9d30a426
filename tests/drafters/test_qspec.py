"""qspec: the target drafts with its own quantized copy (int8 in PyTorch, or a written GGUF file on llama.cpp),
optionally drafted for by prompt lookup; greedy-exact and distribution-exact against `autoregressive`, every
acceptance from none to all, EOS inside a draft, short requests, the draft length from the measured costs, the
format `auto` picks and clear errors."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

import accelgen
from accelgen.drafters import qspec
from accelgen.models.formats import quantize

pytest.importorskip("gguf", reason="writing GGUF files needs `pip install 'accelgen[gguf]'`")
pytest.importorskip("xllamacpp", reason="the llama.cpp engine needs `pip install 'accelgen[llamacpp]'`")

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

PROMPT = [5, 17, 923, 441, 77, 12]
CONSTANT = {"gamma_schedule": "constant", "gamma": 4}  # the fake costs of the tests make no draft pay


@pytest.fixture
def own_cache(tmp_path_factory, monkeypatch):
    """Written GGUF files and quantized tensors in a cache of this test session (written once per model)."""
    monkeypatch.setenv("ACCELGEN_CACHE", str(tmp_path_factory.getbasetemp() / "qspec-cache"))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request, make_tiny_model):
    """A tiny fp32 target over the first 1024 tokens (quick to write as GGUF)."""
    return make_tiny_model(request.param, seed=0, vocab_size=1024)


def time_as(monkeypatch, tmp_path, tables: list) -> None:
    """Forward costs as if measured so (accelgen/costs.py): tables holds (model, (seconds of a one-token forward,
    {k: r(k)})) pairs (a list: a llama.cpp model is not hashable); other models 10 ms, r(k) = 1."""
    from accelgen import costs
    from accelgen.profile import interpolate

    by_key = {costs.model_key(model): table for model, table in tables}

    def timer(model, batch, sizes):
        one_token, ratios = by_key.get(costs.model_key(model), (0.01, {1: 1.0}))
        return {k: batch * one_token * interpolate(ratios, k) for k in sizes}

    folder = tmp_path / f"costs-{len(list(tmp_path.iterdir()))}"  # a fresh cache for each table
    monkeypatch.setattr(costs, "costs_folder", lambda: folder)
    monkeypatch.setattr(costs, "time_forwards", timer)


def draft_with(monkeypatch, draft_model) -> None:
    """qspec drafts with draft_model instead of the target's quantized copy."""
    monkeypatch.setattr(qspec, "quantized_copy", lambda *arguments: draft_model)


@pytest.mark.parametrize("copy_options", [{"quantized": "int8"}, {"quantized": "gguf", "gguf_type": "q8_0"},
                                          {"quantized": "gguf", "gguf_type": "q8_0", "levels": "pld"},
                                          {"quantized": "int8", "levels": "pld", "stage_two_tokens": 2}],
                         ids=["int8", "gguf", "gguf+pld", "int8+pld"])
def test_greedy_output_is_the_targets(target, tokenizer, assert_lossless, copy_options):
    result = assert_lossless(target, tokenizer, PROMPT, "qspec", 40, **CONSTANT, **copy_options)
    assert 0 < result.stats["accepted_draft_tokens"]  # the copy agrees with the target often


def test_the_copy_is_the_targets_own(target, tokenizer):
    """gguf: a file written from the target's weights, run by llama.cpp; int8: the target's layers quantized."""
    from accelgen.models.formats import weight_format
    from accelgen.models.llamacpp import LlamaCppModel

    gguf_copy = qspec.quantized_copy(target, tokenizer, "gguf", "q8_0")
    assert isinstance(gguf_copy, LlamaCppModel) and gguf_copy.config.vocab_size == target.config.vocab_size
    assert qspec.quantized_copy(target, tokenizer, "gguf", "q8_0") is gguf_copy  # made once per target
    assert qspec.served_copy(target, tokenizer, {"quantized": "gguf", "gguf_type": "q8_0"}) is gguf_copy
    int8_copy = qspec.quantized_copy(target, tokenizer, "int8")
    assert weight_format(int8_copy) == "int8" and weight_format(target) == "fp32"


def test_every_draft_accepted_when_the_copy_is_exact(target, tokenizer, assert_lossless, monkeypatch):
    draft_with(monkeypatch, target)
    result = assert_lossless(target, tokenizer, PROMPT, "qspec", 20, **CONSTANT)
    assert result.stats["accepted_draft_tokens"] == result.stats["draft_tokens"] > 0
    assert result.stats["target_forwards"] == 4  # 5 tokens per verification: 20 tokens in 4 forwards


def test_no_draft_accepted_from_an_unrelated_copy(target, tokenizer, assert_lossless, monkeypatch, make_tiny_model):
    draft_with(monkeypatch, make_tiny_model("llama", seed=7, vocab_size=1024))
    result = assert_lossless(target, tokenizer, PROMPT, "qspec", 20, **CONSTANT)
    assert result.stats["accepted_draft_tokens"] < result.stats["draft_tokens"] / 4


def test_partial_acceptance_from_a_coarse_copy(target, tokenizer, assert_lossless, monkeypatch):
    """An int8 copy whose first layer's weights are coarser still: some drafts accepted, some rejected."""
    coarse = copy.deepcopy(target)
    with torch.no_grad():
        for parameter in coarse.model.layers[0].mlp.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    quantize(coarse, "int8")
    draft_with(monkeypatch, coarse)
    result = assert_lossless(target, tokenizer, PROMPT, "qspec", 40, **CONSTANT)
    assert 0 < result.stats["accepted_draft_tokens"] < result.stats["draft_tokens"]


def test_eos_inside_a_draft_ends_generation_there(target, tokenizer, greedy, monkeypatch):
    plain = greedy(target, tokenizer, PROMPT, 12).token_ids
    position = next(i for i in range(2, 12) if plain[i] not in plain[:i])  # its first occurrence
    ending = copy.deepcopy(target)
    ending.generation_config.eos_token_id = plain[position]
    draft_with(monkeypatch, target)  # drafts every token right, the EOS among them
    result = accelgen.generate(ending, tokenizer, PROMPT, method="qspec", max_new_tokens=12, gamma=8,
                               gamma_schedule="constant")
    assert result.token_ids == plain[: position + 1] and result.finish_reason == "stop"


@pytest.mark.parametrize("max_new_tokens", [1, 3])
def test_max_new_tokens_smaller_than_a_draft(target, tokenizer, assert_lossless, max_new_tokens):
    result = assert_lossless(target, tokenizer, PROMPT, "qspec", max_new_tokens, quantized="gguf", gguf_type="q8_0",
                             gamma=8, gamma_schedule="constant")
    assert len(result.token_ids) == max_new_tokens


@pytest.mark.slow  # 1,500 sampled generations per engine, like every method's distribution check
@pytest.mark.parametrize("copy_options", [{"quantized": "int8"}, {"quantized": "gguf", "gguf_type": "q8_0"}],
                         ids=["int8", "gguf"])
def test_sampling_keeps_the_target_distribution(assert_samples_target, copy_options):
    assert_samples_target("qspec", [1, 3, 4, 5, 6, 7, 0, 1, 3], gamma=2, gamma_schedule="constant", **copy_options)


def test_the_measured_costs_size_the_drafts(target, tokenizer, assert_lossless, monkeypatch, tmp_path):
    """Where the copy costs a tenth of a target step and verifying is free (r = 1), the budget drafts; where
    verifying k tokens costs k steps, no draft pays and qspec decodes plainly."""
    gguf_copy = qspec.quantized_copy(target, tokenizer, "gguf", "q8_0")
    time_as(monkeypatch, tmp_path, [(target, (0.01, {1: 1.0, 16: 1.0})), (gguf_copy, (0.001, {1: 1.0}))])
    drafted = assert_lossless(target, tokenizer, PROMPT, "qspec", 30, quantized="gguf", gguf_type="q8_0")
    assert drafted.stats["draft_tokens"] > 0
    time_as(monkeypatch, tmp_path, [(target, (0.01, {1: 1.0, 16: 16.0})), (gguf_copy, (0.01, {1: 1.0}))])
    plain = assert_lossless(target, tokenizer, PROMPT, "qspec", 30, quantized="gguf", gguf_type="q8_0")
    assert plain.stats["draft_tokens"] == 0


def test_lookup_level_is_sized_from_the_copys_costs(target, tokenizer, monkeypatch, tmp_path):
    gguf_copy = qspec.quantized_copy(target, tokenizer, "gguf", "q8_0")
    time_as(monkeypatch, tmp_path, [(gguf_copy, (0.001, {1: 1.0, 16: 1.0}))])  # 16 tokens at the price of one
    assert qspec.lookup_tokens(gguf_copy, "auto") == qspec.MAX_STAGE_TWO
    time_as(monkeypatch, tmp_path, [(gguf_copy, (0.001, {1: 1.0, 2: 2.0, 16: 16.0}))])  # each token a forward
    assert qspec.lookup_tokens(gguf_copy, "auto") == 0
    assert qspec.lookup_tokens(gguf_copy, 3) == 3


def test_auto_falls_back_to_int8_for_an_architecture_the_writer_does_not_know(tokenizer, greedy, capsys):
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, eos_token_id=2)
    mistral = MistralForCausalLM(config).eval()
    assert qspec.resolve_format(mistral, "auto", "auto") == "int8"
    assert "model type 'mistral'" in capsys.readouterr().err
    result = accelgen.generate(mistral, tokenizer, PROMPT, method="qspec", max_new_tokens=20, **CONSTANT)
    assert result.token_ids == greedy(mistral, tokenizer, PROMPT, 20).token_ids
    with pytest.raises(ValueError, match=r"quantized=gguf is not possible here: .*model type 'mistral'.*int8"):
        accelgen.generate(mistral, tokenizer, PROMPT, method="qspec", max_new_tokens=4, quantized="gguf")


def test_auto_picks_gguf_for_a_writable_architecture(target):
    assert qspec.resolve_format(target, "auto", "auto") == "gguf"
    assert qspec.resolve_format(target, "int4", "auto") == "int4"


def test_clear_errors(target, tokenizer):
    int8_target = copy.deepcopy(target)
    quantize(int8_target, "int8")
    with pytest.raises(ValueError, match="already int8"):
        accelgen.generate(int8_target, tokenizer, PROMPT, method="qspec", max_new_tokens=2)
    gguf_target = qspec.quantized_copy(target, tokenizer, "gguf", "q8_0")
    with pytest.raises(ValueError, match="already runs its GGUF file on llama.cpp"):
        accelgen.generate(gguf_target, tokenizer, PROMPT, method="qspec", max_new_tokens=2)
    for options, message in (({"quantized": "int2"}, "unknown quantized 'int2'"),
                             ({"levels": "tree"}, "unknown levels 'tree'"),
                             ({"gguf_type": "q2_k"}, "unknown gguf_type 'q2_k'"),
                             ({"stage_two_tokens": -1}, "stage_two_tokens must be"),
                             ({"levels": "pld", "gamma_schedule": "heuristic"}, "levels=pld takes")):
        with pytest.raises(ValueError, match=message):
            accelgen.generate(target, tokenizer, PROMPT, method="qspec", max_new_tokens=2, **options)


def test_auto_drafts_with_the_copy_where_its_costs_pay(target, tokenizer, assert_lossless, monkeypatch, tmp_path):
    """Without a draft model, auto weighs the target's quantized copy (its format as quantized="auto" picks) by its
    measured cost: cheap, it drafts (and says so); as slow as the target, prompt lookup or nothing."""
    gguf_copy = qspec.quantized_copy(target, tokenizer, "gguf", "auto")
    time_as(monkeypatch, tmp_path, [(target, (0.01, {1: 1.0, 16: 1.2})), (gguf_copy, (0.002, {1: 1.0}))])
    result = assert_lossless(target, tokenizer, PROMPT, "auto", 24)
    choice = result.stats["choice"]
    assert choice["method"] == "qspec" and "quantized copy drafting a token c = 0.20" in choice["reason"]
    assert result.stats["draft_tokens"] > 0
    time_as(monkeypatch, tmp_path, [(target, (0.01, {1: 1.0, 2: 1.9, 16: 16.0})), (gguf_copy, (0.01, {1: 1.0}))])
    assert assert_lossless(target, tokenizer, PROMPT, "auto", 8).stats["choice"]["method"] == "autoregressive"


def test_auto_leaves_out_the_copy_of_a_quantized_target(target, tokenizer):
    from accelgen.drafters.auto import self_draft

    int8_target = copy.deepcopy(target)
    quantize(int8_target, "int8")
    assert self_draft(int8_target, tokenizer) is None
    assert self_draft(target, tokenizer) is qspec.quantized_copy(target, tokenizer, "gguf", "auto")


def test_a_server_batch_of_qspec_requests_gets_what_each_gets_alone(target, tokenizer):
    """The server's engine batches requests of every copy format with other methods; each request's tokens are
    its own (the copies made once per target, shared by the requests)."""
    from accelgen.loop import GenerationResult, Sequence
    from accelgen.server.engine import Engine, Request
    from accelgen.server.speculation import TokenBudget

    requests = [{"quantized": "gguf", "gguf_type": "q8_0"}, {"quantized": "int8"},
                {"quantized": "gguf", "gguf_type": "q8_0", "levels": "pld"}, None]
    prompts = [PROMPT, [8, 9, 10, 8, 9, 10, 8, 9], list(range(300, 340)), [1000, 20, 300]]
    engine, alone, results = Engine(max_batch=4, speculation=TokenBudget(0)), [], {}
    for index, (prompt, options) in enumerate(zip(prompts, requests)):
        kwargs = dict(max_new_tokens=16) | ({"method": "qspec", **CONSTANT, **options} if options else {})
        alone.append(accelgen.generate(target, tokenizer, prompt, **kwargs).token_ids)
        deliver = (lambda index: lambda event: isinstance(event, GenerationResult) and results.update({index: event}))
        engine.submit(Request(Sequence.start(target, tokenizer, prompt, **kwargs), deliver(index)))
    for _ in range(500):
        if not engine.load:
            break
        engine.step()
    assert [results[index].token_ids for index in range(len(prompts))] == alone
