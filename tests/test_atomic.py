"""Atomic files (accelgen/atomic.py) and the fault-injection suite: a trainer, a datastore build and the feature
cache are killed at each of their writes, then run again. After the kill every file left reads back whole (the old
one, or none), a load gives the old content or an error naming the file and the command that fixes it, and the
rerun ends as if nothing had happened."""

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from accelgen import atomic
from accelgen.atomic import (CorruptFileError, load_tensors, load_torch, save_pretrained_atomically,
                             write_atomically, write_json_atomically, write_text_atomically)
from accelgen.drafters.rest import Datastore, RestDrafter, write_datastore
from accelgen.train.eagle import collect_features
from accelgen.train.layerskip import TRAINER_FILE, LayerSkipConfig, train_layerskip
from accelgen.heads.medusa import MedusaHeads
from accelgen.train.medusa import CHECKPOINT, MedusaConfig, train_medusa
from accelgen.train.shards import shard_name, stored_features

# --- the helper ----------------------------------------------------------------------------------------------


def test_a_process_killed_mid_write_leaves_the_old_file(tmp_path):
    path = write_json_atomically(tmp_path / "costs.json", {"old": True})
    script = f"""
import importlib.util, os, signal
spec = importlib.util.spec_from_file_location("atomic", {atomic.__file__!r})  # alone: no torch to import
atomic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(atomic)

def write(partial):
    partial.write_text('{{"new": tr')  # half of the new content
    os.kill(os.getpid(), signal.SIGKILL)

atomic.write_atomically({str(path)!r}, write)
"""
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert json.loads(path.read_text()) == {"old": True}
    [leftover] = [file.name for file in tmp_path.iterdir() if file != path]  # hidden; nothing reads it
    assert leftover.startswith(".costs.json.") and leftover.endswith(".partial")


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path):
    path = write_text_atomically(tmp_path / "a.txt", "old")

    def fail(partial: Path) -> None:
        partial.write_text("ne")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomically(path, fail)
    assert path.read_text() == "old" and list(tmp_path.iterdir()) == [path]


def test_the_content_reaches_the_disk_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda handle: (events.append("fsync"), real_fsync(handle)))
    monkeypatch.setattr(os, "replace", lambda source, target: (events.append("replace"), real_replace(source, target)))
    write_text_atomically(tmp_path / "a.txt", "hello")
    assert events == ["fsync", "replace", "fsync"]  # the file, the rename, then the folder's entry


def test_files_get_the_usual_permissions(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic = write_text_atomically(tmp_path / "atomic.txt", "x")
    assert stat.S_IMODE(atomic.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)


def test_a_damaged_file_is_named_with_its_fix(tmp_path):
    empty = tmp_path / "trainer.pt"
    empty.write_bytes(b"")
    with pytest.raises(CorruptFileError, match="delete it and rerun") as error:
        load_torch(empty, "delete it and rerun")
    assert str(empty) in str(error.value) and isinstance(error.value, ValueError)
    torch.save({"step": 3}, tmp_path / "whole.pt")
    assert load_torch(tmp_path / "whole.pt", "")["step"] == 3
    truncated = tmp_path / "heads.safetensors"
    write_atomically(truncated, lambda partial: partial.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\""))
    with pytest.raises(CorruptFileError, match="heads.safetensors is unreadable"):
        load_tensors(truncated, "train them again")
    with pytest.raises(FileNotFoundError):  # missing is not damaged: callers tell the two apart
        load_torch(tmp_path / "missing.pt", "")


def test_an_interrupted_model_save_leaves_no_loadable_mix(tmp_path):
    class Part:
        def __init__(self, files, fail=False):
            self.files, self.fail = files, fail

        def save_pretrained(self, folder):
            Path(folder).mkdir(exist_ok=True)
            for name, text in self.files.items():
                (Path(folder) / name).write_text(text)
            if self.fail:
                raise OSError("killed")

    save_pretrained_atomically(tmp_path, Part({"config.json": "old", "model.safetensors": "old"}))
    assert sorted(file.name for file in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(OSError):
        save_pretrained_atomically(tmp_path, Part({"config.json": "new", "model.safetensors": "new"}),
                                   Part({"tokenizer.json": "new"}, fail=True))
    assert sorted(file.name for file in tmp_path.iterdir()) == ["model.safetensors"]  # no config: not a model
    assert (tmp_path / "model.safetensors").read_text() == "old"


# --- fault injection -----------------------------------------------------------------------------------------


class Killed(BaseException):
    """The process died here: no except clause of the code under test runs (a SIGKILL runs none either)."""


@contextlib.contextmanager
def killed_while_writing(name: str):
    """Inside, the first write of the file called `name` stops half-way, as a kill would: the file written (in
    place, or the temporary file an atomic write renames) keeps half its bytes and Killed ends the code. Covers
    the writers accelgen's files go through: torch.save, safetensors, numpy, Path.write_text, save_pretrained."""
    import safetensors.torch
    from transformers import PreTrainedModel

    def killing(write, written):
        def write_then_die(*args, **kwargs):
            result = write(*args, **kwargs)
            for path in [Path(file if isinstance(file, (str, os.PathLike)) else file.name) for file in written(*args)]:
                if path.name == name or path.name.startswith(f".{name}."):
                    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
                    raise Killed(path)
            return result

        return write_then_die

    writers = ((torch, "save", lambda content, file, *rest: [file]),
               (safetensors.torch, "save_file", lambda tensors, file, *rest: [file]),
               (np, "save", lambda file, *rest: [file]),
               (Path, "write_text", lambda path, *rest: [path]),
               (PreTrainedModel, "save_pretrained", lambda model, folder, *rest: list(Path(folder).iterdir())))
    with pytest.MonkeyPatch.context() as patch:
        for owner, attribute, written in writers:
            patch.setattr(owner, attribute, killing(getattr(owner, attribute), written))
        with pytest.raises(Killed):
            yield


def assert_whole(folder: Path) -> None:
    """Every file the run left in folder reads back (hidden .partial files aside: nothing reads them)."""
    readers = {".json": lambda path: json.loads(path.read_text()), ".pt": lambda path: load_torch(path, ""),
               ".safetensors": lambda path: load_tensors(path, ""), ".npy": np.load}
    for path in sorted(folder.iterdir()):
        if path.suffix in readers and not path.name.startswith("."):
            try:
                readers[path.suffix](path)
            except Exception as error:
                pytest.fail(f"the kill left {path.name} damaged: {type(error).__name__}: {error}")


@pytest.fixture(scope="module")
def target(make_tiny_model):
    return make_tiny_model("qwen2", seed=4, vocab_size=256)


def random_windows(count: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (count, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("victim", [CHECKPOINT, "medusa_heads.safetensors", "medusa_heads.json"])
def test_a_medusa_run_killed_at_any_write_resumes(victim, target, tmp_path):
    windows = random_windows(6, 12, seed=0)
    features, choices = collect_features(target, windows)

    def run(steps: int) -> dict:  # what `accelgen train medusa` does: train (checkpointing), then save the heads
        config = MedusaConfig(heads=2, steps=steps, batch_size=16, learning_rate=1e-2, draft_vocab=0,
                              checkpoint_every=2)
        heads, info = train_medusa(target, windows, features, choices, config, tmp_path)
        heads.save(tmp_path)
        return info

    run(2)
    with killed_while_writing(victim):
        run(4)
    assert_whole(tmp_path)
    try:
        assert len(MedusaHeads.load(tmp_path)) == 2  # the heads of the run before
    except (FileNotFoundError, CorruptFileError) as error:  # or none, with the command that trains them
        assert f"accelgen train medusa --out {tmp_path}" in str(error)
    assert run(4)["resumed_at"] == (2 if victim == CHECKPOINT else 4)  # only the killed step's work is redone
    assert len(MedusaHeads.load(tmp_path)) == 2


class NoTokenizer:
    """train_layerskip saves a tokenizer beside the model; these runs have none."""

    def save_pretrained(self, folder) -> None:
        pass


@pytest.mark.parametrize("victim", [TRAINER_FILE, "model.safetensors", "layerskip.json"])
def test_a_layerskip_run_killed_at_any_write_ends_as_if_never_killed(victim, make_tiny_model, tmp_path):
    windows = random_windows(12, 8, seed=1)

    def config(steps: int) -> LayerSkipConfig:
        return LayerSkipConfig(steps=steps, batch_size=2, seq_len=8, learning_rate=1e-3, p_max=0.0, checkpoint_every=2)

    straight = make_tiny_model("qwen2", seed=4, vocab_size=256)
    train_layerskip(straight, NoTokenizer(), windows, config(6), tmp_path / "straight")
    out = tmp_path / "killed"
    train_layerskip(make_tiny_model("qwen2", seed=4, vocab_size=256), NoTokenizer(), windows, config(2), out)
    with killed_while_writing(victim):  # at the checkpoint of step 4
        train_layerskip(make_tiny_model("qwen2", seed=4, vocab_size=256), NoTokenizer(), windows, config(6), out)
    assert_whole(out)
    resumed = make_tiny_model("qwen2", seed=4, vocab_size=256)
    result = train_layerskip(resumed, NoTokenizer(), windows, config(6), out)
    assert result["resumed_at"] == (2 if victim == TRAINER_FILE else 4)
    for (name, expected), actual in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(actual, expected, msg=name)


@pytest.mark.parametrize("victim", ["tokens.npy", "suffix_array.npy", "datastore.json"])
def test_a_datastore_rebuild_killed_at_any_write_is_never_opened_half_built(victim, tmp_path):
    old, new = [[1, 2, 3, 4, 5]] * 3, [[7, 1, 2, 3, 9, 9, 9]] * 40 + [[8, 8]] * 10
    write_datastore(old, tmp_path, progress=False)
    with killed_while_writing(victim):
        write_datastore(new, tmp_path, progress=False)
    assert_whole(tmp_path)
    with pytest.raises(FileNotFoundError, match="accelgen datastore build") as error:
        Datastore(tmp_path)
    assert str(tmp_path) in str(error.value)
    write_datastore(new, tmp_path, progress=False)
    draft = RestDrafter(Datastore(tmp_path), draft_depth=3).propose(torch.tensor([7, 1, 2, 3]), 8)
    assert draft.tokens.tolist() == [9, 9, 9]


def test_a_feature_store_killed_while_saving_a_shard_is_never_read_damaged(target, tmp_path):
    windows = random_windows(4, 8, seed=3)

    def extract(batch: torch.Tensor) -> dict:
        features, choices = collect_features(target, batch)
        return {"features": features, "choices": choices}

    identity = {"extractor": "last-hidden", "model": "tiny"}
    with killed_while_writing(shard_name(1)):
        stored_features(tmp_path, identity, windows, extract, shard_windows=2)
    assert_whole(tmp_path)
    stored = stored_features(tmp_path, identity, windows, extract, shard_windows=2)
    expected_features, expected_choices = collect_features(target, windows)
    assert torch.equal(stored["features"], expected_features) and torch.equal(stored["choices"], expected_choices)
