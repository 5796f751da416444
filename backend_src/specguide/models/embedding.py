"""The token embedding in GGUF Q8_0 blocks where its rows are exactly such values (CPU).

A GGUF checkpoint keeps the embedding in Q8_0 (the default model's: every row is 32-input blocks of
q * d, q int8 and d an fp16 value), so the fp32 table the loader makes from it (108 MiB for the
default model) holds nothing that q and d (28 MiB) do not. `Q8Rows` keeps only those; a row looked
up is `q * d` in fp32, the same bits as the fp32 table's (checked bit for bit when it is made).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import kernels

_SAMPLE_ROWS = 64  # rows quantized first (evenly spread): a table that is not Q8_0 values is told in microseconds


class Q8Rows(nn.Module):
    """Rows [V, D] held as Q8_0: q [V, D] int8, d [V, D/32] fp16. `forward(ids)` -> fp32 [..., D]."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor):
        super().__init__()
        self.register_buffer("q", q.contiguous(), persistent=False)  # [V, D] int8
        self.register_buffer("d", d.to(torch.float16).contiguous(), persistent=False)  # [V, D/32] fp16
        self.num_embeddings, self.embedding_dim = q.shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.q.device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = kernels.q8_rows(self.q, self.d, ids)
        if out is not None:
            return out
        q, d = self.q[ids], self.d[ids]  # [..., D], [..., D/32]
        return (q.float().unflatten(-1, (-1, kernels.QBLK)) * d.float().unsqueeze(-1)).flatten(-2)

    @classmethod
    def of(cls, weight: torch.Tensor, head: Optional[nn.Module] = None) -> Optional["Q8Rows"]:
        """`weight` [V, D] (CPU fp32) as Q8Rows when every row is exactly Q8_0 values, else None.
        `head`: an LM head packed from these same rows (tied) in a Q8_0 format, whose blocks are
        then unpacked instead of quantizing the table again."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 \
                or weight.shape[1] % kernels.QBLK:
            return None
        sample = torch.linspace(0, weight.shape[0] - 1, min(_SAMPLE_ROWS, weight.shape[0])).long()
        if not kernels.quantize_q8_0(weight[sample])[2]:
            return None
        unpacked = _unpack_head(head, weight.shape) if head is not None else None
        q, d = unpacked if unpacked is not None else kernels.quantize_q8_0(weight)[:2]
        rows = cls(q, d)
        same = rows(torch.arange(weight.shape[0])).view(torch.int32)  # bit for bit: -0.0 and NaN included
        return rows if torch.equal(same, weight.detach().view(torch.int32)) else None


def _unpack_head(head: nn.Module, shape: torch.Size) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(q [V, D] int8, d [V, D/32] fp16) of an LM head packed in q8_0 or q8_0_q8, None for any other head."""
    fmt = getattr(head, "weight_dtype", None)
    if fmt not in ("q8_0", "q8_0_q8") or (head.out_features, head.in_features) != tuple(shape):
        return None
    return kernels.unpack_q8_0(fmt, head.packed, head.scale, shape[0])
