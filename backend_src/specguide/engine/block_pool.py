"""The paged KV caches' blocks: which blocks each slot holds (its row of the block table) and which
are free. Pure Python and numpy; the runner's caches read the table (kv_cache.py)."""
from __future__ import annotations

import numpy as np

BLOCK = 16  # positions a block holds (kernels.KEY_BLOCK; kv_cache.py checks they agree)


def blocks_per_seq(max_seq_len: int, lookahead: int) -> int:
    """Blocks of a slot's table row: max_seq_len positions and the `lookahead` (draft) positions
    past them, + 1 (the padding rows of captured steps)."""
    return BlockPool.blocks_for(max_seq_len + lookahead + 1)


class BlockPool:
    """Blocks 1 .. num_blocks - 1 of every paged cache, handed to slots as their sequences grow.

    `table` [slots, blocks_per_seq] int32 is shared with the caches (on the CPU the same memory):
    slot s's position p lives in block table[s, p // 16]. Entries past a slot's blocks are 0, a
    block no slot holds, where only dead positions are ever written (padding rows, positions
    past max_seq_len)."""

    def __init__(self, table: np.ndarray, num_blocks: int):
        assert table.dtype == np.int32 and table.ndim == 2 and num_blocks >= 2
        self.table = table
        self.table[:] = 0
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))  # pop() hands out the lowest first
        self.held = [0] * table.shape[0]  # blocks each slot holds: table[s, :held[s]]

    @staticmethod
    def blocks_for(positions: int) -> int:
        """Blocks covering positions [0, positions)."""
        return -(-positions // BLOCK)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def missing(self, slot: int, positions: int) -> int:
        """Blocks the slot lacks to hold positions [0, positions)."""
        return max(0, min(self.blocks_for(positions), self.table.shape[1]) - self.held[slot])

    def grow(self, slot: int, positions: int) -> bool:
        """Give the slot blocks up to positions [0, positions) (at most its table row); False, and
        nothing given, when too few are free."""
        n = self.missing(slot, positions)
        if n > len(self.free):
            return False
        h = self.held[slot]
        for i in range(h, h + n):
            self.table[slot, i] = self.free.pop()
        self.held[slot] = h + n
        return True

    def shrink(self, slot: int, positions: int = 0) -> None:
        """The slot keeps only the blocks of positions [0, positions); the rest are free."""
        keep = self.blocks_for(positions)
        h = self.held[slot]
        if keep >= h:
            return
        self.free.extend(int(b) for b in self.table[slot, keep:h][::-1])
        self.table[slot, keep:h] = 0
        self.held[slot] = keep

    def check_integrity(self) -> None:
        """Every block is free or held by exactly one slot, once."""
        held = [int(b) for s, h in enumerate(self.held) for b in self.table[s, :h]]
        assert all(not self.table[s, h:].any() for s, h in enumerate(self.held)), "a table entry past a slot's blocks"
        assert sorted(held + self.free) == list(range(1, self.num_blocks)), "a block leaked or is held twice"
