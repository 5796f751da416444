"""Per-slot K/V as the attention kernel's paged blocks and back, for the kernel tests: each slot's
blocks land at shuffled block ids (block 0 and a spare one belong to no slot), so a kernel that
addressed a slot's positions contiguously instead of through its block table reads the wrong keys."""
from __future__ import annotations

import torch

from specguide import kernels

B = kernels.KEY_BLOCK


def paged(k: torch.Tensor, v: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [slots, kvh, S, hw] (S % 16 == 0) -> the kernel's k [blocks, kvh, hw, 16], v [blocks,
    kvh, 16, hw] and the block table [slots, S / 16] int32."""
    slots, kvh, S, hw = v.shape
    mb = S // B
    n = slots * mb
    ids = 2 + torch.randperm(n, generator=torch.Generator().manual_seed(seed))  # blocks 0, 1: no slot's
    table = ids.view(slots, mb).to(torch.int32)
    kc = torch.zeros(n + 2, kvh, hw, B, dtype=k.dtype)
    vc = torch.zeros(n + 2, kvh, B, hw, dtype=v.dtype)
    kc[ids] = k.reshape(slots, kvh, mb, B, hw).permute(0, 2, 1, 4, 3).reshape(n, kvh, hw, B)
    vc[ids] = v.reshape(slots, kvh, mb, B, hw).permute(0, 2, 1, 3, 4).reshape(n, kvh, B, hw)
    return kc, vc, table


def unpaged(kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `paged`: k, v [slots, kvh, S, hw] (copies)."""
    slots, mb = table.shape
    _, kvh, _, hw = vc.shape
    k = kc[table.long()].transpose(-1, -2)  # [slots, mb, kvh, 16, hw]
    v = vc[table.long()]
    return tuple(x.transpose(1, 2).reshape(slots, kvh, mb * B, hw).contiguous() for x in (k, v))


def empty(slots: int, kvh: int, S: int, hw: int, dtype: torch.dtype, seed: int = 0):
    """A zeroed paged cache of `slots` slots of S positions: (k, v, table)."""
    return paged(torch.zeros(slots, kvh, S, hw, dtype=dtype), torch.zeros(slots, kvh, S, hw, dtype=dtype), seed)
