"""The target decoding each token through only part of its layers, as an exit rule decides: early exiting.

Early-exit methods (accelgen/exits/: CALM, EE-LLM, FREE, ConsistentEE, Hash EE, SkipDecode) change the
target's own forward, not the draft: each step still feeds the root alone and commits the token its logits choose, but those logits may come
from an intermediate layer, read through the model's final norm and LM head (`layouts.Decoder.logits`).

A rule decides per token (see `ExitRule`):
- `first_layer(position)`: where the walk starts; SkipDecode skips *lower* layers late in a sequence, the token
  embedding going straight into the first computed layer (so every computed layer's cache stays complete:
  the start never moves down, and later tokens never read the lower layers again);
- `should_exit(token, layer, hidden, previous, logits)`: leave after this layer.

A token that exits at layer ℓ still needs keys and values in layers above ℓ, or later tokens would have nothing
to attend to there. Two ways to provide them (`propagation`):
- "copy" (CALM, Schuster et al. 2022): its exited hidden state is copied up, each upper layer's attention
  running on it to write its cache entries (that attention's output is discarded). The MLPs of the upper
  layers, two thirds of a layer's work in these models, are what exiting saves; the copied entries are approximate.
- "recompute" (EE-LLM, Chen et al. 2023): the upper layers are left missing, and the next step computes them
  for real, as a second row beside the new token from the layer above the exit up (`pending`). The cache ends
  up exactly as if the token had been decoded by the layers above its exit, from its exited state; at most one
  token is pending at a time, the one decoded last.
- "synchronized" (FREE, Bae et al. 2023): as "recompute", but exited tokens wait for the next token that goes
  deep, and their upper layers run as extra rows beside it (all exits at one layer, so the rows line up).
  A rule with `observe` then learns how its exit predictions compare with the full model's.

A prompt (a block of more than one token) goes through every layer, as do draft trees: early exit applies to
decoding only. The runner counts, per decoded token, the layers it went through in full (`layers_used`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from accelgen import cache as kv
from accelgen.errors import InputError
from accelgen.models.block import Block
from accelgen.models.layouts import Decoder
from accelgen.models.runner import ModelRunner


class ExitRule(Protocol):
    def first_layer(self, position: int) -> int:
        """The first layer a token at this position goes through (0 unless lower layers are skipped)."""
        ...

    def should_exit(self, token: int, layer: int, hidden: torch.Tensor, previous: torch.Tensor,
                    logits: Callable[[], torch.Tensor]) -> bool:
        """Whether the token `token` leaves after layer `layer` (0-based). hidden (d,) is that layer's output,
        previous (d,) the one before; logits() computes the exit head's (vocab,) float32 logits there, at most once."""
        ...

    # Optional (MPEE's horizontal perspective, exits/mpee.py): context_mask(layer, state, cache, walk) -> a
    # (1, 1, 1, n + 1) additive mask over the layer's n cached positions and the token itself, or None for all of
    # them; asked before each layer a lone decoding token goes through, state (1, 1, d) being that layer's input.


PROPAGATIONS = ("copy", "recompute", "synchronized")


@dataclass
class Pending:
    """Tokens that exited after `layer` and whose cache entries above it are still to be computed."""

    layer: int
    hidden: torch.Tensor  # (1, k, d) their hidden states at the exit, oldest first
    logits: torch.Tensor  # (k, vocab) the exit predictions they were decoded with


@dataclass
class ExitWalk:
    """One decoding step's walk: where it started and left, and what it computed."""

    start: int  # the first layer it went through
    exit_layer: int  # the layer its logits come from
    exited: bool  # exit_layer is below the last layer
    hidden: torch.Tensor  # (1, 1, d) its hidden state at the exit
    logits: torch.Tensor  # (vocab,) its logits there
    exit_logits: dict[int, torch.Tensor]  # layer -> (vocab,) the exit logits the rule looked at
    pending_hidden: torch.Tensor | None  # (1, k, d) the pending tokens' states, carried up to where the step left


class EarlyExitRunner(ModelRunner):
    def __init__(self, model, rule: ExitRule, propagation: str = "copy", heads=None):
        super().__init__(model)
        if propagation not in PROPAGATIONS:
            raise InputError(f"propagation must be one of {', '.join(PROPAGATIONS)}, not {propagation!r}")
        self.decoder = Decoder(model, "early exit")
        self.layer_count = len(self.decoder.layers)
        self.rule = rule
        self.propagation = propagation
        self.heads = heads  # trained exit adapters (heads/exit_heads.py), or None for the plain exits
        self.layers_used: list[int] = []  # per decoded token: layers it went through in full
        self.pending: Pending | None = None  # "recompute" and "synchronized": the last tokens, if they exited

    @property
    def length(self) -> int:
        """Positions covered: those the cache holds (read from its highest layer, which every token writes, while
        SkipDecode leaves lower ones out), plus pending tokens whose top-layer entries are still to come."""
        waiting = 0 if self.pending is None else self.pending.hidden.shape[1]
        return super().length + waiting

    @property
    def batches(self) -> bool:
        """Never: a decoding step walks the layers itself, as deep as its own token needs."""
        return False

    def reset(self) -> None:
        super().reset()
        self.layers_used = []
        self.pending = None

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, tree: torch.Tensor | None = None, logits_for_last: int = 0,
                appended: torch.Tensor | None = None) -> torch.Tensor:
        """As ModelRunner.forward; a single token alone (a decoding step) exits where the rule says, while a block
        (the prompt, a tree, a token with appended embeddings) goes through every layer."""
        if token_ids.shape[0] != 1 or tree is not None or appended is not None:
            if self.pending is not None:
                raise InputError("early exit decodes one token at a time after the prompt")
            return super().forward(token_ids, tree, logits_for_last, appended)
        position = self.length
        pending, self.pending = self.pending, None
        step = self._decode(token_ids, position, pending)
        if pending is not None and step.exited and self.propagation == "synchronized":
            # FREE: this token joins the pending ones; their deep layers wait for a token that goes deep
            if step.exit_layer != pending.layer:
                raise InputError("synchronized decoding needs every exit at one layer")
            self.pending = Pending(step.exit_layer, torch.cat([pending.hidden, step.hidden], dim=1),
                                   torch.cat([pending.logits, step.logits[None]]))
        else:
            if pending is not None:
                self._finish_pending(pending, step, position)
            if step.exited and self.propagation == "copy":  # CALM: upper layers' KV from the exited state
                walk = self._walk_inputs([position], step.hidden)
                # not a walk through the layers (Decoder.through): every upper layer's keys and values come from the
                # one exited state, none from the layer below
                for layer in self.decoder.layers[step.exit_layer + 1 :]:
                    self.decoder.attention_block(layer, step.hidden, mask=None, **walk)
            elif step.exited:
                self.pending = Pending(step.exit_layer, step.hidden, step.logits[None])
        if not step.exited and self._learns:
            for layer, shallow in step.exit_logits.items():
                if layer < step.exit_layer:
                    self.rule.observe(layer, shallow[None], step.logits[None])
        self.layers_used.append(step.exit_layer + 1 - step.start)
        return step.logits[None]

    def _decode(self, token_ids: torch.Tensor, position: int, pending: Pending | None) -> "ExitWalk":
        """One token (1,) at `position` through the layers from the rule's first one until the rule exits, the
        pending tokens riding along as extra rows above their exit."""
        token = int(token_ids[0])
        hidden = self.decoder.embed(token_ids, torch.tensor([[position]], device=self.device))  # (1, 1, d)
        waiting = 0 if pending is None else pending.hidden.shape[1]
        alone = self._walk([position], hidden, narrow=getattr(self.rule, "context_mask", None))
        together = None if pending is None else self._walk(list(range(position - waiting, position + 1)), hidden)
        pending_hidden = None if pending is None else pending.hidden
        exit_logits: dict[int, torch.Tensor] = {}  # layer -> exit logits, computed at most once per layer

        def logits_at(layer: int, state: torch.Tensor) -> Callable[[], torch.Tensor]:
            def logits() -> torch.Tensor:
                if layer not in exit_logits:
                    adapted = state if self.heads is None else self.heads.adapt(layer, state)
                    exit_logits[layer] = self.decoder.logits(adapted)[0, 0]
                return exit_logits[layer]
            return logits

        start = self.rule.first_layer(position)
        exit_layer = self.layer_count - 1
        # not Decoder.through: the rule decides after each layer whether to go on, the pending tokens join as extra
        # rows above their exit, and each layer's mask follows its own cache's length
        for index in range(start, self.layer_count):
            previous = hidden
            if pending is not None and index > pending.layer:
                states = together(index, torch.cat([pending_hidden, hidden], dim=1))
                pending_hidden, hidden = states[:, :waiting], states[:, waiting:]
            else:
                hidden = alone(index, hidden)
            if index < self.layer_count - 1 and self.rule.should_exit(token, index, hidden[0, 0], previous[0, 0],
                                                                        logits_at(index, hidden)):
                exit_layer = index
                break
        logits = logits_at(exit_layer, hidden)()
        return ExitWalk(start, exit_layer, exit_layer < self.layer_count - 1, hidden, logits, exit_logits, pending_hidden)

    def _finish_pending(self, pending: Pending, step: "ExitWalk", position: int) -> None:
        """Run the pending tokens' layers above both their exit and this step's (which they rode along to)."""
        waiting = pending.hidden.shape[1]
        hidden = step.pending_hidden
        finish = self._walk(list(range(position - waiting, position)), hidden)
        # not Decoder.through, which takes one mask: these layers' caches hold different numbers of positions
        for index in range(max(step.exit_layer, pending.layer) + 1, self.layer_count):
            hidden = finish(index, hidden)
        if self._learns:
            self.rule.observe(pending.layer, pending.logits, self.decoder.logits(hidden[0]))

    @property
    def _learns(self) -> bool:
        """Whether the rule learns from exit predictions set beside the full model's (FREE's adaptive threshold):
        `observe(layer, shallow (k, vocab), deep (k, vocab))` whenever tokens' deep layers complete."""
        return hasattr(self.rule, "observe")

    def _walk_inputs(self, positions: list[int], hidden: torch.Tensor) -> dict:
        position_ids = torch.tensor([positions], device=self.device)
        return {"cache": self.cache, **self.decoder.walk_inputs(hidden, position_ids)}

    def _walk(self, positions: list[int], hidden: torch.Tensor,
              narrow: Callable | None = None) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """layer index, hidden (1, k, d) -> that layer's output for k consecutive new positions. narrow: the rule's
        context_mask, for a lone token (k = 1) whose upper layers may see part of the context only (MPEE)."""
        walk = self._walk_inputs(positions, hidden)

        def through(index: int, state: torch.Tensor) -> torch.Tensor:
            layer = self.decoder.layers[index]
            # this layer's cache may hold fewer positions than others (lower layers skipped, upper ones pending)
            mask = Block.chain(kv.layer_length(self.cache, index), len(positions)).walk_mask(self.dtype, self.device)
            if narrow is not None and len(positions) == 1:
                mask = narrow(index, state, self.cache, walk)
            return self.decoder.layer(layer, state, mask=mask, **walk)

        return through

    def describe(self) -> dict:
        """What exiting saved: the mean number of layers a decoded token went through, of how many."""
        used = self.layers_used
        return {"mean_layers": sum(used) / len(used) if used else float(self.layer_count), "layers": self.layer_count}
