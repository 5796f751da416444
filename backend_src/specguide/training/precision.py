"""The dtype of the draft head's training matmuls: bfloat16 autocast where the hardware has
bf16 dot products (fp32 master weights and losses either way), else float32."""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

log = logging.getLogger("specguide.train")

CHOICES = ("auto", "float32", "bfloat16")
MIN_SPEEDUP = 1.5  # "auto" on CPU: bf16 only when it is clearly faster (emulated bf16 is slower)


def training_autocast(choice: str, device: torch.device, hidden: int) -> Optional[torch.dtype]:
    """None (float32) or torch.bfloat16. "auto": CUDA with bf16 support; on CPU, bf16 when a bf16
    GEMM of the head's MLP shape measures >= MIN_SPEEDUP x float32 (AVX512-BF16, AMX)."""
    if choice not in CHOICES:
        raise ValueError(f"matmul dtype {choice!r}: expected one of {', '.join(CHOICES)}")
    if choice != "auto":
        return torch.bfloat16 if choice == "bfloat16" else None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    if device.type != "cpu":
        return None
    fp32, bf16 = (gemm_seconds(dtype, hidden) for dtype in (torch.float32, torch.bfloat16))
    log.info("training matmuls: bf16 GEMM %.2f ms vs fp32 %.2f ms -> %s", bf16 * 1e3, fp32 * 1e3,
             "bfloat16 autocast" if fp32 >= MIN_SPEEDUP * bf16 else "float32")
    return torch.bfloat16 if fp32 >= MIN_SPEEDUP * bf16 else None


def gemm_seconds(dtype: torch.dtype, hidden: int, rows: int = 256, repeats: int = 8) -> float:
    """Best time of [rows, hidden] @ [hidden, 4 hidden] in `dtype` on the CPU."""
    a = torch.randn(rows, hidden).to(dtype)
    b = torch.randn(hidden, 4 * hidden).to(dtype)
    a @ b  # first call: lazy initialisation, packing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return best
