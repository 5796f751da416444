"""The paged KV cache: blocks of 16 positions, a block table per slot, allocated once."""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

from specguide import kernels
from specguide.util.memory import advise_huge_pages, available_bytes

from .block_pool import BLOCK, blocks_per_seq

assert BLOCK == kernels.KEY_BLOCK

log = logging.getLogger("specguide")

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..models.llama import LlamaModel


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu",
               touch: bool = True) -> torch.Tensor:
    """torch.zeros; on the CPU in memory advised for huge pages before its first touch. `touch`
    False (CPU): not written here, so its pages are only taken as they are first written (fresh
    mappings read as zeros; a small tensor may reuse freed memory: only for callers that never
    read a position before writing it)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t.data_ptr(), t.nbytes)
    if touch:
        t.zero_()
        advise_huge_pages(t.data_ptr(), t.nbytes, collapse=True)  # what the faults could not get
    return t


class KVCache:
    """K and V of every layer in blocks of `BLOCK` (16) positions, and a block table per slot.

    Position p of slot s lives in block table[s, p // 16], at p % 16 in it. Two layouts of a
    block: torch's, K and V [layers, blocks, kv_heads, 16, head_dim]; and the C attention kernel's
    (`kernel_layout`: CPU, fp32, kernels.serves_attention), K [layers, blocks, kv_heads, hw, 16]
    (dims outermost: a decode query reads 16 keys' dim i as one vector), V [layers, blocks,
    kv_heads, 16, hw], both in `store`: float32, float16 (half the bytes a decode step reads) or
    int8 (a quarter, plus a scale per position and KV head: hw = head_dim + 4,
    `kernels.kv_row_width`). Every query reads the same stored values whatever the step and
    wherever its blocks lie, so the batch, chunk and paging invariance hold as with fp32. `rows`
    reads a slot back as fp32 [layers, kv_heads, n, head_dim].

    A slot holds up to `blocks_per_seq` blocks, max_seq_len + spare positions rounded up to 16
    (`spare` positions absorb the padded draft positions of a verification step); block 0 is
    no slot's (padding rows' dead writes may land there). `table` (and `num_blocks`): the engine's
    block table, shared by its caches, whose blocks the scheduler hands out (block_pool.py); else
    each slot owns its blocks, 1 + s * blocks_per_seq ...

    On the CPU both live in memory advised for huge pages (huge_zeros): a decode step streams
    its sequences' K and V. The kernel layout's are not written here (the kernel never reads a
    position before it is written): the pages of blocks are taken as they are first used.

    A slot's valid length lives in the scheduler; entries past it are dead and overwritten later,
    so rejecting draft tokens needs no cache work."""

    BLOCK = BLOCK  # positions a block holds (block_pool.py; the kernels' KEY_BLOCK)
    tokens_per_block = BLOCK  # what a reported block counts (TRT-LLM perf metrics)

    def __init__(self, num_layers: int, max_slots: int, num_kv_heads: int, max_seq_len: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu", spare: int = 0,
                 store: Optional[torch.dtype] = None, kernel_layout: Optional[bool] = None,
                 table: Optional[torch.Tensor] = None, num_blocks: int = 0):
        if kernel_layout is None:
            kernel_layout = kernels.serves_attention(device, dtype, head_dim)
        store = store or dtype
        if store != dtype and not (kernel_layout and store in kernels.KV_KINDS):
            raise ValueError(f"a {store} KV cache needs the C attention kernel (CPU, dtype float32)")
        self.kernel_layout, self.store, self.head_dim = kernel_layout, store, head_dim
        B = self.BLOCK
        self.blocks_per_seq = mb = -(-(max_seq_len + spare) // B)
        if table is None:  # [slots, blocks_per_seq] int32: slot s's blocks, 1 + s * mb ..
            num_blocks = 1 + max_slots * mb
            table = (1 + torch.arange(max_slots * mb, dtype=torch.int32, device=device)).view(max_slots, mb)
        assert table.shape == (max_slots, mb) and table.dtype == torch.int32 and num_blocks >= 2
        self.table, self.num_blocks = table, num_blocks
        hw = kernels.kv_row_width(store, head_dim)
        shape = (num_layers, num_blocks, num_kv_heads)
        self.k = huge_zeros((*shape, hw, B) if kernel_layout else (*shape, B, hw), store, device, not kernel_layout)
        self.v = huge_zeros((*shape, B, hw), store, device, not kernel_layout)
        self.max_slots, self.dtype = max_slots, dtype  # dtype: the model's (`like` passes it on)
        self.max_seq_len = max_seq_len + spare  # positions a slot holds

    def like(self, max_slots: int, positions: Optional[int] = None) -> KVCache:
        """An empty cache of this one's layout, storage and device, each slot its own blocks
        (`positions`: default this one's)."""
        L, _, kvh = self.v.shape[:3]
        return KVCache(L, max_slots, kvh, positions or self.max_seq_len, self.head_dim, self.dtype,
                       self.v.device, store=self.store, kernel_layout=self.kernel_layout)

    def rows(self, slot: int, start: int = 0, end: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end) of `slot`, every layer: fp32 copies [layers, kv_heads, n, head_dim]."""
        ids = self.table[slot]
        k, v = self.k[:, ids], self.v[:, ids]  # [layers, mb, kvh, ..]
        if self.kernel_layout:
            k, v = kernels.kv_values(k, v, self.head_dim)
        L, mb, kvh, B, hd = v.shape[0], v.shape[1], v.shape[2], self.BLOCK, self.head_dim
        return tuple(x.float().transpose(1, 2).reshape(L, kvh, mb * B, hd)[:, :, start:end].contiguous()
                     for x in (k, v))

    def blocks(self, positions: int) -> int:
        """Blocks covering `positions` token positions."""
        return -(-positions // self.tokens_per_block)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def kv_store(config: EngineConfig, model: LlamaModel) -> Optional[torch.dtype]:
    """EngineConfig.kv_cache_dtype -> what `model`'s KV cache holds: None (the model's dtype), fp16
    or int8 ("auto": fp16 with int8 activations)."""
    want = config.kv_cache_dtype
    if want in ("float16", "int8") and not model.invariant_attention:
        raise ValueError(f"kv_cache_dtype {want} needs the CPU attention kernel (device cpu, dtype float32, "
                         "the C kernels built); use float32 or auto")
    if want == "auto":
        return torch.float16 if model.integer_dot and model.invariant_attention else None
    return getattr(torch, want) if want != "float32" else None


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


def size_slots(config: "EngineConfig", cfg: Any, device: torch.device, free_bytes: Optional[int] = None) -> "EngineConfig":
    """`config` with max_slots from `kv_cache_memory_fraction` of the device's free memory (read
    after the weights are loaded, or `free_bytes`), logged."""
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
    positions = config.max_seq_len + config.num_draft_tokens + 1
    per_slot = slot_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, positions,
                          torch.finfo(getattr(torch, config.dtype)).bits // 8)  # EngineConfig.dtype: a torch dtype's name
    n = slots_for_memory(free_bytes, config.kv_cache_memory_fraction, per_slot)
    log.info("max_slots %d: %d slots x %d positions = %.2f GiB of %.2f GiB free (kv_cache_memory_fraction %.2f)",
             n, n, positions, n * per_slot / 2**30, free_bytes / 2**30, config.kv_cache_memory_fraction)
    return dataclasses.replace(config, max_slots=n)


def block_bytes(cfg: Any, store: torch.dtype, dtype: torch.dtype, head: bool) -> int:
    """Bytes one block of 16 positions takes in the caches that share the block table: the target's
    K and V over every layer (held as `store`), and with `head` the draft head's one-layer K and V
    and its features (`dtype`, the model's)."""
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * kernels.kv_row_width(store, cfg.head_dim) * store.itemsize
    extra = (2 * cfg.num_kv_heads * cfg.head_dim + cfg.hidden_size) * dtype.itemsize if head else 0
    return KVCache.BLOCK * (kv + extra)


def size_blocks(config: "EngineConfig", cfg: Any, device: torch.device, per_block: int,
                free_bytes: Optional[int] = None) -> tuple[int, "EngineConfig"]:
    """(blocks of the KV caches, `config` with max_seq_len at most what one sequence may hold in
    them), logged: `kv_cache_bytes`, else `kv_cache_memory_fraction` of the free memory (CUDA: the
    device's after the weights; CPU: MemAvailable; or `free_bytes`), at most what every slot at
    max_seq_len takes."""
    spare = config.num_draft_tokens + 1  # KVCache's: the positions a slot's table row covers past max_seq_len
    want = 1 + config.max_slots * blocks_per_seq(config.max_seq_len, config.num_draft_tokens)
    if config.kv_cache_bytes > 0:
        budget, how = config.kv_cache_bytes, "kv_cache_bytes"
    else:
        if free_bytes is None:
            free_bytes = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_bytes()
        budget = int(free_bytes * config.kv_cache_memory_fraction)
        how = f"kv_cache_memory_fraction {config.kv_cache_memory_fraction:.2f} of {free_bytes / 2**30:.2f} GiB free"
    n = min(want, budget // per_block)
    one = (n - 1) * KVCache.BLOCK - spare  # positions one sequence may hold: all the blocks
    if one < KVCache.BLOCK:
        raise ValueError(f"the KV cache memory ({how}: {budget} bytes) holds {max(n, 0)} blocks of "
                         f"{per_block} bytes, too few for one sequence: raise it")
    if one < config.max_seq_len:
        log.warning("max_seq_len %d -> %d: what the KV cache's %d blocks hold (%s)", config.max_seq_len, one, n, how)
        config = dataclasses.replace(config, max_seq_len=one)
    log.info("KV cache: %d blocks of 16 positions (%.2f GiB; every slot at max_seq_len takes %d; %s)",
             n, n * per_block / 2**30, want, how)
    return n, config
