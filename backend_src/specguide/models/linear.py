"""CPU linear layers with oneDNN-prepacked weights.

At decode batch sizes (1..16 rows) MKL's plain GEMV reads fp32 weights at ~10 GB/s on these
machines; oneDNN with weights reordered once for a batch hint of 16 reaches ~20 GB/s, which is
what decides decode speed for a memory-bound model. Elsewhere (CUDA, no oneDNN) plain nn.Linear.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

BATCH_HINT = 16


def packing_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and dtype in (torch.float32, torch.bfloat16))


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (an opaque tensor)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x W^T + b, plus `residual` fused into the same kernel when given."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if residual is None:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        else:
            y = torch.ops.mkldnn._linear_pointwise.binary(
                x2, residual.reshape(-1, self.out_features), self.packed, self.bias, "add")
        return y.view(*shape[:-1], self.out_features)


def linear_add(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + layer(x), fused when the layer is packed."""
    if isinstance(layer, PackedLinear):
        return layer(x, residual)
    return residual + layer(x)


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear; returns how many."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            n += 1
        else:
            n += pack_linears(child)
    return n


def packed_head(weight: torch.Tensor) -> nn.Module:
    """An LM head over `weight` [vocab, hidden] (a packed copy when tied to the embedding)."""
    if packing_available(weight.device, weight.dtype):
        return PackedLinear(weight, None)
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    lin.weight = nn.Parameter(weight, requires_grad=False)
    return lin


