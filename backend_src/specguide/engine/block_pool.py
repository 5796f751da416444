"""The paged KV caches' blocks: which blocks each slot holds (its row of the block table), which
are free, and which full blocks hold a known prefix (shared by every sequence that starts with it).
Pure Python and numpy; the runner's caches read the table (kv_cache.py)."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np

BLOCK = 16  # positions a block holds (kernels.KEY_BLOCK; kv_cache.py checks they agree)


def blocks_per_seq(max_seq_len: int, lookahead: int) -> int:
    """Blocks of a slot's table row: max_seq_len positions and the `lookahead` (draft) positions
    past them, + 1 (the padding rows of captured steps)."""
    return BlockPool.blocks_for(max_seq_len + lookahead + 1)


def block_keys(tokens: Sequence[int], keys: list[bytes], limit: int, seed: bytes = b"") -> list[bytes]:
    """Extend `keys` (block i's key, for the blocks already keyed) to every block b whose positions
    and the one after, [0, 16b + 17), lie within tokens[:limit]; returns the keys of those blocks
    (`keys` may hold more, keyed with a larger limit before). Key b is a hash chain over those
    tokens, from `seed` (the sequence's LoRA adapter): the block's K/V (a function of the tokens up to
    its last position) and the draft head's rows in it (row p reads token p + 1) are the same for
    every sequence with the same key."""
    end = min(limit, len(tokens))
    while (b := len(keys)) * BLOCK + BLOCK < end:
        h = hashlib.blake2b(keys[-1] if keys else seed, digest_size=16)
        h.update(np.asarray(tokens[b * BLOCK: b * BLOCK + BLOCK + 1], np.int64).tobytes())
        keys.append(h.digest())
    return keys[: max(0, (end - 1) // BLOCK)]  # b with 16b + 17 <= end


class BlockPool:
    """Blocks 1 .. num_blocks - 1 of every paged cache, handed to slots as their sequences grow.

    `table` [slots, blocks_per_seq] int32 is shared with the caches (on the CPU the same memory):
    slot s's position p lives in block table[s, p // 16]. Entries past a slot's blocks are 0, a
    block no slot holds, where only dead positions are ever written (padding rows, positions
    past max_seq_len).

    Prefix sharing: a full block whose K/V is computed can be registered under its key
    (`block_keys`); a sequence whose tokens have the same keys takes those blocks into its own table
    row (`share`) instead of computing them, and never writes them (its writes start past them).
    A block counts its holders (`ref`); when none is left a registered block stays cached until
    a block is needed. Blocks are taken in this order: free ones used before; then, while the cache
    holds a sequence row's worth of blocks or as many as are in use, whichever is more, cached ones
    (the least recently freed first); then ones never used. On the CPU a block's pages are taken when
    it is first written: the cache stays within that bound of memory the work already took, and the
    process's memory follows what the work holds, not the whole pool."""

    def __init__(self, table: np.ndarray, num_blocks: int):
        assert table.dtype == np.int32 and table.ndim == 2 and num_blocks >= 2
        self.table = table
        self.table[:] = 0
        self.num_blocks = num_blocks
        self.fresh: list[int] = list(range(num_blocks - 1, 0, -1))  # never handed out: pop() gives the lowest first
        self.free: list[int] = []  # handed out before, unkeyed, unheld
        self.held = [0] * table.shape[0]  # blocks each slot holds: table[s, :held[s]]
        self.ref = [0] * num_blocks  # slots holding each block
        self.key_of: list[Optional[bytes]] = [None] * num_blocks
        self.by_key: dict[bytes, int] = {}  # registered blocks (held or cached)
        self.cached: OrderedDict[int, None] = OrderedDict()  # registered blocks no slot holds, oldest first

    @staticmethod
    def blocks_for(positions: int) -> int:
        """Blocks covering positions [0, positions)."""
        return -(-positions // BLOCK)

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take: unused ones and cached ones (evicted on demand)."""
        return len(self.free) + len(self.cached) + len(self.fresh)

    @property
    def num_used(self) -> int:
        """Blocks some slot holds."""
        return self.num_blocks - 1 - self.num_free

    def missing(self, slot: int, positions: int) -> int:
        """Blocks the slot lacks to hold positions [0, positions)."""
        return max(0, min(self.blocks_for(positions), self.table.shape[1]) - self.held[slot])

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        if self.fresh and len(self.cached) < max(self.table.shape[1], self.num_used):
            return self.fresh.pop()
        b, _ = self.cached.popitem(last=False)  # the least recently used prefix block
        del self.by_key[self.key_of[b]]
        self.key_of[b] = None
        return b

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if self.key_of[b] is not None:
                self.cached[b] = None
            else:
                self.free.append(b)

    def grow(self, slot: int, positions: int) -> bool:
        """Give the slot blocks up to positions [0, positions) (at most its table row); False, and
        nothing given, when too few are free."""
        n = self.missing(slot, positions)
        if n > self.num_free:
            return False
        h = self.held[slot]
        for i in range(h, h + n):
            b = self._take()
            self.table[slot, i] = b
            self.ref[b] = 1
        self.held[slot] = h + n
        return True

    def shrink(self, slot: int, positions: int = 0) -> None:
        """The slot keeps only the blocks of positions [0, positions); it lets go of the rest."""
        keep = self.blocks_for(positions)
        h = self.held[slot]
        if keep >= h:
            return
        for b in self.table[slot, keep:h][::-1]:
            self._release(int(b))
        self.table[slot, keep:h] = 0
        self.held[slot] = keep

    def match(self, keys: list[bytes]) -> list[int]:
        """The registered blocks of the longest run of `keys` from the first."""
        out = []
        for k in keys:
            b = self.by_key.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def share(self, slot: int, blocks: list[int]) -> None:
        """The (empty) slot's first blocks are these registered ones."""
        assert self.held[slot] == 0 and len(blocks) <= self.table.shape[1]
        for i, b in enumerate(blocks):
            if self.ref[b] == 0:
                del self.cached[b]
            self.ref[b] += 1
            self.table[slot, i] = b
        self.held[slot] = len(blocks)

    def register(self, slot: int, keys: list[bytes], start: int = 0) -> None:
        """The slot's blocks start .. len(keys) - 1 are computed: keyed by `keys` for sharing (a key
        already held by another block keeps that one)."""
        for i in range(start, min(len(keys), self.held[slot])):
            b = int(self.table[slot, i])
            if self.key_of[b] is None and keys[i] not in self.by_key:
                self.key_of[b] = keys[i]
                self.by_key[keys[i]] = b

    def forget(self) -> None:
        """No block is shared from now on: cached ones are free, held ones unkeyed."""
        for b in self.by_key.values():
            self.key_of[b] = None
        self.by_key.clear()
        self.free.extend(sorted(self.cached, reverse=True))
        self.cached.clear()

    def check_integrity(self) -> None:
        """Every block is free, cached, or held; held blocks are counted once per holder."""
        refs = [0] * self.num_blocks
        for s, h in enumerate(self.held):
            for b in self.table[s, :h]:
                refs[int(b)] += 1
        assert all(not self.table[s, h:].any() for s, h in enumerate(self.held)), "a table entry past a slot's blocks"
        assert refs[1:] == self.ref[1:], "a block's holders miscounted"
        held = [b for b in range(1, self.num_blocks) if refs[b]]
        assert sorted(held + self.free + list(self.cached) + self.fresh) == list(range(1, self.num_blocks)), \
            "a block leaked, or is both held and free"
        assert all(self.key_of[b] is None for b in self.free + self.fresh), "a free block keeps a key"
        assert all(self.by_key[self.key_of[b]] == b for b in self.cached), "a cached block lost its key"
        assert all(self.key_of[b] == k for k, b in self.by_key.items()), "keys and blocks disagree"
