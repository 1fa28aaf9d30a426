"""FlowSeq (Ma, Zhou, Li, Neubig & Hovy 2019, "FlowSeq: Non-Autoregressive Conditional Sequence Generation with
Generative Flow", EMNLP): every target token in one decoder pass, the dependencies between them carried by a
continuous latent sequence whose prior is a normalizing flow.

The model (section 3 of the paper), for a source x and a target y of T tokens:
- a latent z = (z_1 .. z_T), one d_z vector per target position;
- the prior p(z | x): z = f(ε; x) with ε ~ N(0, I), f an invertible flow conditioned on the source, so that
  log p(z | x) = log N(f⁻¹(z); 0, I) + log |det ∂f⁻¹(z)/∂z| (change of variables). Each flow step is, as in
  Glow, actnorm (a per-feature scale and bias), an invertible linear map over the features, and affine coupling
  layers: half of the features pass unchanged and set the scale and shift of the other half, through a network
  that attends to the other target positions and to the source; a step couples each half once. Padding positions
  are masked out of every layer and of the log-determinant, so a flow over T real positions is a bijection of
  R^(T·d_z);
- the posterior q(z | y, x) = Π_t N(z_t; μ_t, σ_t²): a Transformer layer over the target's embeddings that also
  attends to the source, then a linear map to μ and log σ²;
- the decoder p(y | z, x) = Π_t p(y_t | z, x): the shared backbone's decoder, every position at once (no
  attention mask), reading z projected to the model width;
- the length T from the backbone's length predictor (trained alongside, as the paper's length predictor is).

Training maximises the evidence lower bound
    log p(y | x) ≥ E_q[log p(y | z, x)] − KL(q(z | y, x) || p(z | x)),
with one reparameterised sample z = μ + σ·n per row (n drawn by `training_inputs` from the step's generator, so a
resumed run draws the same) and the KL estimated on that sample: log q(z | y, x) − log p(z | x), the prior's
density through the flow's inverse and its log-determinant. The loss is the negative ELBO per target token plus
the length predictor's cross-entropy.

Decoding (section 3.4):
- argmax decoding: the most likely length T*, ε = 0 (the mode of N(0, I)), z = f(ε; x), and each position's most
  likely token given z: one flow pass and one decoder pass;
- noisy parallel decoding (NPD): lengths T* − Δl .. T* + Δl and, for each, several ε ~ N(0, τ²I), all decoded
  in one pass, then scored by an autoregressive scorer (nat.Scorer, e.g. the AR student's `sequence_log_probs`)
  in one batched call; each source's best-scored candidate is the output.

Where this implementation departs from the paper, and why:
- the flow is a single scale (the paper's is multi-scale, factoring out half the features at each level) and its
  coupling layers split the features only into contiguous halves (the paper also splits alternately and along
  the time axis); its invertible linear map is a full d_z × d_z matrix in LU form (Glow's parameterisation, which
  keeps it invertible and its log-determinant exact) where the paper mixes within heads; couplings use Glow's
  sigmoid scale. Enough for a small latent, which is what the tiny shared backbone asks for;
- actnorm starts as the identity instead of the paper's data-dependent initialisation (one more pass over a
  batch before training that `train_model` does not make), and the posterior has no token dropout;
- in NPD the first ε of every length is 0, so the argmax candidate is always among those scored (the paper
  samples every ε); importance weighted decoding (the paper's third way) is not implemented;
- the latent is projected to the model width for the shared decoder (the paper's latent has the model's width).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from accelgen.errors import InputError
from accelgen.nar.backbone import BackboneConfig, MethodModel, length_loss
from accelgen.nar.nat import NoisyParallelDecoding, Scorer
from accelgen.nar.tokens import fixed_length_tokens, length_mask

# --- densities, lengths and tokens (pure functions) --------------------------------------------------------------


def standard_normal_log_density(values: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """values (B, T, D), target_mask (B, T) bool -> (B,): log N(values; 0, I) summed over each row's real
    positions."""
    per_position = -0.5 * (values.pow(2) + math.log(2 * math.pi)).sum(dim=-1)  # (B, T)
    return (per_position * target_mask).sum(dim=1)


def posterior_log_density(noise: torch.Tensor, log_variance: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """log q(z | y, x) of z = μ + σ·noise under the diagonal Gaussian N(μ, σ²): noise (B, T, D), log_variance
    (B, T, D) (log σ²), target_mask (B, T) -> (B,), summed over the real positions. (The density of z at μ + σ·n
    is the standard normal's at n divided by Π σ.)"""
    log_scales = 0.5 * (log_variance * target_mask.unsqueeze(-1)).sum(dim=(1, 2))
    return standard_normal_log_density(noise, target_mask) - log_scales


def length_candidates(best_lengths: torch.Tensor, window: int, max_length: int) -> torch.Tensor:
    """best_lengths (B,) -> (B, 2·window + 1): each best length first, then best − 1, best + 1, best − 2, ..., each
    clamped to 1..max_length (near the ends a length can repeat: it is then decoded with other noise)."""
    offsets = [0] + [sign * step for step in range(1, window + 1) for sign in (-1, 1)]
    shifted = best_lengths.unsqueeze(1) + torch.tensor(offsets, device=best_lengths.device)
    return shifted.clamp(1, max_length)


# --- the conditional flow ------------------------------------------------------------------------------------------


class Condition(NamedTuple):
    """What the coupling layers read besides the latents: the source and the target positions."""

    memory: torch.Tensor  # (B, S, width): the encoded source
    src_mask: torch.Tensor  # (B, S) bool
    positions: torch.Tensor  # (T, width): the flow's position embeddings of the T target positions


# Every layer maps latents -> noise (`inverse`, the direction of the density, which training takes) and noise ->
# latents (`forward`, the direction of sampling, which decoding takes); each returns (values (B, T, D), log|det| of
# its Jacobian (B,), summed over the real positions). Padding positions come out 0 either way.


class ActNorm(nn.Module):
    """A per-feature scale and bias (Glow's activation normalisation); the identity at first."""

    def __init__(self, features: int):
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros(features))
        self.bias = nn.Parameter(torch.zeros(features))

    def inverse(self, latents: torch.Tensor, target_mask: torch.Tensor,
                condition: Condition) -> tuple[torch.Tensor, torch.Tensor]:
        """latents (B, T, D), target_mask (B, T) -> (values, log-determinant)."""
        values = (latents * self.log_scale.exp() + self.bias) * target_mask.unsqueeze(-1)
        return values, self.log_scale.sum() * target_mask.sum(dim=1)

    def forward(self, noise: torch.Tensor, target_mask: torch.Tensor,
                condition: Condition) -> tuple[torch.Tensor, torch.Tensor]:
        """noise (B, T, D), target_mask (B, T) -> (values, log-determinant)."""
        values = (noise - self.bias) * (-self.log_scale).exp() * target_mask.unsqueeze(-1)
        return values, -self.log_scale.sum() * target_mask.sum(dim=1)


class InvertibleLinear(nn.Module):
    """An invertible D × D map of each position's features, W = P·L·(U + diag(sign·exp(log_diagonal))) (Glow's LU
    form: P a fixed permutation, L unit lower-triangular, U strictly upper-triangular), so that W stays invertible
    and log |det W| = Σ log_diagonal exactly. Starts as a random rotation."""

    def __init__(self, features: int):
        super().__init__()
        rotation = torch.linalg.qr(torch.randn(features, features))[0]
        permutation, lower, upper = torch.linalg.lu(rotation)
        diagonal = upper.diagonal()
        self.register_buffer("permutation", permutation)  # fixed, but saved with the weights
        self.register_buffer("sign", diagonal.sign())
        self.lower = nn.Parameter(lower.tril(-1))
        self.upper = nn.Parameter(upper.triu(1))
        self.log_diagonal = nn.Parameter(diagonal.abs().log())

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(L, U') with W = P·L·U': L unit lower-triangular, U' upper-triangular with the signed diagonal."""
        identity = torch.eye(len(self.sign), device=self.sign.device, dtype=self.lower.dtype)
        lower = self.lower.tril(-1) + identity  # tril: only the strict lower part is a free parameter
        upper = self.upper.triu(1) + torch.diag(self.sign * self.log_diagonal.exp())
        return lower, upper

    def inverse(self, latents: torch.Tensor, target_mask: torch.Tensor,
                condition: Condition) -> tuple[torch.Tensor, torch.Tensor]:
        """latents (B, T, D), target_mask (B, T) -> (W·latents at each position, log-determinant)."""
        lower, upper = self.factors()
        weight = self.permutation @ lower @ upper
        return latents @ weight.T, self.log_diagonal.sum() * target_mask.sum(dim=1)

    def forward(self, noise: torch.Tensor, target_mask: torch.Tensor,
                condition: Condition) -> tuple[torch.Tensor, torch.Tensor]:
        """noise (B, T, D), target_mask (B, T) -> (W⁻¹·noise at each position, log-determinant): two triangular
        solves, exact where an inverted matrix would round."""
        lower, upper = self.factors()
        columns = self.permutation.T @ noise.reshape(-1, noise.shape[-1]).T  # (D, B·T): P⁻¹ = Pᵀ
        columns = torch.linalg.solve_triangular(lower, columns, upper=False, unitriangular=True)
        columns = torch.linalg.solve_triangular(upper, columns, upper=True)
        return columns.T.reshape(noise.shape), -self.log_diagonal.sum() * target_mask.sum(dim=1)


class AffineCoupling(nn.Module):
    """One half of the features (`transformed`: 0 the first, 1 the second) scaled and shifted by amounts that a
    Transformer layer computes from the other half: the half's values attend to every real target position and
    to the source. The scale is Glow's sigmoid(h + 2): in (0, 1), so the density direction never divides by it.
    The last layer starts at zero: every coupling starts as the same fixed scaling."""

    def __init__(self, features: int, config: BackboneConfig, transformed: int):
        super().__init__()
        half = features // 2
        self.transformed = transformed
        self.kept_slice = slice(half, features) if transformed == 0 else slice(0, half)
        self.changed_slice = slice(0, half) if transformed == 0 else slice(half, features)
        kept_features = features - half if transformed == 0 else half
        changed_features = features - kept_features
        self.input = nn.Linear(kept_features, config.width)
        self.layer = nn.TransformerDecoderLayer(config.width, config.heads, config.feedforward, config.dropout,
                                                batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(config.width)
        self.output = nn.Linear(config.width, 2 * changed_features)
        nn.init.zeros_(self.output.weight)
        nn.init.zeros_(self.output.bias)

    def scale_and_shift(self, kept: torch.Tensor, target_mask: torch.Tensor,
                        condition: Condition) -> tuple[torch.Tensor, torch.Tensor]:
        """kept (B, T, D_kept), target_mask (B, T) -> (log scale, shift), each (B, T, D_changed), 0 at padding."""
        hidden = self.input(kept) + condition.positions
        hidden = self.layer(hidden, condition.memory, tgt_key_padding_mask=~target_mask,
                            memory_key_padding_mask=~condition.src_mask)
        raw_scale, shift = self.output(self.norm(hidden)).chunk(2, dim=-1)
        real = target_mask.unsqueeze(-1)
        return nn.functional.logsigmoid(raw_scale + 2.0) * real, shift * real

    def inverse(self, latents: torch.Tensor, target_mask: torch.Tensor,
                condition: Condition) -> tuple[torch.Tensor, torch.Tensor]:
        """latents (B, T, D), target_mask (B, T) -> (values, log-determinant): changed · scale + shift."""
        kept = latents[..., self.kept_slice] * target_mask.unsqueeze(-1)
        log_scale, shift = self.scale_and_shift(kept, target_mask, condition)
        changed = (latents[..., self.changed_slice] * log_scale.exp() + shift) * target_mask.unsqueeze(-1)
        return self.join(kept, changed), log_scale.sum(dim=(1, 2))

    def forward(self, noise: torch.Tensor, target_mask: torch.Tensor,
                condition: Condition) -> tuple[torch.Tensor, torch.Tensor]:
        """noise (B, T, D), target_mask (B, T) -> (values, log-determinant): (changed − shift) / scale."""
        kept = noise[..., self.kept_slice] * target_mask.unsqueeze(-1)
        log_scale, shift = self.scale_and_shift(kept, target_mask, condition)
        changed = (noise[..., self.changed_slice] - shift) * (-log_scale).exp() * target_mask.unsqueeze(-1)
        return self.join(kept, changed), -log_scale.sum(dim=(1, 2))

    def join(self, kept: torch.Tensor, changed: torch.Tensor) -> torch.Tensor:
        """The two halves (B, T, ·) back in feature order -> (B, T, D)."""
        return torch.cat([changed, kept] if self.transformed == 0 else [kept, changed], dim=-1)


class ConditionalFlow(nn.Module):
    """f(ε; x): `steps` steps of actnorm, invertible linear map and two affine couplings (each half transformed
    once), over D features at each target position, conditioned on the source. `forward` maps noise to latents,
    `inverse` latents to noise; both return the log |det| of their own Jacobian (B,), over the real positions."""

    def __init__(self, features: int, config: BackboneConfig, steps: int):
        super().__init__()
        self.max_positions = config.max_target_len + 1
        self.positions = nn.Embedding(self.max_positions, config.width)
        layers: list[nn.Module] = []
        for _ in range(steps):  # in the density direction (latents -> noise), Glow's order
            layers += [ActNorm(features), InvertibleLinear(features), AffineCoupling(features, config, 1),
                       AffineCoupling(features, config, 0)]
        self.layers = nn.ModuleList(layers)

    def condition(self, memory: torch.Tensor, src_mask: torch.Tensor, length: int) -> Condition:
        """memory (B, S, width), src_mask (B, S) -> what the couplings of a T = length flow read."""
        if length > self.max_positions:
            raise InputError(f"the flow was asked for {length} positions but has {self.max_positions} "
                             f"(max_target_len + 1)")
        return Condition(memory, src_mask, self.positions(torch.arange(length, device=memory.device)))

    def inverse(self, latents: torch.Tensor, target_mask: torch.Tensor, memory: torch.Tensor,
                src_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latents (B, T, D), target_mask (B, T) bool, memory (B, S, width), src_mask (B, S) -> (noise (B, T, D),
        log |det ∂noise/∂latents| (B,))."""
        condition = self.condition(memory, src_mask, latents.shape[1])
        values = latents * target_mask.unsqueeze(-1)
        total = latents.new_zeros(len(latents))
        for layer in self.layers:
            values, log_det = layer.inverse(values, target_mask, condition)
            total = total + log_det
        return values, total

    def forward(self, noise: torch.Tensor, target_mask: torch.Tensor, memory: torch.Tensor,
                src_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """noise (B, T, D), target_mask (B, T) bool, memory (B, S, width), src_mask (B, S) -> (latents (B, T, D),
        log |det ∂latents/∂noise| (B,))."""
        condition = self.condition(memory, src_mask, noise.shape[1])
        values = noise * target_mask.unsqueeze(-1)
        total = noise.new_zeros(len(noise))
        for layer in reversed(self.layers):
            values, log_det = layer(values, target_mask, condition)
            total = total + log_det
        return values, total

    def log_prob(self, latents: torch.Tensor, target_mask: torch.Tensor, memory: torch.Tensor,
                 src_mask: torch.Tensor) -> torch.Tensor:
        """log p(z | x) (B,) of latents (B, T, D) over the real positions of target_mask (B, T): the standard
        normal's density of f⁻¹(z) times |det ∂f⁻¹/∂z| (change of variables)."""
        noise, log_det = self.inverse(latents, target_mask, memory, src_mask)
        return standard_normal_log_density(noise, target_mask) + log_det


class Posterior(nn.Module):
    """q(z | y, x): a Transformer layer over the target embeddings (attending to every target token and to the
    source), then each position's mean and log-variance."""

    def __init__(self, config: BackboneConfig, latent_dim: int):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(config.width, config.heads, config.feedforward, config.dropout,
                                                batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(config.width)
        self.output = nn.Linear(config.width, 2 * latent_dim)

    def forward(self, target_embeddings: torch.Tensor, target_mask: torch.Tensor, memory: torch.Tensor,
                src_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """target_embeddings (B, T, width) (with positions), target_mask (B, T), memory (B, S, width), src_mask
        (B, S) -> (mean, log-variance), each (B, T, latent_dim)."""
        hidden = self.layer(target_embeddings, memory, tgt_key_padding_mask=~target_mask,
                            memory_key_padding_mask=~src_mask)
        mean, log_variance = self.output(self.norm(hidden)).chunk(2, dim=-1)
        return mean, log_variance


# --- the model -------------------------------------------------------------------------------------------------


class FlowSeqModel(MethodModel):
    method = "flowseq"

    def __init__(self, config: BackboneConfig, latent_dim: int = 32, flow_steps: int = 2):
        super().__init__(config)
        if latent_dim < 2 or latent_dim % 2:
            raise InputError(f"latent_dim must be an even number >= 2 (the couplings split it in halves), "
                             f"got {latent_dim}")
        if flow_steps < 1:
            raise InputError(f"flow_steps must be >= 1, got {flow_steps}")
        self.latent_dim, self.flow_steps = latent_dim, flow_steps
        self.posterior = Posterior(config, latent_dim)
        self.prior_flow = ConditionalFlow(latent_dim, config, flow_steps)
        self.latent_to_width = nn.Linear(latent_dim, config.width)  # the decoder reads z at the model's width

    def options(self) -> dict:
        return {"latent_dim": self.latent_dim, "flow_steps": self.flow_steps}

    def training_inputs(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The batch with "posterior_noise" (B, T, latent_dim) ~ N(0, I): the reparameterisation's noise of each
        row's one posterior sample (unless the batch brings its own)."""
        if "posterior_noise" in batch:
            return batch
        rows, width = batch["tgt"].shape
        noise = torch.randn((rows, width, self.latent_dim), generator=generator)
        return {**batch, "posterior_noise": noise.to(batch["tgt"].device)}

    def posterior_parameters(self, tgt_ids: torch.Tensor, tgt_mask: torch.Tensor, memory: torch.Tensor,
                             src_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tgt (B, T), tgt_mask (B, T), memory (B, S, width) -> q(z | y, x)'s (mean, log-variance), each
        (B, T, latent_dim)."""
        positions = self.backbone.target_positions(torch.arange(tgt_ids.shape[1], device=tgt_ids.device))
        return self.posterior(self.backbone.embed_tokens(tgt_ids) + positions, tgt_mask, memory, src_mask)

    def latent_logits(self, latents: torch.Tensor, target_mask: torch.Tensor, memory: torch.Tensor,
                      src_mask: torch.Tensor) -> torch.Tensor:
        """p(y | z, x): latents (B, T, latent_dim), target_mask (B, T), memory (B, S, width), src_mask (B, S) ->
        logits (B, T, V), every position at once."""
        hidden = self.backbone.decode(self.latent_to_width(latents), target_mask, memory, src_mask)
        return self.backbone.logits(hidden)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The negative ELBO per target token, −(log p(y | z, x) − log q(z | y, x) + log p(z | x)) at one posterior
        sample z, plus the length predictor's cross-entropy."""
        src, src_mask, tgt, tgt_mask = batch["src"], batch["src_mask"], batch["tgt"], batch["tgt_mask"]
        noise = batch["posterior_noise"]
        if noise.shape != (*tgt.shape, self.latent_dim):
            raise InputError(f"posterior_noise must have the shape of the targets plus latent_dim, "
                             f"{(*tgt.shape, self.latent_dim)}, got {tuple(noise.shape)}")
        memory = self.backbone.encode(src, src_mask)
        mean, log_variance = self.posterior_parameters(tgt, tgt_mask, memory, src_mask)
        latents = (mean + (0.5 * log_variance).exp() * noise) * tgt_mask.unsqueeze(-1)
        kl = posterior_log_density(noise, log_variance, tgt_mask) - self.prior_flow.log_prob(latents, tgt_mask,
                                                                                           memory, src_mask)
        logits = self.latent_logits(latents, tgt_mask, memory, src_mask)
        token_nll = nn.functional.cross_entropy(logits.transpose(1, 2), tgt, reduction="none") * tgt_mask
        tokens = tgt_mask.sum().clamp(min=1)
        reconstruction, kl = token_nll.sum() / tokens, kl.sum() / tokens
        lengths = length_loss(self.backbone, memory, src_mask, tgt_mask)
        return reconstruction + kl + lengths, {"token_loss": float(reconstruction.detach()),
                                               "kl": float(kl.detach()), "length_loss": float(lengths.detach())}

    def decode_noise(self, noise: torch.Tensor, target_mask: torch.Tensor, memory: torch.Tensor,
                     src_mask: torch.Tensor) -> torch.Tensor:
        """One flow pass and one decoder pass: noise (N, T, latent_dim), target_mask (N, T), memory (N, S, width),
        src_mask (N, S) -> tokens (N, T), each position's most likely token given z = f(noise; x)."""
        latents, _ = self.prior_flow(noise, target_mask, memory, src_mask)
        return fixed_length_tokens(self.latent_logits(latents, target_mask, memory, src_mask), target_mask)

    @torch.no_grad()
    def generate(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> list[list[int]]:
        """Argmax decoding of each source (B, S): its most likely length, ε = 0 pushed through the flow, one
        parallel pass. Returns the target ids of each."""
        memory = self.backbone.encode(src_ids, src_mask)
        target_mask = length_mask(self.backbone.length_logits(memory, src_mask).argmax(-1) + 1)
        noise = memory.new_zeros(*target_mask.shape, self.latent_dim)  # the mode of the prior's N(0, I)
        tokens = self.decode_noise(noise, target_mask, memory, src_mask)
        return [row[mask].tolist() for row, mask in zip(tokens, target_mask)]


# --- noisy parallel decoding ---------------------------------------------------------------------------------------


@torch.no_grad()
def noisy_parallel_decode(model: FlowSeqModel, src_ids: torch.Tensor, src_mask: torch.Tensor, scorer: Scorer,
                          samples: int = 4, length_window: int = 1, temperature: float = 1.0,
                          generator: torch.Generator | None = None) -> NoisyParallelDecoding:
    """FlowSeq's NPD for each source (B, S): the lengths T* − length_window .. T* + length_window around the most
    likely T* (length_candidates' order) and, at each, `samples` noises ε ~ N(0, temperature²·I), the first of them
    ε = 0; all (2·length_window + 1)·samples candidates decoded in one parallel pass and scored by scorer in one
    batched call; each source's best-scored candidate wins. Candidate 0 is argmax decoding's output."""
    if samples < 1 or length_window < 0:
        raise InputError(f"samples must be >= 1 and length_window >= 0, got {samples} and {length_window}")
    if not temperature >= 0:
        raise InputError(f"temperature must be >= 0, got {temperature}")
    backbone = model.backbone
    memory = backbone.encode(src_ids, src_mask)
    best = backbone.length_logits(memory, src_mask).argmax(-1) + 1
    lengths = length_candidates(best, length_window, backbone.config.max_target_len)  # (B, L)
    rows, count = len(src_ids), lengths.shape[1] * samples
    target_mask = length_mask(lengths.repeat_interleave(samples, dim=1).flatten())  # (B · count, T)
    noise = torch.randn((rows, lengths.shape[1], samples, target_mask.shape[1], model.latent_dim),
                        generator=generator) * temperature
    noise[:, :, 0] = 0.0  # each length's first candidate: the prior's mode
    repeated_src, repeated_mask = src_ids.repeat_interleave(count, 0), src_mask.repeat_interleave(count, 0)
    tokens = model.decode_noise(noise.flatten(0, 2).to(memory.device), target_mask,
                                memory.repeat_interleave(count, 0), repeated_mask)
    scores = scorer(repeated_src, repeated_mask, tokens, target_mask).view(rows, count)
    flat = [row[mask].tolist() for row, mask in zip(tokens, target_mask)]
    candidates = [flat[row * count:(row + 1) * count] for row in range(rows)]
    chosen = scores.argmax(dim=1).tolist()
    return NoisyParallelDecoding([candidates[row][chosen[row]] for row in range(rows)], candidates, scores)
