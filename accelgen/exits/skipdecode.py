"""SkipDecode (Del Corro et al. 2023, arXiv:2307.02628).

One depth per position, the same for every sequence of a batch, shrinking along the sequence: a token at
position t skips the lowest `skipped_layers(t)` layers, a count that rises linearly from `min_skip` at
position 0 to `max_skip` at `horizon` and stays there. It skips *lower* layers rather than exiting early:
the top layers, whose output is read, always run, and since the skipped count never falls, a later token
never needs a lower layer that an earlier token skipped, so no KV is missing and none is copied. The token
embedding goes straight into the first computed layer, which the paper trains the model for; on a model
not trained for it the quality loss is larger, and measured (`accelgen bench`).
"""

from __future__ import annotations

from dataclasses import dataclass

from accelgen.drafters.autoregressive import no_drafter
from accelgen.errors import InputError
from accelgen.models.early_exit import EarlyExitRunner
from accelgen.registry import MethodOptions, MethodSpec, Part, register


def skipped_layers(position: int, *, min_skip: int, max_skip: int, horizon: int) -> int:
    """Lower layers a token at `position` skips: min_skip at 0, rising linearly to max_skip at horizon."""
    return min_skip + (max_skip - min_skip) * min(position, horizon) // horizon


@dataclass(frozen=True)
class SkipSchedule:
    min_skip: int
    max_skip: int
    horizon: int

    def first_layer(self, position: int) -> int:
        return skipped_layers(position, min_skip=self.min_skip, max_skip=self.max_skip, horizon=self.horizon)

    def should_exit(self, token, layer, hidden, previous, logits) -> bool:
        return False


@dataclass(frozen=True)
class SkipDecodeOptions(MethodOptions):
    min_skip: int = 0  # lower layers skipped at the first position ...
    max_skip: int | None = None  # ... and at the last (None: a quarter of the layers)
    horizon: int = 512  # positions over which the skip grows


def make_rule(model, *, min_skip: int, max_skip, horizon: int) -> SkipSchedule:
    layer_count = model.config.num_hidden_layers
    max_skip = layer_count // 4 if max_skip is None else max_skip
    if not 0 <= min_skip <= max_skip < layer_count:
        raise InputError(f"skipdecode: need 0 <= min_skip <= max_skip < {layer_count} layers, "
                         f"got min_skip={min_skip}, max_skip={max_skip}")
    if horizon < 1:
        raise InputError(f"skipdecode: horizon must be at least 1 position, got {horizon}")
    return SkipSchedule(min_skip, max_skip, horizon)


register(
    MethodSpec(
        name="skipdecode",
        family="early-exit",
        lossless="lossy",
        paper="Del Corro et al. 2023, arXiv:2307.02628",
        summary="one depth per position for the whole batch, shrinking along the sequence by skipping lower "
                "layers, so every computed layer's KV cache stays complete",
        drafter=Part(no_drafter),
        runner=Part(lambda model, options: EarlyExitRunner(model, make_rule(model, **options.as_dict())),
                    SkipDecodeOptions),
    )
)
