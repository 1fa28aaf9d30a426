"""The Latent Transformer with decomposed vector quantisation (Kaiser, Roy, Vaswani, Parmar, Bengio, Uszkoreit &
Shazeer 2018, "Fast Decoding in Sequence Models Using Discrete Latent Variables", ICML): a short sequence of
discrete latents is generated autoregressively, then every target token in one parallel pass.

The paper's three parts, each a network of its own:

- ae(y, x), the autoencoder: the target y (T tokens, padded up to a multiple of the compression factor c) is
  read with self-attention and attention to the source x, then compressed by strided convolution into T/c latent
  vectors (the paper stacks stride-2 convolutions, c = 2^n_c);
- the discretisation bottleneck, decomposed vector quantisation (DVQ, "sliced"): each latent vector of D dimensions
  is cut into n slices of D/n; slice i is replaced by the nearest of the K codes of its own codebook i. A latent is
  thus a tuple of n codes, one of K^n values, while each nearest-neighbour search and each softmax is over K only,
  which is what lets DVQ use large latent alphabets without the codebook collapse of one big VQ table. The
  decoder reads the codes' vectors; gradients skip the non-differentiable search (straight-through: the encoder
  receives the decoder's gradient of the quantised vector as is);
- ad(l, x), the decoder: the latents upsampled by c back to target length, then a Transformer decoder attending
  to x, every position at once;
- lp(x), the latent model: a causal Transformer decoder over latent positions attending to x, predicting the
  codes of latent j from those of latents < j, each slice with its own softmax (the slices of one latent are
  independent given the earlier latents, as in the paper's code: one softmax of K per slice, not one of K^n).

Training minimises, in one pass over a batch: the decoder's cross-entropy reconstructing y from the quantised
latents of ae(y, x), plus lp's cross-entropy on the autoencoder's codes (teacher-forced, the codes detached: lp
learns the codes, it does not move them), plus the VQ losses. Decoding: T/c autoregressive steps of lp (greedy:
each slice's most likely code), then one parallel pass of ad.

Where this differs from the paper, and why:

- The codebooks learn through VQ-VAE's codebook loss ||sg(z) - e||² plus the commitment loss β·||z - sg(e)||²
  (van den Oord et al. 2017), not the exponential moving averages of the paper (and its tensor2tensor code): an
  EMA update is a side effect of a forward pass, which the shared trainer's promise (a step's update is that of
  the whole batch's mean loss, whatever the number of micro-batches and processes; a resumed run repeats it
  exactly) would not cover.
- The number of latents comes from the backbone's length predictor (target length T, trained alongside), T/c
  rounded up; in the paper's code the latent sequence has a length fixed from the input's and the output ends at
  EOS. A length given up front makes the count of latent steps exactly ceil(T/c) and lets the decoder mask
  padding.
- One attention layer and one strided convolution of kernel and stride c compress the target (the paper's code:
  residual convolutions, attention to x, then log2(c) stride-2 convolutions; one convolution also allows any c,
  not only powers of two); one linear map of each latent to c vectors upsamples (there: 1x1 convolutions and
  reshapes, log2(c) times).
- The latent vectors are layer-normalised (no learnt gain) before quantisation, so that their scale stays that of
  the codebooks' initialisation and codebooks learning at the optimiser's pace keep up with them (without it, the
  quantisation error of the tiny models here grew as they trained).
- The paper's warm-up (the decoder reading dense, unquantised latents early in training) is left out: the losses
  above train the tiny models here without it. Latents are decoded greedily (the paper also samples or searches).
- The token decoder is the shared backbone's decoder (every method here uses it, so comparisons measure the
  decoding algorithm); the autoencoder, latent model, codebooks and upsampling are this method's own modules.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from accelgen.errors import InputError
from accelgen.nar.backbone import BackboneConfig, MethodModel, causal_mask, length_loss, masked_cross_entropy
from accelgen.nar.tokens import EOS, NEVER_GENERATED, PAD, length_mask

# --- decomposed vector quantisation (pure functions) --------------------------------------------------------------


def split_slices(vectors: torch.Tensor, slices: int) -> torch.Tensor:
    """vectors (..., D) -> (..., slices, D / slices): slice i is dimensions i·D/n .. (i+1)·D/n - 1."""
    if vectors.shape[-1] % slices:
        raise InputError(f"{vectors.shape[-1]} dimensions cannot be cut into {slices} equal slices")
    return vectors.unflatten(-1, (slices, vectors.shape[-1] // slices))


def nearest_codes(vectors: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """vectors (..., D), codebooks (n, K, D / n) -> codes (..., n): for each slice, the index of the nearest code
    (squared Euclidean distance; ties: the lower index) in that slice's own codebook."""
    sliced = split_slices(vectors, codebooks.shape[0])  # (..., n, d)
    distances = (sliced.unsqueeze(-2) - codebooks).pow(2).sum(-1)  # (..., n, K)
    return distances.argmin(-1)


def code_vectors(codes: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """codes (..., n), codebooks (n, K, d) -> (..., n·d): each slice's code vector, the slices concatenated."""
    slices = torch.arange(codebooks.shape[0], device=codes.device)
    return codebooks[slices, codes].flatten(-2)


def decomposed_vector_quantise(latents: torch.Tensor, codebooks: torch.Tensor, latent_mask: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DVQ of latents (B, L, D) with codebooks (n, K, D / n); latent_mask (B, L) bool, True on real latents.
    Returns (quantised (B, L, D), codes (B, L, n), codebook loss, commitment loss): quantised carries the code
    vectors forward and passes gradients straight through to latents (none to the codebooks: they learn from the
    codebook loss, the mean ||sg(latent) - code||² per dimension; the commitment loss ||latent - sg(code)||² pulls
    the encoder toward its codes). Both losses are over the real latents only."""
    codes = nearest_codes(latents.detach(), codebooks)
    chosen = code_vectors(codes, codebooks)  # (B, L, D)
    weights = latent_mask.unsqueeze(-1).to(latents.dtype)
    count = weights.sum().clamp(min=1) * latents.shape[-1]
    codebook_loss = ((chosen - latents.detach()).pow(2) * weights).sum() / count
    commitment_loss = ((latents - chosen.detach()).pow(2) * weights).sum() / count
    quantised = latents + (chosen - latents).detach()  # forward: the codes; backward: the identity
    return quantised, codes, codebook_loss, commitment_loss


def latent_counts(lengths: torch.Tensor, compression: int) -> torch.Tensor:
    """Target lengths (B,) -> latents per target (B,): ceil(T / c), the target padded to a multiple of c."""
    return (lengths + compression - 1) // compression


# --- the method's own modules ----------------------------------------------------------------------------------


def transformer_decoder_layer(config: BackboneConfig) -> nn.TransformerDecoderLayer:
    """A layer shaped like the backbone's: self-attention, attention to the source memory, feedforward."""
    return nn.TransformerDecoderLayer(d_model=config.width, nhead=config.heads, dim_feedforward=config.feedforward,
                                      dropout=config.dropout, batch_first=True, norm_first=True)


class TargetCompressor(nn.Module):
    """ae(y, x): target embeddings (B, W, width), W a multiple of c -> latent vectors (B, W / c, width)."""

    def __init__(self, config: BackboneConfig, compression: int):
        super().__init__()
        padded = math.ceil(config.max_target_len / compression) * compression
        self.positions = nn.Embedding(padded, config.width)
        self.attend = transformer_decoder_layer(config)
        self.norm = nn.LayerNorm(config.width)
        self.compress = nn.Conv1d(config.width, config.width, kernel_size=compression, stride=compression)
        # latents of a fixed scale (no learnt gain): codebooks trained at the optimiser's pace can keep up with them
        self.latent_norm = nn.LayerNorm(config.width, elementwise_affine=False)

    def forward(self, target_embeddings: torch.Tensor, target_mask: torch.Tensor, memory: torch.Tensor,
                src_mask: torch.Tensor) -> torch.Tensor:
        """target_embeddings (B, W, width), target_mask (B, W) bool, memory (B, S, width), src_mask (B, S) bool."""
        positions = self.positions(torch.arange(target_embeddings.shape[1], device=target_embeddings.device))
        hidden = self.attend(target_embeddings + positions, memory, tgt_key_padding_mask=~target_mask,
                             memory_key_padding_mask=~src_mask)
        # padding is zeroed: the last window of a target (padded to a multiple of c) reads only its own tokens
        hidden = self.norm(hidden) * target_mask.unsqueeze(-1)
        return self.latent_norm(self.compress(hidden.transpose(1, 2)).transpose(1, 2))


class LatentPrior(nn.Module):
    """lp(x): a causal decoder over latent positions; latent j's n codes from the codes of latents < j."""

    def __init__(self, config: BackboneConfig, max_latents: int, layers: int, slices: int, codes: int):
        super().__init__()
        self.slices, self.codes = slices, codes
        self.start = nn.Parameter(torch.randn(config.width) * 0.02)  # the input of latent 0: nothing before it
        self.positions = nn.Embedding(max_latents, config.width)
        self.decoder = nn.TransformerDecoder(transformer_decoder_layer(config), layers, norm=nn.LayerNorm(config.width))
        self.heads = nn.Linear(config.width, slices * codes)  # one softmax of K codes per slice

    def forward(self, previous: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """previous (B, L - 1, width): the code vectors of latents 0 .. L-2 (detached: the latent model learns the
        codes, it does not move them), memory (B, S, width), src_mask (B, S) -> code logits (B, L, n, K), latent j's
        from the start vector and the latents before j."""
        inputs = torch.cat([self.start.expand(len(previous), 1, -1), previous.detach()], dim=1)
        length = inputs.shape[1]
        inputs = inputs + self.positions(torch.arange(length, device=inputs.device))
        hidden = self.decoder(inputs, memory, tgt_mask=causal_mask(length, inputs.device),
                              memory_key_padding_mask=~src_mask)
        return self.heads(hidden).unflatten(-1, (self.slices, self.codes))


# --- the model -------------------------------------------------------------------------------------------------


class LatentTransformerModel(MethodModel):
    method = "latent"

    def __init__(self, config: BackboneConfig, compression: int = 2, slices: int = 2, codes: int = 16,
                 latent_layers: int = 1, commitment: float = 0.25):
        super().__init__(config)
        if not 1 <= compression <= config.max_target_len:
            raise InputError(f"compression must be in 1..{config.max_target_len} (max_target_len), got {compression}")
        if slices < 1 or config.width % slices:
            raise InputError(f"slices must be a positive divisor of the width {config.width}, got {slices}")
        if codes < 2:
            raise InputError(f"codes (per slice's codebook) must be >= 2, got {codes}")
        if latent_layers < 1:
            raise InputError(f"latent_layers must be >= 1, got {latent_layers}")
        if not commitment >= 0:  # also refuses NaN
            raise InputError(f"commitment must be >= 0, got {commitment}")
        self.compression, self.slices, self.codes = compression, slices, codes
        self.latent_layers, self.commitment = latent_layers, float(commitment)
        self.max_latents = math.ceil(config.max_target_len / compression)
        self.compressor = TargetCompressor(config, compression)
        # the scale of the compressor's (normalised) outputs, so that at first the latents spread over the codes
        # instead of all landing on the one nearest the origin
        self.codebooks = nn.Parameter(torch.randn(slices, codes, config.width // slices))
        self.upsample = nn.Linear(config.width, compression * config.width)  # one latent -> its c positions
        self.prior = LatentPrior(config, self.max_latents, latent_layers, slices, codes)

    def options(self) -> dict:
        return {"compression": self.compression, "slices": self.slices, "codes": self.codes,
                "latent_layers": self.latent_layers, "commitment": self.commitment}

    def encode_latents(self, tgt_ids: torch.Tensor, tgt_mask: torch.Tensor, memory: torch.Tensor,
                       src_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ae(y, x): tgt_ids (B, T), tgt_mask (B, T) bool, memory (B, S, width), src_mask (B, S) -> (latent vectors
        (B, L, width), latent_mask (B, L) bool), L = ceil(T / c), the target padded with PAD to L·c."""
        if tgt_ids.shape[1] > self.config.max_target_len:
            raise InputError(f"the targets have {tgt_ids.shape[1]} tokens but this model reads at most "
                             f"{self.config.max_target_len} (max_target_len): encode_pairs cuts them")
        padding = -tgt_ids.shape[1] % self.compression
        ids = nn.functional.pad(tgt_ids, (0, padding), value=PAD)
        mask = nn.functional.pad(tgt_mask, (0, padding), value=False)
        latents = self.compressor(self.backbone.embed_tokens(ids), mask, memory, src_mask)
        counts = latent_counts(tgt_mask.sum(dim=1), self.compression)
        return latents, length_mask(counts, latents.shape[1])

    def token_logits(self, quantised: torch.Tensor, target_mask: torch.Tensor, memory: torch.Tensor,
                     src_mask: torch.Tensor) -> torch.Tensor:
        """ad(l, x): quantised latents (B, L, width), target_mask (B, T) bool (T <= L·c), memory (B, S, width),
        src_mask (B, S) -> token logits (B, T, V), every position in one pass of the backbone's decoder."""
        width = quantised.shape[-1]
        inputs = self.upsample(quantised).unflatten(-1, (self.compression, width)).flatten(1, 2)  # (B, L·c, width)
        hidden = self.backbone.decode(inputs[:, :target_mask.shape[1]], target_mask, memory, src_mask)
        return self.backbone.logits(hidden)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Reconstruction cross-entropy from the quantised latents + the latent model's cross-entropy on the codes
        (summed over slices: the log-likelihood of a code tuple, per latent) + the length predictor's + codebook
        loss + commitment · commitment loss."""
        src, src_mask, tgt, tgt_mask = batch["src"], batch["src_mask"], batch["tgt"], batch["tgt_mask"]
        memory = self.backbone.encode(src, src_mask)
        latents, latent_mask = self.encode_latents(tgt, tgt_mask, memory, src_mask)
        quantised, codes, codebook_loss, commitment_loss = decomposed_vector_quantise(latents, self.codebooks,
                                                                                      latent_mask)
        tokens = masked_cross_entropy(self.token_logits(quantised, tgt_mask, memory, src_mask), tgt, tgt_mask)
        code_logits = self.prior(code_vectors(codes[:, :-1], self.codebooks), memory, src_mask)  # (B, L, n, K)
        per_slice = nn.functional.cross_entropy(code_logits.flatten(0, 2), codes.flatten(), reduction="none")
        per_latent = per_slice.view(codes.shape).sum(-1)  # (B, L)
        latent = (per_latent * latent_mask).sum() / latent_mask.sum().clamp(min=1)
        lengths = length_loss(self.backbone, memory, src_mask, tgt_mask)
        total = tokens + latent + lengths + codebook_loss + self.commitment * commitment_loss
        return total, {"token_loss": float(tokens.detach()), "latent_loss": float(latent.detach()),
                       "length_loss": float(lengths.detach()), "codebook_loss": float(codebook_loss.detach()),
                       "commitment_loss": float(commitment_loss.detach())}

    @torch.no_grad()
    def generate(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> list[list[int]]:
        """The target ids of each source (B, S) (see latent_decode)."""
        return latent_decode(self, src_ids, src_mask)


@torch.no_grad()
def greedy_latents(model: LatentTransformerModel, memory: torch.Tensor, src_mask: torch.Tensor,
                   count: int) -> torch.Tensor:
    """count autoregressive steps of the latent model, one latent each, each slice its most likely code given the
    source memory (B, S, width), src_mask (B, S) and the latents before it -> codes (B, count, n)."""
    rows = len(memory)
    codes = torch.zeros(rows, 0, model.slices, dtype=torch.long, device=memory.device)
    for _ in range(count):
        logits = model.prior(code_vectors(codes, model.codebooks), memory, src_mask)[:, -1]  # (B, n, K): the next
        codes = torch.cat([codes, logits.argmax(-1).unsqueeze(1)], dim=1)
    return codes


@torch.no_grad()
def latent_decode(model: LatentTransformerModel, src_ids: torch.Tensor, src_mask: torch.Tensor) -> list[list[int]]:
    """The Latent Transformer's decoding of each source (B, S): its most likely length T (the backbone's length
    predictor), ceil(T / c) greedy steps of the latent model (the longest row's count, for the whole batch), then
    one parallel pass of the token decoder over the code vectors; each position's most likely token (specials and
    EOS excluded: the length is decided). Returns each row's T token ids."""
    backbone = model.backbone
    memory = backbone.encode(src_ids, src_mask)
    lengths = backbone.length_logits(memory, src_mask).argmax(-1) + 1  # (B,)
    codes = greedy_latents(model, memory, src_mask, int(latent_counts(lengths, model.compression).max()))
    target_mask = length_mask(lengths)  # (B, T)
    logits = model.token_logits(code_vectors(codes, model.codebooks), target_mask, memory, src_mask)
    logits[..., list(NEVER_GENERATED) + [EOS]] = float("-inf")
    tokens = logits.argmax(-1)
    return [row[row_mask].tolist() for row, row_mask in zip(tokens, target_mask)]
