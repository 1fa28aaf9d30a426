"""A block of new tokens appended after a KV cache, and the geometry of its forward: where every position and
attention mask of accelgen's forwards is built.

A block is m new tokens after the `cached` entries of a cache, arranged by a pattern (m, t + m) bool:
pattern[r, c] says whether new token r sees the c-th of the last t cached entries (a tree going on from levels
already cached) or of the new tokens. A causal chain is the lower triangle; a token tree has each row its
ancestors and itself; PPD's candidates see themselves only. Everything before those t entries is always seen.

A token's position is the position of the pattern's first column plus its depth (the entries it sees among the
pattern's columns, itself excluded): the next position for every link of a chain, the same one for siblings.
`offset` counts positions the cache leaves out (a sparse cache, as TriForce's), so that positions stay true
while cache indices count entries held.

Batches of blocks are left-padded into one forward (`left_padded`): see models/batch.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen.draft import causal


def blocking_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., m, n) additive attention mask from allowed (..., m, n) bool: 0 where allowed, the dtype's minimum
    elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


@dataclass(frozen=True)
class Block:
    """The geometry of m new tokens after `cached` cache entries, arranged by `pattern` (m, t + m) bool."""

    cached: int
    pattern: torch.Tensor
    offset: int = 0  # positions the cache leaves out before its entries

    @classmethod
    def chain(cls, cached: int, m: int, offset: int = 0) -> "Block":
        return cls(cached, causal(m), offset)

    @property
    def first(self) -> int:
        """Cache index of the pattern's first column: the cached levels of a tree, else the first new token."""
        return self.cached - (self.pattern.shape[1] - self.pattern.shape[0])

    @property
    def positions(self) -> torch.Tensor:
        """(m,) long: each new token's position, the pattern's start + its depth."""
        return self.offset + self.first + self.pattern.cpu().sum(dim=-1) - 1

    @property
    def allowed(self) -> torch.Tensor:
        """(m, cached + m) bool: the keys each new token sees (before any sliding window)."""
        m = self.pattern.shape[0]
        return torch.cat([torch.ones(m, self.first, dtype=torch.bool), self.pattern.cpu()], dim=1)

    @property
    def key_indices(self) -> torch.Tensor:
        """(cached + m,) long: the position of every key the block attends to, counted in the cache (offset
        left out): the entries before the pattern, then each of its columns at first + its depth. A column's
        depth is read off any row that sees it, its ancestors being exactly the earlier columns that row sees
        (a column no new row sees is blocked: its position is moot)."""
        pattern = self.pattern.cpu()
        depths = torch.where(pattern, pattern.cumsum(dim=1) - 1, -1).amax(dim=0).clamp(min=0)  # (t + m,)
        return torch.cat([torch.arange(self.first), self.first + depths])

    def mask(self, dtype: torch.dtype, device) -> torch.Tensor:
        """(1, 1, m, cached + m) additive attention mask."""
        return blocking_mask(self.allowed, dtype)[None, None].to(device, non_blocking=True)

    def walk_mask(self, dtype: torch.dtype, device) -> torch.Tensor | None:
        """The mask of a walk through the layers: None for one token, which sees the whole cache anyway."""
        return None if self.pattern.shape[0] == 1 else self.mask(dtype, device)


def left_padded(blocks: list[Block]) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (b, M) and allowed keys (b, M, L + M) bool of blocks (no cached tree levels) in one padded
    forward, row i laid out [pad · (L - L_i) | cache · L_i | pad · (M - m_i) | new · m_i] with L, M the largest
    cache and block. Padding queries see themselves only (their outputs are thrown away)."""
    cached, new = max(block.cached for block in blocks), max(block.pattern.shape[0] for block in blocks)
    positions = torch.zeros(len(blocks), new, dtype=torch.long)
    allowed = torch.zeros(len(blocks), new, cached + new, dtype=torch.bool)
    for row, block in enumerate(blocks):
        width = block.pattern.shape[0]
        pad = new - width  # padding before this row's new tokens
        positions[row, pad:] = block.positions
        positions[row, :pad] = block.offset + block.cached
        allowed[row, pad:, cached - block.cached : cached] = True
        allowed[row, pad:, cached + pad :] = block.pattern.cpu()
        allowed[row, :pad, cached : cached + pad] = torch.eye(pad, dtype=torch.bool)
    return positions, allowed
