"""Heads that ship in the package: found for the embedded model they were trained for, refused by name for a model
they do not fit, made from a trained head in bfloat16 within the size a file may have, and part of the package
build."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accelgen.heads import shipping
from accelgen.heads.eagle import EagleHead
from accelgen.heads.eagle3 import new_eagle3_head

ROOT = Path(__file__).resolve().parents[2]


def test_the_embedded_smollm2_ships_an_eagle3_head_with_its_training_record():
    drafters = shipping.shipped_drafters("smollm2-135m")
    assert set(drafters) == {"eagle"}
    folder = drafters["eagle"]
    config = json.loads((folder / "eagle_head.json").read_text())
    assert config["recipe"] == "eagle3" and config["base_model"] == "smollm2-135m" and config["layer_count"] == 30
    curve = json.loads((folder / "curve.json").read_text())
    assert curve["sessions"] and curve["sessions"][-1]["tokens_seen"] > 0 and "machine" in curve["sessions"][0]
    assert json.loads((folder / "evaluation.json").read_text())["top1"] > 0
    assert all(path.stat().st_size <= shipping.FILE_LIMIT for path in folder.iterdir())
    assert shipping.shipped_drafters("qwen2.5-coder-1.5b") == {}
    assert "eagle (eagle3, " in shipping.shipped_summary("smollm2-135m")


def renamed(model, name: str, tmp_path):
    """The model as if loaded from a folder called `name` (how accelgen loads an embedded model)."""
    model.name_or_path = str(tmp_path / name)
    return model


def test_a_shipped_head_is_found_only_for_its_model_and_refused_by_name_where_it_does_not_fit(make_tiny_model,
                                                                                             tmp_path):
    other = make_tiny_model("qwen2", seed=0)
    assert shipping.embedded_name(other) is None and shipping.shipped_head(other, "eagle") is None
    impostor = renamed(make_tiny_model("llama", seed=0), "smollm2-135m", tmp_path)  # the name, other weights
    with pytest.raises(ValueError, match="the eagle head shipped for smollm2-135m .* do not fit this model: hidden size"):
        shipping.shipped_head(impostor, "eagle")


@pytest.fixture
def shipped_into(tmp_path, monkeypatch):
    """Heads ship into a scratch folder for the test."""
    monkeypatch.setattr(shipping, "SHIPPED", tmp_path / "shipped")
    return tmp_path / "shipped"


def test_shipping_a_trained_head_keeps_it_in_bfloat16_with_its_record(make_tiny_model, shipped_into, tmp_path):
    model = make_tiny_model("qwen2", seed=0, layers=4)
    head = new_eagle3_head(model, torch.arange(0, 49152, 7))
    head.save(tmp_path / "trained")
    (tmp_path / "trained" / "curve.json").write_text(json.dumps({"points": [], "sessions": [{"tokens_seen": 5}]}))
    folder = shipping.ship(tmp_path / "trained", "smollm2-135m")
    assert folder == shipped_into / "smollm2-135m" / "eagle"
    weights = load_file(folder / "eagle_head.safetensors")
    assert weights["fc.weight"].dtype == torch.bfloat16 and weights["d2t"].dtype == torch.long
    assert json.loads((folder / "eagle_head.json").read_text())["base_model"] == "smollm2-135m"
    assert json.loads((folder / "curve.json").read_text())["sessions"] == [{"tokens_seen": 5}]
    loaded = EagleHead.load(folder, model)  # cast to the model's dtype on loading
    assert loaded.fc.weight.dtype == torch.float32 and torch.equal(loaded.d2t, head.d2t)
    assert torch.equal(loaded.fc.weight, head.fc.weight.to(torch.bfloat16).float())
    assert shipping.shipped_head(renamed(model, "smollm2-135m", tmp_path), "eagle") == folder
    shallower = renamed(make_tiny_model("qwen2", seed=0, layers=2), "smollm2-135m", tmp_path)
    with pytest.raises(ValueError, match="do not fit this model: layer count 4, the model's is 2"):
        shipping.shipped_head(shallower, "eagle")


def test_a_head_too_large_to_ship_or_for_no_embedded_model_is_refused(make_tiny_model, shipped_into, tmp_path,
                                                                       monkeypatch):
    model = make_tiny_model("qwen2", seed=0, layers=4)
    new_eagle3_head(model, torch.arange(0, 49152, 7)).save(tmp_path / "trained")
    with pytest.raises(ValueError, match="not an embedded model"):
        shipping.ship(tmp_path / "trained", "my-model")
    with pytest.raises(FileNotFoundError, match="no eagle head in"):
        shipping.ship(tmp_path / "nothing", "smollm2-135m")
    monkeypatch.setattr(shipping, "FILE_LIMIT", 1 << 10)
    with pytest.raises(ValueError, match="MiB a shipped file may take: train it with a smaller --draft-vocab"):
        shipping.ship(tmp_path / "trained", "smollm2-135m")
    assert not shipped_into.exists()


def test_the_package_build_includes_the_shipped_head(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("accelgen-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for file in ("eagle_head.json", "eagle_head.safetensors", "curve.json", "evaluation.json"):
        assert f"accelgen/heads/shipped/smollm2-135m/eagle/{file}" in names
