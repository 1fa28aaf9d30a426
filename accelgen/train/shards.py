"""A feature store in numbered shards: what a frozen target computes over token windows, kept so that a stopped
extraction resumes where it stopped, on this machine or another.

The windows are cut into fixed ranges of `shard_windows` (shard i holds windows [i·k, (i+1)·k)). Each shard is a
safetensors file of named tensors, whatever the extractor returns for its windows (EAGLE: features and choices;
EAGLE-3: three layers' hidden states), written atomically; then `index.json`, also written atomically, lists it
with the windows it holds and a hash of their tokens. So at any moment the index names only whole shards:

- a resumed run starts at the first shard the index lacks (a shard written but not yet indexed, by a run killed
  in between, is computed again and replaces it), and reads the indexed ones back, so no window is skipped and
  none is held twice;
- a store made for another model, format, extractor or dataset is refused by name (its `identity` differs), and
  so is one whose windows are not this run's (a hash of each shard's tokens differs), rather than mixed in;
- a run asking for more windows than the store holds extends it (a short last shard is completed), a run asking
  for fewer reads the first ones.

Also here: which format, fp32 or bf16, a target extracts features fastest in on this machine (`prefill_format`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from accelgen.atomic import load_tensors, save_tensors_atomically, write_json_atomically
from accelgen.errors import InputError

INDEX = "index.json"
STORE_VERSION = 1
SHARD_WINDOWS = 16  # windows per shard: a kill loses at most this many windows' extraction

# window batch (b, n) long -> {name: tensor (b, ...)}: what the target computes over those windows
Extractor = Callable[[torch.Tensor], dict]


def windows_digest(windows: torch.Tensor) -> str:
    """A short hash of token windows (b, n): tells a store's windows from another run's."""
    return hashlib.sha1(windows.to(torch.long).contiguous().numpy().tobytes()).hexdigest()[:16]


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass
class FeatureStore:
    """The store in `folder` for one `identity` (a JSON-able dict naming what the features are of and how they
    were computed: model, format, extractor, dataset, window length, ...)."""

    folder: Path
    identity: dict
    shard_windows: int = SHARD_WINDOWS

    def __post_init__(self):
        self.folder = Path(self.folder)
        if self.shard_windows < 1:
            raise InputError(f"shard_windows must be >= 1, got {self.shard_windows}")
        self.identity = json.loads(json.dumps(self.identity))  # as it reads back from the index
        self.shards: list[dict] = self._indexed_shards()

    # --- the index ------------------------------------------------------------------------------------------

    def _indexed_shards(self) -> list[dict]:
        """The shards an existing index lists (after checking it belongs to this identity), else []."""
        path = self.folder / INDEX
        if not path.is_file():
            return []
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
            saved_identity, shard_windows, shards = index["identity"], index["shard_windows"], index["shards"]
        except (ValueError, KeyError, TypeError) as error:
            raise InputError(f"{path} is not a feature store index ({error}); delete {self.folder} or choose another "
                             "folder") from None
        if saved_identity != self.identity:
            difference = identity_difference(saved_identity, self.identity)
            raise InputError(f"{self.folder} holds features of another run ({difference}); delete it or choose "
                             "another folder for this run's features")
        if shard_windows != self.shard_windows:
            raise InputError(f"{self.folder} was written in shards of {shard_windows} windows, this run asks for "
                             f"{self.shard_windows}")
        return shards

    def _write_index(self) -> None:
        write_json_atomically(self.folder / INDEX, {"version": STORE_VERSION, "identity": self.identity,
                                                    "shard_windows": self.shard_windows, "shards": self.shards})

    @property
    def windows_held(self) -> int:
        return self.shards[-1]["end"] if self.shards else 0

    @staticmethod
    def saved_identity(folder) -> dict | None:
        """The identity of the store in folder, or None where there is none (to adopt its settings on resume)."""
        path = Path(folder) / INDEX
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))["identity"]
        except (ValueError, KeyError, TypeError):
            return None

    # --- filling and reading --------------------------------------------------------------------------------

    def check_windows(self, windows: torch.Tensor) -> None:
        """Refuse windows (count, n) that are not those the indexed shards were computed over (as far as both go)."""
        for entry in self.shards:
            start, end = entry["start"], min(entry["end"], len(windows))
            if start >= end:
                break
            if end == entry["end"]:
                same = windows_digest(windows[start:end]) == entry["windows_sha1"]
            else:  # this run has fewer windows than the shard holds: compare the part it has
                held = load_tensors(self.folder / entry["file"], f"delete {self.folder} and run again")["windows"]
                same = torch.equal(held[: end - start], windows[start:end])
            if not same:
                raise InputError(f"{self.folder}: windows {start}..{end - 1} differ from those its features were "
                                 "computed over (another dataset, tokenizer or --seq-len); delete it or choose another "
                                 "folder")

    def fill(self, windows: torch.Tensor, extract: Extractor, progress: Callable[[int], None] | None = None) -> None:
        """Compute and save the shards that windows (count, n) need and the store lacks, in order; progress(windows
        done, of count) after each shard. A short last shard is completed when there are more windows now."""
        self.check_windows(windows)
        count = len(windows)
        last = self.shards[-1] if self.shards else None
        if last is not None and last["end"] < count and last["end"] - last["start"] < self.shard_windows:
            self.shards.pop()  # a short last shard: unlisted first, then computed again, whole
            self._write_index()
        if progress is not None:
            progress(min(self.windows_held, count))
        while self.windows_held < count:
            number = len(self.shards)
            start = number * self.shard_windows
            end = min(start + self.shard_windows, count)
            tensors = extract(windows[start:end])
            check_extracted(tensors, end - start)
            save_tensors_atomically(self.folder / shard_name(number), {**tensors, "windows": windows[start:end]})
            self.shards.append({"file": shard_name(number), "start": start, "end": end,
                                "windows_sha1": windows_digest(windows[start:end]),
                                "names": sorted(tensors)})
            self._write_index()
            if progress is not None:
                progress(end)

    def load(self, count: int | None = None) -> dict[str, torch.Tensor]:
        """The first count windows' tensors (default: all held), each concatenated over the shards, with "windows"."""
        count = self.windows_held if count is None else count
        if count > self.windows_held:
            raise InputError(f"{self.folder} holds features of {self.windows_held} windows, not {count}: fill it first")
        parts: dict[str, list[torch.Tensor]] = {}
        for entry in self.shards:
            if entry["start"] >= count:
                break
            path = self.folder / entry["file"]
            if not path.is_file():
                raise InputError(f"{path} is missing though {self.folder / INDEX} lists it; delete {self.folder} and "
                                 "run again")
            tensors = load_tensors(path, f"delete {self.folder} and run again")
            if windows_digest(tensors["windows"]) != entry["windows_sha1"]:
                raise InputError(f"{path} does not hold the windows {self.folder / INDEX} says; delete {self.folder} "
                                 "and run again")
            for name, tensor in tensors.items():
                parts.setdefault(name, []).append(tensor[: count - entry["start"]])
        return {name: torch.cat(tensors) for name, tensors in parts.items()}


def check_extracted(tensors: dict, count: int) -> None:
    if not isinstance(tensors, dict) or not tensors or "windows" in tensors:
        raise InputError("an extractor returns a non-empty dict of named tensors (not named 'windows')")
    wrong = [name for name, tensor in tensors.items() if not isinstance(tensor, torch.Tensor) or len(tensor) != count]
    if wrong:
        raise InputError(f"extracted tensors {wrong} do not have one row per window ({count})")


def identity_difference(saved: dict, wanted: dict) -> str:
    """"model: a (stored) vs b (this run)" for the keys that differ."""
    keys = sorted(set(saved) | set(wanted))
    return "; ".join(f"{key}: {saved.get(key)!r} stored vs {wanted.get(key)!r} this run"
                     for key in keys if saved.get(key) != wanted.get(key))


def stored_features(folder, identity: dict, windows: torch.Tensor, extract: Extractor,
                    progress: Callable[[int], None] | None = None, shard_windows: int = SHARD_WINDOWS) -> dict:
    """{name: tensor (count, ...)}: extract(window batch) over windows (count, n), computed once into the store in
    folder (resumed where a run stopped) and read back."""
    store = FeatureStore(folder, identity, shard_windows)
    store.fill(windows, extract, progress)
    tensors = store.load(len(windows))
    if not torch.equal(tensors.pop("windows"), windows):
        raise InputError(f"{folder}: its windows are not this run's; delete it and run again")
    return tensors


# --- the format features are extracted in -------------------------------------------------------------------


def prefill_format(model_name: str, threads: int | None = None) -> tuple[str, str]:
    """(fp32 or bf16, why): the format a forward over many tokens (prefill, feature extraction) runs faster in
    here. From the widest forward the weights probe timed for this model on this machine (accelgen/models/probe.py,
    `--weights auto`), where it has run; else by the CPU: bf16 with native bf16 matrix units, fp32 without (where
    bf16 is converted on the fly, fp32 prefill is several times faster)."""
    from accelgen import hardware
    from accelgen.models.probe import cached_choice

    choice = cached_choice(model_name, threads)
    timings = (choice or {}).get("timings", {})
    if "fp32" in timings and "bf16" in timings:
        fp32, bf16 = timings["fp32"]["t8"], timings["bf16"]["t8"]
        fastest = "fp32" if fp32 <= bf16 else "bf16"
        return fastest, (f"measured on this machine: an 8-token forward takes {fp32 * 1000:.0f} ms in fp32, "
                         f"{bf16 * 1000:.0f} ms in bf16")
    if hardware.native_bf16():
        return "bf16", "this CPU multiplies bf16 natively (not measured: `accelgen profile` or --weights auto measures)"
    return "fp32", ("this CPU has no native bf16 (it converts bf16, and fp32 prefill is faster; not measured: "
                    "`accelgen profile` or --weights auto measures)")
