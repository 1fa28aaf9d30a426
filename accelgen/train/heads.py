"""What trained heads share: saving and loading them (a safetensors file and a JSON config in one folder,
checked against the model they are used with so that a head that does not fit is refused by name), training
checkpoints, and the LM head cut to a draft vocabulary."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from accelgen.atomic import (load_torch, read_checked, save_tensors_atomically, torch_save_atomically,
                             write_json_atomically)


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
        raise ValueError(f"{what} do not fit this model: {'; '.join(problems)}")


class DraftLMHead:
    """The target's LM head cut to a draft vocabulary (FR-Spec's idea): on a CPU the LM head is most of a draft
    step's cost, and a few thousand frequent tokens carry nearly all of the text. Only those rows are computed;
    the rows are detached, so training a head through them never touches the target's weights."""

    def __init__(self, lm_head, vocab: torch.Tensor):
        """vocab: (V',) token ids to draft from; empty for the whole vocabulary."""
        self.vocab_size = lm_head.weight.shape[0]
        self.vocab = vocab.to(lm_head.weight.device) if len(vocab) else None
        weight, bias = lm_head.weight.detach(), None if lm_head.bias is None else lm_head.bias.detach()
        self.weight = weight if self.vocab is None else weight[self.vocab]
        self.bias = bias if bias is None or self.vocab is None else bias[self.vocab]

    def restricted(self, states: torch.Tensor) -> torch.Tensor:
        """(.., V') float32 logits over the draft vocabulary only, from states (.., d)."""
        return torch.nn.functional.linear(states.to(self.weight.dtype), self.weight, self.bias).float()

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """(.., vocab) float32 logits from states (.., d); -inf outside the draft vocabulary."""
        logits = self.restricted(states)
        if self.vocab is None:
            return logits
        full = torch.full((*logits.shape[:-1], self.vocab_size), float("-inf"), device=logits.device)
        full[..., self.vocab] = logits
        return full

    def label_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (..) as indices into the draft vocabulary; -100 (cross-entropy's ignore_index) outside it."""
        if self.vocab is None:
            return tokens
        index = torch.full((self.vocab_size,), -100, dtype=torch.long)
        index[self.vocab.cpu()] = torch.arange(len(self.vocab))
        return index[tokens.cpu()].to(tokens.device)


def run_settings(config) -> dict:
    """What a resumed run must share with its checkpoint: all of a trainer's config (a dataclass) but the run's
    length and checkpoint interval."""
    return {key: value for key, value in asdict(config).items() if key not in ("steps", "checkpoint_every")}


def resume(module, optimizer, path: Path | None, settings: dict, what: str) -> int:
    """The step a training run continues from: 0, or that of the checkpoint at path (its weights and optimizer
    state loaded). settings: what the run must share with its checkpoint (not its length); what: whose
    checkpoint it is, for errors ("EAGLE")."""
    if path is None or not Path(path).exists():
        return 0
    saved = load_torch(path, "delete it and rerun the same command to train from the start")
    if saved["settings"] != settings:
        raise ValueError(f"the {what} checkpoint in {Path(path).parent} was trained with other settings; use another --out")
    try:
        module.load_state_dict(saved["module"])
    except RuntimeError as error:
        raise ValueError(f"the {what} checkpoint in {Path(path).parent} does not fit this model: {str(error)[:200]}") from None
    optimizer.load_state_dict(saved["optimizer"])
    return saved["step"]


def save_checkpoint(path: Path, step: int, settings: dict, module, optimizer) -> None:
    """Atomically: a run killed while saving resumes from the checkpoint before."""
    torch_save_atomically(path, {"step": step, "settings": settings, "module": module.state_dict(),
                                 "optimizer": optimizer.state_dict()})
