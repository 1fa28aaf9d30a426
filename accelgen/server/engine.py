"""Continuous batching: many sequences share each target forward, each with its own draft and acceptance.

One engine thread runs the loop. Between steps, waiting requests join the batch (up to `max_batch`) and
finished or cancelled ones leave it. Each step, every sequence in the batch proposes its draft, one
batched target forward scores all of them (`models/batch.py`), and each sequence verifies and commits on
its own: acceptance is ragged, since every sequence keeps its own KV cache.

A batched forward pads every block to the widest, so a prompt chunk in the batch would make every decoding
sequence pay for its width: b sequences beside a 200-token chunk cost 200 · b token rows. Blocks that carry
prompt tokens therefore share a forward of their own in the same step, and the decodes share another.

Two policies keep the batch fast and fair:
- chunked prefill (SARATHI): prompts share a budget of `prefill_chunk` tokens per step, in arrival order, so
  a long prompt is fed chunk by chunk between the decode steps instead of stalling them;
- speculation by batch size (speculation.py): verifying k tokens costs about as much as one only while the
  whole forward is small, so a policy caps each step's drafts: by measured goodput (`Goodput`, what
  `accelgen serve` uses), or by a fixed token budget (`TokenBudget`).

The policy learns from timed forwards; on a GPU their clocks are read after the device has finished
(hardware.synchronize), as its kernels run asynchronously.

A seeded request (`Sequence.seeded`) is run as if it were alone: its drafts and target forwards share no batch,
its drafts are capped by no policy (its method's own lengths, which follow no clock under a seed) and its prompt is
fed in chunks of `prefill_chunk` whatever else waits. The logits of a row depend on the shape of the forward that
computed them (in float32 by about 1e-5, in bf16 by much more), so this is what makes its tokens independent of
the timings and of the other requests, in every dtype, at the cost of the forwards it does not share.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from accelgen.errors import InputError
from accelgen.loop import Chunk, GenerationResult, Sequence, Step
from accelgen.hardware import timed
from accelgen.models.batch import batched_forward, forward_together
from accelgen.server.speculation import Goodput, TokenBudget


@dataclass
class Request:
    """A sequence waiting for or in the batch. `emit` receives Chunks, then a GenerationResult or an Exception."""

    sequence: Sequence
    emit: Callable[[Chunk | GenerationResult | Exception], None]
    method: str = ""  # the method's name: the speculation policy pools acceptance per method
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Abort: the engine drops the sequence (and frees its cache) before its next step."""
        self.cancelled.set()


@dataclass
class EngineStats:
    """Counters for /metrics."""

    requests: int = 0
    prompt_tokens: int = 0  # of the requests received
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    new_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0  # sequence-steps that verified a draft (a batched forward counts once per sequence)
    forwards: int = 0  # batched target forwards
    step_seconds: float = 0.0
    batch_size: int = 0
    running: int = 0  # requests in the batch
    queue_length: int = 0
    draft_cap: int | None = None  # the last step's cap on drafts (None: uncapped)
    draft_cap_total: int = 0  # caps summed over steps, for the mean


def _load_malloc_trim():
    """glibc's malloc_trim, or None elsewhere. Each step allocates and frees KV tensors of ever-changing sizes,
    from several threads; glibc keeps much of that freed memory, so a long-running server would creep up.
    Trimming now and then hands it back to the system."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim") if name else None
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()
TRIM_EVERY_SECONDS = 5.0


class Engine:
    def __init__(self, max_batch: int = 8, prefill_chunk: int = 256, speculation: TokenBudget | Goodput | None = None,
                 device=None):
        """speculation: the policy capping drafts by batch (default: a token budget of 8); device: where the models
        run (None: the CPU), whose queued work the timings wait for."""
        if max_batch < 1 or prefill_chunk < 0:
            raise InputError("max_batch must be >= 1, prefill_chunk >= 0")
        self.device = device
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.speculation = speculation or TokenBudget(8)
        self.stats = EngineStats()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # sequences and the tokenizer are only touched under this lock (the engine holds it except during the
        # target forward), so that requests can be prepared on other threads while a step runs
        self.lock = threading.Lock()
        self._trimmed_at = 0.0
        self.ready = threading.Event()  # set once the engine thread has prepared its speculation policy
        self.starting = "the engine thread has not started"  # what it is doing until ready (for /health)

    # --- called from any thread ---

    def submit(self, *requests: Request) -> None:
        """Queue the requests, all or none (the choices of one API request, n > 1, join together)."""
        with self._wake:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            for request in requests:
                self._waiting.append(request)
                self.stats.requests += 1
                self.stats.prompt_tokens += request.sequence.prompt_tokens
            self._wake.notify()

    @property
    def load(self) -> int:
        """Requests waiting or running."""
        return len(self._waiting) + len(self._running)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="accelgen-engine", daemon=True)
        self._thread.start()

    def stop(self, grace_seconds: float = 30.0) -> None:
        """Stop taking requests, let those in flight finish for up to grace_seconds, then cancel the rest."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        deadline = time.monotonic() + grace_seconds
        while self.load and time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            time.sleep(0.05)
        for request in list(self._waiting) + list(self._running):
            request.cancel()
        with self._wake:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # --- the engine thread ---

    def _report_start(self, doing: str) -> None:
        self.starting = doing

    def _loop(self) -> None:
        self.starting = "preparing the speculation policy"
        self.speculation.prepare(self._report_start)  # model work of the engine belongs on this thread (Goodput.prepare)
        self.starting = ""
        self.ready.set()
        while True:
            with self._wake:
                while not self._waiting and not self._running and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self._waiting and not self._running:
                    return
            try:
                self.step()
            except Exception as error:  # a bug, not a request's fault: fail what is running, keep serving
                with self.lock:
                    for request in list(self._running):
                        self._leave(request, error)

    def step(self) -> None:
        """One scheduling step: admit, drop cancelled, plan, forward (the decodes batched, the prompt chunks
        batched apart), commit. (Tests call it directly.)"""
        started = time.perf_counter()
        with self.lock:
            planned, cap = self._plan()
        if not planned:
            return
        shared = [pair for pair in planned if not pair[0].sequence.seeded]
        # a block with prompt tokens would pad every decode to its width: prompt chunks share a forward apart;
        # a seeded request forwards alone (see the module's docstring)
        decoding = [pair for pair in shared if pair[0].sequence.uncached == 1]
        prompts = [pair for pair in shared if pair[0].sequence.uncached > 1]
        alone = [[pair] for pair in planned if pair[0].sequence.seeded]
        logits = {}
        for group in [group for group in (decoding, prompts, *alone) if group]:
            for (request, _), rows in zip(group, self._forward(group)):
                logits[id(request)] = rows
        with self.lock:
            for request, step in planned:
                self._commit(request, step, logits[id(request)], None if request.sequence.seeded else cap)
        self.stats.forwards += 1
        self.stats.batch_size = len(planned)
        self.stats.step_seconds += time.perf_counter() - started

    def _forward(self, group: list[tuple[Request, Step]]) -> list:
        """One batched target forward over these requests' steps: each one's logits, or the exception for all."""
        try:
            logits, seconds = timed(self.device, lambda: batched_forward(
                [request.sequence.target for request, _ in group], [step.forward_args for _, step in group]))
        except Exception as error:
            return [error] * len(group)
        widest = max(len(step.input_ids) for _, step in group)  # every block is padded to the widest
        self.speculation.measured(target_batch=len(group), target_width=widest, target_seconds=seconds)
        return logits

    def _plan(self) -> tuple[list[tuple[Request, Step]], int | None]:
        """This step's (request, step) pairs, and the cap on their drafts."""
        with self._wake:
            while self._waiting and len(self._running) < self.max_batch:
                self._running.append(self._waiting.popleft())
            self.stats.queue_length = len(self._waiting)
            self.stats.running = len(self._running)
        for request in [r for r in self._running if r.cancelled.is_set() or r.sequence.done]:
            if request.sequence.done:  # nothing to generate (max_tokens 0)
                self.stats.finished += 1
            else:  # cancelled
                self.stats.aborted += 1
            self._leave(request)
        # prompt tokens share a budget of prefill_chunk per step, taken in arrival order (a seeded request takes a
        # whole chunk whatever is left, so that its chunks do not depend on the others); decodes always run
        active, prefill_limits, budget = [], {}, self.prefill_chunk
        for request in self._running:
            if self.prefill_chunk and request.sequence.uncached > 1:
                if budget == 0 and not request.sequence.seeded:
                    continue  # sits this step out
                prefill_limits[id(request)] = self.prefill_chunk if request.sequence.seeded else budget
                budget -= min(budget, request.sequence.uncached)
            active.append(request)
        if not active:
            return [], None
        shared = [r for r in active if not r.sequence.seeded]
        cap = self.speculation.draft_length([r for r in shared if r.sequence.uncached == 1])
        self.stats.draft_cap = cap
        self.stats.draft_cap_total += cap or 0
        # draft models run for the whole batch in lockstep, one batched forward per draft step
        shared_steps, drafting_seconds = timed(self.device, lambda: forward_together(
            [r.sequence.planning(cap, prefill_limits.get(id(r), 0)) for r in shared]))
        drafted_with_model = [len(step.draft) for r, step in zip(shared, shared_steps)
                              if isinstance(step, Step) and step.draft and r.sequence.drafts_with_a_model]
        if drafted_with_model:
            self.speculation.measured(draft_batch=len(drafted_with_model), draft_rounds=max(drafted_with_model),
                                      draft_seconds=drafting_seconds)
        # a seeded request drafts alone, its method's own lengths (None: no cap)
        steps_of = dict(zip(map(id, shared), shared_steps))
        for request in active:
            if request.sequence.seeded:
                planning = request.sequence.planning(None, prefill_limits.get(id(request), 0))
                steps_of[id(request)] = forward_together([planning])[0]
        steps = [steps_of[id(request)] for request in active]
        planned = []
        for request, step in zip(active, steps):
            if isinstance(step, Exception):  # a drafter failing hurts its own request only
                self._leave(request, step)
            else:
                planned.append((request, step))
        return planned, cap

    def _commit(self, request: Request, step: Step, target_logits, cap: int | None) -> None:
        try:
            if isinstance(target_logits, Exception):
                raise target_logits
            chunk = request.sequence.commit(step, target_logits)
        except Exception as error:
            self._leave(request, error)
            return
        if not step.prefill_only:
            if cap != 0:  # a sequence given no room to draft says nothing about its drafts
                self.speculation.verified(request, len(step.draft), request.sequence.stats.accepted_per_step[-1])
            self.stats.verify_steps += 1
            self.stats.draft_tokens += len(step.draft)
            self.stats.accepted_tokens += request.sequence.stats.accepted_per_step[-1]
            self.stats.new_tokens += len(chunk.token_ids)
        if chunk.token_ids or chunk.text:
            request.emit(chunk)
        if request.sequence.done:
            self.stats.finished += 1  # before the answer goes out: a client reading /metrics next sees it counted
            self._leave(request)

    def _leave(self, request: Request, error: Exception | None = None) -> None:
        """Take a request out of the batch, free its state and send its result (or error)."""
        self._running.remove(request)
        self.stats.running = len(self._running)
        self.speculation.left(request)
        if _MALLOC_TRIM is not None and time.monotonic() - self._trimmed_at > TRIM_EVERY_SECONDS:
            self._trimmed_at = time.monotonic()
            _MALLOC_TRIM(0)
        result = request.sequence.finish()
        if error is not None:
            self.stats.failed += 1
            request.emit(error)
        else:
            request.emit(result)  # finish_reason "abort" when cancelled (nobody may be listening any more)
