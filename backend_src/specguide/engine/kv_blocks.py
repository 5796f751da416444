"""The KV blocks of the running sequences: how many each needs for its next write, whether a new
one fits beside them, and prefix sharing (keying the blocks a sequence computed, sharing a later
one's prefix, waiting for a prefix another prompt is computing). The scheduler decides who runs;
this decides what each holds. Pure Python (the pool's table is numpy)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from .block_pool import BLOCK, BlockPool, block_keys

if TYPE_CHECKING:
    from .scheduler import Sequence


class KVBlocks:
    """The one owner of `pool` (its block table rows, one per slot) for the scheduler's sequences.

    A running sequence holds blocks for the positions its next forward writes (a decoding one: its
    tokens and `lookahead` draft positions, up to max_seq_len). Prefix sharing (`sharing`): each full
    block a sequence has computed is registered under its key (the hash chain of its tokens and the
    next one); a sequence admitted later whose tokens give the same keys shares those blocks and
    computes only the rest; blocks nobody holds stay cached until needed (BlockPool)."""

    wait_min_blocks = 4  # a shorter shared run costs less to compute again than to wait a step for

    def __init__(self, pool: BlockPool, max_seq_len: int, lookahead: int, sharing: bool, prefix_min_tokens: int):
        self.pool = pool
        self.max_seq_len = max_seq_len
        self.lookahead = lookahead  # positions past a decoding sequence's tokens its step may write (drafts)
        self.sharing = sharing  # computed blocks are keyed and shared (chunk-invariant forwards only)
        self.prefix_min_tokens = prefix_min_tokens

    # ---- what a sequence holds -------------------------------------------------------------
    def decode_need(self, seq: Sequence) -> int:
        """Positions a decoding sequence's next step may write: its tokens and its drafts."""
        return min(seq.num_tokens + self.lookahead, self.max_seq_len)

    def grow(self, seq: Sequence, positions: int) -> bool:
        """Blocks for positions [0, positions) of the sequence; False (none given) when too few are free."""
        return self.pool.grow(seq.slot, positions)

    def missing(self, seq: Sequence, positions: int) -> int:
        return self.pool.missing(seq.slot, positions)

    def holds(self, seq: Sequence) -> bool:
        return bool(self.pool.held[seq.slot])

    def release(self, seq: Sequence) -> None:
        """The sequence lets go of its blocks (finished or preempted); what it computed stays cached."""
        self.register(seq)
        self.pool.shrink(seq.slot, 0)

    def fits(self, positions: int, decoding: Iterable[Sequence]) -> bool:
        """Whether positions [0, positions) of a (new or resumed) sequence fit beside the `decoding`
        sequences' next steps (kept free for them; cached prefix blocks count as free)."""
        reserve = sum(self.pool.missing(s.slot, self.decode_need(s) + self.lookahead + 1) for s in decoding)
        return BlockPool.blocks_for(positions) <= self.pool.num_free - reserve

    # ---- prefix sharing --------------------------------------------------------------------
    def share(self, seq: Sequence, limit: int) -> None:
        """The (blockless) sequence takes the cached blocks of its longest keyed prefix within
        tokens[:limit] (each block's key reads the token after it: at least one token is left to
        compute); it computes from there."""
        seq.num_reused = seq.num_cached = seq.registered = 0
        if not (self.sharing and seq.shares):
            return
        tokens = seq.prompt_ids + seq.output_ids if seq.output_ids else seq.prompt_ids
        blocks = self.pool.match(block_keys(tokens, seq.block_keys, limit, seq.adapter_key))
        if not blocks or len(blocks) * BLOCK < self.prefix_min_tokens:
            return
        self.pool.share(seq.slot, blocks)
        seq.num_reused = seq.num_cached = len(blocks) * BLOCK
        seq.registered = len(blocks)

    def register(self, seq: Sequence) -> None:
        """Key the sequence's computed full blocks for sharing: block b once its positions are
        cached (num_cached >= 16b + 16; the token after it is then known)."""
        n = min(seq.num_cached // BLOCK, self.pool.held[seq.slot]) if seq.slot is not None else 0
        if n <= seq.registered or not (self.sharing and seq.shares):
            return
        keys = block_keys(seq.prompt_ids + seq.output_ids, seq.block_keys, seq.num_cached + 1, seq.adapter_key)
        self.pool.register(seq.slot, keys[:n], seq.registered)
        seq.registered = n

    def in_flight(self, seq: Sequence, prefilling: Iterable[Sequence]) -> bool:
        """Whether one of the `prefilling` sequences is computing the next `wait_min_blocks` or more
        blocks of the waiting one's prompt that are not cached yet (16 requests with one system
        prompt, arriving together: the first computes it, the others then share it)."""
        keys = block_keys(seq.prompt_ids, seq.block_keys, len(seq.prompt_ids), seq.adapter_key)
        n = len(self.pool.match(keys))
        for r in prefilling:
            if not r.shares or r.num_cached >= (n + 1) * BLOCK:
                continue
            m, end = n, min(len(keys), len(r.block_keys))
            while m < end and r.block_keys[m] == keys[m]:
                m += 1
            if m - n >= self.wait_min_blocks:
                return True
        return False

    def forget(self, running: Iterable[Sequence]) -> None:
        """No block computed so far is shared, nor any the `running` sequences compute from now on."""
        self.pool.forget()
        for seq in running:
            seq.shares = False
