"""A narrow interface over one HF causal LM and its KV cache: the only place that calls the model.

The runner holds the KV cache of a token sequence and extends it by a block of new tokens, either a causal
chain or a tree given by an attention pattern, returning float32 logits per new token. After verification,
`keep` rolls the cache back to the accepted tokens. Another runtime could implement the same few methods.
"""

from __future__ import annotations

import torch

from accelgen import cache as kv
from accelgen.models.llamacpp import LlamaCppModel


class ModelRunner:
    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.device = model.device
        self.dtype = model.dtype
        self.vocab_size = model.config.vocab_size
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.cache = kv.new_cache(model.config)
        # positions the cache leaves out: a sparse cache (TriForce's retrieval and StreamingLLM caches) holds
        # only some of the positions before its newest entries, which still have their true positions
        self.position_offset = 0
        # drafters that read the target's last hidden states (Medusa, EAGLE) set keep_hidden; `hidden` then holds
        # the final (normed) hidden state of every cached position, (cached, d), rolled back with the cache
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Number of positions the KV cache covers: those it holds, plus `position_offset` left out."""
        return self.position_offset + kv.cache_length(self.cache)

    def reset(self) -> None:
        self.cache = kv.new_cache(self.config)
        self.position_offset = 0
        self.hidden = None

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, tree: torch.Tensor | None = None, logits_for_last: int = 0,
                appended: torch.Tensor | None = None) -> torch.Tensor:
        """Append token_ids (m,) after the cached positions and return their logits, (m, vocab) float32.

        tree: None for a causal chain, else (m, m) bool, tree[r, c] = new token r may attend to new token c
        (ancestors and itself); each token's position is then the cache length + its depth in the tree.
        A tree may also go on from its earlier levels, cached as the last t positions: it is then (m, t + m),
        its first t columns saying which of those each new token sees (the rest of the cache is always seen).
        logits_for_last: compute logits for the last k tokens only, returning (k, vocab); 0 = all tokens.
        (A prompt needs no logits but its last token's: skipping the rest saves a vocab-sized matmul per token.)
        appended: (a, d) input embeddings fed after the tokens as a causal chain, with logits rows of their own
        (PaSS's look-ahead embeddings); chains only.
        """
        start = self.length
        m = token_ids.shape[0] + (0 if appended is None else appended.shape[0])
        if tree is None:
            positions = torch.arange(start, start + m)
            mask = None  # the model builds its own causal mask over cache + new tokens
        else:
            tree_start = start - (tree.shape[1] - tree.shape[0])  # where the tree's first level sits
            positions = tree_start + tree.sum(dim=-1) - 1  # depth = number of ancestors
            mask = additive_mask(kv.cache_length(self.cache), tree, self.dtype, self.device)
        inputs = dict(position_ids=positions.to(self.device)[None], attention_mask=mask, use_cache=True,
                      **{kv.cache_keyword(self.model): self.cache})
        if appended is None:
            inputs["input_ids"] = token_ids.to(self.device)[None]
        else:
            if tree is not None:
                raise ValueError("appended embeddings follow a chain, not a tree")
            embedded = self.model.get_input_embeddings()(token_ids.to(self.device))
            inputs["inputs_embeds"] = torch.cat([embedded, appended.to(embedded.dtype)])[None]
        if self.keep_hidden:  # the decoder, then its LM head on the rows asked for: what the causal LM does
            hidden = self.model.model(**inputs).last_hidden_state[0]  # (m, d)
            self.hidden = hidden if self.hidden is None else torch.cat([self.hidden, hidden])
            return self.model.get_output_embeddings()(hidden[-logits_for_last:]).float()
        return self.model(**inputs, logits_to_keep=logits_for_last).logits[0].float()

    def keep(self, prefix: int, rows: list[int]) -> None:
        """Keep the first `prefix` cached positions, then the rows `rows` (increasing) of the last forward.

        rows [0, 1, ..., k-1] is a crop; anything else (an accepted path through a tree) is gathered.
        prefix counts covered positions (see `length`): the newest entries of a sparse cache are kept by position.
        """
        prefix -= self.position_offset
        if rows == list(range(len(rows))):
            kv.crop(self.cache, prefix + len(rows))
            keep = slice(0, prefix + len(rows))
        else:
            keep = torch.cat([torch.arange(prefix), prefix + torch.tensor(rows, dtype=torch.long)])
            kv.compact(self.cache, keep)
        if self.hidden is not None:
            self.hidden = self.hidden[keep]


def runner_for(model):
    """A fresh runner over a model: ModelRunner for a transformers model, else the model's own engine's
    (a GGUF file loaded by llama.cpp: accelgen.models.llamacpp)."""
    return model.new_runner() if isinstance(model, LlamaCppModel) else ModelRunner(model)


def additive_mask(cached: int, pattern: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """(1, 1, m, cached + m) additive attention mask: each of m new tokens sees the whole cache, then the new
    tokens that pattern (m, m) bool allows it (its tree ancestors and itself, or the causal triangle).
    A pattern (m, t + m) also says which of the last t cached positions each new token sees."""
    m, covered = pattern.shape
    allowed = torch.cat([torch.ones(m, cached + m - covered, dtype=torch.bool), pattern.cpu()], dim=1)
    return blocking_mask(allowed, dtype)[None].to(device)


def blocking_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(1, m, n) additive attention mask from allowed (m, n) bool: 0 where allowed, the dtype's minimum elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None]
