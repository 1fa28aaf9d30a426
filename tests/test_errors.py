"""accelgen's input errors: InputError, a ValueError, raised where input is checked; an unknown hub id refused in
seconds when the hub cannot be reached."""

import time

import pytest

import accelgen
from accelgen.errors import InputError
from accelgen.models import EMBEDDED_MODELS, checkpoints


def test_input_error_is_a_value_error():
    assert issubclass(InputError, ValueError)  # `except ValueError` and the server's 400 answers keep working


@pytest.mark.parametrize("check", [
    lambda: accelgen.get_method("warp-drive"),
    lambda: accelgen.get_method("speculative").check_options({"no_such_option": 1}),
    lambda: accelgen.get_method("speculative").check_needs(draft_model=None),
    lambda: checkpoints.check_weights("int3"),
])
def test_input_checks_raise_input_errors(check):
    with pytest.raises(InputError):
        check()


@pytest.fixture
def uncached(monkeypatch):
    monkeypatch.setattr(checkpoints, "local_folder", lambda name: None)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def test_an_uncached_hub_id_offline_is_refused_naming_the_embedded_models(monkeypatch, uncached):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(InputError, match="HF_HUB_OFFLINE=1") as error:
        checkpoints.check_source("someone/no-such-model")
    assert all(name in str(error.value) for name in EMBEDDED_MODELS)


def test_an_unreachable_hub_is_refused_in_seconds(monkeypatch, uncached):
    from huggingface_hub import constants

    def no_network(address, timeout):
        assert timeout <= 3
        raise OSError("Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("socket.create_connection", no_network)
    started = time.monotonic()
    with pytest.raises(InputError, match="HF_HUB_OFFLINE=1 loads models from the Hugging Face cache") as error:
        checkpoints.check_source("someone/no-such-model")
    assert time.monotonic() - started < 3 and "smollm2-135m" in str(error.value)


def test_a_proxy_lets_the_download_try(monkeypatch, uncached):
    from huggingface_hub import constants

    def unused(*args, **kwargs):
        raise AssertionError("the hub was probed directly, past the proxy")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.setattr("socket.create_connection", unused)
    checkpoints.check_source("someone/no-such-model")


def test_a_cached_hub_id_is_not_probed(monkeypatch, tmp_path):
    def unused(*args, **kwargs):
        raise AssertionError("the hub was probed for a cached model")

    monkeypatch.setattr(checkpoints, "local_folder", lambda name: tmp_path)
    monkeypatch.setattr("socket.create_connection", unused)
    checkpoints.check_source("someone/cached-model")
