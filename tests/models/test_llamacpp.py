"""The llama.cpp runner on SmolLM2-135M's own GGUF file: the loop's contract (chains, trees, roll-back),
methods exact against `autoregressive` on the same engine, and clear errors for what the engine cannot do."""

from __future__ import annotations

import pytest
import torch

import accelgen

pytest.importorskip("xllamacpp", reason="the llama.cpp engine needs `pip install 'accelgen[llamacpp]'`")

from accelgen.models import llamacpp  # noqa: E402
from accelgen.models.llamacpp import LlamaCppError, LlamaCppModel, _chunks  # noqa: E402
from accelgen.models.loading import gguf_file  # noqa: E402

PROMPTS = [
    [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    [{"role": "user", "content": "List the planets of the solar system in order, one per line."}],
]
# llama.cpp's logits depend on how tokens are batched and where their KV cells lie (other kernels, another
# summation order), by up to about a logit on this 4-bit model, so two runs of the same model may pick different
# tokens where the two best logits are this close.
NEAR_TIE = 1.0


@pytest.fixture(scope="module")
def gguf_model():
    return LlamaCppModel(gguf_file("smollm2-135m"), threads=2)


@pytest.fixture(scope="module")
def baselines(gguf_model, tokenizer):
    return [accelgen.generate(gguf_model, tokenizer, prompt, max_new_tokens=40).token_ids for prompt in PROMPTS]


def assert_same_or_near_tie(model, tokenizer, prompt, tokens, baseline):
    """tokens equal baseline, or first differ where the engine's two best logits are a near-tie."""
    if tokens == baseline:
        return
    first = next(i for i, (a, b) in enumerate(zip(tokens, baseline)) if a != b)
    ids = accelgen.generate.__globals__["encode_prompt"](tokenizer, prompt)
    logits = model.new_runner().forward(torch.tensor(ids + baseline[:first]), logits_for_last=1)[0]
    best, second = logits.topk(2).values.tolist()
    assert {tokens[first], baseline[first]} <= set(logits.topk(2).indices.tolist()), f"diverged at {first}: not the top two"
    assert best - second < NEAR_TIE, f"diverged at {first} with a logit margin of {best - second:.3f}"


def test_chunks_cover_a_long_prompt_with_the_last_chunk_full():
    assert _chunks(5, 512) == [(0, 5)]
    assert _chunks(1100, 512) == [(0, 76), (76, 588), (588, 1100)]


def test_the_installed_wheel_is_in_the_supported_range_the_extra_names():
    """The llamacpp extra asks for exactly the wheels whose llama.cpp builds the engine declares, and the installed
    one is among them (its structs pass the defaults check when the library loads)."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    extra = [Requirement(text) for text in pyproject["project"]["optional-dependencies"]["llamacpp"]]
    wheel = next(requirement for requirement in extra if requirement.name == "xllamacpp")
    assert str(wheel.specifier) == str(Requirement(f"xllamacpp{llamacpp.XLLAMACPP_REQUIREMENT}").specifier)
    installed = llamacpp.installed_xllamacpp_version()
    assert wheel.specifier.contains(installed) and llamacpp.llama_build(installed) in llamacpp.LLAMA_BUILDS
    assert llamacpp.library() is not None


@pytest.mark.parametrize("version", ["2026.11.11800", "2026.9.11063", "0.2.14"])
def test_another_wheel_version_is_refused_by_name(monkeypatch, version):
    monkeypatch.setattr(llamacpp, "_library", None)  # (restored afterwards: the loaded library stays for the rest)
    monkeypatch.setattr(llamacpp, "installed_xllamacpp_version", lambda: version)
    with pytest.raises(LlamaCppError, match=rf"xllamacpp {version} is installed.*"
                                            rf"xllamacpp>=2026\.10\.11549,<2026\.10\.11550.*b11549"):
        LlamaCppModel(gguf_file("smollm2-135m"))
    assert llamacpp._library is None


def test_a_missing_wheel_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(llamacpp, "_library", None)
    monkeypatch.setattr(llamacpp, "installed_xllamacpp_version", lambda: None)
    with pytest.raises(LlamaCppError, match=r"needs the xllamacpp package: pip install 'accelgen\[llamacpp\]'"):
        llamacpp.library()


def test_a_library_whose_defaults_differ_from_the_declared_structs_is_refused(monkeypatch):
    """The version check's second guard: a build laid out otherwise (here: declared defaults it does not have)."""
    monkeypatch.setattr(llamacpp, "_library", None)
    monkeypatch.setitem(llamacpp.CONTEXT_DEFAULTS, "n_batch", 4096)
    with pytest.raises(LlamaCppError, match=r"returns \{'n_batch': 2048\}, not the defaults of llama.cpp b11549"):
        llamacpp.library()


def test_wheel_versions_name_their_llama_cpp_build():
    assert llamacpp.llama_build("2026.10.11549") == 11549 and llamacpp.llama_build("2026.10.11549.1") == 11549
    assert llamacpp.llama_build("0.2.14") is None


def test_runner_rolls_back_and_matches_a_fresh_forward(gguf_model):
    runner = gguf_model.new_runner()
    prompt = torch.tensor([1, 504, 3458, 314, 4132, 30])
    full = runner.forward(prompt)  # (6, vocab)
    assert full.shape == (6, gguf_model.config.vocab_size) and runner.length == 6
    runner.keep(3, [])  # forget the last three
    assert runner.length == 3
    again = runner.forward(prompt[3:], logits_for_last=1)
    assert again.shape == (1, gguf_model.config.vocab_size)
    assert int(again[0].argmax()) == int(full[-1].argmax())


def test_tree_siblings_do_not_see_each_other(gguf_model):
    """Root with two children a, b: b's logits in the tree are b's after the root alone, not after a; the kept
    path then continues like a chain."""
    prompt, a, b = [1, 504, 3458, 314], 4132, 30
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)

    def tree_then_keep(children, kept_row):
        runner = gguf_model.new_runner()
        runner.forward(torch.tensor(prompt[:-1]))
        logits = runner.forward(torch.tensor([prompt[-1], *children]), tree)  # (3, vocab)
        runner.keep(len(prompt) - 1, [0, kept_row])
        assert runner.length == len(prompt) + 1
        return logits, runner.forward(torch.tensor([7]), logits_for_last=1)[0]

    def chain(tokens):
        return gguf_model.new_runner().forward(torch.tensor(tokens), logits_for_last=1)[0]

    in_tree, next_after_b = tree_then_keep([a, b], kept_row=2)
    assert torch.equal(in_tree[2], chain(prompt + [b]))
    assert (in_tree[2] - chain(prompt + [a, b])).abs().max() > 2.0
    # keeping the second child leaves a free cell before it, which changes the summation order only
    assert int(next_after_b.argmax()) == int(chain(prompt + [b, 7]).argmax())
    _, next_after_first_child = tree_then_keep([b, a], kept_row=1)
    assert torch.equal(next_after_first_child, chain(prompt + [b, 7]))


@pytest.mark.parametrize("method", ["speculative", "pld", "trie-lookahead", "lookahead-decoding"])
def test_methods_match_autoregressive_on_the_same_engine(gguf_model, tokenizer, baselines, method):
    # a fixed draft length: by default the measured costs cap drafts, and drafting with the target itself never pays
    draft = {"draft_model": gguf_model, "gamma": 4} if method == "speculative" else {}
    for prompt, baseline in zip(PROMPTS, baselines):
        result = accelgen.generate(gguf_model, tokenizer, prompt, method=method, max_new_tokens=40, **draft)
        assert_same_or_near_tie(gguf_model, tokenizer, prompt, result.token_ids, baseline)
        if method == "speculative":  # the target drafting for itself: (nearly) every draft accepted
            assert result.stats["mean_accepted_tokens"] > 3


def test_a_pytorch_draft_under_a_llamacpp_target(gguf_model, tokenizer, smollm, baselines):
    """Partial acceptance: the fp32 PyTorch model drafts for the quantized GGUF target."""
    result = accelgen.generate(gguf_model, tokenizer, PROMPTS[0], method="speculative", draft_model=smollm[0],
                               max_new_tokens=40, gamma=3)
    assert_same_or_near_tie(gguf_model, tokenizer, PROMPTS[0], result.token_ids, baselines[0])
    assert 0 < result.stats["acceptance_rate"] <= 1


def test_max_new_tokens_shorter_than_the_draft_and_eos(gguf_model, tokenizer):
    result = accelgen.generate(gguf_model, tokenizer, PROMPTS[1], method="speculative", draft_model=gguf_model,
                               max_new_tokens=2, gamma=8)
    assert len(result.token_ids) == 2 and result.finish_reason == "length"
    long = accelgen.generate(gguf_model, tokenizer, [{"role": "user", "content": "Say yes."}], method="speculative",
                             draft_model=gguf_model, max_new_tokens=200, gamma=8)
    assert long.finish_reason == "stop" and long.token_ids[-1] in (tokenizer.eos_token_id, 2)


def test_clear_errors_for_what_the_engine_cannot_do(gguf_model, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="needs a PyTorch model"):
        accelgen.generate(gguf_model, tokenizer, "Hi", method="calm", max_new_tokens=2)
    with pytest.raises(ValueError, match="PyTorch"):
        accelgen.generate(gguf_model, tokenizer, "Hi", method="specinfer", draft_model=gguf_model, max_new_tokens=2)
    with pytest.raises(ValueError, match="hidden states"):
        gguf_model.new_runner().keep_hidden = True
    with pytest.raises(FileNotFoundError):
        LlamaCppModel(tmp_path / "missing.gguf")


def test_server_engine_batches_llamacpp_sequences(gguf_model, tokenizer, baselines):
    """The server's engine runs requests on the llama.cpp engine side by side (each its own context), each
    getting what it gets alone."""
    from accelgen.loop import GenerationResult, Sequence
    from accelgen.server.engine import Engine, Request

    engine = Engine(max_batch=4)
    results = {}
    for index, (prompt, method) in enumerate(zip(PROMPTS, ["pld", "speculative"])):
        extra = {"draft_model": gguf_model} if method == "speculative" else {}
        sequence = Sequence.start(gguf_model, tokenizer, prompt, method=method, max_new_tokens=40, **extra)
        engine.submit(Request(sequence, lambda event, index=index: isinstance(event, GenerationResult)
                              and results.__setitem__(index, event)))
    for _ in range(200):
        if not engine.load:
            break
        engine.step()
    for index, prompt in enumerate(PROMPTS):
        assert_same_or_near_tie(gguf_model, tokenizer, prompt, results[index].token_ids, baselines[index])
