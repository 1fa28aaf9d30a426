"""Saving and loading trained heads (exit heads, Medusa heads): a safetensors file and a JSON config in one
folder, checked against the model they are used with so that a head that does not fit is refused by name."""

from __future__ import annotations

import json
from pathlib import Path


def save_heads(module, folder, name: str, config: dict) -> None:
    """`name`.safetensors (the module's weights) and `name`.json (config: what rebuilds it) in folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({key: tensor.contiguous() for key, tensor in module.state_dict().items()}, folder / f"{name}.safetensors")
    (folder / f"{name}.json").write_text(json.dumps(config, indent=1) + "\n")


def load_heads(cls, folder, name: str, train_command: str, model=None):
    """cls(**config) with the saved weights; with a model, checked to fit it (`check_fits`) and moved to it."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    if not (folder / f"{name}.json").exists():
        raise FileNotFoundError(f"no {name.replace('_', ' ')} in {folder} (no {name}.json); train them with "
                                f"`{train_command} --out {folder}`")
    heads = cls(**json.loads((folder / f"{name}.json").read_text()))
    heads.load_state_dict(load_file(folder / f"{name}.safetensors"))
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
        raise ValueError(f"{what} do not fit this model: {'; '.join(problems)}")
