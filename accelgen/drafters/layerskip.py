"""LayerSkip self-speculative decoding (Elhoushi et al. 2024, arXiv:2404.16710).

The target drafts with its first layers only, leaving after `exit_layer` through its own final norm and LM
head (an early exit), and verifies with all of them, so its output is exactly the target's, greedy or sampled.
Draft and verification share one KV cache (`ExitDraftRunner`, the target's runner): the verifying forward starts
the tokens the draft fed above the exit, reusing their lower layers' keys, values and exit hidden states ("cache
reuse"); only the last draft token, which the draft never fed, goes through the first layers there.
LayerSkip's training (`accelgen train layerskip`: layer dropout rising with depth plus an early-exit loss)
is what makes an early exit accurate enough to pay; on a model not trained that way the drafts are accepted
less often, and the benchmark shows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen import cache as kv
from accelgen.drafters.base import BuildContext
from accelgen.drafters.draft_model import SelfDraftingOptions, make_self_drafter
from accelgen.errors import InputError
from accelgen.models.block import Block
from accelgen.models.layouts import Decoder
from accelgen.models.runner import ModelRunner
from accelgen.registry import MethodOptions, MethodSpec, Part, register


class ExitDraftRunner(ModelRunner):
    """The target's runner: one KV cache for drafting with the first layers and verifying with the rest.

    Its `draft` view is the draft model's runner (for DraftModelDrafter): its forwards run the first layers only,
    writing the lower layers' cache and keeping the hidden states at the exit (`exit_states`) until a verifying
    forward takes them. The lower layers' cache may therefore run ahead of the upper layers' by the tokens
    drafted; `keep` after verification evens them out again. Decoders whose layout is described
    (models/layouts.py)."""

    batches = False  # its forwards walk the layers themselves

    def __init__(self, model, exit_layer: int):
        super().__init__(model)
        self.decoder = Decoder(model, "layerskip")
        self.layer_count = len(self.decoder.layers)
        self.exit_layer = exit_layer
        # (1, n, d): hidden states after exit_layer of the n positions the lower layers hold beyond the upper ones
        self.exit_states: torch.Tensor | None = None
        self.draft = ExitDraft(self)

    @property
    def length(self) -> int:
        """Positions the top layer holds: the ones verified. (The draft may fill the lower layers first, before the
        prompt's verifying forward has reached the top: the highest layer holding any would say too much.)"""
        return kv.layer_length(self.cache, -1)

    @property
    def lower_length(self) -> int:
        """Positions the lower layers hold: the verified ones (`length`, read from the top layer), then the drafted."""
        return kv.layer_length(self.cache, 0)

    def reset(self) -> None:
        super().reset()
        self.exit_states = None

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, tree: torch.Tensor | None = None, logits_for_last: int = 0) -> torch.Tensor:
        """As ModelRunner.forward for a chain; tokens the draft already fed start above the exit."""
        if tree is not None:
            raise InputError("layerskip verifies chains of draft tokens, not trees")
        start, m = self.length, token_ids.shape[0]
        drafted = min(self.lower_length - start, m)  # leading tokens whose lower layers the draft computed
        kv.crop(self.cache, start + drafted, layers=range(self.exit_layer + 1))
        states = self.exit_states[:, :drafted] if drafted else None
        if drafted < m:
            fresh = self._through(range(self.exit_layer + 1), self._embed(token_ids[drafted:], start + drafted),
                                  start + drafted)
            states = fresh if states is None else torch.cat([states, fresh], dim=1)
        hidden = self._through(range(self.exit_layer + 1, self.layer_count), states, start)
        self.exit_states = None
        if logits_for_last:
            hidden = hidden[:, -logits_for_last:]
        return self.decoder.logits(hidden)[0]

    def keep(self, prefix: int, rows: list[int]) -> None:
        super().keep(prefix, rows)
        self.exit_states = None

    def draft_forward(self, token_ids: torch.Tensor, logits_for_last: int = 0) -> torch.Tensor:
        """The draft's forward: token_ids (m,) through the layers up to the exit, after the lower layers' cache;
        returns the exit's logits, (m or logits_for_last, vocab) float32."""
        start = self.lower_length
        hidden = self._through(range(self.exit_layer + 1), self._embed(token_ids, start), start)
        self.exit_states = hidden if self.exit_states is None else torch.cat([self.exit_states, hidden], dim=1)
        if logits_for_last:
            hidden = hidden[:, -logits_for_last:]
        return self.decoder.logits(hidden)[0]

    def crop_draft(self, length: int) -> None:
        """Forget the lower layers' positions from `length` (at least the verified length) on, with their exit states."""
        kv.crop(self.cache, length, layers=range(self.exit_layer + 1))
        if self.exit_states is not None:
            self.exit_states = self.exit_states[:, : self.lower_length - self.length]

    def _embed(self, token_ids: torch.Tensor, start: int) -> torch.Tensor:
        """(1, m, d) input states of token_ids (m,) at positions start.."""
        return self.decoder.embed(token_ids, torch.arange(start, start + token_ids.shape[0], device=self.device)[None])

    def _through(self, layers: range, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """hidden (1, m, d) of positions start.. through `layers`, whose caches hold `start` positions each."""
        m = hidden.shape[1]
        positions = torch.arange(start, start + m, device=self.device)[None]
        mask = Block.chain(start, m).walk_mask(self.dtype, self.device)
        return self.decoder.through(layers, hidden, positions=positions, mask=mask, cache=self.cache)


class ExitDraft:
    """The draft model's runner for DraftModelDrafter: the target's first layers, in the target's cache.

    The drafter rolls back to the tokens it fed itself; a token it never fed but that was verified (the last
    token of a fully accepted draft) already has its lower layers from the verifying forward, and is skipped
    when the drafter feeds it."""

    batches = False  # it walks the target's first layers itself

    def __init__(self, target: ExitDraftRunner):
        self.target = target
        self.max_positions = target.max_positions
        self.next_position = 0  # position of the next token the drafter feeds

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, tree: torch.Tensor | None = None, logits_for_last: int = 0) -> torch.Tensor:
        held = self.target.lower_length - self.next_position
        self.next_position += token_ids.shape[0]
        return self.target.draft_forward(token_ids[held:], logits_for_last)

    def keep(self, prefix: int, rows: list[int]) -> None:
        self.next_position = prefix + len(rows)
        self.target.crop_draft(max(self.next_position, self.target.length))


def exit_layer_of(model, exit_layer: int | None) -> int:
    layer_count = model.config.num_hidden_layers
    exit_layer = layer_count // 2 - 1 if exit_layer is None else exit_layer
    if not 0 <= exit_layer < layer_count - 1:
        raise InputError(f"layerskip: exit_layer must be a layer below the last (0..{layer_count - 2}), got {exit_layer}")
    return exit_layer


@dataclass(frozen=True)
class ExitLayerOptions(MethodOptions):
    exit_layer: int | None = None  # the draft's exit (None: the middle layer)


def _make_runner(model, options: ExitLayerOptions) -> ExitDraftRunner:
    return ExitDraftRunner(model, exit_layer_of(model, options.exit_layer))


def _make(build: BuildContext, options: SelfDraftingOptions):
    """Draft-model drafting whose draft model is the target runner's own first layers."""
    return make_self_drafter(build.target.draft, build, options)


register(
    MethodSpec(
        name="layerskip",
        family="speculative",
        lossless="distribution-exact",
        paper="Elhoushi et al. 2024, arXiv:2404.16710",
        summary="the target drafts with its first layers and an early exit through its own LM head, then "
                "verifies with the remaining layers, reusing the draft's cache",
        drafter=Part(_make, SelfDraftingOptions),
        runner=Part(_make_runner, ExitLayerOptions),
        draft_budget="measured",  # drafts capped by the measured costs unless the request fixes their length
    )
)
