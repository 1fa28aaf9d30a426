"""EE-LLM's KV recomputation (Chen et al. 2023, arXiv:2312.04916), with CALM's confidence exits.

Exits are decided as in `calm` (same measures, thresholds and exit layers). What
differs is the KV of the layers a token skipped: instead of copying the exited state up, the token's missing
layers are computed for real in the next step, as a second row beside the new token from the layer above its
exit (`models/early_exit.py`, propagation="recompute"). Later tokens then attend to the entries the layers
above would have written from that state, not to a copy, at the price of running those layers after all,
batched with the next token, where a memory-bound forward makes a second row nearly free.
"""

from __future__ import annotations

from accelgen.drafters.autoregressive import no_drafter
from accelgen.exits.calm import CalmOptions, make_runner
from accelgen.registry import MethodSpec, Part, register

register(
    MethodSpec(
        name="ee-recompute",
        family="early-exit",
        lossless="lossy",
        paper="Chen et al. 2023, arXiv:2312.04916 (EE-LLM)",
        summary="CALM's confidence exits, with the skipped layers' KV of an exited token recomputed in the next "
                "forward together with the new token instead of copied",
        drafter=Part(no_drafter),
        runner=Part(lambda model, options: make_runner(model, propagation="recompute", **options.as_dict()),
                    CalmOptions),
    )
)
