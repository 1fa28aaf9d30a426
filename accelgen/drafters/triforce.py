"""TriForce (Sun et al. 2024, arXiv:2404.11912): hierarchical speculation for long contexts.

With a long context, reading the KV cache can cost more than reading the weights. TriForce drafts with the
target's own weights over a small *retrieved* part of its KV cache, and speculates on that draft with a
small model whose cache is a StreamingLLM window:

    small draft model, StreamingLLM cache (the first `sink` positions + the last `window`)
        │ proposes `stage_two_tokens` tokens per forward to
    the target over a retrieval cache (`budget` positions of its prompt + everything generated since)
        │ drafts `gamma` tokens for
    the target over its full cache: verification, so the output is the target's own (lossless)

Retrieval cache. Once the prompt is in the target's cache (the first step only reads it), the root's query
at each layer scores chunks of `chunk_size` prompt positions by its dot product with the chunk's mean key
(summed over heads); the best budget // chunk_size chunks of each layer are kept, and every position after
the prompt is added as it is generated. The query comes from one forward of the root over a copy of the full
cache. Before each draft the retrieval cache is gathered afresh from the target's cache, so it holds the
target's exact keys and values; its newest tokens keep their true positions (`ModelRunner.position_offset`).

The middle level decodes speculatively (stage_two.py): the small model proposes its greedy tokens, a
deterministic function of the context, and the retrieval-cache draft checks them with the target's own
rule (greedy match, or speculative sampling against a point mass), so the middle's tokens are exactly those it
would produce alone, greedy or sampled, each with the distribution it was drawn from for the final
verification.

On this CPU a 1.5B model's forward is bound by reading its weights until contexts of many thousand tokens,
so the middle level costs about what a target step costs: TriForce pays where the KV cache dominates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen import cache as kv
from accelgen.draft import Draft
from accelgen.drafters.draft_decoding import decode_draft, shared_prefix
from accelgen.drafters.base import BuildContext, Drafter
from accelgen.drafters.budget import AUTO_LENGTH, draft_length
from accelgen.drafters.draft_model import check_vocabularies
from accelgen.drafters.stage_two import SelfSpeculatingDraftModel
from accelgen.errors import InputError
from accelgen.models.runner import ModelRunner
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.sampling import SamplingConfig

USUAL_GAMMA = 6  # the draft length with gamma="auto", capped each step by the measured costs


def chunk_scores(query: torch.Tensor, keys: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Score of each whole chunk of keys: Σ over heads of query · (mean key of the chunk).

    query: (heads, head_dim) one token's query per attention head; keys: (kv_heads, n, head_dim) with heads a
    multiple of kv_heads (grouped-query attention: consecutive query heads share a key head). Returns (n // chunk_size,).
    """
    kv_heads, n, head_dim = keys.shape
    chunks = n // chunk_size
    means = keys[:, : chunks * chunk_size].reshape(kv_heads, chunks, chunk_size, head_dim).float().mean(dim=2)
    grouped = query.float().reshape(kv_heads, -1, head_dim).sum(dim=1)  # (kv_heads, head_dim): summed over each group
    return torch.einsum("hd,hcd->c", grouped, means)


def retrieved_positions(scores: torch.Tensor, chunk_size: int, budget: int, prompt: int) -> torch.Tensor:
    """The positions of the best-scoring chunks under the budget, plus the prompt's incomplete last chunk, in order."""
    chosen = torch.topk(scores, min(budget // chunk_size, len(scores))).indices.sort().values
    positions = (chosen[:, None] * chunk_size + torch.arange(chunk_size)).reshape(-1)
    return torch.cat([positions, torch.arange(len(scores) * chunk_size, prompt)])


class StreamingProposer:
    """TriForce's lowest level: a small model's greedy tokens, over a StreamingLLM cache that keeps the first
    `sink` positions and the last `window` (older ones are evicted; the rest keep their true positions)."""

    def __init__(self, draft_model, sink: int, window: int):
        self.runner = ModelRunner(draft_model)
        self.sink = sink
        self.window = window
        self.cached_tokens: list[int] = []  # tokens the cache covers, in order

    def observe(self, context: list[int]) -> None:
        pass  # propose catches up on whatever it has not seen

    def propose(self, sequence: list[int], length: int) -> list[int]:
        if length <= 0:
            return []
        shared = shared_prefix(self.cached_tokens, sequence)
        if self.runner.position_offset and shared < self.sink + self.runner.position_offset:
            self.runner.reset()  # the sequence parts from what the cache holds inside the evicted positions
            self.cached_tokens = []
        tokens, _ = decode_draft(self.runner, self.cached_tokens, sequence, length)  # greedy
        self._evict()
        return tokens

    def _evict(self) -> None:
        held = kv.cache_length(self.runner.cache)
        if held <= self.sink + self.window:
            return
        keep = torch.cat([torch.arange(self.sink), torch.arange(held - self.window, held)])
        kv.compact(self.runner.cache, keep)
        self.runner.position_offset += held - len(keep)


class TriForceDrafter(Drafter):
    def __init__(self, target_model, target: ModelRunner | None, draft_model, sampling: SamplingConfig,
                 generator: torch.Generator | None, gamma: int = USUAL_GAMMA, stage_two_tokens: int = 4, budget: int = 256, chunk_size: int = 16, sink: int = 4,
                 window: int = 256):
        for name, value, least in (("gamma", gamma, 1), ("stage_two_tokens", stage_two_tokens, 1),
                                   ("chunk_size", chunk_size, 1), ("budget", budget, chunk_size),
                                   ("sink", sink, 0), ("window", window, 1)):
            if value < least:
                raise InputError(f"triforce: {name} must be >= {least}, got {value}")
        self.model = target_model
        self.sampling = sampling
        self.gamma = gamma
        self.budget = budget
        self.chunk_size = chunk_size
        self.middle = SelfSpeculatingDraftModel(ModelRunner(target_model), sampling, generator, stage_two_tokens,
                                                proposer=StreamingProposer(draft_model, sink, window))
        self.target = target  # the runner holding the target's KV cache, which the retrieval cache is gathered from
        self.retrieved: list[torch.Tensor] | None = None  # per layer: the prompt positions kept
        self.prompt = 0  # positions the retrieval chose from; later ones are all kept

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        """context: (L,) long, prompt + committed tokens."""
        if self.target is None:
            raise RuntimeError("triforce drafts from the target's KV cache: build it with the target's runner")
        cached = self.target.length
        count = min(self.gamma, max_nodes)
        if cached == 0 or cached < len(context) - 1 or count <= 0:
            return Draft.empty()  # the target is still reading the prompt
        context_ids = context.tolist()
        if self.retrieved is None:
            self.prompt = cached
            self.retrieved = self._retrieve(context_ids[-1])
        generated = torch.arange(self.prompt, cached)
        self.middle.runner.cache = kv.gather(self.target.cache, [torch.cat([kept, generated]) for kept in self.retrieved],
                                             self.model.config)
        self.middle.runner.position_offset = cached - kv.cache_length(self.middle.runner.cache)
        self.middle.cached_tokens = context_ids[:-1]
        tokens, logits = self.middle.chain(context_ids, count)  # logits: (count, vocab)
        tokens = torch.tensor(tokens, dtype=torch.long)
        return Draft.chain(tokens) if self.sampling.greedy else Draft.chain(tokens, self.middle.probs(logits))

    def update(self, draft, verdict, target_logits) -> None:
        pass  # the next proposal gathers its cache from the target's again

    @torch.inference_mode()
    def _retrieve(self, root: int) -> list[torch.Tensor]:
        """Per layer, the prompt positions whose chunks the root's query scores highest."""
        if self.prompt <= self.budget:
            return [torch.arange(self.prompt)] * len(self.target.cache.layers)  # it all fits
        queries = root_queries(self.model, self.target, root)
        return [retrieved_positions(chunk_scores(query, layer.keys[0], self.chunk_size), self.chunk_size, self.budget,
                                    self.prompt)
                for query, layer in zip(queries, self.target.cache.layers)]


def root_queries(model, target: ModelRunner, root: int) -> list[torch.Tensor]:
    """The root's query at each layer, (heads, head_dim) after rotary embedding: one forward of the root over a
    copy of the target's cache, reading each attention's input on the way (the target's cache is untouched)."""
    full = kv.gather(target.cache, [torch.arange(target.length)] * len(target.cache.layers), model.config)
    queries: list[torch.Tensor] = []

    def read_query(attention, args, kwargs):
        hidden = kwargs["hidden_states"]  # (1, 1, hidden): the normalized input of this attention
        query = attention.q_proj(hidden).view(1, 1, -1, attention.head_dim).transpose(1, 2)
        if hasattr(attention, "q_norm"):  # models that normalize queries per head (Qwen3)
            query = attention.q_norm(query.transpose(1, 2)).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]  # (1, 1, head_dim)
        query = query * cos[:, None] + rotate_half(query) * sin[:, None]
        queries.append(query[0, :, 0])

    decoder_layers = getattr(getattr(model, "model", None), "layers", None)
    if decoder_layers is None or not all(hasattr(layer, "self_attn") for layer in decoder_layers):
        raise InputError(f"triforce needs a Llama-style decoder (model.model.layers[i].self_attn); "
                         f"{type(model).__name__} is not one")
    hooks = [layer.self_attn.register_forward_pre_hook(read_query, with_kwargs=True) for layer in decoder_layers]
    try:
        model(input_ids=torch.tensor([[root]], device=model.device),
              position_ids=torch.tensor([[target.length]], device=model.device), use_cache=True,
              logits_to_keep=1, **{kv.cache_keyword(model): full})
    finally:
        for hook in hooks:
            hook.remove()
    return queries


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@dataclass(frozen=True)
class TriForceOptions(MethodOptions):
    gamma: int | str = AUTO_LENGTH  # tokens the retrieval-cache target drafts per step (AUTO_LENGTH: USUAL_GAMMA,
    # capped by the measured costs)
    stage_two_tokens: int = 4  # tokens the small model drafts for it per step
    budget: int = 256  # prompt positions the retrieval cache keeps ...
    chunk_size: int = 16  # ... in chunks of this many
    sink: int = 4  # the small model's StreamingLLM cache: first positions kept ...
    window: int = 256  # ... and the last


def _make(build: BuildContext, options: TriForceOptions) -> TriForceDrafter:
    check_vocabularies(build.target_model, build.draft_model)
    if not isinstance(build.draft_model, torch.nn.Module):
        raise InputError("triforce's small model keeps a StreamingLLM cache of its own, which needs its PyTorch model; "
                         "load the draft in a PyTorch format (draft weights bf16, int8, int4 or fp32; on the command "
                         "line --draft-weights auto picks the fastest of them for this method)")
    return TriForceDrafter(build.target_model, build.target, build.draft_model, build.sampling, build.generator,
                           **{**options.as_dict(), "gamma": draft_length(options.gamma, USUAL_GAMMA)})


register(
    MethodSpec(
        name="triforce",
        family="speculative",
        lossless="distribution-exact",
        paper="Sun et al. 2024, arXiv:2404.11912",
        summary="for long contexts: the target over a retrieved part of its own KV cache drafts, itself drafted for "
                "by a small model with a StreamingLLM cache; the full target verifies",
        drafter=Part(_make, TriForceOptions),
        needs=("draft_model",),
        draft_budget="measured",  # drafts capped by the measured costs unless the request fixes their length
        pytorch_draft=True,  # StreamingProposer: the small model's own StreamingLLM cache
    )
)
