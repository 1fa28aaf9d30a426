"""Roll back a HF KV cache after verification: crop for chains, gather-compact for trees.

Works on the tensors of each layer of a `DynamicCache` (keys/values of shape (batch, kv_heads, seq, head_dim)).
Caches whose layers cannot be rolled back this way (sliding windows, linear-attention states) are refused early.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


def new_cache(config) -> DynamicCache:
    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            kind = "sliding-window" if isinstance(layer, DynamicSlidingWindowLayer) else type(layer).__name__
            raise NotImplementedError(
                f"accelgen needs a KV cache it can roll back; this model's config asks for {kind} cache layers"
            )
    return cache


def cache_length(cache: DynamicCache) -> int:
    """Positions held, read from the first layer that holds any (a layer skipped while drafting holds none)."""
    for layer in cache.layers:
        if layer.is_initialized:
            return layer.keys.shape[-2]
    return 0


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def compact(cache: DynamicCache, keep: torch.Tensor) -> None:
    """Keep the positions `keep` (1-D, increasing), in that order: gathers an accepted tree path to the front.

    Example: 10 committed positions, then root at 10 and draft nodes at 11..14; accepting nodes 0 and 2
    keeps positions [0..10, 11, 13], so the cache again holds one contiguous accepted sequence.
    """
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys = layer.keys.index_select(-2, keep.to(layer.keys.device))
            layer.values = layer.values.index_select(-2, keep.to(layer.values.device))
