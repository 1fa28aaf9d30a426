"""LayerSkip's target: one KV cache for drafting with the first layers and verifying with the rest.

LayerSkip (Elhoushi et al. 2024) drafts with the target's first `exit_layer` + 1 layers and an early exit, then
verifies with all of them. Its "cache reuse": the draft's forwards already computed the first layers of the
tokens it fed (their keys and values, and their hidden states at the exit), so the verifying forward starts
those tokens above the exit. Only the last draft token, which the draft never fed, goes through the first
layers there.

`ExitDraftRunner` is the target's runner. Its `draft` view is the draft model's runner (for DraftModelDrafter):
its forwards run the first layers only, writing the lower layers' cache and keeping the hidden states at the
exit (`exit_states`) until a verifying forward takes them. The lower layers' cache may therefore run ahead
of the upper layers' by the tokens drafted; `keep` after verification evens them out again.
Decoders whose layout is described (models/layouts.py).
"""

from __future__ import annotations

import torch

from accelgen import cache as kv
from accelgen.models.layouts import Decoder
from accelgen.models.runner import ModelRunner, additive_mask


class ExitDraftRunner(ModelRunner):
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
        """Positions the upper layers hold: the ones verified (the lower layers may hold draft tokens beyond)."""
        return kv.layer_length(self.cache, -1)

    @property
    def lower_length(self) -> int:
        return kv.cache_length(self.cache)

    def reset(self) -> None:
        super().reset()
        self.exit_states = None

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, tree: torch.Tensor | None = None, logits_for_last: int = 0) -> torch.Tensor:
        """As ModelRunner.forward for a chain; tokens the draft already fed start above the exit."""
        if tree is not None:
            raise ValueError("layerskip verifies chains of draft tokens, not trees")
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
        causal = torch.ones(m, m, dtype=torch.bool).tril()
        mask = None if m == 1 else additive_mask(start, causal, self.dtype, self.device)
        return self.decoder.through(layers, hidden, positions=positions, mask=mask, cache=self.cache)


class ExitDraft:
    """The draft model's runner for DraftModelDrafter: the target's first layers, in the target's cache.

    The drafter rolls back to the tokens it fed itself; a token it never fed but that was verified (the last
    token of a fully accepted draft) already has its lower layers from the verifying forward, and is skipped
    when the drafter feeds it."""

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
