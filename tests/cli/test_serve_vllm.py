"""`accelgen serve` for vLLM users: `--speculative-config` translated (vLLM's documented examples), refused quickly
where it has no counterpart, the positional model, vLLM's names for the limits, served-model-name, chat template."""

import copy
import time

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import accelgen.cli.serve as serve_module
import accelgen.server.app as app_module
from accelgen.cli import app
from accelgen.server.vllm_options import Speculation, allowed_origins, speculative_config

runner = CliRunner()


@pytest.mark.parametrize("text, expected", [
    # vLLM's documented examples (docs "Speculative Decoding"), the model paths as they are there
    ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}',
     Speculation("pld", {"max_ngram": 4, "draft_length": 5})),
    ('{"model": "facebook/opt-125m", "num_speculative_tokens": 5}',
     Speculation("speculative", {"gamma": 5}, draft="facebook/opt-125m")),
    ('{"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "draft_tensor_parallel_size": 1, '
     '"num_speculative_tokens": 2}', Speculation("eagle", {"heads": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "depth": 2})),
    ('{"method": "eagle3", "model": "heads/", "num_speculative_tokens": 3}',
     Speculation("eagle", {"heads": "heads/", "depth": 3})),
    ('{"method": "medusa", "model": "medusa-heads/"}', Speculation("medusa", {"heads": "medusa-heads/"})),
    ('{"method": "draft_model", "model": "small"}', Speculation("speculative", {}, draft="small")),
    ('{"method": "ngram", "prompt_lookup_min": 5}', Speculation("pld", {"min_ngram": 5, "max_ngram": 5})),
])
def test_speculative_config_is_translated(text, expected):
    assert speculative_config(text) == expected


@pytest.mark.parametrize("text, message", [
    ('{"method": "mtp", "num_speculative_tokens": 1}', "'mtp' has no counterpart"),
    ('{"method": "warp"}', "'warp' is not one of vLLM's"),
    ('{"method": "ngram", "quantization": "fp8"}', "quantization has no counterpart"),
    ('{"method": "draft_model"}', "needs \"model\""),
    ('{"method": "eagle", "model": "h", "draft_tensor_parallel_size": 2}', "must be 1 here"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "integer >= 1"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "over prompt_lookup_max"),
    ('{"model": "m", "prompt_lookup_max": 2}', "belong to method ngram"),
    ("[1]", "must be a JSON object"),
    ("{method: ngram}", "is not JSON"),
])
def test_speculative_config_refusals_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        speculative_config(text)


def test_allowed_origins_in_vllms_json_form_or_comma_separated():
    assert allowed_origins(['["*"]']) == ("*",)
    assert allowed_origins(["https://a.example, https://b.example", "https://c.example"]) == (
        "https://a.example", "https://b.example", "https://c.example")


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(serve_module, "load_target_and_draft", refuse)


@pytest.mark.parametrize("arguments", [
    ["serve", "tiny", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
    ["serve", "tiny", "--speculative_config", '{"method": "warp-drive"}'],
    ["serve", "tiny", "--speculative-config", '{"method": "ngram"}', "--method", "speculative"],
    ["serve", "tiny", "--model", "other"],
    ["serve", "tiny", "--chat-template", "no/such/template.jinja"],
    ["serve", "tiny", "--allowed-origins", '["*"'],
])
def test_serve_refuses_before_loading_and_quickly(no_loading, arguments):
    started = time.monotonic()
    result = runner.invoke(app, arguments)
    assert result.exit_code == 2 and "a model was loaded" not in result.output, result.output
    assert time.monotonic() - started < 3


@pytest.fixture
def served(monkeypatch, tiny_target, tokenizer):
    """Runs `accelgen serve` through its CLI code path with the tiny models and no uvicorn: the app it built."""
    built = {}

    def load(model, dtype, weights, draft, draft_dtype, draft_weights, device):
        built["loaded"] = (model, draft)
        return tiny_target, copy.deepcopy(tokenizer), tiny_target if draft else None

    monkeypatch.setattr(serve_module, "load_target_and_draft", load)
    monkeypatch.setattr(app_module, "run", lambda server_app, **kwargs: built.setdefault("app", server_app))

    def invoke(*arguments):
        result = runner.invoke(app, ["serve", *arguments, "--token-budget", "8"])
        assert result.exit_code == 0, result.output
        return built

    return invoke


@pytest.mark.parametrize("config, method, draft", [
    ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}', "pld", None),
    ('{"model": "draft-path", "num_speculative_tokens": 5}', "speculative", "draft-path"),
])
def test_serve_with_vllms_speculative_examples_answers_the_openai_client(served, config, method, draft):
    openai = pytest.importorskip("openai")
    built = served("target-path", "--speculative-config", config, "--served-model-name", "a,b",
                   "--max-num-seqs", "3", "--max-model-len", "128")
    assert built["loaded"] == ("target-path", draft)
    server_app = built["app"]
    assert server_app.state.engine.max_batch == 3 and server_app.state.config.max_prompt_tokens == 128
    with TestClient(server_app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
        assert [m.id for m in client.models.list().data] == ["a", "b"]
        reply = client.completions.create(model="b", prompt="a b c a b c a b c a b", max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert reply.model == "a" and reply.usage.completion_tokens == 12
    statistics = reply.model_extra["accelgen"]
    assert statistics["method"] == method and statistics["draft_tokens"] > 0  # speculation on


def test_serve_positional_model_chat_template_and_old_names(served, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}")
    built = served("--model", "target-path", "--chat-template", str(template), "--max-batch", "2",
                   "--max-prompt-tokens", "64", "--allowed-origins", "https://app.example")
    config = built["app"].state.config
    assert built["loaded"] == ("target-path", None) and config.served_names == ["target-path"]
    assert config.tokenizer.chat_template == template.read_text() and config.max_prompt_tokens == 64
    assert built["app"].state.engine.max_batch == 2 and config.allowed_origins == ("https://app.example",)
    with TestClient(built["app"]) as http:
        reply = http.post("/v1/chat/completions", json={"model": "target-path", "max_tokens": 1,
                                                        "messages": [{"role": "user", "content": "hi"}]}).json()
    assert reply["usage"]["prompt_tokens"] == len(config.tokenizer("<user>hi\n", add_special_tokens=False).input_ids)
