"""LoRA adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), held beside
the base model and applied per cache row: a projection's output gains B (A x) * scale for each
token whose row is bound to an adapter (rows of one forward may use different adapters or none).

The C stack adds them inside its one call (ops.c `lora_low_for`, then `epi_tile` as each output
tile of the projection is computed; each output one thread's sums: batch- and thread-invariant);
the torch path (other dtypes, CUDA) groups the rows by adapter."""
from __future__ import annotations

import ctypes
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..kernels.bindings import WEIGHT_KINDS
from ..kernels.stack import LoraProj, LoraStruct
from .llama import ModelConfig

PROJS = ("qkv", "o", "gate_up", "down")  # ops.c P_QKV .. P_DOWN
# PEFT module -> (projection, piece: its output range in the fused projection; -1 the whole of it)
MODULES = {"q_proj": (0, 0), "k_proj": (0, 1), "v_proj": (0, 2), "qkv_proj": (0, -1), "o_proj": (1, 0),
           "gate_proj": (2, 0), "up_proj": (2, 1), "gate_up_proj": (2, -1), "down_proj": (3, 0)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
B_TILE = 64  # outputs per tile of a piece's B^T (ops.c LORA_TILE)


class AdapterError(ValueError):
    """An adapter that cannot serve this base model (the message names it and why)."""


LORA_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


@dataclass(frozen=True)
class Piece:
    """One output range [off, off + len) of a projection: y[off:off+len] += (scale * a @ x) @ bt."""

    a: torch.Tensor  # [r, in]
    bt: torch.Tensor  # B^T [r, len]; on the CPU in tiles of outputs [ceil(len / B_TILE), r, B_TILE], zero-padded
    scale: float
    off: int
    length: int  # len: the outputs it adds to
    sa: Optional[torch.Tensor] = None  # int8: a's and B^T's scales per row [r] (value = q * s)
    sb: Optional[torch.Tensor] = None

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a [r, in], B^T [r, len]) as floats (int8 rows times their scales)."""
        bt = self.bt if self.bt.dim() == 2 else self.bt.transpose(0, 1).reshape(self.bt.shape[1], -1)[:, : self.length]
        if self.sa is None:
            return self.a, bt
        return self.a.float() * self.sa[:, None], bt.float() * self.sb[:, None]


def _tiles(bt: torch.Tensor) -> torch.Tensor:
    """B^T [r, len] -> [ceil(len / B_TILE), r, B_TILE] (zeros past len): the rows of one tile of
    outputs side by side, so that a tile's weights are one stream (ops.c `lora_out`)."""
    r, n = bt.shape
    tiles = -(-n // B_TILE)
    out = torch.zeros(r, tiles * B_TILE, dtype=bt.dtype, device=bt.device)
    out[:, :n] = bt
    return out.view(r, tiles, B_TILE).transpose(0, 1).contiguous()


def _rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [r, n] as int8 rows and their scales (symmetric, per row: max |w| -> 127)."""
    s = w.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), s.float().contiguous()


@dataclass
class LoRAAdapter:
    """A loaded adapter: `layers[i][p]` the pieces of layer i's projection PROJS[p] (empty: none)."""

    name: str
    path: Path
    layers: list[list[list[Piece]]]
    rank: int  # the largest summed rank of one projection (ops.c rmax)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.bt.nbytes + (0 if p.sa is None else p.sa.nbytes + p.sb.nbytes)
                   for layer in self.layers for proj in layer for p in proj)


def _shape(cfg: ModelConfig, module: str) -> tuple[int, int, int, int]:
    """A PEFT module on this model: (its projection, input width, output offset and length in the
    fused projection)."""
    q, kv, h, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    width, outs = [(h, [(0, q), (q, kv), (q + kv, kv)]), (q, [(0, h)]), (h, [(0, inter), (inter, inter)]),
                   (inter, [(0, h)])][MODULES[module][0]]
    piece = MODULES[module][1]
    off, length = (0, outs[-1][0] + outs[-1][1]) if piece < 0 else outs[piece]
    return MODULES[module][0], width, off, length


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank / alpha patterns: the value of the first key that names the module (a suffix)."""
    for key, value in (patterns or {}).items():
        if module == key or re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _held_as(tensors: list[torch.Tensor], lora_dtype: str) -> torch.dtype:
    """lora_dtype "auto": bfloat16 when every value is one already (no rounding), else float32."""
    if lora_dtype != "auto":
        return LORA_DTYPES[lora_dtype]
    exact = all(t.dtype == torch.bfloat16 or torch.equal(t.float().to(torch.bfloat16).float(), t.float())
                for t in tensors)
    return torch.bfloat16 if exact else torch.float32


def load_adapter(name: str, folder: Path | str, cfg: ModelConfig, lora_dtype: str = "auto",
                 device: torch.device | str = "cpu") -> LoRAAdapter:
    """Read a PEFT LoRA folder for a base model of `cfg`, its weights held in `lora_dtype` ("auto":
    bfloat16 where that is exact, "float32", "bfloat16", "int8"); AdapterError naming the adapter when it is
    not one this model can use (another model's shapes, embeddings or heads adapted, DoRA, biases)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    where = f"LoRA adapter {name!r} ({folder})"
    try:
        conf = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{where}: cannot read {CONFIG} ({exc})") from None
    if not isinstance(conf, dict) or str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{where}: not a LoRA adapter (peft_type {conf.get('peft_type')!r})")
    for field, ok in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if conf.get(field, ok) not in (ok, None):
            raise AdapterError(f"{where}: {field}={conf[field]!r} is not supported")
    if conf.get("modules_to_save"):
        raise AdapterError(f"{where}: modules_to_save {conf['modules_to_save']} is not supported "
                           f"(only low-rank q/k/v/o and MLP projections)")
    if not (folder / WEIGHTS).is_file():
        raise AdapterError(f"{where}: no {WEIGHTS}")
    try:
        tensors = load_file(str(folder / WEIGHTS))
    except Exception as exc:  # a truncated or foreign file
        raise AdapterError(f"{where}: cannot read {WEIGHTS} ({exc})") from None
    found: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(3) not in MODULES:
            raise AdapterError(f"{where}: tensor {key!r} adapts a module this server does not (only "
                               f"{', '.join(MODULES)} of the decoder layers)")
        found.setdefault((int(m.group(1)), m.group(2), m.group(3)), {})[m.group(4)] = t
    if not found:
        raise AdapterError(f"{where}: {WEIGHTS} holds no LoRA weights")
    alpha0, rslora = float(conf.get("lora_alpha", 8)), bool(conf.get("use_rslora", False))
    entries = []
    for (i, block, module), ab in sorted(found.items()):
        full = f"model.layers.{i}.{block}.{module}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: {full}: needs both lora_A and lora_B")
        r = ab["A"].shape[0] if ab["A"].dim() == 2 else 0
        alpha = float(_pattern_value(conf.get("alpha_pattern"), full, alpha0))
        entries.append((i, full, module, ab["A"], ab["B"], alpha / math.sqrt(r) if rslora else alpha / max(r, 1)))
    return _build(name, where, folder, entries, cfg, _held_as(list(tensors.values()), lora_dtype), device)


def _build(name: str, where: str, path: Path, entries: list, cfg: ModelConfig, dtype: torch.dtype,
           device: torch.device | str) -> LoRAAdapter:
    """The adapter of (layer, its name for errors, PEFT module, A [r, in], B [out, r], scale) entries,
    each checked against the base model's shapes."""
    layers: list[list[list[Piece]]] = [[[] for _ in PROJS] for _ in range(cfg.num_layers)]
    for i, full, module, a, b, scale in entries:
        if not 0 <= i < cfg.num_layers:
            raise AdapterError(f"{where}: {full}: the base model has {cfg.num_layers} layers")
        proj, width, off, length = _shape(cfg, module)
        r = a.shape[0] if a.dim() == 2 else 0
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != width or b.shape != (length, r) or r < 1:
            raise AdapterError(f"{where}: {full} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this base "
                               f"model needs [r, {width}] and [{length}, r]")
        if not math.isfinite(scale):
            raise AdapterError(f"{where}: {full}: its scale is {scale}")
        ps = layers[i][proj]
        if any(p.off < off + length and off < p.off + p.length for p in ps):
            raise AdapterError(f"{where}: {full} adapts outputs another of its modules adapts too")
        held = _tiles if torch.device(device).type == "cpu" else torch.Tensor.contiguous  # the C stack's layout
        if dtype == torch.int8:
            (qa, sa), (qb, sb) = _rows_int8(a.float()), _rows_int8(b.T.float())
            ps.append(Piece(qa.to(device), held(qb.to(device)), float(scale), off, length, sa.to(device),
                            sb.to(device)))
        else:
            ps.append(Piece(a.to(device, dtype).contiguous(), held(b.T.to(device, dtype)), float(scale), off, length))
    for layer in layers:
        for pieces in layer:
            pieces.sort(key=lambda p: p.off)
    rank = max(sum(p.a.shape[0] for p in pieces) for layer in layers for pieces in layer)
    if not rank:
        raise AdapterError(f"{where}: it adapts nothing")
    return LoRAAdapter(name, path, layers, rank)


# TensorRT-LLM's LoRA module ids (its `lora_config` rows) -> the PEFT module they are
TRTLLM_MODULES = {0: "qkv_proj", 1: "q_proj", 2: "k_proj", 3: "v_proj", 4: "o_proj", 5: "gate_proj",
                  6: "down_proj", 7: "up_proj"}


def adapter_from_trtllm(name: str, weights: np.ndarray, config: np.ndarray, cfg: ModelConfig,
                        lora_dtype: str = "auto", device: torch.device | str = "cpu") -> LoRAAdapter:
    """An adapter sent as TensorRT-LLM sends one: `lora_config` [n, 3] rows (module id, layer, rank
    D), `lora_weights` [n, >= D x in + out x D] rows (A [D, in] then B [out, D] flattened, the scale
    folded into B: hf_lora_convert.py's layout); AdapterError saying what does not fit."""
    where = f"LoRA task {name}"
    w, c = np.asarray(weights), np.asarray(config)
    if w.ndim == 3 and w.shape[0] == 1:  # the converter's leading batch dimension
        w = w[0]
    if c.ndim == 3 and c.shape[0] == 1:
        c = c[0]
    if w.ndim != 2 or c.ndim != 2 or c.shape[1] != 3 or w.shape[0] != c.shape[0] or not c.shape[0]:
        raise AdapterError(f"{where}: lora_weights must be [n, size] and lora_config [n, 3] with the same n, got "
                           f"{list(w.shape)} and {list(c.shape)}")
    values = torch.from_numpy(np.asarray(w, dtype=np.float32))  # [n, size]
    entries = []
    for row, (mid, layer, rank) in enumerate(c.tolist()):
        module = TRTLLM_MODULES.get(int(mid))
        if module is None:
            raise AdapterError(f"{where}: lora_config row {row}: module id {mid} is not one this model has "
                               f"(0-7: attention q/k/v/qkv/dense, MLP gate/up/down)")
        _, width, _, length = _shape(cfg, module)
        if not 1 <= rank <= min(width, length) or rank * (width + length) > w.shape[1]:
            raise AdapterError(f"{where}: lora_config row {row}: adapter size {rank} does not fit (module {mid}: "
                               f"{rank} x {width} + {length} x {rank} values in a row of {w.shape[1]})")
        flat = values[row]
        a = flat[: rank * width].view(rank, width)
        b = flat[rank * width: rank * (width + length)].view(length, rank)
        entries.append((int(layer), f"lora_config row {row} (module {mid}, layer {layer})", module, a, b, 1.0))
    if not torch.isfinite(values).all():
        raise AdapterError(f"{where}: lora_weights holds a value that is not finite")
    return _build(name, where, Path(), entries, cfg, _held_as([values], lora_dtype), device)


class LoRARows:
    """The adapters of one torch-path forward's tokens (idx [N]: a bank index, -1 none)."""

    def __init__(self, bank: "LoRABank", idx: torch.Tensor):
        self.bank = bank
        self.groups = [(int(a), (idx == a).nonzero().squeeze(1)) for a in idx.unique().tolist() if a >= 0]

    def add(self, layer: int, proj: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [..., O] += B (A x [..., in]) for each token's adapter (y updated in place, returned)."""
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for a, rows in self.groups:
            xa = x2.index_select(0, rows)
            for p in self.bank.adapters[a].layers[layer][proj]:
                pa, pbt = p.dense()
                t = (xa @ pa.to(xa.dtype).T) * p.scale
                y2[rows, p.off: p.off + pbt.shape[1]] += t @ pbt.to(xa.dtype)
        return y


class LoRABank:
    """Adapters resident in memory, at indices 0 .. capacity - 1, and the one each cache row is
    bound to (`of_row`, -1: the base model). The engine's adapter registry decides what is resident."""

    def __init__(self, cfg: ModelConfig, rows: int, capacity: int, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.adapters: list[Optional[LoRAAdapter]] = [None] * capacity
        self.of_row = torch.full((rows,), -1, dtype=torch.int32, device=device)  # [cache rows]
        self._host_rows = [-1] * rows
        self._bound = 0
        self._proj = (LoraProj * (capacity * cfg.num_layers * len(PROJS)))()
        self._struct = LoraStruct(ctypes.addressof(self._proj), self.of_row.data_ptr(), capacity, cfg.num_layers, 0)

    def place(self, index: int, adapter: Optional[LoRAAdapter]) -> None:
        """Put `adapter` at `index` (None: empty it). NOTE: no row may be bound to the index."""
        assert index not in self._host_rows
        self.adapters[index] = adapter
        L, P = self.cfg.num_layers, len(PROJS)
        for li in range(L):
            for p in range(P):
                s = self._proj[(index * L + li) * P + p]
                pieces = [] if adapter is None else adapter.layers[li][p]
                s.n = len(pieces)
                for k, pc in enumerate(pieces):
                    s.piece[k].a, s.piece[k].b, s.piece[k].scale = pc.a.data_ptr(), pc.bt.data_ptr(), pc.scale
                    s.piece[k].r, s.piece[k].off, s.piece[k].len = pc.a.shape[0], pc.off, pc.length
                    s.piece[k].kind = WEIGHT_KINDS[str(pc.a.dtype).removeprefix("torch.")]
                    s.piece[k].sa = None if pc.sa is None else pc.sa.data_ptr()
                    s.piece[k].sb = None if pc.sb is None else pc.sb.data_ptr()
        self._struct.rmax = max([a.rank for a in self.adapters if a is not None], default=0)

    def bind(self, row: int, index: int) -> None:
        """Cache row `row` runs with the adapter at `index` (-1: none) from its next forward."""
        self._bound += (index >= 0) - (self._host_rows[row] >= 0)
        self._host_rows[row] = index
        self.of_row[row] = index

    def c_struct(self) -> Optional[int]:
        """The address of the C stack's `lora_t`, or None while no row is bound (no cost at all)."""
        return ctypes.addressof(self._struct) if self._bound else None

    def rows(self, slots: torch.Tensor, T: int) -> Optional[LoRARows]:
        """The torch path's adapters for rows `slots` [B] of T tokens each, or None when none has one."""
        if not self._bound:
            return None
        idx = self.of_row.index_select(0, slots.to(self.of_row.device)).repeat_interleave(T)
        return LoRARows(self, idx) if bool((idx >= 0).any()) else None
