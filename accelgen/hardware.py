"""What this CPU is and which of its matrix instructions matter for speed; which GPU a model runs on.

The same model runs at very different relative costs on different CPUs: with native bf16 matrix instructions
(AVX-512 BF16, AMX) a forward over 8 tokens costs little more than one, while on an AVX2-only CPU it costs
several, and bf16 matrix products can be slower than fp32 ones. Measured costs are therefore cached per
machine (`machine_key`) and, on a GPU, per GPU (`device_key`); every benchmark report names the CPU and these
flags, and the GPU it ran on (`describe_device`).

A GPU runs what it is given asynchronously: the host's clock reads the time work was queued, not done. So a
timing reads the clock only after `synchronize(device)` (a no-op on the CPU).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import time
from functools import lru_cache
from pathlib import Path

import torch

# The flags that decide which weight format and how much speculation pays (lscpu's names).
SPEED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16",
               "amx_int8", "amx_tile", "avx_vnni")


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    path = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    return fields


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The SPEED_FLAGS this CPU has (Linux's /proc/cpuinfo; empty where it cannot be read)."""
    flags = set(_cpuinfo().get("flags", "").split())
    return [flag for flag in SPEED_FLAGS if flag in flags]


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 matrices natively (otherwise bf16 is converted, often slower than fp32)."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))


def describe(threads: int | None = None) -> dict:
    """The machine as every report states it."""
    return {
        "cpu": cpu_model(),
        "flags": cpu_flags(),
        "native_bf16": native_bf16(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "logical_cores": os.cpu_count(),
        "torch_threads": threads or torch.get_num_threads(),
        "system": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
    }


def machine_key(threads: int | None = None) -> str:
    """A short key for measurements that hold on this machine only: CPU model, its speed flags, thread count
    and the torch version (whose kernels decide the costs)."""
    text = "|".join([cpu_model(), ",".join(cpu_flags()), str(threads or torch.get_num_threads()), torch.__version__])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def flags_text(machine: dict) -> str:
    """One line for a report: the CPU, its speed flags, and whether bf16 is native."""
    flags = " ".join(machine.get("flags", [])) or "none of " + ", ".join(SPEED_FLAGS[:3])
    native = "native bf16" if machine.get("native_bf16") else "no native bf16"
    return f"{machine.get('cpu', 'unknown')}; flags: {flags} ({native})"


def synchronize(device) -> None:
    """Wait until the device has done the work queued on it, so that a clock read next times it: CUDA runs kernels
    asynchronously. A no-op on the CPU (and for None)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, call):
    """(call()'s result, the seconds it took on `device`): the clock is read only once the device has done the
    work queued before and by the call."""
    synchronize(device)
    started = time.perf_counter()
    result = call()
    synchronize(device)
    return result, time.perf_counter() - started


def device_name(device) -> str:
    """The GPU's name ("NVIDIA H200") for a CUDA device, else the device's type ("cpu")."""
    device = torch.device("cpu" if device is None else device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def device_key(device) -> str | None:
    """A short key for measurements that hold on this device only: None on the CPU (machine_key says it all),
    else the device's type and the GPU's name, e.g. "cuda-nvidia-h200"."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cpu":
        return None
    return "-".join([device.type, *re.findall(r"[a-z0-9]+", device_name(device).lower())])


def nvidia_driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it, or None where there is no nvidia-smi (or it fails)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        output = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return output.strip().splitlines()[0].strip() if output.strip() else None


def describe_device(device) -> dict:
    """The device a model runs on, as reports state it: {"type": "cpu"} (describe() tells the CPU), or for CUDA
    the GPU's name, torch's CUDA version, the driver's version (None if unknown) and torch's version."""
    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda":
        return {"type": device.type}
    return {"type": "cuda", "device": str(device), "name": device_name(device),
            "cuda": torch.version.cuda, "driver": nvidia_driver_version(), "torch": torch.__version__}


def device_text(device: dict) -> str:
    """One line for a report: "cpu", or "NVIDIA H200 (cuda:0; CUDA 12.8, driver 570.124, torch 2.13.0)"."""
    if device.get("type") != "cuda":
        return device.get("type", "cpu")
    return (f"{device['name']} ({device['device']}; CUDA {device['cuda']}, driver {device['driver'] or 'unknown'}, "
            f"torch {device['torch']})")
