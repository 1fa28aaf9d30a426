"""Count the host reads of a generation: the points where the CPU waits for values the device computed.

On a GPU every `.item()`, `.tolist()`, `int(tensor)`, `if tensor:` or blocking device→host copy of a value a model
computed stalls Python until the GPU has finished all the work queued before it; a decoding step that does
this often cannot keep the GPU busy. Two ways to count them:

- on CUDA, `torch.cuda.set_sync_debug_mode("warn")` makes torch warn at every synchronizing call (blocking
  copies either way included): `count_host_reads` counts those warnings;
- on the CPU, where nothing synchronizes, the same places are found by marking what a model computes: every
  module's output becomes a `DeviceValue` (a tensor subclass that ops pass on to what they compute from it), and
  reading a `DeviceValue` back into Python is counted. Values the host built itself (prompts, draft trees,
  positions) are not counted, as on a GPU they would not stall.

    with count_host_reads(model.device) as reads:
        accelgen.generate(model, tokenizer, prompt, method="pld")
    reads.count  # host reads during the generation
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from dataclasses import dataclass, field

import torch

# the Tensor methods that hand a value (or a Python scalar) to the host
READ_METHODS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")


class DeviceValue(torch.Tensor):
    """A tensor computed by a model (the CPU stand-in for a tensor living on a GPU)."""


@dataclass
class HostReads:
    count: int = 0
    places: list[str] = field(default_factory=list)  # what read, for a test's message (CPU counting only)


@contextlib.contextmanager
def count_host_reads(device: torch.device | str = "cpu", where: bool = False):
    """Count host reads of device values inside the block (see the module's docstring). where=True also records
    the reading method's name and its caller's place per read (CPU counting)."""
    device = torch.device(device)
    reads = HostReads()
    if device.type == "cuda":
        with _cuda_syncs(reads):
            yield reads
        return
    with _marked_model_outputs(), _counted_reads(reads, where):
        yield reads


@contextlib.contextmanager
def _cuda_syncs(reads: HostReads):
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            reads.count = sum("synchroniz" in str(warning.message) for warning in caught)


def _mark(value):
    if isinstance(value, torch.Tensor):
        return value if isinstance(value, DeviceValue) else value.as_subclass(DeviceValue)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_mark(item) for item in value)
    if hasattr(value, "logits") and isinstance(getattr(value, "logits"), torch.Tensor):  # a transformers ModelOutput
        value.logits = _mark(value.logits)
        if getattr(value, "hidden_states", None) is not None:
            value.hidden_states = tuple(_mark(state) for state in value.hidden_states)
    return value


@contextlib.contextmanager
def _marked_model_outputs():
    """Every torch module's output marked as a DeviceValue while the block runs."""
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: _mark(output))
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _counted_reads(reads: HostReads, where: bool):
    originals = {name: getattr(torch.Tensor, name) for name in READ_METHODS}

    def counting(name, original):
        def read(self, *args, **kwargs):
            if type(self) is DeviceValue:
                reads.count += 1
                if where:
                    reads.places.append(_caller(name))
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(DeviceValue, name, counting(name, original))
    try:
        yield
    finally:
        for name in originals:
            delattr(DeviceValue, name)


def _caller(name: str) -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "host_reads" not in frame.filename and "/torch/" not in frame.filename:
            return f"{name} at {frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name}"
    return name
