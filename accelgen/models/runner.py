"""A narrow interface over one HF causal LM and its KV cache: the only place that calls the model.

The runner holds the KV cache of a token sequence and extends it by a block of new tokens, either a causal
chain or a tree given by an attention pattern, returning float32 logits per new token. After verification,
`keep` rolls the cache back to the accepted tokens. Another runtime could implement the same few methods.

Sliding-window layers keep a full cache too (cache.py); a tree's masks keep each layer within its window, as the
model's own masks do for a chain. ALiBi models score trees through their blocks (models/layouts.py).
"""

from __future__ import annotations

import torch

from accelgen import cache as kv
from accelgen.models.layouts import alibi_layout, alibi_tree_hidden, check_tree_positions
from accelgen.models.llamacpp import LlamaCppModel

# HF's names of the attention layer types whose masks a model takes as a dict (models mixing both: Gemma 2 and 3)
FULL, SLIDING = "full_attention", "sliding_attention"


class ModelRunner:
    def __init__(self, model):
        if getattr(model, "_is_stateful", False):  # HF's own mark of a model whose state cannot be rolled back
            raise ValueError(f"{type(model).__name__} is a recurrent (stateful) model: accelgen needs a KV cache it "
                             f"can roll back after a rejected draft, as HF's assisted generation does")
        self.model = model
        self.config = model.config
        self.device = model.device
        self.dtype = model.dtype
        self.vocab_size = model.config.vocab_size
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.cache = kv.new_cache(model.config)
        windows = kv.layer_windows(model.config)  # per layer: its sliding window, or None
        self.window = sliding_window(windows)
        self.mixed_attention = None in windows and self.window is not None  # full and windowed layers both
        self.alibi = alibi_layout(model.config)
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

    @property
    def shares_batched_forward(self) -> bool:
        """Whether a padded batched forward (models/batch.py: one full-attention mask for every layer, positions
        shifted by the padding) scores this runner's tokens exactly: not with a sliding window shorter than the
        model's context, nor with ALiBi biases, which the model derives from a 2-D mask."""
        alibi = self.alibi is not None or getattr(self.config, "alibi", False)
        return not alibi and (self.window is None or self.window >= self.max_positions)

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
        if appended is not None and tree is not None:
            raise ValueError("appended embeddings follow a chain, not a tree")
        start = self.length
        m = token_ids.shape[0] + (0 if appended is None else appended.shape[0])
        if tree is None:
            positions = torch.arange(start, start + m)
            mask = None  # the model builds its own causal mask over cache + new tokens
        else:
            tree_start = start - (tree.shape[1] - tree.shape[0])  # where the tree's first level sits
            positions = tree_start + tree.sum(dim=-1) - 1  # depth = number of ancestors
            cached = kv.cache_length(self.cache)
            allowed = attention_allowed(cached, tree)
            keys = key_positions(cached, tree, tree_start - self.position_offset)
            if self.alibi is not None:  # the model's forward would bias tree nodes by cache index, not depth
                return self._alibi_tree(token_ids, allowed, keys, logits_for_last)
            check_tree_positions(self.config)
            mask = self._tree_mask(allowed, positions, keys)
        inputs = dict(position_ids=positions.to(self.device)[None], attention_mask=mask, use_cache=True,
                      **{kv.cache_keyword(self.model): self.cache})
        if appended is None:
            inputs["input_ids"] = token_ids.to(self.device)[None]
        else:
            embedded = self.model.get_input_embeddings()(token_ids.to(self.device))
            inputs["inputs_embeds"] = torch.cat([embedded, appended.to(embedded.dtype)])[None]
        if not self.keep_hidden:
            return self.model(**inputs, logits_to_keep=logits_for_last).logits[0].float()
        # the decoder's output, read as it passes (every row, while the LM head sees only the rows asked for)
        decoded = []
        hook = self.model.base_model.register_forward_hook(lambda module, args, output: decoded.append(output[0]))
        try:
            logits = self.model(**inputs, logits_to_keep=logits_for_last).logits[0].float()
        finally:
            hook.remove()
        if not decoded:  # a causal LM that calls parts of its base model itself (OPT calls model.decoder)
            raise ValueError(f"{type(self.model).__name__} does not call its base model in its forward, so its final "
                             f"hidden states cannot be read for the drafter that needs them")
        self._keep_hidden(decoded[0][0])
        return logits

    def _keep_hidden(self, hidden: torch.Tensor) -> None:
        """Append the final hidden states (m, d) of a forward's tokens, if kept."""
        if self.keep_hidden:
            self.hidden = hidden if self.hidden is None else torch.cat([self.hidden, hidden])

    def _alibi_tree(self, token_ids: torch.Tensor, allowed: torch.Tensor, keys: torch.Tensor,
                    logits_for_last: int) -> torch.Tensor:
        hidden = alibi_tree_hidden(self.model, self.alibi, token_ids, allowed, keys + self.position_offset, self.cache)
        self._keep_hidden(hidden)
        return self.model.get_output_embeddings()(hidden[-logits_for_last:]).float()  # ALiBi models scale no logits

    def _tree_mask(self, allowed: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor):
        """The additive mask (1, 1, m, n) of a tree whose new tokens at positions (m,) see the keys allowed
        (m, n) bool, at positions keys (n,) (counted in the cache); with a sliding window, the mask of the
        windowed layers has the keys that are window or more positions back blocked too, and a model that also
        has full-attention layers gets both masks, by HF's layer type names."""
        full = blocking_mask(allowed, self.dtype)[None].to(self.device)
        if self.window is None:
            return full
        within = (positions - self.position_offset)[:, None] - keys[None, :] < self.window
        windowed = blocking_mask(allowed & within, self.dtype)[None].to(self.device)
        return {FULL: full, SLIDING: windowed} if self.mixed_attention else windowed

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
    return blocking_mask(attention_allowed(cached, pattern), dtype)[None].to(device)


def attention_allowed(cached: int, pattern: torch.Tensor) -> torch.Tensor:
    """(m, cached + m) bool: the keys each of m new tokens sees (see additive_mask), before any window."""
    m, covered = pattern.shape
    return torch.cat([torch.ones(m, cached + m - covered, dtype=torch.bool), pattern.cpu()], dim=1)


def key_positions(cached: int, pattern: torch.Tensor, tree_start: int) -> torch.Tensor:
    """(cached + m,) long: the position of every key a tree forward attends to, counted in the cache: the cached
    positions before the tree, then the tree's nodes (pattern (m, t + m): its t cached nodes, then the m new
    ones), each at tree_start + its depth. A node's depth is read off any row that sees it: its ancestors are
    exactly the earlier columns that row sees. (A node that no new row sees is blocked: its position is moot.)"""
    m, covered = pattern.shape
    pattern = pattern.cpu()
    depths = torch.where(pattern, pattern.cumsum(dim=1) - 1, -1).amax(dim=0).clamp(min=0)  # (t + m,)
    return torch.cat([torch.arange(cached + m - covered), tree_start + depths])


def sliding_window(windows: list[int | None]) -> int | None:
    """The one sliding window of a model's windowed layers (windows: per layer, None for full attention), None
    if it has none. HF passes a model one mask per layer type, so layers with different windows are refused."""
    sizes = {window for window in windows if window is not None}
    if len(sizes) > 1:
        raise ValueError(f"this model's layers have different sliding windows ({sorted(sizes)}); accelgen's masks "
                         f"take one window per model")
    return next(iter(sizes), None)


def blocking_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(1, m, n) additive attention mask from allowed (m, n) bool: 0 where allowed, the dtype's minimum elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None]
