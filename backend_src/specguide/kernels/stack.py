"""A decoder stack's forward in one C call (`forward_f32` in ops.c): the layers' packed weights and
norms described once as C structs, the per-forward arguments (caches, RoPE tables, rows) per call.

The Python path makes ~15 calls a layer (ctypes, torch ops, allocations); at batch 1 those cost as
much as streaming the weights, so the CPU fp32 forward of every Llama-family model runs here when
its linears are the C kernels' (models/llama.py decides). The results are the same per-row and
batch-invariant kernels, called in one parallel region."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .bindings import KV_KINDS, WEIGHT_KINDS
from .build import library
from .ops import kv_row_width

_P = ctypes.c_void_p
ACTS = {"silu": 0, "gelu_tanh": 1}


class LayerStruct(ctypes.Structure):
    """ops.c `layer_t`: one decoder layer's weights (pointers into tensors the owner keeps alive)."""

    _fields_ = [("w", _P * 4), ("aux", _P * 4), ("kind", ctypes.c_int * 4), ("local", ctypes.c_int),
                ("qkv_bias", _P), ("in_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P),
                ("attn_out_norm", _P), ("mlp_out_norm", _P)]


class StackStruct(ctypes.Structure):
    """ops.c `stack_t`: shapes, attention settings, RoPE tables and caches of one forward."""

    _fields_ = [("hidden", ctypes.c_int), ("inter", ctypes.c_int), ("nh", ctypes.c_int), ("kvh", ctypes.c_int),
                ("hd", ctypes.c_int), ("mb", ctypes.c_int), ("window", ctypes.c_int), ("act", ctypes.c_int),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
                ("cos", _P), ("sin", _P), ("cos_local", _P), ("sin_local", _P), ("kc", _P), ("vc", _P), ("table", _P),
                ("layer_stride", ctypes.c_int64), ("kvk", ctypes.c_int), ("final_norm", _P), ("lora", _P)]


class LoraPiece(ctypes.Structure):
    """ops.c `lora_piece_t`: one output range's A [r, in] and B^T [r, len] in tiles of 64 outputs
    ([ceil(len / 64), r, 64], zero-padded; fp32, bf16 or int8: kind; int8 with per-row scales sa / sb
    [r]), scale."""

    _fields_ = [("a", _P), ("b", _P), ("sa", _P), ("sb", _P), ("scale", ctypes.c_float), ("r", ctypes.c_int),
                ("off", ctypes.c_int), ("len", ctypes.c_int), ("kind", ctypes.c_int)]


class LoraProj(ctypes.Structure):
    """ops.c `lora_proj_t`: one projection's adapter (n pieces; 0: none)."""

    _fields_ = [("piece", LoraPiece * 3), ("n", ctypes.c_int)]


class LoraStruct(ctypes.Structure):
    """ops.c `lora_t`: proj [adapters][layers][4], of_row [cache rows] (-1: no adapter)."""

    _fields_ = [("proj", _P), ("of_row", _P), ("adapters", ctypes.c_int), ("layers", ctypes.c_int),
                ("rmax", ctypes.c_int)]


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    if t is None:
        return None
    assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
    return t.data_ptr()


@dataclass(frozen=True)
class Linear:
    """A linear's packed weight, its aux (scales) and format (kernels.pack_weight / pack_exact)."""

    packed: torch.Tensor
    aux: Optional[torch.Tensor]
    weight_dtype: str


@dataclass(frozen=True)
class LayerWeights:
    """What `forward_f32` reads of one layer; None: the layer has no such norm or bias."""

    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    local: bool = False
    qkv_bias: Optional[torch.Tensor] = None
    q_norm: Optional[torch.Tensor] = None
    k_norm: Optional[torch.Tensor] = None
    attn_out_norm: Optional[torch.Tensor] = None
    mlp_out_norm: Optional[torch.Tensor] = None

    def struct(self) -> LayerStruct:
        s = LayerStruct()
        for i, lin in enumerate((self.qkv, self.o, self.gate_up, self.down)):
            s.w[i] = lin.packed.data_ptr()
            s.aux[i] = None if lin.aux is None else lin.aux.data_ptr()
            s.kind[i] = WEIGHT_KINDS[lin.weight_dtype]
        s.local = int(self.local)
        for name in ("qkv_bias", "in_norm", "post_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm"):
            setattr(s, name, _ptr(getattr(self, name)))
        return s


@dataclass(frozen=True)
class Shape:
    """The stack's sizes and attention settings (ModelConfig's, as the C struct wants them)."""

    hidden: int
    inter: int
    nh: int
    kvh: int
    hd: int
    eps: float
    scale: float
    window: int = 0
    softcap: float = 0.0
    act: str = "silu"


class FusedStack:
    """Layers run by one `forward_f32` call. NOTE: holds raw pointers into the weights: the owner
    rebuilds it whenever it repacks or replaces them (finalize / attach)."""

    def __init__(self, layers: Sequence[LayerWeights], shape: Shape):
        self.layers = list(layers)  # keeps every tensor a pointer refers to alive
        self.array = (LayerStruct * len(self.layers))(*(w.struct() for w in self.layers))
        self.shape = shape

    def __len__(self) -> int:
        return len(self.layers)

    def _stack(self, tables: tuple[torch.Tensor, ...], kc: torch.Tensor, vc: torch.Tensor,
               block_table: torch.Tensor) -> StackStruct:
        """The per-forward struct (a few us to build: not worth caching)."""
        # kc [layers, blocks, kvh, hw, 16], vc [layers, blocks, kvh, 16, hw], block_table [slots, mb] int32
        assert kc.is_contiguous() and vc.is_contiguous() and kc.dim() == 5 and vc.dim() == 5
        assert kc.shape == (*vc.shape[:3], vc.shape[4], vc.shape[3]) and kc.dtype == vc.dtype and kc.dtype in KV_KINDS
        assert vc.shape[2] == self.shape.kvh and vc.shape[-1] == kv_row_width(vc.dtype, self.shape.hd)
        assert block_table.dtype == torch.int32 and block_table.is_contiguous() and block_table.dim() == 2
        assert all(t.dtype == torch.float32 and t.is_contiguous() for t in tables)
        sh = self.shape
        s = StackStruct(hidden=sh.hidden, inter=sh.inter, nh=sh.nh, kvh=sh.kvh, hd=sh.hd, mb=block_table.shape[1],
                        window=sh.window, act=ACTS[sh.act], eps=sh.eps, scale=sh.scale, softcap=sh.softcap,
                        layer_stride=kc.stride(0), kvk=KV_KINDS[kc.dtype])
        s.cos, s.sin, s.cos_local, s.sin_local = (t.data_ptr() for t in tables)
        s.kc, s.vc, s.table = kc.data_ptr(), vc.data_ptr(), block_table.data_ptr()
        return s

    def __call__(self, x: torch.Tensor, tables: tuple[torch.Tensor, ...], kc: torch.Tensor, vc: torch.Tensor,
                 block_table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, num_layers: int = 0,
                 final_norm: Optional[torch.Tensor] = None, in_place: bool = False,
                 seg: Optional[torch.Tensor] = None, lora: Optional[int] = None) -> torch.Tensor:
        """x [B, T, hidden] through the first `num_layers` (0: all) layers, caches kc / vc (KVCache's
        kernel layout, paged by `block_table` [slots, mb]) written at (slots [B], positions [B, T]); tables: (cos, sin,
        cos_local, sin_local) [P, hd] -> [B, T, hidden] (a new tensor), RMS-normed by `final_norm`
        [hidden] when given (in the same call: a torch norm after it ran with cold caches). `in_place`:
        x is the caller's own temporary, updated and returned (no copy). Rows of any length (`seg`
        int64 [rows + 1], their starts: ops.rope_attention_f32): x [1, seg[-1], hidden], positions
        [1, seg[-1]], slots [rows]. `lora`: the address of a LoraStruct (the rows' adapters: models/lora.py)."""
        lib = library()
        assert lib is not None
        nl = num_layers or len(self.layers)
        assert 0 < nl <= len(self.layers) <= kc.shape[0]
        B, T, D = x.shape
        assert D == self.shape.hidden and x.dtype == torch.float32
        # the residual stream, updated in place
        out = x if in_place and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
        slots = slots.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        assert positions.shape == (B, T)
        if seg is not None:
            seg = seg.to(torch.int64).contiguous()
            assert B == 1 and seg.dim() == 1 and int(seg[-1]) == T
            B, T = seg.numel() - 1, 0
        assert slots.shape == (B,)
        stack = self._stack(tables, kc, vc, block_table)  # NOTE: kept alive until the call returns
        stack.final_norm = _ptr(final_norm)
        stack.lora = lora
        lib.forward_f32(ctypes.addressof(self.array), nl, ctypes.addressof(stack), out.data_ptr(), slots.data_ptr(),
                        positions.data_ptr(), None if seg is None else seg.data_ptr(), B, T, torch.get_num_threads())
        return out
