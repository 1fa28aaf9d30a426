"""/metrics: prometheus_client's exposition, vLLM-style names, a registry per app, latency histograms."""

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from accelgen.server.app import create_app
from accelgen.server.engine import Engine
from accelgen.server.metrics import Metrics


def scrape(client) -> dict:
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def value(family, suffix: str = "", **labels) -> float:
    return sum(sample.value for sample in family.samples
               if sample.name == family.name + suffix and labels.items() <= sample.labels.items())


def test_metrics_count_what_the_engine_did(tiny_target, tokenizer, make_server_config):
    with TestClient(create_app(make_server_config(tiny_target, tokenizer), Engine(max_batch=4))) as client:
        client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 12, "temperature": 0, "n": 2})
        families = scrape(client)
    counter = {name: value(families[name], "_total", model_name="tiny")
               for name in ("accelgen:request_received", "accelgen:request_success", "accelgen:generation_tokens",
                            "accelgen:spec_decode_num_draft_tokens", "accelgen:spec_decode_num_accepted_tokens",
                            "accelgen:prompt_tokens")}
    assert counter["accelgen:request_received"] == 2 and counter["accelgen:request_success"] == 2  # n=2: two sequences
    assert counter["accelgen:generation_tokens"] == 24
    assert 0 < counter["accelgen:spec_decode_num_accepted_tokens"] <= counter["accelgen:spec_decode_num_draft_tokens"]
    assert counter["accelgen:prompt_tokens"] == 2 * len(tokenizer("def f(x):").input_ids)
    assert value(families["accelgen:num_requests_running"], model_name="tiny") == 0
    assert 0 < value(families["accelgen:spec_decode_draft_acceptance_rate"]) <= 1
    for histogram in ("accelgen:time_to_first_token_seconds", "accelgen:time_per_output_token_seconds",
                      "accelgen:e2e_request_latency_seconds"):
        assert families[histogram].type == "histogram"
        assert value(families[histogram], "_count", model_name="tiny") == 2
        assert value(families[histogram], "_sum") > 0
    assert value(families["process_resident_memory_bytes"]) > 0


def test_each_app_has_its_own_registry(tiny_target, tokenizer, make_server_config):
    first, second = Metrics(Engine(), "a"), Metrics(Engine(), "b")  # the global registry would refuse the second
    first.observe_request(arrived=0.0, first_token=0.5, finished=1.5, tokens=3)
    texts = [metrics.text().decode() for metrics in (first, second)]
    assert 'accelgen:time_to_first_token_seconds_count{model_name="a"} 1.0' in texts[0]
    assert 'accelgen:time_to_first_token_seconds_count{model_name="b"} 0.0' in texts[1]
    assert 'accelgen:time_per_output_token_seconds_sum{model_name="a"} 0.5' in texts[0]
    create_app(make_server_config(tiny_target, tokenizer))
    create_app(make_server_config(tiny_target, tokenizer))


@pytest.mark.parametrize("tokens,observed", [(1, 0), (0, 0)])
def test_no_time_per_token_without_a_second_token(tokens, observed):
    metrics = Metrics(Engine(), "m")
    metrics.observe_request(arrived=0.0, first_token=0.2 if tokens else None, finished=0.3, tokens=tokens)
    sample = lambda name: metrics.registry.get_sample_value(name, {"model_name": "m"})  # noqa: E731
    assert sample("accelgen:time_per_output_token_seconds_count") == observed
    assert sample("accelgen:time_to_first_token_seconds_count") == (1 if tokens else 0)
    assert sample("accelgen:e2e_request_latency_seconds_sum") == pytest.approx(0.3)
