"""ConsistentEE (Zeng et al. 2024, arXiv:2312.11882): exits decided by a policy trained with policy gradient.

The policy, trained by `accelgen train consistent-ee` (train/consistent_ee.py), gives at each exit layer the
probability of leaving; a token leaves at the first exit layer where it is above `threshold` (the greedy
policy at 0.5). It is stored as the classifiers of an exit-heads folder, so decoding is `calm`'s runner with
that probability as the confidence (and exit adapters, if the policy was trained on top of exit heads).
"""

from __future__ import annotations

from dataclasses import dataclass

from accelgen.drafters.autoregressive import no_drafter
from accelgen.errors import InputError
from accelgen.exits.calm import make_runner
from accelgen.registry import MethodOptions, MethodSpec, Part, register


@dataclass(frozen=True)
class ConsistentExitOptions(MethodOptions):
    heads: str | None = None  # the trained exit policy's folder
    threshold: float = 0.5  # the policy's exit probability that exits


def _make_runner(model, options: ConsistentExitOptions):
    heads, threshold = options.heads, options.threshold
    if not heads:
        raise InputError("consistent-ee needs a trained exit policy: heads=FOLDER "
                         "(from `accelgen train consistent-ee --out FOLDER`)")
    return make_runner(model, heads=heads, measure="classifier", threshold=threshold, exit_layers=None)


register(
    MethodSpec(
        name="consistent-ee",
        family="early-exit",
        lossless="lossy",
        paper="Zeng et al. 2024, arXiv:2312.11882",
        summary="exits where a policy trained with policy gradient says so, rewarded for accuracy on hard tokens "
                "and for depth saved on easy ones",
        drafter=Part(no_drafter),
        runner=Part(_make_runner, ConsistentExitOptions),
        needs=("heads",),
    )
)
