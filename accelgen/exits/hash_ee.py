"""Hash-based early exiting (Sun et al. 2022, arXiv:2203.01670).

No confidence, no classifier: a fixed hash of the token id picks the layer it exits after, so the same token
always takes the same depth and the cost of a text is known before running it. Here the hashed token is the
one being decoded (the root), and its exited state is copied up as in CALM (`models/early_exit.py`). The
hash spreads token ids uniformly over `exit_layers`; the last layer there means "no early exit".
"""

from __future__ import annotations

from dataclasses import dataclass

from accelgen.drafters.autoregressive import no_drafter
from accelgen.exits.calm import check_exit_layers
from accelgen.models.early_exit import EarlyExitRunner
from accelgen.registry import MethodOptions, MethodSpec, Part, register


def hashed_exit_layer(token: int, exit_layers: tuple[int, ...]) -> int:
    """The exit layer of a token id: Knuth's multiplicative hash, spread over the allowed layers."""
    return exit_layers[(token * 2654435761) % 2**32 % len(exit_layers)]


@dataclass(frozen=True)
class HashExit:
    exit_layers: tuple[int, ...]

    def first_layer(self, position: int) -> int:
        return 0

    def should_exit(self, token, layer, hidden, previous, logits) -> bool:
        return layer == hashed_exit_layer(token, self.exit_layers)


@dataclass(frozen=True)
class HashExitOptions(MethodOptions):
    exit_layers: list[int] | None = None  # the layers hashed to (None: from the middle up, the last included)


def make_rule(model, *, exit_layers) -> HashExit:
    layer_count = model.config.num_hidden_layers
    if exit_layers is None:  # from the middle up, the full depth included
        exit_layers = list(range(layer_count // 2, layer_count, max(1, layer_count // 8))) + [layer_count - 1]
    return HashExit(tuple(check_exit_layers(exit_layers, layer_count)))


register(
    MethodSpec(
        name="hash-ee",
        family="early-exit",
        lossless="lossy",
        paper="Sun et al. 2022, arXiv:2203.01670",
        summary="each token exits at a layer chosen by a fixed hash of its id: no confidence, no classifier",
        drafter=Part(no_drafter),
        runner=Part(lambda model, options: EarlyExitRunner(model, make_rule(model, **options.as_dict())),
                    HashExitOptions),
    )
)
