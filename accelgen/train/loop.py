"""The one optimization loop every trainer runs: on one CPU, one GPU, or several processes started by
`accelerate launch` (data-parallel), with mixed precision and gradient accumulation.

A trainer supplies two functions:

- `draw(step) -> batch`: the step's whole batch, a dict of tensors whose first dimension is its rows. It must
  depend on the step alone (`step_generator(seed, step)`), so every process draws the same batch, and a run
  resumed at step s, on any number of processes, draws what an unbroken run draws at s;
- `loss_of(micro_batch) -> (loss, metrics)`: the mean loss over some of those rows (on the training device), and
  floats to show in the progress row.

Each step, process r of W takes rows r, r+W, r+2W, ... of the batch and splits them into `grad_accum`
micro-batches. Every micro-batch's loss is weighted by its share of the whole batch's rows, and the gradients are
summed across processes after the step's last micro-batch. So a step's gradient is that of the whole batch's mean
loss whatever the number of processes and micro-batches, and the trained weights match an unbroken
single-process run's up to float rounding (tests/train/test_loop.py runs 2 processes over gloo).

The gradients are summed by one all-reduce rather than by wrapping the module in DistributedDataParallel: the
trainers call their modules in several ways per step (EAGLE-3 unrolls its head), which DDP does not allow.

Checkpoints hold the module's and the optimizer's state (full copies: every process holds the same), written by
the first process only, so a run resumes on any number of processes or devices. The first process also
shows progress and records learning-curve points; the others only train.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from accelgen.errors import InputError
from accelgen.train.checkpoints import resume, save_checkpoint

MIXED_PRECISION = ("no", "bf16", "fp16")


@dataclass
class ScaleOut:
    """How a trainer's steps run (the `accelgen train` flags every trainer shares). Where they run is
    `accelerate launch`'s business: plain `accelgen train ...` is one process on this machine's GPU, else its CPU."""

    mixed_precision: str = field(default="no", metadata={"help": "no, bf16 or fp16 (GPU only): the forward and "
                                                                 "backward under autocast; the weights stay float32."})
    grad_accum: int = field(default=1, metadata={"help": "Micro-batches each process splits its share of a step's "
                                                         "batch into (the step's batch and result stay the same).",
                                                 "min": 1})
    max_minutes: float = field(default=0.0, metadata={"help": "Stop after the first step that ends this many minutes "
                                                              "into training (0: no limit), checkpointed there, so the "
                                                              "same command goes on later; the head is saved as it is.",
                                                      "min": 0.0})

    def __post_init__(self):
        if self.mixed_precision not in MIXED_PRECISION:
            raise InputError(f"--mixed-precision {self.mixed_precision}: choose one of {', '.join(MIXED_PRECISION)}")
        if self.grad_accum < 1:
            raise InputError(f"--grad-accum must be >= 1, got {self.grad_accum}")
        if self.max_minutes < 0:
            raise InputError(f"--max-minutes must be >= 0, got {self.max_minutes}")


@dataclass
class Checkpointing:
    """Where a trainer keeps its checkpoint (None: it keeps none) and what a resumed run must share with it."""

    path: Path | None
    settings: dict
    what: str  # whose checkpoint, for errors: "EAGLE"
    every: int


def step_generator(seed: int, step: int) -> torch.Generator:
    """The random draws of one step: the same on every process and in a resumed run."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def launched_processes() -> int:
    """How many processes `accelerate launch` (or torchrun) started this one among; 1 when run plainly."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """Whether this process is the one that writes results and shows progress (always, when run plainly)."""
    return int(os.environ.get("RANK", "0")) == 0


def process_state():
    """accelerate's PartialState of this process. Without a GPU, processes launched together train on their CPUs over
    gloo (accelerate's MULTI_CPU, which it sets up only when told cpu=True)."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def accelerator_for(scale: ScaleOut | None = None):
    """The accelerate Accelerator of this process, in scale's mixed precision. A later trainer in the same plain
    process may ask for another precision (accelerate keeps one per process, so its state is renewed then)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    precision = (scale or ScaleOut()).mixed_precision
    if precision == "fp16" and not torch.cuda.is_available():
        raise InputError("--mixed-precision fp16 needs a GPU (and a gradient scaler); on a CPU use bf16 or no")
    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision") != precision and launched_processes() == 1:
        AcceleratorState._reset_state()  # one process, one trainer at a time: nothing else shares the state
    process_state()  # first, so that the Accelerator shares its processes
    return Accelerator(mixed_precision=precision, cpu=not torch.cuda.is_available())


def training_device(scale: ScaleOut | None = None) -> torch.device:
    """Where this process trains (its GPU, else the CPU): a trainer moves its frozen model there first. (The
    Accelerator, which fixes the precision, is made by run_training alone.)"""
    return process_state().device


@contextlib.contextmanager
def main_process_first():
    """Run the body on the first process, then on the others: what the first writes (a feature store, collected
    trajectories) the others read back rather than compute again."""
    if launched_processes() == 1:
        yield
        return
    with process_state().main_process_first():
        yield


def process_share(batch: dict, process: int, processes: int) -> dict:
    """Rows process, process + processes, ... of batch ({name: tensor (rows, ...)})."""
    return {name: tensor[process::processes] for name, tensor in batch.items()}


def micro_batches(batch: dict, count: int) -> list[dict]:
    """batch ({name: tensor (rows, ...)}) in `count` consecutive parts of nearly equal rows."""
    rows = batch_rows(batch)
    bounds = [rows * part // count for part in range(count + 1)]
    return [{name: tensor[bounds[part]:bounds[part + 1]] for name, tensor in batch.items()} for part in range(count)]


def batch_rows(batch: dict) -> int:
    sizes = {len(tensor) for tensor in batch.values()}
    if len(sizes) != 1:
        raise InputError(f"a batch's tensors must have the same number of rows, got {sorted(sizes)}")
    return sizes.pop()


def sum_across_processes(parameters: list[torch.nn.Parameter], accelerator) -> None:
    """Sum the gradients of parameters over all processes, in one flat all-reduce."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    flat = accelerator.reduce(flat, reduction="sum")
    offset = 0
    for parameter, grad in zip(parameters, grads):
        parameter.grad = flat[offset:offset + grad.numel()].view_as(grad).to(grad.dtype)
        offset += grad.numel()


def out_of_time(started: float, max_minutes: float, accelerator) -> bool:
    """Whether the training that started at `started` (perf_counter) has used its max_minutes (0: never). Every
    process stops at the same step: the first process's clock decides for all."""
    if not max_minutes:
        return False
    over = time.perf_counter() - started >= max_minutes * 60
    if accelerator.num_processes == 1:
        return over
    first_says = torch.tensor([float(over and accelerator.is_main_process)], device=accelerator.device)
    return bool(accelerator.reduce(first_says, reduction="sum").item())


def run_training(module: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int,
                 draw: Callable[[int], dict], loss_of: Callable[[dict], tuple[torch.Tensor, dict]], *,
                 scale: ScaleOut | None = None, checkpointing: Checkpointing | None = None,
                 max_grad_norm: float | None = None, tokens_per_row: int = 1,
                 progress: Callable[[dict], None] | None = None,
                 after_step: Callable[[int], None] | None = None, warmup_steps: int = 0) -> dict:
    """Train module's parameters in optimizer for `steps` steps (from its checkpoint's step, if it has one),
    step s on draw(s), stopping early once scale.max_minutes have passed; returns {"resumed_at", "stopped_at" (the
    steps done, counting those before a resume), "seconds", "processes"}.

    progress(row) gets {"step", "steps", "loss", "seconds", "tokens_per_second", **metrics} after each step (first
    process only, metrics being loss_of's averaged over its rows); after_step(s) runs after step s, and at 0 before
    a run that starts untrained (first process only: learning curves). warmup_steps: the learning rate rises
    linearly to the optimizer's over that many first steps (a fresh optimizer on trained weights needs it)."""
    scale = scale or ScaleOut()
    learning_rates = [group["lr"] for group in optimizer.param_groups]  # before a checkpoint's state is loaded
    accelerator = accelerator_for(scale)
    module.to(accelerator.device)
    checkpoint = checkpointing.path if checkpointing is not None else None
    start = resume(module, optimizer, checkpoint, checkpointing.settings, checkpointing.what) if checkpoint else 0
    parameters = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    stepper = accelerator.prepare_optimizer(optimizer)  # fp16: the gradient scaler's step
    processes, process, main = accelerator.num_processes, accelerator.process_index, accelerator.is_main_process
    if main and after_step is not None and start == 0:
        after_step(0)
    started = time.perf_counter()
    rows_done, stopped_at = 0, start
    for step in range(start, steps):
        for group, learning_rate in zip(optimizer.param_groups, learning_rates):
            group["lr"] = learning_rate * min(1.0, (step + 1) / warmup_steps) if warmup_steps else learning_rate
        batch = draw(step)
        rows = batch_rows(batch)
        if rows < processes * scale.grad_accum:
            raise InputError(f"a step's batch of {rows} rows cannot be split among {processes} processes × "
                             f"{scale.grad_accum} micro-batches: raise the batch size or lower --grad-accum")
        share = process_share(batch, process, processes)
        own_rows = batch_rows(share)
        sums: dict[str, torch.Tensor] = {}  # loss and metrics, weighted by rows, over this process's share
        for micro in micro_batches(share, scale.grad_accum):
            micro = {name: tensor.to(accelerator.device) for name, tensor in micro.items()}
            micro_rows = batch_rows(micro)
            with accelerator.autocast():
                loss, metrics = loss_of(micro)
            accelerator.backward(loss * (micro_rows / rows))  # its share of the whole batch's mean loss
            for name, value in {"loss": loss.detach(), **metrics}.items():
                sums[name] = sums.get(name, 0.0) + torch.as_tensor(value, dtype=torch.float64).cpu() * micro_rows
        if processes > 1:
            sum_across_processes(parameters, accelerator)
        if max_grad_norm is not None:
            accelerator.clip_grad_norm_(parameters, max_grad_norm)
        stepper.step()
        stepper.zero_grad(set_to_none=True)
        rows_done, stopped_at = rows_done + rows, step + 1
        stopping = out_of_time(started, scale.max_minutes, accelerator)
        if main:
            if checkpoint is not None and ((step + 1) % checkpointing.every == 0 or step + 1 == steps or stopping):
                save_checkpoint(checkpoint, step + 1, checkpointing.settings, module, optimizer)
            if progress is not None:
                seconds = time.perf_counter() - started
                means = {name: (total / own_rows).tolist() for name, total in sums.items()}  # the first's rows
                progress({"step": step + 1, "steps": steps, "seconds": seconds,
                          "tokens_per_second": rows_done * tokens_per_row / seconds, **means})
            if after_step is not None:
                after_step(step + 1)
        if stopping:
            break
    return {"resumed_at": start, "stopped_at": stopped_at, "seconds": time.perf_counter() - started,
            "processes": processes}
