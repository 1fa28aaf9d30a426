"""Trained drafters that ship inside the package, for the embedded models: `heads/shipped/MODEL/METHOD/` holds a
head as `accelgen train` saves it (weights, config) with its training record (the learning curve across
sessions, `curve.json`, and the held-out evaluation, `evaluation.json`).

A method that needs a trained head (`eagle`) uses the shipped one when it is given none and the target is the
embedded model the head was trained for; a head the user passes always wins. Each later training session goes on
from the shipped head (`accelgen train eagle --resume-from FOLDER`, `shipped_folder` names it) and replaces it.
"""

from __future__ import annotations

import json
from pathlib import Path

from accelgen.errors import InputError
from accelgen.heads.eagle_common import NAME as EAGLE_NAME
from accelgen.heads.io import check_fits
from accelgen.models.embedded import EMBEDDED_MODELS

SHIPPED = Path(__file__).parent / "shipped"
# the file that makes a folder a head, per method that drafts with one
HEAD_FILES = {"eagle": f"{EAGLE_NAME}.json"}


def shipped_folder(model_name: str, method: str) -> Path:
    """Where the head of `method` for the embedded model `model_name` ships (there or not)."""
    return SHIPPED / model_name / method


def shipped_drafters(model_name: str) -> dict[str, Path]:
    """{method: folder} of the heads shipped for the embedded model `model_name`."""
    return {method: shipped_folder(model_name, method) for method, file in HEAD_FILES.items()
            if (shipped_folder(model_name, method) / file).is_file()}


def embedded_name(model) -> str | None:
    """The embedded model `model` was loaded as (accelgen caches each in a folder of its name), else None."""
    loaded_from = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "") or ""
    name = Path(str(loaded_from)).name
    return name if name in EMBEDDED_MODELS else None


def shipped_head(model, method: str) -> Path | None:
    """The folder of the shipped head of `method` for this target, None where none ships for it. A shipped head
    whose shape does not fit the loaded model (an embedded name over other weights) is refused by name."""
    name = embedded_name(model)
    folder = None if name is None else shipped_drafters(name).get(method)
    if folder is None:
        return None
    config = json.loads((folder / HEAD_FILES[method]).read_text())
    shape = {"hidden_size": config["config"]["hidden_size"], "layer_count": config["layer_count"],
             "vocab_size": config["config"]["vocab_size"], "intermediate_size": config["config"]["intermediate_size"]}
    check_fits(shape, model, f"the {method} head shipped for {name} ({folder})")
    return folder


def shipped_summary(model_name: str) -> str:
    """One line per shipped drafter of an embedded model, for `accelgen models`: method, recipe, tokens trained
    and held-out top-1 at depth 1 ("" where none ships)."""
    lines = []
    for method, folder in shipped_drafters(model_name).items():
        config = json.loads((folder / HEAD_FILES[method]).read_text())
        described = [config.get("recipe", "eagle1")]
        curve = read_json(folder / "curve.json")
        if curve.get("sessions"):
            described.append(f"{curve['sessions'][-1]['tokens_seen']:,} tokens over {len(curve['sessions'])} "
                             f"session{'s' * (len(curve['sessions']) != 1)}")
        evaluation = read_json(folder / "evaluation.json")
        if "top1" in evaluation:
            described.append(f"held-out top-1 {evaluation['top1']:.0%}")
        lines.append(f"{method} ({', '.join(described)})")
    return "; ".join(lines)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


FILE_LIMIT = 16 << 20  # bytes: what one file may weigh to travel back from a GPU machine in one piece


def ship(trained, model_name: str, method: str = "eagle") -> Path:
    """Make the head trained in folder `trained` (with its curve.json and evaluation.json) the one shipped for the
    embedded `model_name`: its weights in bfloat16 (the integer buffers as they are), each file written atomically.
    A file over FILE_LIMIT is refused: shrink the head (a smaller draft vocabulary)."""
    import torch
    from safetensors.torch import load_file

    from accelgen.atomic import save_tensors_atomically, write_json_atomically

    if model_name not in EMBEDDED_MODELS:
        raise InputError(f"{model_name!r} is not an embedded model ({', '.join(EMBEDDED_MODELS)})")
    trained, folder = Path(trained), shipped_folder(model_name, method)
    config = read_json(trained / HEAD_FILES[method])
    if not config:
        raise FileNotFoundError(f"no {method} head in {trained} ({HEAD_FILES[method]} missing)")
    weights = {name: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
               for name, tensor in load_file(trained / f"{EAGLE_NAME}.safetensors").items()}
    size = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    if size > FILE_LIMIT:
        raise InputError(f"the head's weights take {size / 2**20:.1f} MiB in bfloat16, over the "
                         f"{FILE_LIMIT >> 20} MiB a shipped file may take: train it with a smaller --draft-vocab")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / HEAD_FILES[method]).unlink(missing_ok=True)  # weights without their config are not a head
    save_tensors_atomically(folder / f"{EAGLE_NAME}.safetensors", weights)
    for record in ("curve.json", "evaluation.json"):
        if (trained / record).is_file():
            write_json_atomically(folder / record, read_json(trained / record))
    write_json_atomically(folder / HEAD_FILES[method], {**config, "base_model": model_name})
    return folder
