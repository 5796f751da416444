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
