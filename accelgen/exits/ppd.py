"""Predictive pipelined decoding (Yang et al. 2023, arXiv:2307.05908): start the next token before this one ends.

While a token goes through the decoder, PPD reads an early exit at `pipeline_layer` and starts the next
token's forward for each of that exit's top `candidates` tokens, in parallel with the rest of the current pass.
When the last layer has chosen the next token, a candidate that matches it has already gone through its first
layers; the others are dropped. The output is the model's own (every token still comes from the last
layer), so PPD is exact, greedy or sampled: it trades extra compute for latency.

On hardware that pipelines, the candidates run on otherwise idle units, at the same time as the current
token's upper layers: a hit saves the layers the candidate got through, `precomputed` =
min(pipeline_layer, L − 1 − pipeline_layer) (as many as the current pass has left, and only layers whose
cache entries for the current token already exist). Here the candidates run as k extra rows through those
layers, in one batched call after the current token passes `pipeline_layer` (their rows sit beside each
other in the cache, seeing the context but not each other, and all but the hit are dropped). One CPU stream
cannot overlap them with the main pass, so the wall time shows the compute PPD adds, and the stats show what
it would save: `hit_rate`, `mean_layers` (layers on a token's critical path: L, or L − precomputed after a
hit) and `compute` (layer-rows run, relative to plain decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen import cache as kv
from accelgen.drafters.autoregressive import no_drafter
from accelgen.errors import InputError
from accelgen.models.block import Block
from accelgen.models.layouts import Decoder
from accelgen.models.runner import ModelRunner
from accelgen.registry import MethodOptions, MethodSpec, Part, register


@dataclass
class Candidates:
    """The next token's candidates, already through the first `layers` layers at one position."""

    tokens: list[int]  # the exit's top tokens at pipeline_layer
    hidden: torch.Tensor  # (1, k, d) their hidden states after those layers


class PipelinedRunner(ModelRunner):
    batches = False  # decoding steps walk the layers themselves

    def __init__(self, model, pipeline_layer: int, candidates: int):
        super().__init__(model)
        self.decoder = Decoder(model, "ppd")
        self.layer_count = len(self.decoder.layers)
        self.pipeline_layer = pipeline_layer
        self.candidate_count = candidates
        self.precomputed = min(pipeline_layer, self.layer_count - 1 - pipeline_layer)
        self.candidates: Candidates | None = None  # their rows follow the last position in the lower caches
        self.critical_layers: list[int] = []  # per decoded token: layers on its critical path
        self.candidate_rows = 0  # layer-rows spent on candidates

    def reset(self) -> None:
        super().reset()
        self.candidates, self.critical_layers, self.candidate_rows = None, [], 0

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, tree: torch.Tensor | None = None, logits_for_last: int = 0) -> torch.Tensor:
        """As ModelRunner.forward; a single token (a decoding step) is pipelined."""
        if token_ids.shape[0] != 1 or tree is not None:
            if self.candidates is not None:
                raise InputError("ppd decodes one token at a time after the prompt")
            return super().forward(token_ids, tree, logits_for_last)
        position = self.length
        hidden, start = self._take_candidate(int(token_ids[0]), position)
        if hidden is None:
            hidden = self.decoder.embed(token_ids, self._at(position))
        lower = range(start, self.pipeline_layer + 1)
        hidden = self.decoder.through(lower, hidden, positions=self._at(position), mask=None, cache=self.cache)
        # the exit at pipeline_layer starts the next token's candidates (start never passes it: precomputed <= it)
        guesses = self.decoder.logits(hidden)[0, 0].topk(self.candidate_count).indices
        self._start_candidates(guesses.tolist(), position + 1)
        upper = range(self.pipeline_layer + 1, self.layer_count)
        hidden = self.decoder.through(upper, hidden, positions=self._at(position), mask=None, cache=self.cache)
        self.critical_layers.append(self.layer_count - start)
        return self.decoder.logits(hidden)[0]

    def keep(self, prefix: int, rows: list[int]) -> None:
        if prefix + len(rows) < self.length:  # only a longer block is ever rolled back; it has no candidates
            super().keep(prefix, rows)

    def _at(self, position: int) -> torch.Tensor:
        return torch.tensor([[position]], device=self.device)

    def _start_candidates(self, tokens: list[int], position: int) -> None:
        """The candidates through the first `precomputed` layers, as k rows at `position` that see the cache
        but not each other."""
        block = Block(position, torch.eye(len(tokens), dtype=torch.bool))  # depth 0 each: all at `position`
        positions = block.positions[None].to(self.device)
        hidden = self.decoder.embed(torch.tensor(tokens), positions)
        hidden = self.decoder.through(range(self.precomputed), hidden, positions=positions,
                                      mask=block.mask(self.dtype, self.device), cache=self.cache)
        self.candidates = Candidates(tokens, hidden)
        self.candidate_rows += len(tokens) * self.precomputed

    def _take_candidate(self, token: int, position: int) -> tuple[torch.Tensor | None, int]:
        """(hidden (1, 1, d), first layer still to run) of the token if it was a candidate, else (None, 0);
        the other candidates' rows leave the cache."""
        candidates, self.candidates = self.candidates, None
        if candidates is None:
            return None, 0
        lower = range(self.precomputed)
        if token not in candidates.tokens:
            kv.crop(self.cache, position, layers=lower)
            return None, 0
        row = candidates.tokens.index(token)
        kv.compact(self.cache, torch.cat([torch.arange(position), torch.tensor([position + row])]), layers=lower)
        return candidates.hidden[:, row : row + 1], self.precomputed

    def describe(self) -> dict:
        """What pipelining would save (critical-path layers, hit rate) and what it spent (compute)."""
        decoded = self.critical_layers
        if not decoded:
            return {"mean_layers": float(self.layer_count), "layers": self.layer_count, "hit_rate": 0.0, "compute": 1.0}
        hits = sum(layers < self.layer_count for layers in decoded)
        main_rows = sum(decoded)
        return {"mean_layers": main_rows / len(decoded), "layers": self.layer_count, "hit_rate": hits / len(decoded),
                "compute": (main_rows + self.candidate_rows) / (self.layer_count * len(decoded))}


@dataclass(frozen=True)
class PipelineOptions(MethodOptions):
    pipeline_layer: int | None = None  # the exit whose candidates start early (None: the middle layer)
    candidates: int = 3  # next-token candidates started per step


def make_runner(model, *, pipeline_layer, candidates) -> PipelinedRunner:
    layer_count = model.config.num_hidden_layers
    pipeline_layer = layer_count // 2 if pipeline_layer is None else pipeline_layer
    if not 1 <= pipeline_layer < layer_count - 1:
        raise InputError(f"ppd: pipeline_layer must be in 1..{layer_count - 2} (a layer with layers below and above "
                         f"it), got {pipeline_layer}")
    if not 1 <= candidates <= model.config.vocab_size:
        raise InputError(f"ppd: candidates must be in 1..{model.config.vocab_size}, got {candidates}")
    return PipelinedRunner(model, pipeline_layer, candidates)


register(
    MethodSpec(
        name="ppd",
        family="early-exit",
        lossless="distribution-exact",
        paper="Yang et al. 2023, arXiv:2307.05908",
        summary="an early exit's top-k candidates for the next token start their forwards before the current "
                "one ends; the last layer's choice keeps its candidate (saves latency on pipelining hardware)",
        drafter=Part(no_drafter),
        runner=Part(lambda model, options: make_runner(model, **options.as_dict()), PipelineOptions),
    )
)
