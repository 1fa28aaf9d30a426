"""NAT-CRF (Sun, Li, Wang, He, Lin & Deng 2019, "Fast Structured Decoding for Sequence Models", NeurIPS): a
non-autoregressive Transformer whose per-position outputs are the emission scores of a linear-chain conditional
random field over the target, so that one parallel pass plus a cheap dynamic programme decide tokens that agree
with their neighbours.

The paper's model:

- p(y | x) = exp(sum_i s(y_i, x, i) + sum_{i>1} t(y_{i-1}, y_i, x)) / Z(x): the emission s(·, x, i) is the NAT
  decoder's logit vector at position i; the transition t(a, b) = M[a, b] scores token b right after token a.
- Low-rank approximation: a full |V| x |V| matrix M is too large, so M = E1 E2^T with E1, E2 of shape
  |V| x rank (the paper: rank 32).
- Beam approximation: Z(x) sums over |V|^n sequences; the forward algorithm costs O(n |V|^2), still too much.
  Only the top-k tokens of each position by emission take part (the paper: k = 64), which makes Z(x) an
  O(n k^2) forward pass over a k-token lattice; in training the gold token is always put in its position's beam,
  so the gold path is one of the summed paths.
- Dynamic transition (NART-DCRF): the transition between positions i and i+1 depends on their decoder states:
  M_i = E1 f([h_i, h_{i+1}]) E2^T, where f maps the two states to a rank x rank matrix (`dynamic=True`).
- Training maximises the CRF log-likelihood of the target (beam-approximated Z); decoding is one parallel pass
  for the emissions, then Viterbi over the k-token lattice, O(n k^2). The paper also rescores several length
  candidates with an autoregressive teacher.

Here: the decoder inputs are Gu et al.'s uniform copy of the source embeddings at the length the backbone's
length predictor gives (nat.NATModel with decoder_inputs="uniform"). This model inherits NATModel's length
candidates, and decoding goes through `decode_fertilities`, so nat.noisy_parallel_decode (rescoring several
lengths with the AR student) works on it unchanged. The loss is the CRF negative log-likelihood per target
token (each row's NLL divided by its length, as fairseq's re-implementation of the paper does) plus the length
predictor's cross-entropy. `token_loss_weight` > 0 adds the plain NAT per-position cross-entropy of the
emissions (fairseq's co-training, weight 0.5 there); it is 0 by default, so the default loss is the CRF's alone.

Where this departs from the paper, and why:
- Length: the shared length predictor, not the paper's own length prediction, so that every method of
  accelgen.nar decodes at lengths predicted the same way and comparisons measure the decoding.
- E2 (and so every transition) starts at zero: an untrained model is exactly the plain NAT, and the
  transitions move away from zero only as far as training asks (this implementation's choice of
  initialisation).
- In training the beam is the top-k of the raw emissions plus the gold token; at decoding the specials and EOS
  are excluded first (the length is decided), as nat.py's argmax does.
- f of the dynamic transition is one tanh layer of the model's width, then a linear map to rank x rank: a small
  network of this implementation's choosing, not a reproduction of the paper's.
"""

from __future__ import annotations

import torch
from torch import nn

from accelgen.errors import InputError
from accelgen.nar.backbone import BackboneConfig, length_loss, masked_cross_entropy
from accelgen.nar.nat import NATModel, uniform_fertilities
from accelgen.nar.tokens import EOS, NEVER_GENERATED

DECODINGS = ("viterbi", "argmax")


# --- the linear-chain CRF over a k-token lattice (pure functions) -------------------------------------------------


def check_prefix_mask(mask: torch.Tensor) -> None:
    """mask (B, L) bool: a ValueError unless every row is a non-empty run of True followed by padding."""
    if mask.shape[1] == 0 or not mask[:, 0].all():
        raise InputError("every row of a CRF's mask needs at least one real position, at the start")
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise InputError("a CRF's mask must be right-padded: True on a prefix of each row, then False")


def check_lattice(emissions: torch.Tensor, transitions: torch.Tensor, mask: torch.Tensor) -> None:
    rows, length, beam = emissions.shape
    if transitions.shape != (rows, max(length - 1, 0), beam, beam) or mask.shape != (rows, length):
        raise InputError(f"emissions {tuple(emissions.shape)} (B, L, k) need transitions (B, L-1, k, k) and mask "
                         f"(B, L); got {tuple(transitions.shape)} and {tuple(mask.shape)}")
    check_prefix_mask(mask)


def crf_log_partition(emissions: torch.Tensor, transitions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log Z: the log-sum-exp of the scores of every path through the lattice, by the forward algorithm in
    O(L k^2). emissions (B, L, k): the score of candidate j at position i; transitions (B, L-1, k, k): [b, i, a, c]
    scores candidate a at position i followed by candidate c at position i+1; mask (B, L) bool, right-padded
    -> (B,)."""
    check_lattice(emissions, transitions, mask)
    forward = emissions[:, 0]  # (B, k): log-sum of the paths ending in each candidate of position 0
    for position in range(1, emissions.shape[1]):
        extended = (forward.unsqueeze(2) + transitions[:, position - 1]).logsumexp(dim=1) + emissions[:, position]
        forward = torch.where(mask[:, position:position + 1], extended, forward)  # a finished row keeps its sums
    return forward.logsumexp(dim=1)


def path_score(emissions: torch.Tensor, transitions: torch.Tensor, path: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """The score of one path per row: emissions (B, L, k), transitions (B, L-1, k, k), path (B, L) (the candidate
    index at each position; any value at padding), mask (B, L) bool -> (B,): its emissions plus the transitions
    between its consecutive real positions."""
    check_lattice(emissions, transitions, mask)
    path = path.masked_fill(~mask, 0)  # padding indices are read but never counted
    emitted = emissions.gather(2, path.unsqueeze(2)).squeeze(2)  # (B, L)
    score = (emitted * mask).sum(dim=1)
    if emissions.shape[1] > 1:
        from_rows = transitions.gather(2, path[:, :-1, None, None].expand(-1, -1, 1, transitions.shape[3]))
        stepped = from_rows.squeeze(2).gather(2, path[:, 1:, None]).squeeze(2)  # (B, L-1)
        score = score + (stepped * mask[:, 1:]).sum(dim=1)
    return score


def viterbi(emissions: torch.Tensor, transitions: torch.Tensor,
            mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The best path through the lattice in O(L k^2): emissions (B, L, k), transitions (B, L-1, k, k), mask (B, L)
    bool, right-padded -> (best candidate indices (B, L), 0 at padding; their path scores (B,))."""
    check_lattice(emissions, transitions, mask)
    rows, length, beam = emissions.shape
    best = emissions[:, 0]  # (B, k): the best score of a path ending in each candidate
    stay = torch.arange(beam, device=emissions.device).expand(rows, beam)
    backpointers = []  # per step (B, k): the best predecessor of each candidate
    for position in range(1, length):
        step_scores, predecessors = (best.unsqueeze(2) + transitions[:, position - 1]).max(dim=1)
        real = mask[:, position:position + 1]
        best = torch.where(real, step_scores + emissions[:, position], best)
        backpointers.append(torch.where(real, predecessors, stay))  # at padding: the path stays where it is
    scores, last = best.max(dim=1)
    path = [last]
    for pointers in reversed(backpointers):
        path.append(pointers.gather(1, path[-1].unsqueeze(1)).squeeze(1))
    return torch.stack(path[::-1], dim=1).masked_fill(~mask, 0), scores


# --- the beam approximation and the low-rank transitions (pure functions) -----------------------------------------


def beam_candidates(emissions: torch.Tensor, beam: int, targets: torch.Tensor | None = None) -> torch.Tensor:
    """emissions (B, L, V) -> token ids (B, L, beam): each position's `beam` highest-scoring tokens, best first;
    with targets (B, L), each position's target token is forced in, first (in place of the lowest of the others
    when it is not already among them), so that the gold path is one of the lattice's."""
    if not 1 <= beam <= emissions.shape[-1]:
        raise InputError(f"beam must be in 1..{emissions.shape[-1]} (the vocabulary), got {beam}")
    ranking = emissions.detach()  # which tokens take part is a choice, not something to differentiate
    if targets is not None:
        ranking = ranking.scatter(2, targets.unsqueeze(2), float("inf"))
    return ranking.topk(beam, dim=2).indices


def low_rank_transitions(candidates: torch.Tensor, previous_embedding: torch.Tensor, next_embedding: torch.Tensor,
                         dynamic: torch.Tensor | None = None) -> torch.Tensor:
    """The transitions of the lattice of candidates (B, L, k) (token ids) under M = E1 E2^T: previous_embedding
    E1 (V, rank) embeds the token at position i, next_embedding E2 (V, rank) the token at i+1; dynamic
    (B, L-1, rank, rank), when given, is the dynamic CRF's per-position matrix: M_i = E1 dynamic_i E2^T
    -> (B, L-1, k, k), [b, i, a, c] = M_i[candidates[b, i, a], candidates[b, i+1, c]]."""
    previous = previous_embedding[candidates[:, :-1]]  # (B, L-1, k, rank)
    following = next_embedding[candidates[:, 1:]]  # (B, L-1, k, rank)
    if dynamic is not None:
        previous = previous @ dynamic
    return previous @ following.transpose(2, 3)


def beam_log_likelihood(emissions: torch.Tensor, targets: torch.Tensor, target_mask: torch.Tensor,
                        previous_embedding: torch.Tensor, next_embedding: torch.Tensor, beam: int,
                        dynamic: torch.Tensor | None = None) -> torch.Tensor:
    """log p(targets | x) of the CRF with emissions (B, L, V) and transitions E1 (V, rank) E2^T (dynamic
    (B, L-1, rank, rank) between them when given), Z summed over the lattice of each position's top-`beam` tokens
    plus its target token; targets (B, L), target_mask (B, L) bool, right-padded -> (B,). Exact when beam = V."""
    candidates = beam_candidates(emissions, beam, targets)  # (B, L, k)
    lattice_emissions = emissions.gather(2, candidates)
    transitions = low_rank_transitions(candidates, previous_embedding, next_embedding, dynamic)
    gold = (candidates == targets.unsqueeze(2)).int().argmax(dim=2)  # the target's place in its beam
    return path_score(lattice_emissions, transitions, gold, target_mask) - \
        crf_log_partition(lattice_emissions, transitions, target_mask)


def beam_viterbi(emissions: torch.Tensor, target_mask: torch.Tensor, previous_embedding: torch.Tensor,
                 next_embedding: torch.Tensor, beam: int,
                 dynamic: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CRF's best tokens among each position's top-`beam` by emission: emissions (B, L, V) (-inf on tokens
    that must not be chosen), target_mask (B, L) bool, E1, E2 (V, rank), dynamic (B, L-1, rank, rank) or None
    -> (token ids (B, L), 0 at padding; path scores (B,))."""
    candidates = beam_candidates(emissions, beam)
    transitions = low_rank_transitions(candidates, previous_embedding, next_embedding, dynamic)
    path, scores = viterbi(emissions.gather(2, candidates), transitions, target_mask)
    return candidates.gather(2, path.unsqueeze(2)).squeeze(2).masked_fill(~target_mask, 0), scores


# --- the model -------------------------------------------------------------------------------------------------


class CRFModel(NATModel):
    """NAT-CRF: nat.py's uniform-copy NAT, its logits the emissions of a low-rank, beam-approximated CRF.

    rank: the width of E1, E2 (M = E1 E2^T); beam: the tokens per position in the lattice of Z (training) and of
    Viterbi (decoding), all of them when it exceeds the vocabulary (the exact CRF); dynamic: the dynamic
    transition M_i = E1 f([h_i, h_{i+1}]) E2^T; token_loss_weight: the weight of the emissions' per-position
    cross-entropy added to the loss (0: none)."""

    method = "nat-crf"

    def __init__(self, config: BackboneConfig, rank: int = 32, beam: int = 64, dynamic: bool = False,
                 token_loss_weight: float = 0.0):
        super().__init__(config, decoder_inputs="uniform")
        if rank < 1:
            raise InputError(f"rank (of the transition factors E1, E2) must be >= 1, got {rank}")
        if beam < 1:
            raise InputError(f"beam (tokens per position in the CRF's lattice) must be >= 1, got {beam}")
        if not token_loss_weight >= 0:
            raise InputError(f"token_loss_weight must be >= 0, got {token_loss_weight}")
        self.rank, self.beam, self.dynamic, self.token_loss_weight = rank, beam, bool(dynamic), float(token_loss_weight)
        self.lattice_size = min(beam, config.vocab_size)  # a beam wider than the vocabulary: all of it (exact CRF)
        # E1 random, E2 zero: every transition starts at 0, the CRF starts as the plain NAT (see the docstring)
        self.previous_embedding = nn.Parameter(torch.randn(config.vocab_size, rank) * rank ** -0.5)
        self.next_embedding = nn.Parameter(torch.zeros(config.vocab_size, rank))
        if self.dynamic:  # f([h_i, h_{i+1}]) -> the rank x rank matrix between E1 and E2
            self.dynamic_transition = nn.Sequential(nn.Linear(2 * config.width, config.width), nn.Tanh(),
                                                    nn.Linear(config.width, rank * rank))

    def options(self) -> dict:
        return {"rank": self.rank, "beam": self.beam, "dynamic": self.dynamic,
                "token_loss_weight": self.token_loss_weight}

    def dynamic_matrices(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden (B, T, width) -> the dynamic CRF's matrices (B, T-1, rank, rank) of [h_i, h_{i+1}], or None
        (static transitions)."""
        if not self.dynamic:
            return None
        pairs = torch.cat([hidden[:, :-1], hidden[:, 1:]], dim=2)  # (B, T-1, 2 width)
        return self.dynamic_transition(pairs).unflatten(2, (self.rank, self.rank))

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The CRF's negative log-likelihood per target token (beam-approximated Z) given the uniform copy of the
        true length, plus the length predictor's cross-entropy (plus token_loss_weight times the emissions'
        per-position cross-entropy)."""
        src, src_mask, tgt, tgt_mask = batch["src"], batch["src_mask"], batch["tgt"], batch["tgt_mask"]
        memory = self.backbone.encode(src, src_mask)
        fertility = uniform_fertilities(src_mask.sum(dim=1), tgt_mask.sum(dim=1), src.shape[1])
        hidden, _ = self.parallel_hidden(src, src_mask, memory, fertility, width=tgt.shape[1])
        emissions = self.backbone.logits(hidden)  # (B, T, V)
        log_likelihood = beam_log_likelihood(emissions, tgt, tgt_mask, self.previous_embedding, self.next_embedding,
                                             self.lattice_size, self.dynamic_matrices(hidden))
        crf = (-log_likelihood / tgt_mask.sum(dim=1)).mean()
        lengths = length_loss(self.backbone, memory, src_mask, tgt_mask)
        total = crf + lengths
        metrics = {"crf_loss": float(crf.detach()), "length_loss": float(lengths.detach())}
        if self.token_loss_weight:
            tokens = masked_cross_entropy(emissions, tgt, tgt_mask)
            total = total + self.token_loss_weight * tokens
            metrics["token_loss"] = float(tokens.detach())
        return total, metrics

    def decode_fertilities(self, src_ids: torch.Tensor, src_mask: torch.Tensor, memory: torch.Tensor,
                           fertility: torch.Tensor, decoding: str = "viterbi") -> tuple[torch.Tensor, torch.Tensor]:
        """One parallel pass at the length of fertility (B, S) (its total, at most max_target_len), then Viterbi
        over each position's top-`beam` tokens ("argmax": NATModel's per-position argmax of the same emissions,
        the CRF ignored) -> (tokens (B, T), mask (B, T))."""
        if decoding not in DECODINGS:
            raise InputError(f"decoding must be one of {DECODINGS}, got {decoding!r}")
        if decoding == "argmax":
            return super().decode_fertilities(src_ids, src_mask, memory, fertility)
        width = min(max(int(fertility.sum(dim=1).max()), 1), self.config.max_target_len)
        hidden, target_mask = self.parallel_hidden(src_ids, src_mask, memory, fertility, width)
        emissions = self.backbone.logits(hidden)
        emissions[..., list(NEVER_GENERATED) + [EOS]] = float("-inf")  # the length is decided: no EOS either
        tokens, _ = beam_viterbi(emissions, target_mask, self.previous_embedding, self.next_embedding,
                                 self.lattice_size, self.dynamic_matrices(hidden))
        return tokens, target_mask

    @torch.no_grad()
    def generate(self, src_ids: torch.Tensor, src_mask: torch.Tensor, decoding: str = "viterbi") -> list[list[int]]:
        """The target ids of each source (B, S): the most likely length, one parallel pass, then Viterbi over the
        beam lattice ("argmax": each position's most likely emission instead, for comparison)."""
        memory = self.backbone.encode(src_ids, src_mask)
        fertility = self.fertility_candidates(memory, src_mask)[:, 0]
        tokens, mask = self.decode_fertilities(src_ids, src_mask, memory, fertility, decoding)
        return [row[row_mask].tolist() for row, row_mask in zip(tokens, mask)]
