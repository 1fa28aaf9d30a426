"""The sharded feature store: features computed once, in shards written atomically, resumed after a stop without a
window skipped or held twice, and refused where they belong to another run."""

from __future__ import annotations

import json

import pytest
import torch

from accelgen.atomic import CorruptFileError
from accelgen.train import shards
from accelgen.train.shards import INDEX, FeatureStore, prefill_format, shard_name, stored_features

IDENTITY = {"extractor": "test", "model": "tiny", "format": "fp32", "dataset": "jsonl:x", "seq_len": 6}


def some_windows(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (count, 6), generator=torch.Generator().manual_seed(seed))


class Extractor:
    """A stand-in for the target: per window, a feature row and its choices, and a log of the windows it saw;
    it stops (as a kill would) before its `stop_at`-th call."""

    def __init__(self, stop_at: int | None = None):
        self.seen: list[torch.Tensor] = []
        self.calls, self.stop_at = 0, stop_at

    def __call__(self, windows: torch.Tensor) -> dict:
        self.calls += 1
        if self.stop_at is not None and self.calls >= self.stop_at:
            raise KeyboardInterrupt
        self.seen.extend(windows)
        return {"features": windows.float()[..., None] * 0.5, "choices": windows.flip(-1)}


def expected(windows: torch.Tensor) -> dict:
    return {"features": windows.float()[..., None] * 0.5, "choices": windows.flip(-1)}


def assert_same(tensors: dict, windows: torch.Tensor) -> None:
    assert sorted(tensors) == ["choices", "features"]
    for name, tensor in expected(windows).items():
        assert torch.equal(tensors[name], tensor), name


def test_features_are_stored_in_shards_with_an_index_of_their_windows(tmp_path):
    windows = some_windows(10)
    extract = Extractor()
    assert_same(stored_features(tmp_path, IDENTITY, windows, extract, shard_windows=4), windows)
    index = json.loads((tmp_path / INDEX).read_text())
    assert [(entry["file"], entry["start"], entry["end"]) for entry in index["shards"]] == [
        (shard_name(0), 0, 4), (shard_name(1), 4, 8), (shard_name(2), 8, 10)]
    assert index["identity"] == IDENTITY and extract.calls == 3
    again = Extractor(stop_at=1)  # a rerun computes nothing
    assert_same(stored_features(tmp_path, IDENTITY, windows, again, shard_windows=4), windows)


def test_a_stopped_run_resumes_without_duplicates_or_gaps(tmp_path):
    windows = some_windows(11)
    first = Extractor(stop_at=3)  # killed while computing the third shard
    with pytest.raises(KeyboardInterrupt):
        stored_features(tmp_path, IDENTITY, windows, first, shard_windows=4)
    assert FeatureStore(tmp_path, IDENTITY, 4).windows_held == 8
    progress = []
    second = Extractor()
    tensors = stored_features(tmp_path, IDENTITY, windows, second, shard_windows=4, progress=progress.append)
    assert_same(tensors, windows)
    seen = torch.stack(first.seen + second.seen)
    assert torch.equal(seen, windows)  # every window computed exactly once, in order
    assert progress == [8, 11]


def test_a_shard_written_but_not_indexed_is_computed_again(tmp_path, monkeypatch):
    windows = some_windows(8)
    real_write = FeatureStore._write_index
    calls = []

    def killed_before_indexing_the_second(store):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_write(store)

    monkeypatch.setattr(FeatureStore, "_write_index", killed_before_indexing_the_second)
    with pytest.raises(KeyboardInterrupt):
        stored_features(tmp_path, IDENTITY, windows, Extractor(), shard_windows=4)
    assert (tmp_path / shard_name(1)).exists() and FeatureStore(tmp_path, IDENTITY, 4).windows_held == 4
    monkeypatch.setattr(FeatureStore, "_write_index", real_write)
    extract = Extractor()
    assert_same(stored_features(tmp_path, IDENTITY, windows, extract, shard_windows=4), windows)
    assert torch.equal(torch.stack(extract.seen), windows[4:])


def test_more_windows_extend_the_store_and_fewer_read_its_first(tmp_path):
    windows = some_windows(14)
    stored_features(tmp_path, IDENTITY, windows[:6], Extractor(), shard_windows=4)  # shards of 4 and 2
    extract = Extractor()
    assert_same(stored_features(tmp_path, IDENTITY, windows, extract, shard_windows=4), windows)
    assert torch.equal(torch.stack(extract.seen), windows[4:])  # the short shard completed, whole
    fewer = Extractor(stop_at=1)
    assert_same(stored_features(tmp_path, IDENTITY, windows[:5], fewer, shard_windows=4), windows[:5])


@pytest.mark.parametrize("key, value", [("model", "another"), ("format", "bf16"), ("dataset", "sharegpt"),
                                        ("extractor", "eagle3")])
def test_a_store_of_another_run_is_refused_by_name(tmp_path, key, value):
    windows = some_windows(4)
    stored_features(tmp_path, IDENTITY, windows, Extractor(), shard_windows=4)
    with pytest.raises(ValueError, match=f"holds features of another run \\({key}: "):
        stored_features(tmp_path, {**IDENTITY, key: value}, windows, Extractor(), shard_windows=4)


def test_other_windows_are_refused(tmp_path):
    stored_features(tmp_path, IDENTITY, some_windows(8), Extractor(), shard_windows=4)
    with pytest.raises(ValueError, match="windows 0..3 differ"):
        stored_features(tmp_path, IDENTITY, some_windows(8, seed=1), Extractor(), shard_windows=4)
    with pytest.raises(ValueError, match="windows 4..5 differ"):  # fewer windows, differing inside a shard
        stored_features(tmp_path, IDENTITY, torch.cat([some_windows(4), some_windows(2, seed=3)]), Extractor(),
                        shard_windows=4)
    with pytest.raises(ValueError, match="shards of 4 windows"):
        stored_features(tmp_path, IDENTITY, some_windows(8), Extractor(), shard_windows=8)


def test_a_damaged_shard_is_named(tmp_path):
    windows = some_windows(8)
    stored_features(tmp_path, IDENTITY, windows, Extractor(), shard_windows=4)
    path = tmp_path / shard_name(1)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CorruptFileError, match=f"{path} is unreadable"):
        stored_features(tmp_path, IDENTITY, windows, Extractor(), shard_windows=4)


def test_an_extractor_must_give_a_row_per_window(tmp_path):
    with pytest.raises(ValueError, match="one row per window"):
        stored_features(tmp_path, IDENTITY, some_windows(4), lambda windows: {"features": windows[:1]})


def test_the_prefill_format_follows_the_measured_costs_else_the_cpu(monkeypatch):
    from accelgen import hardware
    from accelgen.models import probe

    timings = {"fp32": {"t1": 0.02, "t8": 0.03}, "bf16": {"t1": 0.015, "t8": 0.1}, "int8": {"t1": 0.01, "t8": 0.2}}
    monkeypatch.setattr(probe, "cached_choice", lambda name, threads=None: {"timings": timings})
    assert prefill_format("m")[0] == "fp32"  # the 8-token forward, not the 1-token one, decides
    timings["bf16"]["t8"] = 0.02
    assert prefill_format("m")[0] == "bf16"
    monkeypatch.setattr(probe, "cached_choice", lambda name, threads=None: None)
    for native, chosen in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(hardware, "native_bf16", lambda native=native: native)
        fmt, reason = prefill_format("m")
        assert fmt == chosen and "not measured" in reason


def test_saved_identity_reads_an_existing_store(tmp_path):
    assert shards.FeatureStore.saved_identity(tmp_path) is None
    stored_features(tmp_path, IDENTITY, some_windows(2), Extractor())
    assert shards.FeatureStore.saved_identity(tmp_path) == IDENTITY
