"""llama.cpp's own loop as benchmark rows (accelgen/bench/llamacpp.py): on the real SmolLM2-135M GGUF file where the
xllamacpp package is installed (scripts/install.sh installs it); the error paths run everywhere."""

from __future__ import annotations

import importlib.util
import sys

import pytest

import accelgen
from accelgen.bench import llamacpp, rows, runner
from accelgen.bench.runner import BenchConfig
from accelgen.prompts import encode_prompt, eos_token_ids

needs_xllamacpp = pytest.mark.skipif(importlib.util.find_spec("xllamacpp") is None,
                                     reason="llama.cpp rows need `pip install 'accelgen[llamacpp]'`")
MODEL = "smollm2-135m"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,"


class SpyServer:
    """A llama.cpp server that keeps every request and response."""

    def __init__(self, server):
        self.server, self.requests, self.responses = server, [], []

    def handle_completions(self, request):
        self.requests.append(request)
        self.responses.append(self.server.handle_completions(request))
        return self.responses[-1]


@pytest.fixture(scope="module")
def peers():
    """The three rows' servers on the same GGUF file (the model drafting for itself), loaded once for the module."""
    return llamacpp.LlamaCppPeers(MODEL, MODEL, threads=2)


def row(name: str) -> tuple:
    method = rows.variant(rows.available_methods(), name)
    return method, method.check_options({})


def run(peers, name: str, prompt_ids: list[int], max_new_tokens: int) -> dict:
    method, options = row(name)
    return peers.run(method, options, prompt_ids, max_new_tokens)


@needs_xllamacpp
def test_the_server_reads_the_prompt_token_ids_as_given(peers, tokenizer):
    """Token ids go in, not text: one character per token, which the text would never tokenize to, is what
    llama.cpp reads; the new tokens come back as ids."""
    run(peers, "llamacpp", [1, 2], 1)  # start the server
    spy = SpyServer(peers.servers["llamacpp"])
    prompt_ids = [tokenizer.convert_tokens_to_ids(char) for char in "Hello"]
    assert tokenizer("Hello").input_ids != prompt_ids
    record = llamacpp.run_peer(spy, prompt_ids, 4)
    assert spy.requests[0]["prompt"] == prompt_ids and spy.responses[0]["usage"]["prompt_tokens"] == len(prompt_ids)
    assert record["new_tokens"] == len(record["token_ids"]) == 4 and all(isinstance(t, int) for t in record["token_ids"])


@needs_xllamacpp
def test_greedy_output_is_deterministic_and_matches_accelgens_llamacpp_runner(peers, tokenizer):
    from accelgen.models.checkpoints import load_llamacpp

    prompt_ids = encode_prompt(tokenizer, [{"role": "user", "content": "Name three colours."}])
    plain = run(peers, "llamacpp", prompt_ids, 12)
    assert plain["new_tokens"] == 12 and plain["finish_reason"] == "length" and plain["seconds"] > 0
    assert plain["draft_tokens"] is None and plain["target_forwards"] is None  # not reported, not zero
    assert run(peers, "llamacpp", prompt_ids, 12)["token_ids"] == plain["token_ids"]
    model, gguf_tokenizer = load_llamacpp(MODEL, threads=2)  # the same file and prompt ids through accelgen's loop
    assert accelgen.generate(model, gguf_tokenizer, prompt_ids, max_new_tokens=12).token_ids == plain["token_ids"]


@needs_xllamacpp
def test_max_new_tokens_and_eos_are_handled_like_the_other_rows(peers, smollm, tokenizer):
    long = encode_prompt(tokenizer, [{"role": "user", "content": "Write a long story about a dragon."}])
    assert run(peers, "llamacpp", long, 5)["new_tokens"] == 5
    short = encode_prompt(tokenizer, [{"role": "user", "content": "Say only: yes"}])
    record = run(peers, "llamacpp", short, 64)
    assert record["finish_reason"] == "stop" and record["new_tokens"] < 64
    assert record["token_ids"][-1] in eos_token_ids(smollm[0], tokenizer)  # the EOS that ended it is kept, as accelgen does
    ours = accelgen.generate(smollm[0], tokenizer, short, max_new_tokens=64)
    assert ours.finish_reason == "stop" and ours.token_ids[-1] == record["token_ids"][-1]


@needs_xllamacpp
def test_ngram_and_draft_speculation_run_and_report_acceptance(peers, tokenizer):
    prompt_ids = tokenizer(COUNTING).input_ids
    plain = run(peers, "llamacpp", prompt_ids, 16)
    ngram = run(peers, "llamacpp-ngram", prompt_ids, 16)
    drafted = run(peers, "llamacpp-draft", prompt_ids, 16)  # the model drafting for itself
    for record in (ngram, drafted):
        assert record["token_ids"] == plain["token_ids"]
        assert 0 < record["accepted_draft_tokens"] <= record["draft_tokens"]
    no_repeats = encode_prompt(tokenizer, [{"role": "user", "content": "Say only: yes"}])
    assert run(peers, "llamacpp-ngram", no_repeats, 8)["draft_tokens"] == 0  # drafted none: zero, not unknown


@needs_xllamacpp
def test_llamacpp_options_reach_the_server(tokenizer):
    """A variant sets llama.cpp's draft length; the row's server is its own."""
    method, options = row("llamacpp-draft@draft_max=6")
    assert options == {**llamacpp.OPTIONS["llamacpp-draft"], "draft_max": 6}
    peers = llamacpp.LlamaCppPeers(MODEL, MODEL, threads=2)
    record = peers.run(method, options, tokenizer(COUNTING).input_ids, 12)
    assert list(peers.servers) == ["llamacpp-draft@draft_max=6"] and record["draft_tokens"] > 0
    with pytest.raises(ValueError, match="has no option 'draft_max'"):
        row("llamacpp-ngram@draft_max=6")


@pytest.mark.slow  # three llama.cpp servers and SmolLM2; the tests above run each llama.cpp row by default
@needs_xllamacpp
def test_bench_interleaves_llamacpp_rows_with_the_others(tmp_path, smollm, tokenizer):
    """A run with llama.cpp rows: records in format gguf compared with the plain llamacpp row; the plain row with
    hf-greedy for quality only; tokens/s, the GGUF file and the CPU in the report."""
    from accelgen.bench import report

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "count", "category": "numbers", "prompt": "' + COUNTING + '"}\n')
    config = BenchConfig(model=MODEL, dataset=f"jsonl:{prompts}", draft=MODEL, max_new_tokens=8, warmup=True,
                         methods=["autoregressive", "llamacpp", "llamacpp-ngram", "llamacpp-draft"])
    out_dir = runner.run(runner.plan(config), smollm[0], tokenizer, tmp_path / "out", smollm[0])
    results = report.render(out_dir)
    records = {r["method"]: r for r in results["records"]}
    assert records["llamacpp-ngram"]["weights"] == "gguf" and records["llamacpp-ngram"]["reference"] == "llamacpp"
    assert records["llamacpp-draft"]["draft_weights"] == "gguf"
    assert records["llamacpp"]["quality_only"] and records["llamacpp"]["reference"] == "hf-greedy"
    assert records["autoregressive"]["weights"] == "fp32" and records["autoregressive"]["identical"]
    overall = results["aggregates"]["overall"]
    assert overall["llamacpp-ngram"]["identical"] == 1 and overall["llamacpp-ngram"]["acceptance_rate"] > 0
    assert all(overall[name]["tokens_per_second"] > 0 for name in overall)
    assert not [w for w in results["warnings"] if w["method"] == "llamacpp"]  # another format is no violation
    text = (out_dir / "report.md").read_text()
    assert f"target {llamacpp.gguf_file(MODEL).name}" in text and "flags:" in text
    assert (out_dir / "tokens.png").exists()


def test_missing_package_is_a_clear_error_before_anything_loads(monkeypatch):
    monkeypatch.setitem(sys.modules, "xllamacpp", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"pip install 'accelgen\[llamacpp\]'"):
        llamacpp.make_server("llamacpp", MODEL, None, threads=2)
    with pytest.raises(ValueError, match=r"pip install 'accelgen\[llamacpp\]'"):
        runner.plan(BenchConfig(model=MODEL, dataset="specbench", methods=["llamacpp"], limit=1))


def test_a_model_without_a_gguf_file_is_a_clear_error(tmp_path):
    folder = tmp_path / "hf-model"
    folder.mkdir()
    with pytest.raises(ValueError, match="llama.cpp runs GGUF files only"):
        llamacpp.gguf_files(str(folder), [], peers=False)
    # rows on llama.cpp's kernels are checked when the run is planned, before any model is loaded
    with pytest.raises(ValueError, match="llama.cpp runs GGUF files only"):
        runner.plan(BenchConfig(model=str(folder), dataset="specbench", methods=["autoregressive@weights=gguf"], limit=1))
    assert runner.plan(BenchConfig(model=str(folder), dataset="specbench", methods=["autoregressive"], limit=1)).gguf_files == {}


def test_llamacpp_rows_take_no_weight_format_and_need_a_draft():
    with pytest.raises(ValueError, match="its own weight format"):
        rows.resolve_methods(["llamacpp@weights=int8"], set(), 0)
    with pytest.raises(ValueError, match="needs draft_model"):
        rows.resolve_methods(["llamacpp-draft"], set(), 0)
    with pytest.raises(ValueError, match="greedy decoding only"):
        rows.resolve_methods(["llamacpp"], set(), 0.7)
