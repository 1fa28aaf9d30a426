"""A narrow interface over one HF causal LM and its KV cache: the only place that calls the model.

The runner holds the KV cache of a token sequence and extends it by a block of new tokens, either a causal
chain or a tree given by an attention pattern, returning float32 logits per new token. After verification,
`keep` rolls the cache back to the accepted tokens. Another runtime could implement the same few methods.

Sliding-window layers keep a full cache too (cache.py); a tree's masks keep each layer within its window, as the
model's own masks do for a chain. ALiBi models score trees through their blocks (models/layouts.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from accelgen import cache as kv
from accelgen.draft import causal
from accelgen.errors import InputError
from accelgen.models.block import Block, blocking_mask
from accelgen.models.layouts import Decoder, alibi_layout, alibi_tree_hidden, check_tree_positions

# HF's names of the attention layer types whose masks a model takes as a dict (models mixing both: Gemma 2 and 3)
FULL, SLIDING = "full_attention", "sliding_attention"


class LayerPlan(Protocol):
    """How a runner walks the decoder's layers itself, rather than through the model's own forward: per layer,
    whether it runs its attention and its MLP sub-block (a layer whose attention is skipped never writes to its
    cache). Plans live in their method files (self-speculative's skip set: drafters/self_speculative.py)."""

    purpose: str  # the method, named in errors about layouts it cannot walk

    def sub_blocks(self, layer: int) -> tuple[bool, bool]:
        """(attend, feed): whether the layer runs its attention, and its MLP."""
        ...


class ModelRunner:
    def __init__(self, model, plan: LayerPlan | None = None):
        if getattr(model, "_is_stateful", False):  # HF's own mark of a model whose state cannot be rolled back
            raise InputError(f"{type(model).__name__} is a recurrent (stateful) model: accelgen needs a KV cache it "
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
        # set by the loop for methods whose drafter reads the target's last hidden states (Medusa, EAGLE:
        # MethodSpec.reads_target_hidden); `hidden` then holds the final (normed) hidden state of every cached
        # position, (cached, d), rolled back with the cache
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None
        # set by a drafter that reads the residual stream entering chosen layers (EAGLE-3 reads three): index i is
        # what enters layer i, 0 the embeddings (HF's hidden_states[i]); `layer_hidden` then holds them side by
        # side for every cached position, (cached, len(keep_layers) * d), rolled back with the cache
        self.keep_layers: tuple[int, ...] = ()
        self.layer_hidden: torch.Tensor | None = None
        self.plan = plan
        self.decoder = None if plan is None else Decoder(model, plan.purpose)

    @property
    def length(self) -> int:
        """Number of positions the KV cache covers: those it holds (its highest layer's, which verified tokens
        all reach), plus `position_offset` left out."""
        return self.position_offset + kv.cache_length(self.cache)

    @property
    def batches(self) -> bool:
        """Whether this runner's forwards may share a padded batched forward with other runners' (models/batch.py):
        through the model's own forward (no plan), with no hidden states to keep, and masks a batch expresses."""
        return self.plan is None and not self.keeps_states and self.shares_batched_forward

    @property
    def keeps_states(self) -> bool:
        """Whether forwards keep hidden states for a drafter: the final ones, or chosen layers' (keep_layers)."""
        return self.keep_hidden or bool(self.keep_layers)

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
        self.layer_hidden = None

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
        appended: (a, d) input embeddings fed after the tokens, with logits rows of their own: a causal chain
        (PaSS's look-ahead embeddings), or with a tree (m + a, m + a) covering tokens and embeddings alike (BiTA's
        and SPACE's mask groups, drafters/mask_drafting.py).
        """
        if appended is not None and tree is not None:
            if tree.shape[0] != token_ids.shape[0] + appended.shape[0]:
                raise InputError("appended embeddings follow a chain, not a tree over the tokens alone: a tree with "
                                 "appended embeddings covers both, (m + a, m + a)")
            if self.alibi is not None:
                raise InputError("appended embeddings in a tree need a model with position ids (not ALiBi)")
        if self.plan is not None:
            return self._walk(token_ids, tree, logits_for_last, appended)
        m = token_ids.shape[0] + (0 if appended is None else appended.shape[0])
        block = self._block(causal(m) if tree is None else tree)
        mask = None  # for a chain, the model builds its own causal mask over cache + new tokens
        if tree is not None:
            if self.alibi is not None:  # the model's forward would bias tree nodes by cache index, not depth
                if self.keep_layers:
                    raise InputError("an ALiBi model's trees are scored outside its forward, which keeps no layers' "
                                     "hidden states for the drafter that reads them")
                return self._alibi_tree(token_ids, block, logits_for_last)
            check_tree_positions(self.config)
            mask = self._tree_mask(block)
        inputs = dict(position_ids=block.positions.to(self.device, non_blocking=True)[None], attention_mask=mask, use_cache=True,
                      **{kv.cache_keyword(self.model): self.cache})
        if appended is None:
            inputs["input_ids"] = token_ids.to(self.device, non_blocking=True)[None]
        else:
            embedded = self.model.get_input_embeddings()(token_ids.to(self.device, non_blocking=True))
            inputs["inputs_embeds"] = torch.cat([embedded, appended.to(embedded.dtype)])[None]
        if not self.keeps_states:
            return self.model(**inputs, logits_to_keep=logits_for_last).logits[0].float()
        if self.keep_layers:
            inputs["output_hidden_states"] = True
        # the decoder's output, read as it passes (every row, while the LM head sees only the rows asked for)
        decoded = []
        hook = self.model.base_model.register_forward_hook(lambda module, args, output: decoded.append(output[0]))
        try:
            output = self.model(**inputs, logits_to_keep=logits_for_last)
        finally:
            hook.remove()
        if self.keep_hidden and not decoded:  # a causal LM that calls parts of its base model itself (OPT: model.decoder)
            raise InputError(f"{type(self.model).__name__} does not call its base model in its forward, so its final "
                             f"hidden states cannot be read for the drafter that needs them")
        if self.keep_hidden:
            self._keep_hidden(decoded[0][0])
        if self.keep_layers:
            self._keep_layer_states(output.hidden_states)
        return output.logits[0].float()

    def _keep_layer_states(self, states: tuple) -> None:
        """Append the kept layers' inputs (m, k * d) from a forward's hidden_states (embeddings, then each layer's)."""
        if states is None or max(self.keep_layers) >= len(states):
            raise InputError(f"{type(self.model).__name__} returned {0 if states is None else len(states)} hidden "
                             f"states; the drafter reads those entering layers {list(self.keep_layers)}")
        kept = torch.cat([states[index][0] for index in self.keep_layers], dim=-1)
        self.layer_hidden = kept if self.layer_hidden is None else torch.cat([self.layer_hidden, kept])

    def _block(self, pattern: torch.Tensor) -> Block:
        return Block(kv.cache_length(self.cache), pattern, self.position_offset)

    def _walk(self, token_ids: torch.Tensor, tree: torch.Tensor | None, logits_for_last: int,
              appended: torch.Tensor | None) -> torch.Tensor:
        """As forward, walking the layers as the plan says."""
        if appended is not None or self.keeps_states:
            raise InputError(f"{self.plan.purpose} walks the layers itself: it neither takes appended embeddings "
                             f"nor keeps hidden states")
        block = self._block(causal(token_ids.shape[0]) if tree is None else tree)
        positions = block.positions[None].to(self.device)
        hidden = self.decoder.embed(token_ids, positions)
        hidden = self.decoder.through(range(len(self.decoder.layers)), hidden, positions=positions,
                                      mask=block.mask(self.dtype, self.device), cache=self.cache,
                                      sub_blocks=self.plan.sub_blocks)
        return self.decoder.logits(hidden[:, -logits_for_last:])[0]

    def _keep_hidden(self, hidden: torch.Tensor) -> None:
        """Append the final hidden states (m, d) of a forward's tokens, if kept."""
        if self.keep_hidden:
            self.hidden = hidden if self.hidden is None else torch.cat([self.hidden, hidden])

    def _alibi_tree(self, token_ids: torch.Tensor, block: Block, logits_for_last: int) -> torch.Tensor:
        hidden = alibi_tree_hidden(self.model, self.alibi, token_ids, block.allowed,
                                   block.key_indices + self.position_offset, self.cache)
        self._keep_hidden(hidden)
        return self.model.get_output_embeddings()(hidden[-logits_for_last:]).float()  # ALiBi models scale no logits

    def _tree_mask(self, block: Block):
        """The additive mask (1, 1, m, n) of a tree block; with a sliding window, the mask of the windowed layers
        has the keys that are window or more positions back blocked too, and a model that also has
        full-attention layers gets both masks, by HF's layer type names."""
        full = block.mask(self.dtype, self.device)
        if self.window is None:
            return full
        within = (block.positions - self.position_offset)[:, None] - block.key_indices[None, :] < self.window
        windowed = blocking_mask(block.allowed & within, self.dtype)[None, None].to(self.device, non_blocking=True)
        return {FULL: full, SLIDING: windowed} if self.mixed_attention else windowed

    def describe(self) -> dict:
        """What the runner's own way of decoding did, for the result's stats (early exit: layers used); {} here."""
        return {}

    def close(self) -> None:
        """Release what the runner holds beyond its own lifetime (a static cache's slot); nothing here."""

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
            keep = keep.to(self.device, non_blocking=True)  # (a host-built index: no wait for the device)
            kv.compact(self.cache, keep)
        if self.hidden is not None:
            self.hidden = self.hidden[keep]
        if self.layer_hidden is not None:
            self.layer_hidden = self.layer_hidden[keep]


def sliding_window(windows: list[int | None]) -> int | None:
    """The one sliding window of a model's windowed layers (windows: per layer, None for full attention), None
    if it has none. HF passes a model one mask per layer type, so layers with different windows are refused."""
    sizes = {window for window in windows if window is not None}
    if len(sizes) > 1:
        raise InputError(f"this model's layers have different sliding windows ({sorted(sizes)}); accelgen's masks "
                         f"take one window per model")
    return next(iter(sizes), None)
