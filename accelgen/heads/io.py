"""Trained heads on disk: a safetensors file and a JSON config in one folder, checked against the model they
are used with, so that a head that does not fit is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

from accelgen.atomic import read_checked, save_tensors_atomically, write_json_atomically
from accelgen.errors import InputError


def save_heads(module, folder, name: str, config: dict) -> None:
    """`name`.safetensors (the module's weights) and `name`.json (config: what rebuilds it) in folder, each written
    atomically. The config goes last and the old one is removed first: heads without their config are not there,
    so an interrupted save never pairs new weights with an old config."""
    folder = Path(folder)
    (folder / f"{name}.json").unlink(missing_ok=True)
    save_tensors_atomically(folder / f"{name}.safetensors", module.state_dict())
    write_json_atomically(folder / f"{name}.json", config)


def load_heads(cls, folder, name: str, train_command: str, model=None):
    """cls(**config) with the saved weights; with a model, checked to fit it (`check_fits`) and moved to it."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    if not (folder / f"{name}.json").exists():
        raise FileNotFoundError(f"no {name.replace('_', ' ')} in {folder} (no {name}.json); train them with "
                                f"`{train_command} --out {folder}`")
    fix = f"train them again with `{train_command} --out {folder}` (a rerun resumes from its checkpoint)"
    heads = read_checked(folder / f"{name}.json", lambda path: cls(**json.loads(path.read_text())), fix)
    read_checked(folder / f"{name}.safetensors", lambda path: heads.load_state_dict(load_file(path)), fix)
    if model is not None:
        check_fits(heads.describe_shape(), model, f"these {name.replace('_', ' ')} (trained for "
                                                  f"{heads.base_model or 'another model'})")
        heads.to(model.device)
    return heads.eval()


def check_fits(shape: dict, model, what: str) -> None:
    """A clear error if shape's hidden_size / layer_count / vocab_size / intermediate_size (0: not recorded)
    differ from the model's."""
    config = model.config
    actual = {"hidden_size": config.hidden_size, "layer_count": config.num_hidden_layers,
              "vocab_size": config.vocab_size, "intermediate_size": getattr(config, "intermediate_size", 0)}
    names = {"hidden_size": "hidden size", "layer_count": "layer count", "vocab_size": "vocabulary",
             "intermediate_size": "MLP size"}
    problems = [f"{names[key]} {value}, the model's is {actual[key]}" for key, value in shape.items()
                if value and value != actual[key]]
    if problems:
        raise InputError(f"{what} do not fit this model: {'; '.join(problems)}")
