"""Roll back a HF KV cache after verification: crop for chains, gather-compact for trees.

Also stacks per-sequence caches into one padded batch and splits it again (see models/batch.py).

Works on the tensors of each layer of a `DynamicCache` (keys/values of shape (batch, kv_heads, seq, head_dim)).
Every layer keeps every position, sliding-window layers included: HF's window cache drops the oldest positions
as it goes, which a rejected draft could not give back, while a full cache can always be cropped. The window
is then kept by the attention masks (`layer_windows`, used by models/runner.py). Layers whose state cannot be
rolled back (recurrent / linear-attention states) are refused early, as HF refuses them assisted generation.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

from accelgen.errors import InputError

# HF's layer types (transformers.cache_utils) that accelgen decodes: attention over a KV cache it can roll back
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def cache_keyword(module: torch.nn.Module) -> str:
    """The keyword a model, decoder layer or attention module takes its KV cache by: `cache` in newer
    transformers releases, `past_key_values` before (still accepted there, with a deprecation warning), and
    `layer_past` in some attention modules (GPT-NeoX, Bloom)."""
    return _cache_keyword(type(module))


@lru_cache(maxsize=None)
def _cache_keyword(module_type: type) -> str:
    call = getattr(module_type, "forward", None) or module_type.__call__  # a stand-in model may define only __call__
    parameters = inspect.signature(call).parameters
    return next((name for name in ("cache", "layer_past") if name in parameters), "past_key_values")


def new_cache(config) -> DynamicCache:
    """An empty cache with one full (never windowed) layer per decoder layer of the model `config` describes."""
    windows = layer_windows(config)
    return DynamicCache(ddp_cache_data=[(None, None)] * len(windows))  # no data: empty full `DynamicLayer`s


def layer_windows(config) -> list[int | None]:
    """Per decoder layer, its sliding window (a query at position p sees the keys at positions q with
    p - q < window, as HF's masks) or None for full attention. Read from HF's own description of the layers,
    the one its `DynamicCache(config=...)` is built from. A ValueError names a layer kind accelgen cannot decode."""
    layer_types, layer_options = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    refused = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
    if refused:
        raise InputError(f"{config.model_type} has {', '.join(refused)} layers, which accelgen cannot decode: "
                         f"verifying drafts needs full or sliding-window attention over a KV cache that can be rolled "
                         f"back after a rejected draft (a recurrent state cannot be; HF refuses such models assisted "
                         f"generation too)")
    return [options.get("sliding_window") for options in layer_options]


def cache_length(cache: DynamicCache) -> int:
    """Positions held, read from the highest layer that holds any: every verified token reaches it, while lower
    layers may hold more (a layer-skipping draft's tokens) or fewer (SkipDecode), and a layer whose attention a
    draft skips holds none."""
    for layer in reversed(cache.layers):
        if layer.is_initialized:
            return layer.keys.shape[-2]
    return 0


def layer_length(cache: DynamicCache, index: int) -> int:
    """Positions held by one layer (layers may differ: early exit and LayerSkip fill the upper ones later)."""
    layer = cache.layers[index]
    return layer.keys.shape[-2] if layer.is_initialized else 0


def crop(cache: DynamicCache, length: int, layers: range | None = None) -> None:
    """Keep the first `length` positions (of the layers `layers`, default all)."""
    for layer in _chosen(cache, layers):
        if layer.is_initialized:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def compact(cache: DynamicCache, keep: torch.Tensor, layers: range | None = None) -> None:
    """Keep the positions `keep` (1-D, increasing), in that order, of the layers `layers` (default all):
    gathers an accepted tree path to the front.

    Example: 10 committed positions, then root at 10 and draft nodes at 11..14; accepting nodes 0 and 2
    keeps positions [0..10, 11, 13], so the cache again holds one contiguous accepted sequence.
    """
    for layer in _chosen(cache, layers):
        if layer.is_initialized:
            keep = keep.to(layer.keys.device, non_blocking=True)  # (a host-built index: no wait for the device)
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)


def _chosen(cache: DynamicCache, layers: range | None) -> list[DynamicLayer]:
    return cache.layers if layers is None else [cache.layers[index] for index in layers]


def gather(cache: DynamicCache, positions: list[torch.Tensor], config) -> DynamicCache:
    """A new cache holding, in each layer i, the positions positions[i] (1-D, increasing) of that layer."""
    gathered = new_cache(config)
    for layer, source, keep in zip(gathered.layers, cache.layers, positions):
        _fill(layer, source.keys.index_select(-2, keep.to(source.keys.device)),
              source.values.index_select(-2, keep.to(source.values.device)))
    return gathered


def stack_left_padded(caches: list[DynamicCache], lengths: list[int], config) -> DynamicCache:
    """One cache of batch len(caches) holding each (batch-1) cache left-padded with zeros to the longest."""
    batched = new_cache(config)
    longest = max(lengths)
    if longest == 0:
        return batched
    for index, layer in enumerate(batched.layers):
        rows = [cache.layers[index] for cache in caches]
        reference = next(row for row in rows if row.is_initialized)
        keys = [_left_padded(row.keys if row.is_initialized else reference.keys[..., :0, :], longest) for row in rows]
        values = [_left_padded(row.values if row.is_initialized else reference.values[..., :0, :], longest) for row in rows]
        _fill(layer, torch.cat(keys), torch.cat(values))
    return batched


def row_of(batched: DynamicCache, row: int, spans: list[tuple[int, int]], config) -> DynamicCache:
    """The (batch-1) cache of one row of a batched cache, keeping the positions in `spans` ([start, end) pairs)."""
    cache = new_cache(config)
    for layer, source in zip(cache.layers, batched.layers):
        _fill(layer, torch.cat([source.keys[row : row + 1, :, start:end] for start, end in spans], dim=-2),
              torch.cat([source.values[row : row + 1, :, start:end] for start, end in spans], dim=-2))
    return cache


def _left_padded(states: torch.Tensor, length: int) -> torch.Tensor:
    """(1, heads, n, dim) -> (1, heads, length, dim) with zeros in front."""
    padding = states.new_zeros(*states.shape[:-2], length - states.shape[-2], states.shape[-1])
    return torch.cat([padding, states], dim=-2)


def _fill(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
