"""Static per-slot KV cache, allocated once."""
from __future__ import annotations

import torch


class KVCache:
    """K and V of shape [layers, max_slots, kv_heads, max_seq_len + spare, head_dim].

    `spare` positions past max_seq_len absorb the padded draft positions of a verification step.

    A slot's valid length lives in the scheduler; entries past it are dead and overwritten later,
    so rejecting draft tokens needs no cache work.

    For reporting (TRT-LLM perf metrics) a slot's positions count in blocks of `tokens_per_block`."""

    tokens_per_block = 32

    def __init__(self, num_layers: int, max_slots: int, num_kv_heads: int, max_seq_len: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu", spare: int = 0):
        shape = (num_layers, max_slots, num_kv_heads, max_seq_len + spare, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len + spare  # positions the cache holds

    def copy_rows(self, src: int, dst: int, start: int, end: int) -> None:
        """Positions [start, end) of every layer from slot src into slot dst."""
        self.k[:, dst, :, start:end] = self.k[:, src, :, start:end]
        self.v[:, dst, :, start:end] = self.v[:, src, :, start:end]

    def blocks(self, positions: int) -> int:
        """Blocks covering `positions` token positions."""
        return -(-positions // self.tokens_per_block)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


MAX_AUTO_SLOTS = 256  # what sizing from free memory may give (the interfaces batch up to 64 a request)


def slot_bytes(num_layers: int, num_kv_heads: int, head_dim: int, hidden_size: int, positions: int,
               elem_bytes: int) -> int:
    """Device bytes one slot takes: the target's K and V over every layer, the draft head's
    features and its one-layer K and V (the default drafter), all at `positions`."""
    kv = 2 * (num_layers + 1) * num_kv_heads * head_dim * positions * elem_bytes
    return kv + hidden_size * positions * elem_bytes


def slots_for_memory(free_bytes: int, fraction: float, per_slot: int, cap: int = MAX_AUTO_SLOTS) -> int:
    """Slots that `fraction` of `free_bytes` holds at `per_slot` bytes each: in [1, cap]."""
    assert 0 < fraction <= 1 and per_slot > 0
    return max(1, min(cap, int(free_bytes * fraction) // per_slot))
