"""SPEED: speculative pipelined execution (Hooper et al. 2023, arXiv:2310.12072), on a model whose decoder
layers share weights in a cycle (accelgen/models/shared_cycle.py: `cycle` distinct layers run `repeats` times).

In such a model a token's forward is `repeats` passes through the same `cycle` layers. SPEED runs one pass for
several tokens at once, each at a different depth: the current token in a late repeat, the token after it in an
earlier one, and so on. Each distinct layer's weights are then read once for all of them. The tokens after the
current one are not known yet, so they are guessed: after a token's first repeat, its early exit (its hidden
state read through the final norm and LM head) predicts the token after it, which joins the pipeline in the
next pass. When a token finishes its last repeat, its logits are the model's own (every token goes through
every layer), the loop chooses the next token from them, and:

- a hit (the choice is the token in flight) keeps that token's work: it finishes in the next pass;
- a miss drops every guessed token (their KV entries too) and starts the chosen one from the first layer.

Every committed token's logits come from the full model over its true context, so the output is the model's
own, greedy or sampled; only the cost changes. A hit costs one pass, a miss (or the first token after the
prompt, with nothing in flight) `repeats` passes. `describe` reports `hit_rate` (decoding steps whose token was
in flight), `weight_loads_per_token` (distinct-layer weight reads per committed token: cycle x passes / tokens;
plain decoding reads every layer, cycle x repeats) and `compute` (layer-rows run, guesses included, relative to
plain decoding).

Rows at different depths use different KV-cache layers though they share a module: `RowRoutedCache` stands in
for the cache during a pass, sending each row's keys and values to its own layer (repeat x cycle + j) of the
runner's one DynamicCache, the attention itself being the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from accelgen import cache as kv
from accelgen.drafters.autoregressive import no_drafter
from accelgen.models.block import blocking_mask
from accelgen.models.layouts import Decoder
from accelgen.models.runner import ModelRunner
from accelgen.models.shared_cycle import cycle_and_repeats
from accelgen.registry import MethodSpec, Part, register


@dataclass
class Flight:
    """A token in the pipeline: the current one, or a guess at one to come."""

    token: int
    position: int
    repeats_done: int  # passes through the cycle it has had
    hidden: torch.Tensor  # (1, d) its hidden state after them


class RowRoutedCache:
    """The KV cache as one distinct layer's attention sees it while it runs rows at different depths: row i's keys
    and values are appended to cache layer `first_layers[i] + layer_idx` and its keys so far returned, the rows'
    keys right-padded to the longest (the pass's mask blocks the padding)."""

    def __init__(self, cache, first_layers: list[int]):
        self.cache = cache
        self.first_layers = first_layers  # per row: repeat x cycle, the layer its cycle starts at

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        """keys, values (b, kv_heads, 1, head_dim) -> all keys, values of each row's layer (b, kv_heads, n, head_dim)."""
        updated = [self.cache.update(keys[row : row + 1], values[row : row + 1], first + layer_idx)
                   for row, first in enumerate(self.first_layers)]
        longest = max(row_keys.shape[-2] for row_keys, _ in updated)

        def padded(states: torch.Tensor) -> torch.Tensor:
            return F.pad(states, (0, 0, 0, longest - states.shape[-2]))

        return (torch.cat([padded(row_keys) for row_keys, _ in updated]),
                torch.cat([padded(row_values) for _, row_values in updated]))


class SpeedRunner(ModelRunner):
    batches = False  # decoding steps walk the layers themselves

    def __init__(self, model):
        self.cycle, self.repeats = cycle_and_repeats(model, "speed")
        super().__init__(model)
        self.decoder = Decoder(model, "speed")
        self.flights: list[Flight] = []  # oldest first; all but the first are guesses
        self.hits = self.misses = self.cold = 0  # decoding steps: token in flight / guessed wrong / nothing in flight
        self.passes = self.rows = 0  # passes through the cycle; layer-rows run (row x cycle layers per pass)

    def reset(self) -> None:
        super().reset()
        self.flights = []
        self.hits = self.misses = self.cold = self.passes = self.rows = 0

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, tree: torch.Tensor | None = None, logits_for_last: int = 0) -> torch.Tensor:
        """As ModelRunner.forward; a single token (a decoding step) goes through the pipeline."""
        if token_ids.shape[0] != 1 or tree is not None:
            self._drop_guesses(self.length)
            return super().forward(token_ids, tree, logits_for_last)
        token, position = int(token_ids[0]), self.length
        if self.flights and (self.flights[0].token, self.flights[0].position) == (token, position):
            self.hits += 1
        else:
            self.misses += bool(self.flights)
            self.cold += not self.flights
            self._drop_guesses(position)
            self.flights = [Flight(token, position, 0, self._embed(token, position))]
        while True:
            logits = self._pass()
            if logits is not None:
                return logits[None]

    def keep(self, prefix: int, rows: list[int]) -> None:
        if prefix + len(rows) < self.length:  # only a prompt block is ever rolled back; nothing is in flight then
            self._drop_guesses(self.length)
            super().keep(prefix, rows)

    def _embed(self, token: int, position: int) -> torch.Tensor:
        """(1, d) input state of one token."""
        return self.decoder.embed(torch.tensor([token]), torch.tensor([[position]], device=self.device))[0]

    def _drop_guesses(self, length: int) -> None:
        """Forget the tokens in flight: every cache layer keeps its first `length` positions."""
        self.flights = []
        kv.crop(self.cache, length)

    def _pass(self) -> torch.Tensor | None:
        """One pass of every token in flight through the cycle, each in its own repeat; then the next guess joins.
        Returns the first token's (vocab,) logits once it has had its last repeat, else None."""
        flights = self.flights
        positions = torch.tensor([[flight.position] for flight in flights], device=self.device)  # (b, 1)
        self.decoder.check_reach(int(positions.max()))
        hidden = torch.stack([flight.hidden for flight in flights])  # (b, 1, d)
        # row i sees its layer's keys up to its own position (each cache layer holds every earlier position)
        keys = torch.arange(int(positions.max()) + 1)
        mask = blocking_mask(keys[None, :] <= positions.cpu(), self.dtype)[:, None, None, :].to(self.device)
        routed = RowRoutedCache(self.cache, [flight.repeats_done * self.cycle for flight in flights])
        # the distinct layers, each read once for every row
        hidden = self.decoder.through(range(self.cycle), hidden, positions=positions, mask=mask, cache=routed)
        self.passes += 1
        self.rows += len(flights) * self.cycle
        for flight, state in zip(flights, hidden):
            flight.hidden, flight.repeats_done = state, flight.repeats_done + 1
        return self._read_out()

    def _read_out(self) -> torch.Tensor | None:
        """The LM head, once for both rows that need it: the first token if it is done (its final logits) and the
        newest if it just had its first repeat (its early exit guesses the token after it, which joins)."""
        first, newest = self.flights[0], self.flights[-1]
        done = first.repeats_done == self.repeats
        guess = newest.repeats_done == 1 and newest.position + 1 < self.max_positions
        states = [flight.hidden for flight, needed in ((first, done), (newest, guess)) if needed]
        if not states:
            return None
        logits = self.decoder.logits(torch.stack(states))[:, 0]  # (rows, vocab)
        if guess:
            token = int(logits[-1].argmax())
            self.flights.append(Flight(token, newest.position + 1, 0, self._embed(token, newest.position + 1)))
        if not done:
            return None
        self.flights.pop(0)
        return logits[0]

    def describe(self) -> dict:
        """Hit rate, weight loads per committed token and compute relative to plain decoding."""
        steps = self.hits + self.misses + self.cold
        layers = self.cycle * self.repeats
        if not steps:
            return {"hit_rate": 0.0, "weight_loads_per_token": float(layers), "compute": 1.0, "layers": layers}
        return {"hit_rate": self.hits / steps, "misses": self.misses, "cold_starts": self.cold,
                "weight_loads_per_token": self.passes * self.cycle / steps, "layers": layers,
                "compute": self.rows / (layers * steps)}


register(
    MethodSpec(
        name="speed",
        family="early-exit",
        lossless="distribution-exact",
        paper="Hooper et al. 2023, arXiv:2310.12072",
        summary="on a model whose layers share weights in a cycle, one pass through the cycle runs the current "
                "token and early-exit guesses of the next ones at different depths, reading each weight once for "
                "all; a wrong guess is dropped and the true token restarts",
        drafter=Part(no_drafter),
        runner=Part(lambda model, options: SpeedRunner(model)),
    )
)
