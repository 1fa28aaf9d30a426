"""The encoder-decoder Transformer every NAR method and the AR student share, so that a comparison between them
measures the decoding algorithm, not the network.

- `encode`: source ids -> memory;
- `decode`: decoder inputs (embeddings: token embeddings for AR, SAT and CMLM; copied source embeddings for NAT)
  -> hidden states, under any self-attention mask: causal (AR), group-causal (SAT) or none (NAT, CMLM: every
  target position at once);
- `length_logits`: the target length from the mean of the memory, a classification over 1..max_target_len;
- output logits through the token embedding (tied: one table for source, target and output).

A method's model (`MethodModel`) is this backbone plus the method's own heads; it saves as a folder holding
model.safetensors and config.json, which names the model kind and the method, so that a folder is only ever
loaded by the method that trained it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from accelgen.atomic import load_tensors, read_checked, save_tensors_atomically, write_json_atomically
from accelgen.errors import InputError
from accelgen.nar.tokens import PAD

MODEL_KIND = "accelgen-nar"
FORMAT_VERSION = 1
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


@dataclass(frozen=True)
class BackboneConfig:
    vocab_size: int
    width: int = 256
    heads: int = 4
    encoder_layers: int = 3
    decoder_layers: int = 3
    feedforward: int = 1024
    max_source_len: int = 256
    max_target_len: int = 32  # the longest target (summary) in tokens; the decoder has one position more, for EOS
    dropout: float = 0.1

    def __post_init__(self):
        if self.width % self.heads:
            raise InputError(f"width {self.width} is not a multiple of heads {self.heads}")
        sizes = (self.vocab_size, self.width, self.heads, self.encoder_layers, self.decoder_layers, self.feedforward,
                 self.max_source_len, self.max_target_len)
        if min(sizes) < 1:
            raise InputError(f"every size of a backbone must be positive: {self}")


class Seq2SeqBackbone(nn.Module):
    def __init__(self, config: BackboneConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=config.width ** -0.5)  # scaled by sqrt(width) below: unit variance
        self.source_positions = nn.Embedding(config.max_source_len, config.width)
        self.target_positions = nn.Embedding(config.max_target_len + 1, config.width)  # + the EOS of AR and SAT
        layer = dict(d_model=config.width, nhead=config.heads, dim_feedforward=config.feedforward,
                     dropout=config.dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer), config.encoder_layers,
                                             norm=nn.LayerNorm(config.width), enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer), config.decoder_layers,
                                             norm=nn.LayerNorm(config.width))
        self.length_head = nn.Linear(config.width, config.max_target_len)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, L) -> (B, L, width)."""
        return self.embed(ids) * math.sqrt(self.config.width)

    def encode(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """src_ids (B, S), src_mask (B, S) bool (True on real tokens) -> memory (B, S, width)."""
        length = src_ids.shape[1]
        if length > self.config.max_source_len:
            raise InputError(f"the input has {length} tokens but this encoder reads at most "
                             f"{self.config.max_source_len} (max_source_len): truncate it (encode_pairs does) or "
                             f"train a model with a larger max_source_len")
        positions = self.source_positions(torch.arange(length, device=src_ids.device))
        return self.encoder(self.embed_tokens(src_ids) + positions, src_key_padding_mask=~src_mask)

    def decode(self, inputs: torch.Tensor, target_mask: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """inputs (B, T, width) (embeddings, without positions), target_mask (B, T) bool, memory (B, S, width),
        src_mask (B, S) bool; attention_mask (T, T) bool, or (B·heads, T, T) for one mask per row (batch-major, as
        nn.MultiheadAttention takes it), True where position i must not see position j (None: all positions see
        each other) -> hidden states (B, T, width)."""
        length = inputs.shape[1]
        if length > self.config.max_target_len + 1:
            raise InputError(f"the decoder was asked for {length} positions but has {self.config.max_target_len + 1} "
                             f"(max_target_len tokens and an EOS)")
        positions = self.target_positions(torch.arange(length, device=inputs.device))
        return self.decoder(inputs + positions, memory, tgt_mask=attention_mask, tgt_key_padding_mask=~target_mask,
                            memory_key_padding_mask=~src_mask)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., width) -> (..., vocab_size), through the tied embedding."""
        return hidden @ self.embed.weight.T

    def decode_tokens(self, ids: torch.Tensor, target_mask: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (B, T, vocab_size) of decoder input ids (B, T)."""
        return self.logits(self.decode(self.embed_tokens(ids), target_mask, memory, src_mask, attention_mask))

    def length_logits(self, memory: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """memory (B, S, width), src_mask (B, S) -> (B, max_target_len): class i is target length i + 1."""
        weights = src_mask.unsqueeze(-1).to(memory.dtype)
        pooled = (memory * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        return self.length_head(pooled)


def causal_mask(length: int, device=None) -> torch.Tensor:
    """(length, length) bool: True above the diagonal, where position i must not see a later position j."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(diagonal=1)


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits (B, T, V), targets (B, T), mask (B, T) bool -> the mean cross-entropy over the masked-in tokens."""
    losses = nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (losses * mask).sum() / mask.sum().clamp(min=1)


def length_loss(backbone: Seq2SeqBackbone, memory: torch.Tensor, src_mask: torch.Tensor,
                tgt_mask: torch.Tensor) -> torch.Tensor:
    """The length predictor's cross-entropy on the true target lengths (tgt_mask (B, T): True on real tokens)."""
    lengths = tgt_mask.sum(dim=1).clamp(1, backbone.config.max_target_len)
    return nn.functional.cross_entropy(backbone.length_logits(memory, src_mask), lengths - 1)


# --- a method's model, saved and loaded -------------------------------------------------------------------------


class MethodModel(nn.Module):
    """A method's network: the shared backbone plus the method's own heads. Subclasses set `method`, add
    `loss(batch) -> (loss, metrics)` and their decoding, and return their constructor's keyword arguments from
    `options()` (saved in config.json, passed back on load). A new model is fitted to its training data
    (`fit_to_data`) before it trains."""

    method = ""

    def __init__(self, config: BackboneConfig):
        super().__init__()
        self.config = config
        self.backbone = Seq2SeqBackbone(config)

    def options(self) -> dict:
        return {}

    def fit_to_data(self, rows: dict[str, torch.Tensor], vocabulary) -> None:
        """What the method learns from the training rows and their vocabulary before its first step (ENAT's phrase
        table, BERT-NAR's length ratio, SynST's chunker tables); most learn nothing."""

    def training_inputs(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The batch a training step's loss reads: batch plus whatever the method draws or derives per row (CMLM's
        masks, NAT's fertilities), drawn from generator so that a resumed run draws the same."""
        return batch

    def save(self, folder: Path) -> Path:
        """model.safetensors, then config.json (removed first, written last: a half-saved folder does not load)."""
        folder = Path(folder)
        (folder / CONFIG_FILE).unlink(missing_ok=True)
        save_tensors_atomically(folder / WEIGHTS_FILE, self.state_dict())
        write_json_atomically(folder / CONFIG_FILE, {"kind": MODEL_KIND, "format": FORMAT_VERSION,
                                                     "method": self.method, "options": self.options(),
                                                     "backbone": asdict(self.config)})
        return folder

    @classmethod
    def load(cls, folder: Path) -> MethodModel:
        """The model saved in folder by this method, in eval mode; a ValueError naming the problem for a folder
        that holds something else."""
        config, options = read_model_config(folder, cls.method)
        model = cls(config, **options)
        state = load_tensors(Path(folder) / WEIGHTS_FILE, "save the model again")
        try:
            model.load_state_dict(state)
        except RuntimeError as error:
            raise InputError(f"the weights in {folder} do not fit its config.json: {str(error)[:200]}") from None
        return model.eval()


def read_model_config(folder: Path, method: str) -> tuple[BackboneConfig, dict]:
    """(backbone config, method options) of the model in folder, which must be an accelgen NAR model of method."""
    saved = read_saved_config(folder)
    if saved.get("method") != method:
        raise InputError(f"{folder} holds a {saved.get('method')!r} model, not a {method!r} one: load it with the "
                         f"class of its own method")
    return BackboneConfig(**saved["backbone"]), saved.get("options", {})


def read_saved_config(folder: Path) -> dict:
    """config.json of the accelgen NAR model in folder (method, options, backbone); a ValueError naming the problem
    for a folder that holds anything else."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise InputError(f"{folder} is not a model folder: it has no {CONFIG_FILE}")
    saved = read_checked(path, lambda file: json.loads(file.read_text()), "save the model again")
    kind = saved.get("kind") if isinstance(saved, dict) else None
    if kind != MODEL_KIND:
        found = f"a {saved['model_type']!r} model" if isinstance(saved, dict) and "model_type" in saved else \
            f"a model of kind {kind!r}"
        raise InputError(f"{folder} holds {found}, not an accelgen NAR model (kind {MODEL_KIND!r})")
    if saved.get("format") != FORMAT_VERSION:
        raise InputError(f"{folder} was saved in format {saved.get('format')}; this version reads {FORMAT_VERSION}")
    return saved
