"""The device helpers: synchronize waits for CUDA only, a GPU's key and description name the GPU."""

from __future__ import annotations

import subprocess

import pytest
import torch

from accelgen import hardware


@pytest.fixture
def synchronized(monkeypatch):
    """The devices torch.cuda.synchronize was asked to wait for."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(hardware, "nvidia_driver_version", lambda: "570.124.06")


def test_synchronize_is_a_no_op_on_the_cpu(synchronized):
    for device in (None, "cpu", torch.device("cpu")):
        hardware.synchronize(device)
    assert synchronized == []


def test_synchronize_waits_for_a_cuda_device(synchronized):
    hardware.synchronize(torch.device("cuda", 1))
    hardware.synchronize("cuda:0")
    assert synchronized == [torch.device("cuda", 1), "cuda:0"]


def test_timed_reads_the_clock_once_the_device_is_done(synchronized):
    result, seconds = hardware.timed("cuda:0", lambda: synchronized.append("work") or 42)
    assert result == 42 and seconds >= 0
    assert synchronized == ["cuda:0", "work", "cuda:0"]  # waited for before and after the call
    hardware.timed("cpu", lambda: None)
    assert len(synchronized) == 3  # nothing to wait for on the CPU


def test_the_cpu_has_no_device_key_of_its_own():
    assert hardware.device_key(None) is None and hardware.device_key(torch.device("cpu")) is None
    assert hardware.describe_device("cpu") == {"type": "cpu"} and hardware.device_text({"type": "cpu"}) == "cpu"


def test_a_gpu_is_keyed_and_described_by_its_name(h200):
    assert hardware.device_key(torch.device("cuda", 0)) == "cuda-nvidia-h200"
    described = hardware.describe_device(torch.device("cuda", 0))
    assert described == {"type": "cuda", "device": "cuda:0", "name": "NVIDIA H200", "cuda": "12.8",
                         "driver": "570.124.06", "torch": torch.__version__}
    assert hardware.device_text(described) == \
        f"NVIDIA H200 (cuda:0; CUDA 12.8, driver 570.124.06, torch {torch.__version__})"


def test_the_driver_version_is_none_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)
    assert hardware.nvidia_driver_version() is None
    monkeypatch.setattr(hardware.shutil, "which", lambda name: "/usr/bin/nvidia-smi")

    def fails(*args, **kwargs):
        raise subprocess.CalledProcessError(9, args[0])

    monkeypatch.setattr(hardware.subprocess, "run", fails)
    assert hardware.nvidia_driver_version() is None
    monkeypatch.setattr(hardware.subprocess, "run",
                        lambda *args, **kwargs: subprocess.CompletedProcess(args[0], 0, "580.159.03\n580.159.03\n"))
    assert hardware.nvidia_driver_version() == "580.159.03"  # one line per GPU: the first
