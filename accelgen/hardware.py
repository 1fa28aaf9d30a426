"""What this CPU is and which of its matrix instructions matter for speed.

The same model runs at very different relative costs on different CPUs: with native bf16 matrix instructions
(AVX-512 BF16, AMX) a forward over 8 tokens costs little more than one, while on an AVX2-only CPU it costs
several, and bf16 matrix products can be slower than fp32 ones. Measured costs are therefore cached per
machine (`machine_key`), and every benchmark report names the CPU and these flags.
"""

from __future__ import annotations

import hashlib
import os
import platform
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
