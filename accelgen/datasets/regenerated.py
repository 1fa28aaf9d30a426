"""Reading data made by the target (`accelgen data regenerate`, accelgen/train/regenerate.py): the folder's
manifest, and its answered prompts as records or as texts to pack into training windows (`regenerated:DIR`).

Only the shards the manifest lists are read: a shard is listed once it is whole, so data still being made can be
read at any moment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from accelgen.errors import InputError

MANIFEST = "manifest.json"
FORMAT = "accelgen-regenerated"
VERSION = 1


def read_manifest(folder) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if manifest.get("format") != FORMAT or not isinstance(manifest.get("settings"), dict) \
                or not isinstance(manifest.get("shards"), list):
            raise InputError(f"not a {FORMAT} manifest")
    except (ValueError, AttributeError) as error:
        raise InputError(f"{path} is not the manifest of regenerated data ({error}); delete {folder} or choose "
                         "another --out") from None
    return manifest


def read_records(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def regenerated_records(folder) -> Iterator[dict]:
    """The records of the shards the folder's manifest lists, in order (a shard not listed yet is left out).
    A folder without regenerated data is refused here, before any record is read."""
    folder = Path(folder).expanduser()
    manifest = read_manifest(folder)
    if manifest is None:
        raise FileNotFoundError(f"no regenerated data in {folder} (no {MANIFEST}): make it with "
                                "`accelgen data regenerate --out DIR`")
    if not manifest["shards"]:
        raise InputError(f"{folder} holds no answered shard yet; run `accelgen data regenerate` there further")
    return (record for entry in manifest["shards"] for record in shard_records(folder, entry))


def shard_records(folder: Path, entry: dict) -> list[dict]:
    path = folder / entry["file"]
    if not path.is_file():
        raise InputError(f"{path} is missing though {folder / MANIFEST} lists it")
    records = read_records(path)
    if len(records) != entry["prompts"]:
        raise InputError(f"{path} holds {len(records)} answers, {folder / MANIFEST} says {entry['prompts']}")
    return records


def regenerated_texts(folder) -> Iterator[str]:
    """Each answered prompt as the model saw it followed by its answer: what trainers pack into token windows."""
    return (record["text"] for record in regenerated_records(folder))


def regenerated_settings(folder) -> dict | None:
    manifest = read_manifest(Path(folder).expanduser())
    return None if manifest is None else manifest["settings"]
