"""How many draft tokens the sequences of a batch get each step.

Verifying k tokens costs about as much as verifying one only while a forward is bound by reading the
weights; a growing batch ends that (the synergy of speculative decoding and batching, Su et al. 2023,
arXiv:2310.18813). Two policies:

- `TokenBudget(n)`: a fixed rule, drafts of at most n // b − 1 tokens for b sequences.
- `Goodput` (the default of `accelgen serve`): each step, the draft length g with the most expected tokens per
  second, from costs and acceptance measured while serving (as SmartSpec, Liu et al. 2024, arXiv:2406.14066):

      goodput(g) = Σ_i E(α_i, g) / (t_target(b, g + 1) + g · t_draft(d))

  over the b decoding sequences (prompt chunks have forwards of their own, see engine.py). E(α, g) =
  (1 − α^(g+1)) / (1 − α) is the expected tokens a sequence commits per step (Leviathan et al.), with α_i
  from that sequence's own verdicts, starting from its method's recent acceptance. A batched forward pads
  every block to the widest, so b sequences drafting g tokens cost t_target(b, g + 1), the target's forward
  of b blocks of g + 1 tokens; t_draft(d) is one lockstep round of the d sequences that draft with a model
  (model-free drafters cost nothing). Both start from batched forwards timed once per model, weight format,
  machine and batch size and cached (`calibrate`, accelgen/costs.py), and follow what each step measures.

  g = 0 is plain batched decoding. While g stays 0, one step in `probe_interval` drafts one token anyway, so
  that the acceptance estimates do not go stale: as often as keeps the probes' cost (t(b, 2) + draft round
  over t(b, 1), less one) under costs.PROBE_COST of the decoding time; and never where no g would pay even
  with every drafted token accepted (a probe would only make the draft models catch up on skipped tokens).

Either way the cap only shortens drafts, so outputs are unchanged: each request gets the tokens it would get alone,
up to the rounding of another forward shape (a near-tie may flip; float32 logits move by about 1e-5, bf16 by much
more). A seeded request takes no cap: the engine runs it as if alone (engine.py), so its tokens are exactly its own.
"""

from __future__ import annotations

from typing import Callable

from accelgen.costs import SIZES, Timer, forward_seconds, probe_interval
from accelgen.errors import InputError
from accelgen.profile import interpolate
from accelgen.theory import AcceptanceEstimate, expected_tokens_per_forward

CALIBRATION_BATCHES = (1, 2, 4, 8, 16, 32)
CALIBRATION_WIDTHS = (1, 2, 3, 5)
Report = Callable[[str], None]  # told what the start-up is doing, in words (for /health)


class ForwardCosts:
    """Seconds of one batched forward of b sequences whose blocks are padded to w tokens, per batch size and
    width: measured for a few batch sizes once per machine (`calibrate`), faded towards every measured forward of
    those batch sizes (DECAY per measurement), linear in between."""

    DECAY = 0.8

    def __init__(self, seconds: dict[int, dict[int, float]]):
        """seconds: batch size -> block width -> seconds."""
        if not seconds or not all(seconds.values()):
            raise InputError("ForwardCosts needs at least one measured forward per batch size")
        self.seconds = {batch: dict(widths) for batch, widths in seconds.items()}

    def __call__(self, batch: int, width: int) -> float:
        return interpolate({size: interpolate(widths, width) for size, widths in self.seconds.items()}, batch)

    def observe(self, batch: int, width: int, seconds: float) -> None:
        widths = self.seconds.get(batch)
        if widths is None:
            return  # other batch sizes are read between the measured ones
        known = widths.get(width)
        widths[width] = seconds if known is None else self.DECAY * known + (1 - self.DECAY) * seconds


def calibration_batches(max_batch: int) -> list[int]:
    """The batch sizes calibrated: 1, 2, 4, … up to max_batch, and max_batch itself."""
    return sorted({size for size in CALIBRATION_BATCHES if size <= max_batch} | {max_batch})


def calibrate(model, max_batch: int, widths=CALIBRATION_WIDTHS, timer: Timer | None = None,
              progress: Callable[[int], None] = lambda batch: None) -> ForwardCosts:
    """Batched forwards (blocks of each width after costs.CONTEXT_TOKENS cached) for the calibration_batches:
    timed once per model, weight format, machine and thread count, then read from the cache (accelgen/costs.py),
    so a restart is ready at once. Batch size 1 also gets the sizes the requests' own budgets read r(k) from.
    progress(batch) is called before each batch size."""
    seconds = {}
    for batch in calibration_batches(max_batch):
        progress(batch)
        seconds[batch] = forward_seconds(model, batch, sorted(set(widths) | set(SIZES if batch == 1 else ())),
                                         timer=timer)
    return ForwardCosts(seconds)


def policy_calibration(target_model, draft_model, max_batch: int, max_draft: int, timer: Timer | None = None):
    """The calibration a Goodput policy runs in `prepare`: report -> (target costs, draft costs or None), reporting
    "timing batched forwards: i/n" (cached batch sizes pass at once)."""
    def calibration(report: Report):
        models = [target_model] + [draft_model] * (draft_model is not None)
        total = len(calibration_batches(max_batch)) * len(models)
        done = 0

        def progress(_batch: int) -> None:
            nonlocal done
            done += 1
            report(f"timing batched forwards: {done}/{total}")

        target = calibrate(target_model, max_batch, sorted({1, 2, 3, 5, max_draft + 1}), timer, progress)
        draft = calibrate(draft_model, max_batch, (1, 2), timer, progress) if draft_model is not None else None
        return target, draft

    return calibration


def best_draft_length(alphas: list[float], drafting_with_model: int, target: Callable[[int, int], float],
                      draft: Callable[[int, int], float] | None, max_draft: int) -> int:
    """The common draft length g in 0..max_draft with the most expected tokens per second (the shortest on ties).

    alphas: the acceptance of each decoding sequence, all in one batched forward, which costs target(batch, width);
    drafting_with_model: those whose drafts take draft-model forwards, each round costing draft(that many, 1).
    """
    def goodput(g: int) -> float:
        seconds = target(len(alphas), g + 1)
        if g and drafting_with_model and draft is not None:
            seconds += g * draft(drafting_with_model, 1)
        return sum(expected_tokens_per_forward(alpha, g) for alpha in alphas) / seconds

    return max(range(max_draft + 1), key=lambda g: (goodput(g), -g))


class TokenBudget:
    """Drafts of at most budget // b − 1 tokens for b sequences; budget 0: no cap."""

    def __init__(self, budget: int):
        if budget < 0:
            raise InputError(f"token budget must be >= 0, got {budget}")
        self.budget = budget

    def draft_length(self, decoding: list) -> int | None:
        return max(0, self.budget // max(len(decoding), 1) - 1) if self.budget else None

    def prepare(self, report: Report = lambda doing: None) -> None:
        pass

    def measured(self, **_measurements) -> None:
        pass

    def verified(self, request, drafted: int, accepted: int) -> None:
        pass

    def left(self, request) -> None:
        pass


class Goodput:
    """The draft length with the most expected tokens per second, from measured costs and acceptance (above)."""

    def __init__(self, target: ForwardCosts | None = None, draft: ForwardCosts | None = None, max_draft: int = 8,
                 calibration: Callable[[Report], tuple[ForwardCosts, ForwardCosts | None]] | None = None):
        """target, draft: the costs; or calibration(report), which measures them (target, draft) in `prepare`,
        reporting its progress in words (see policy_calibration)."""
        if max_draft < 0:
            raise InputError(f"max_draft must be >= 0, got {max_draft}")
        if target is None and calibration is None:
            raise InputError("Goodput needs the target's forward costs, or a calibration that measures them")
        self.target = target
        self.draft = draft
        self.max_draft = max_draft
        self.calibration = calibration
        self.by_request: dict[int, AcceptanceEstimate] = {}  # id(request) -> its estimate
        self.by_method: dict[str, AcceptanceEstimate] = {}  # method -> estimate over its recent requests
        self._idle_steps = 0
        self._lengths = (0, 0)  # the draft lengths of the step before and of this one

    def prepare(self, report: Report = lambda doing: None) -> None:
        """Measure the costs (telling report what it does), on the engine's thread before its first step: PyTorch's
        CPU worker threads belong to the thread that runs a forward, and a server whose model first ran on another
        thread (the main one, say) decodes about half as fast (measured: 24 against 50 tokens/s on SmolLM2)."""
        if self.calibration is not None:
            self.target, self.draft = self.calibration(report)
            self.calibration = None

    def acceptance(self, request) -> AcceptanceEstimate:
        estimate = self.by_request.get(id(request))
        if estimate is None:  # a new request starts from what its method achieved lately
            method = self.by_method.get(request.method, AcceptanceEstimate())
            estimate = self.by_request[id(request)] = AcceptanceEstimate(method.accepted, method.rejections)
        return estimate

    def draft_length(self, decoding: list) -> int:
        """decoding: the requests past their prompt, which share one batched forward this step."""
        if not decoding:
            return 0
        drafting_with_model = sum(request.sequence.drafts_with_a_model for request in decoding)
        length = best_draft_length([self.acceptance(request).alpha for request in decoding], drafting_with_model,
                                   self.target, self.draft, self.max_draft)
        self._idle_steps = self._idle_steps + 1 if length == 0 else 0
        if self._idle_steps >= probe_interval(self.probe_cost(len(decoding), drafting_with_model)):
            self._idle_steps = 0  # keep the acceptance estimates fresh, where they can change the answer:
            if self.could_pay(len(decoding), drafting_with_model):  # a probe also makes draft models catch up
                length = min(1, self.max_draft)
        self._lengths = (self._lengths[1], length)
        return length

    def could_pay(self, batch: int, drafting_with_model: int) -> bool:
        """Whether some draft length would pay for this batch were every drafted token accepted."""
        return best_draft_length([1.0] * batch, drafting_with_model, self.target, self.draft, self.max_draft) > 0

    def probe_cost(self, batch: int, drafting_with_model: int) -> float:
        """What a step drafting one token costs more than a plain step, in plain steps (if nothing is accepted)."""
        seconds = self.target(batch, 2)
        if drafting_with_model and self.draft is not None:
            seconds += self.draft(drafting_with_model, 1)
        return seconds / self.target(batch, 1) - 1

    def measured(self, *, target_batch: int = 0, target_width: int = 0, target_seconds: float = 0.0,
                 draft_batch: int = 0, draft_rounds: int = 0, draft_seconds: float = 0.0) -> None:
        """A target forward (its sequences and widest block) or a step's draft rounds, as timed."""
        if target_batch:
            self.target.observe(target_batch, target_width, target_seconds)
        # after a step without drafts the draft model first catches up on several tokens: not a typical round
        if draft_batch and draft_rounds and self._lengths[0]:
            if self.draft is None:  # drafting with a model nobody calibrated (the target skipping layers)
                self.draft = ForwardCosts({draft_batch: {1: draft_seconds / draft_rounds}})
            self.draft.observe(draft_batch, 1, draft_seconds / draft_rounds)

    def verified(self, request, drafted: int, accepted: int) -> None:
        self.acceptance(request).observe(drafted, accepted)
        self.by_method.setdefault(request.method, AcceptanceEstimate()).observe(drafted, accepted)

    def left(self, request) -> None:
        self.by_request.pop(id(request), None)
