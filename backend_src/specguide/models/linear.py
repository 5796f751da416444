"""CPU linear layers.

* fp32 with the C kernels available (`InvariantLinear`): `kernels.gemv` over weights packed
  once into 64-wide tiles, held as fp32, bf16, int8 (per-output-channel scales) or GGUF Q4_1 /
  Q8_0 blocks of 32 inputs: weight-only quantization, widened in registers, fp32 activations and accumulation. A row's result never
  depends on the other rows, so greedy output is the same alone or in any batch, and a K+1-row
  verification equals K+1 single steps. It also beats oneDNN at decode sizes (memory-bound,
  ~30 GB/s) and MKL at prefill sizes (~190 GFLOP/s on 2 cores).
* other CPU dtypes (`PackedLinear`): oneDNN with weights reordered once for a batch hint of 16
  (~20 GB/s where MKL's plain GEMV reaches ~10 GB/s).
* elsewhere (CUDA): plain nn.Linear.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import kernels

BATCH_HINT = 16


def packing_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and dtype in (torch.float32, torch.bfloat16))


def invariant_available(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and kernels.library() is not None


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


class InvariantLinear(nn.Module):
    """y = x W^T + b (+ residual), batch-invariant, with W packed for `kernels.gemv` in `weight_dtype`;
    `integer_dot`: block formats (q4_1, q8_0) multiply int8 activations in integer dot products."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], weight_dtype: str = "float32",
                 integer_dot: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if weight_dtype == "auto":  # exact: the format the checkpoint's values already fit
            self.weight_dtype, self.packed, self.scale = kernels.pack_exact(weight, integer_dot)
        else:
            self.weight_dtype = kernels.int_dot(weight_dtype) if integer_dot else weight_dtype
            self.packed, self.scale = kernels.pack_weight(weight.detach(), self.weight_dtype)
        self.bias = None if bias is None else bias.detach()

    @classmethod
    def from_packed(cls, weight_dtype: str, packed: torch.Tensor, scale: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor], out_features: int, in_features: int) -> "InvariantLinear":
        """The layer over weights packed already (`weight_dtype` the format they are in: packed_cache.py)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features = out_features, in_features
        self.weight_dtype, self.packed, self.scale = weight_dtype, packed, scale
        self.bias = None if bias is None else bias.detach()
        return self

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x W^T + b (+ residual); `out`: [rows, out_features] fp32 to write (a caller's static buffer)."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        r2 = None if residual is None else residual.reshape(-1, self.out_features)
        if self.bias is not None:  # bias, then the residual: both per-row adds
            r2 = self.bias.expand(x2.shape[0], -1) if r2 is None else r2 + self.bias
        y = kernels.gemv(x2, self.packed, self.scale, self.out_features, r2, out)
        return y.view(*shape[:-1], self.out_features)

    def forward_tiles(self, x: torch.Tensor, sel: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`forward` (no bias) over the output tiles `sel` only (kernels.gemv_tiles): their outputs
        are the same bits, every other output -inf."""
        assert self.bias is None
        y = kernels.gemv_tiles(x.reshape(-1, self.in_features), self.packed, self.scale, self.out_features, sel,
                               self.weight_dtype, out)
        return y.view(*x.shape[:-1], self.out_features)


def linear_add(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + layer(x), fused when the layer supports it."""
    if isinstance(layer, (PackedLinear, InvariantLinear)):
        return layer(x, residual)
    return residual + layer(x)


def _cpu_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], weight_dtype: str,
                integer_dot: bool = False) -> Optional[nn.Module]:
    if invariant_available(weight):
        return InvariantLinear(weight, bias, weight_dtype, integer_dot)
    if weight_dtype not in ("float32", "auto"):
        raise ValueError(f"weight_dtype {weight_dtype!r} needs the CPU C kernels and dtype float32 "
                         f"(here: {weight.device.type}, {weight.dtype}, kernels: {kernels.unavailable_reason()})")
    if packing_available(weight.device, weight.dtype):
        return PackedLinear(weight, bias)
    return None


def prepare_linears(module: nn.Module, weight_dtype: str = "float32", integer_dot: bool = False) -> int:
    """Replace every nn.Linear under `module` by the best CPU implementation; returns how many.

    `weight_dtype` "bfloat16" / "int8" / "q4_1" / "q8_0" stores the weights so (weight-only
    quantization); "auto" picks per weight the narrowest format that holds it exactly; `integer_dot`:
    see InvariantLinear."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            fast = _cpu_linear(child.weight, child.bias, weight_dtype, integer_dot)
            if fast is not None:
                setattr(module, name, fast)
                n += 1
        else:
            n += prepare_linears(child, weight_dtype, integer_dot)
    return n


HEAD_FORMAT = {"q4_1": "q8_0"}  # as GGUF Q4_1 files keep the embedding / output at 8 bits


def make_head(weight: torch.Tensor, weight_dtype: str = "float32", integer_dot: bool = False) -> nn.Module:
    """An LM head over `weight` [vocab, hidden] (the embedding's own tensor when tied)."""
    fast = _cpu_linear(weight, None, HEAD_FORMAT.get(weight_dtype, weight_dtype), integer_dot)
    if fast is not None:
        return fast
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    lin.weight = nn.Parameter(weight, requires_grad=False)
    return lin
