"""Weights in the kernels' formats: int8 per output channel, GGUF Q4_1 / Q8_0 blocks (exact on a
dequantized checkpoint of that format) and their integer-dot variants, packed into ops.c's tiles
of TILE outputs; `dequantized` gives the fp32 weight each format multiplies by."""
from __future__ import annotations

from typing import Optional

import torch

from ..config import WEIGHT_FORMATS
from .bindings import QBLK, TILE


def _tiles(w: torch.Tensor) -> torch.Tensor:
    """[O, I] -> the kernel's layout [ceil(O/64), I, 64] (zero rows pad O), any dtype."""
    O, I = w.shape
    pad = (-O) % TILE
    if pad:
        w = torch.cat([w, w.new_zeros(pad, I)])
    return w.reshape(-1, TILE, I).transpose(1, 2).contiguous()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: W [O, I] ~ q [O, I] * scale [O, 1]; scale = max|W[o]| / 127."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.squeeze(1).contiguous()


def _fp16_steps(d: torch.Tensor, step: int) -> torch.Tensor:
    """The fp16 value `step` ulps away from d (d >= 0, fp16)."""
    bits = (d.view(torch.int16).to(torch.int32) + step).clamp_(0, 0x7BFF).to(torch.int16)
    return bits.view(torch.float16)


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    O, I = weight.shape
    if I % QBLK:
        raise ValueError(f"block formats need in_features % {QBLK} == 0, got {I}")
    return weight.detach().float().reshape(O, I // QBLK, QBLK)


def _fit(v: torch.Tensor, d0: torch.Tensor, m: torch.Tensor, qmin: int, qmax: int):
    """q = round((v - m) / d) for d = d0 or one fp16 ulp either side, per block the first for which
    q * d + m gives back v exactly (else d0): (q [O, nb, 32], d [O, nb], exact [O, nb])."""
    def try_d(d16: torch.Tensor):
        d = d16.float()[..., None]
        q = torch.round((v - m) / torch.where(d > 0, d, torch.ones_like(d))).clamp_(qmin, qmax)
        q = torch.where(d > 0, q, torch.zeros_like(q))
        return q, ((q * d + m) == v).all(-1)
    q, exact = try_d(d0)
    d = d0.float()
    for step in (1, -1):
        if bool(exact.all()):
            break
        qs, ok = try_d(_fp16_steps(d0, step))
        new = ok & ~exact
        q = torch.where(new[..., None], qs, q)
        d = torch.where(new, _fp16_steps(d0, step).float(), d)
        exact |= ok
    return q, d, exact


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """GGUF Q4_1 per block of 32 inputs: W ~ q * d + m, q in [0, 15], d and m fp16 values.

    Where W already is such a block (a dequantized Q4_1 checkpoint: every block of the default
    model) the block found gives W back exactly; elsewhere it rounds as llama.cpp does.
    Returns q [O, I] uint8, d [O, I/32], m [O, I/32] (fp32 holding fp16 values), and whether
    every block is exact."""
    v = _blocks(weight)
    m = v.amin(-1).half().float()
    d0 = ((v.amax(-1) - m) / 15).clamp_(0, 65504).half()
    q, d, exact = _fit(v, d0, m[..., None], 0, 15)
    return q.to(torch.uint8).reshape(weight.shape), d, m, bool(exact.all())


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """GGUF Q8_0 per block of 32 inputs: W ~ q * d, q in [-127, 127], d an fp16 value (exact on a
    dequantized Q8_0 checkpoint). Returns q [O, I] int8, d [O, I/32], whether every block is exact."""
    v = _blocks(weight)
    d0 = (v.abs().amax(-1) / 127).clamp_(0, 65504).half()
    q, d, exact = _fit(v, d0, torch.zeros_like(v[..., :1]), -127, 127)
    return q.to(torch.int8).reshape(weight.shape), d, bool(exact.all())


def _pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = _tiles(q)  # [T, I, 64]: lane j in the low nibble of byte j, lane j + 32 in its high nibble
    return (t[..., :32] | (t[..., 32:] << 4)).contiguous(), torch.stack([_tiles(d), _tiles(m)], 2).half()


# The block formats' integer-dot variants: the same weights times int8 activations (quantized per
# row and block of 32 at each call, as llama.cpp's q8 activations), summed in integers (ops.c)
INT_DOT = {"q4_1": "q4_1_q8", "q8_0": "q8_0_q8"}
FORMATS = WEIGHT_FORMATS + tuple(INT_DOT.values())  # every format pack_weight makes


def int_dot(fmt: str) -> str:
    """`fmt`'s integer-dot variant (itself when it has none)."""
    return INT_DOT.get(fmt, fmt)


def _groups(t: torch.Tensor) -> torch.Tensor:
    """Tiles [T, I, 64] -> [T, I/4, 64, 4]: an output's 4 consecutive inputs in one 32-bit lane."""
    T, I, _ = t.shape
    return t.reshape(T, I // 4, 4, TILE).transpose(2, 3).contiguous()


def _pack_q4_1_q8(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = _groups(_tiles(q))  # [T, I/4, 64, 4]: output j in the low nibbles, output j + 32 in the high ones
    return (g[:, :, :32] | (g[:, :, 32:] << 4)).contiguous(), torch.stack([_tiles(d), _tiles(m)], 2).half()


def _pack_q8_0_q8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    O, I = q.shape
    qsum = q.to(torch.int16).reshape(O, I // QBLK, QBLK).sum(-1, dtype=torch.int16)  # |sum| <= 32 * 127
    aux = torch.stack([_tiles(d).half().view(torch.int16), _tiles(qsum)], 2)  # [T, I/32, 2, 64]: d bits, sum q
    return _groups(_tiles(q)), aux.contiguous()


def unpack_q8_0(weight_dtype: str, packed: torch.Tensor, aux: torch.Tensor, out_features: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of pack_weight for q8_0 and q8_0_q8: (q [O, I] int8, d [O, I/32] fp16)."""
    T, I = packed.shape[0], packed.shape[1] * (4 if weight_dtype == "q8_0_q8" else 1)
    if weight_dtype == "q8_0_q8":  # [T, I/4, 64, 4] -> tiles [T, I, 64]; aux [T, I/32, 2, 64]: d bits, sum q
        packed, aux = packed.transpose(2, 3).reshape(T, I, TILE), aux[:, :, 0].view(torch.float16)
    q = packed.transpose(1, 2).reshape(-1, I)[:out_features]
    return q.contiguous(), aux.transpose(1, 2).reshape(-1, I // QBLK)[:out_features].contiguous()


def pack_weight(weight: torch.Tensor, weight_dtype: str = "float32") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """W [O, I] fp32 -> (packed tiles in `weight_dtype`, aux): aux is None (float32, bfloat16), the
    per-row scale [O] (int8), d and m [O/64, I/32, 2, 64] (q4_1) or d [O/64, I/32, 64] (q8_0), fp16
    as GGUF stores them (exact: they are fp16 values). The integer-dot variants (q4_1_q8, q8_0_q8)
    hold the same blocks in 4-input groups (ops.c's layout)."""
    assert weight_dtype in FORMATS, weight_dtype
    if weight_dtype == "q4_1_q8":
        return _pack_q4_1_q8(*quantize_q4_1(weight)[:3])
    if weight_dtype == "q8_0_q8":
        return _pack_q8_0_q8(*quantize_q8_0(weight)[:2])
    if weight_dtype in ("float32", "bfloat16"):
        return _tiles(weight.detach().to(getattr(torch, weight_dtype))), None
    if weight_dtype == "q4_1":
        return _pack_q4_1(*quantize_q4_1(weight)[:3])
    if weight_dtype == "q8_0":
        q, d, _ = quantize_q8_0(weight)
        return _tiles(q), _tiles(d).half()
    q, scale = quantize_int8(weight.detach())
    return _tiles(q), scale


def pack_exact(weight: torch.Tensor, integer_dot: bool = False) -> tuple[str, torch.Tensor, Optional[torch.Tensor]]:
    """`weight_dtype` auto: (format, packed, aux) in the narrowest format that holds `weight`
    exactly: q4_1, q8_0, bfloat16 or float32 (each block format quantized once, packed from that);
    with `integer_dot` a block format's integer-dot variant (int8 activations)."""
    w = weight.detach().float()
    if w.shape[1] % QBLK == 0:
        q, d, m, exact = quantize_q4_1(w)
        if exact:
            return ("q4_1_q8", *_pack_q4_1_q8(q, d, m)) if integer_dot else ("q4_1", *_pack_q4_1(q, d, m))
        q8, d8, exact = quantize_q8_0(w)
        if exact:
            return ("q8_0_q8", *_pack_q8_0_q8(q8, d8)) if integer_dot else ("q8_0", _tiles(q8), _tiles(d8).half())
    fmt = "bfloat16" if torch.equal(w.to(torch.bfloat16).float(), w) else "float32"
    return (fmt, *pack_weight(w, fmt))


def exact_format(weight: torch.Tensor) -> str:
    """The format `pack_exact` picks for `weight`."""
    return pack_exact(weight)[0]


def dequantized(weight: torch.Tensor, weight_dtype: str) -> torch.Tensor:
    """The fp32 weight the kernel for `weight_dtype` effectively multiplies by (for references)."""
    if weight_dtype == "bfloat16":
        return weight.to(torch.bfloat16).float()
    if weight_dtype == "int8":
        q, scale = quantize_int8(weight)
        return q.float() * scale[:, None]
    if weight_dtype in ("q4_1", "q4_1_q8"):
        q, d, m, _ = quantize_q4_1(weight)
        return (q.float().reshape(*d.shape, QBLK) * d[..., None] + m[..., None]).reshape(weight.shape)
    if weight_dtype in ("q8_0", "q8_0_q8"):
        q, d, _ = quantize_q8_0(weight)
        return (q.float().reshape(*d.shape, QBLK) * d[..., None]).reshape(weight.shape)
    return weight.float()
