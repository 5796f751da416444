"""The C kernels' operations on torch tensors: the tiled GEMV, RoPE + cache write + attention over
the kernels' KV cache layout, and the row ops of a step (norms, argmax, greedy verification, draft
picks, grammar masks, row gathers and scatters). Most return None / False where the kernels or the
tensors' layouts do not serve a call, for the caller's torch path."""
from __future__ import annotations

from typing import Optional

import torch

from .bindings import KEY_BLOCK, KV_KINDS, KV_SCALE_BYTES, MAX_HEAD_DIM, QBLK, TILE, WEIGHT_KINDS
from .build import library


def kv_row_width(store: torch.dtype, head_dim: int) -> int:
    """Elements one position of a kernel cache takes per KV head (int8: the values, then the scale's bytes)."""
    return head_dim + KV_SCALE_BYTES if store == torch.int8 else head_dim


def _dequantized(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int8 positions [..., S, head_dim + 4] (values, then the fp32 scale's bytes) -> fp32 [..., S, head_dim]."""
    return rows[..., :head_dim].float() * rows[..., head_dim:].contiguous().view(torch.float32)


def kv_values(k: torch.Tensor, v: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel-layout blocks, keys [..., hw, 16] and values [..., 16, hw], as fp32 [..., 16, head_dim]
    (int8: q times its position's scale, what the kernel computes with)."""
    k = k.transpose(-1, -2)
    if v.dtype != torch.int8:
        return k.float(), v.float()
    return _dequantized(k, head_dim), _dequantized(v, head_dim)  # a key's scale: its last 4 columns


def serves_attention(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the C attention kernel serves a model (and so its KV caches take the kernel layout:
    a block's keys dims outermost, KVCache): CPU, fp32 activations, head_dim % 16 == 0 and <= 512, the kernels built."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and head_dim % 16 == 0
            and head_dim <= MAX_HEAD_DIM and library() is not None)


def _output(out: Optional[torch.Tensor], B: int, out_features: int) -> torch.Tensor:
    """`out` [B, O] fp32 contiguous (a caller's static buffer), else a new one."""
    if out is None:
        return torch.empty(B, out_features, dtype=torch.float32)
    assert out.shape == (B, out_features) and out.dtype == torch.float32 and out.is_contiguous()
    return out


def gemv(x: torch.Tensor, packed: torch.Tensor, scale: Optional[torch.Tensor], out_features: int,
         residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [B, I] fp32 @ W^T (+ residual [B, O]) with W and `scale` (its aux) from `pack_weight`;
    fp32 accumulation, batch-invariant. `out`: [B, O] to write (else a new tensor)."""
    lib = library()
    assert lib is not None
    B, I = x.shape
    assert x.dtype == torch.float32 and packed.shape[1] * (4 if packed.dim() == 4 else 1) == I
    x = x.contiguous()
    y = _output(out, B, out_features)
    r = residual.contiguous() if residual is not None else None
    rp = r.data_ptr() if r is not None else None
    n = torch.get_num_threads()
    if packed.dim() == 4:  # the integer-dot variants: [T, I/4, 64 or 32, 4]
        assert scale is not None and scale.shape == (packed.shape[0], I // QBLK, 2, TILE) and scale.is_contiguous()
        assert packed.shape[3] == 4
        fn = lib.gemv_q4_1_q8 if packed.dtype == torch.uint8 else lib.gemv_q8_0_q8
        fn(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), rp, y.data_ptr(), B, I, out_features, n)
    elif packed.dtype == torch.float32:
        lib.gemv_f32(x.data_ptr(), packed.data_ptr(), rp, y.data_ptr(), B, I, out_features, n)
    elif packed.dtype == torch.uint8:  # q4_1
        assert scale is not None and scale.shape == (packed.shape[0], I // QBLK, 2, TILE) and scale.is_contiguous()
        assert scale.dtype == torch.float16
        lib.gemv_q4_1(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), rp, y.data_ptr(), B, I, out_features, n)
    elif packed.dtype == torch.int8 and scale is not None and scale.dim() == 3:  # q8_0
        assert scale.shape == (packed.shape[0], I // QBLK, TILE) and scale.is_contiguous()
        assert scale.dtype == torch.float16
        lib.gemv_q8_0(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), rp, y.data_ptr(), B, I, out_features, n)
    elif packed.dtype == torch.int8:
        assert scale is not None and scale.dtype == torch.float32 and scale.numel() == out_features
        lib.gemv_i8(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), rp, y.data_ptr(), B, I, out_features, n)
    else:
        assert packed.dtype == torch.bfloat16
        lib.gemv_bf16(x.data_ptr(), packed.data_ptr(), rp, y.data_ptr(), B, I, out_features, n)
    return y


def gemv_tiles(x: torch.Tensor, packed: torch.Tensor, scale: Optional[torch.Tensor], out_features: int,
               sel: torch.Tensor, weight_dtype: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`gemv` over the output tiles `sel` (int32, TILE outputs each) only, W packed in `weight_dtype`
    (a `FORMATS` name): their outputs are the same bits as `gemv`'s, every other output -inf."""
    lib = library()
    assert lib is not None
    B, I = x.shape
    assert x.dtype == torch.float32 and sel.dtype == torch.int32 and sel.is_contiguous()
    x = x.contiguous()
    y = _output(out, B, out_features)
    lib.gemv_tiles(WEIGHT_KINDS[weight_dtype], x.data_ptr(), packed.data_ptr(), None if scale is None else scale.data_ptr(),
                   y.data_ptr(), B, I, out_features, sel.data_ptr(), sel.numel(), torch.get_num_threads())
    return y


def _cpu_masks(words: torch.Tensor, token_mask: torch.Tensor) -> bool:
    """Whether grammar masks (words [N, W], token_mask [N]) are in the CPU layout the C loops read."""
    return (words.device.type == "cpu" and token_mask.device.type == "cpu" and words.dtype == torch.int32
            and words.is_contiguous() and token_mask.dtype == torch.int32 and token_mask.is_contiguous())


def mask_tiles(words: torch.Tensor, token_mask: torch.Tensor, rows: torch.Tensor, out_features: int) -> Optional[torch.Tensor]:
    """The output tiles (TILE token ids each, of `out_features`) in which grammar mask rows `rows` of
    words [N, W] (int32 bitmask) allow any token, ascending int32; None when a row has no mask
    (token_mask [N] clear), the masks are not CPU tensors or the kernels are missing."""
    lib = library()
    if lib is None or not _cpu_masks(words, token_mask):
        return None
    rows = rows.to(torch.int64).contiguous()
    sel = torch.empty((out_features + TILE - 1) // TILE, dtype=torch.int32)
    n = lib.mask_tiles(words.data_ptr(), words.shape[1], token_mask.data_ptr(), rows.data_ptr(), rows.numel(),
                       out_features, sel.data_ptr())
    return None if n < 0 else sel[:n]


def _rows_scan(x: torch.Tensor, bad: bool) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    lib = library()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous() or not x.numel():
        return None
    V = x.shape[-1]
    idx = torch.empty(x.shape[:-1], dtype=torch.int64)
    flags = torch.empty(x.shape[:-1], dtype=torch.bool) if bad else None
    lib.argmax_rows(x.data_ptr(), x.numel() // V, V, idx.data_ptr(), None if flags is None else flags.data_ptr())
    return idx, flags


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] RMS-normed with weight w [D] as the layer stack's norms are (one C call on CPU fp32:
    torch's norm is six ops, slow with cold caches after a forward), else torch's."""
    lib = library()
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32
            or not w.is_contiguous() or x.requires_grad or w.requires_grad):
        return torch.nn.functional.rms_norm(x, w.shape, w, eps)
    x = x.contiguous()
    y = torch.empty_like(x)
    lib.rms_norm_rows(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return y


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) (the first maximum of each row; a NaN counts as the maximum): one C call
    on contiguous CPU fp32 (the torch op after a forward runs with cold caches: ~60 us on a 49k
    vocabulary), else torch's."""
    got = _rows_scan(x, False)
    return x.argmax(dim=-1) if got is None else got[0]


def nonfinite_rows(x: torch.Tensor) -> Optional[torch.Tensor]:
    """[..., V] -> [...] bool: the row holds NaN or +inf (one C call); None without the kernels or
    on other layouts."""
    got = _rows_scan(x, True)
    return None if got is None else got[1]


def greedy_verify(logits: torch.Tensor, drafts: Optional[torch.Tensor], num: Optional[torch.Tensor],
                  accepted: torch.Tensor, next_token: torch.Tensor, bad_token: int) -> bool:
    """A greedy step's tail in one C scan over logits [B, T, V] (contiguous CPU fp32, masked):
    accepted [B] / next_token [B] (int64, written in place) get what acceptance.verify gives for
    drafts [B, T-1] and num [B] (None when T is 1), next_token `bad_token` where a row's logits
    hold a NaN or +inf. False (nothing written) without the kernels or on other layouts."""
    lib = library()
    B, T, V = logits.shape
    outs = (accepted, next_token)
    if (lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous()
            or not logits.numel() or any(o.device.type != "cpu" or o.dtype != torch.int64 or not o.is_contiguous()
                                         or o.shape != (B,) for o in outs)):
        return False
    d = n = None
    if T > 1:
        if drafts is None or num is None or drafts.shape != (B, T - 1) or num.shape != (B,):
            return False
        d = drafts.to(torch.int64)
        n = num.to(torch.int64).contiguous()
    lib.greedy_verify_rows(logits.data_ptr(), B, T, V, None if d is None else d.data_ptr(),
                           0 if d is None else d.stride(0), 0 if d is None else d.stride(1),
                           None if n is None else n.data_ptr(), accepted.data_ptr(), next_token.data_ptr(), bad_token)
    return True


def draft_pick(logits: torch.Tensor, d2t: Optional[torch.Tensor], proposals: Optional[tuple[torch.Tensor, torch.Tensor]],
               unsure: float, out: torch.Tensor, out_host: Optional[torch.Tensor] = None) -> bool:
    """A drafter's tokens from its masked logits [B, V'] into out [B] (and out_host [B]), int64 in
    place, in one C call: the argmax, through d2t [V'] when given; with proposals (fixed [B],
    fallback [B]): fixed where >= 0, else fallback where >= 0 and the drafter's top probability is
    below `unsure`. False (nothing written) without the kernels or on other layouts."""
    lib = library()
    B, V = logits.shape
    ints = [t for t in (d2t, *(proposals or ()), out, out_host) if t is not None]
    if (lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous()
            or not logits.numel() or any(t.device.type != "cpu" or t.dtype != torch.int64 or not t.is_contiguous()
                                         for t in ints)
            or any(t.shape != (B,) for t in (*(proposals or ()), out, out_host) if t is not None)
            or (d2t is not None and d2t.shape != (V,))):
        return False
    fixed, fallback = proposals if proposals is not None else (None, None)
    lib.draft_pick_rows(logits.data_ptr(), B, V, *(None if t is None else t.data_ptr() for t in (d2t, fixed, fallback)),
                        unsure, out.data_ptr(), None if out_host is None else out_host.data_ptr())
    return True


def head_inputs(feats: torch.Tensor, embed: torch.Tensor | tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor,
                w: torch.Tensor, eps: float, at: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """[feats ; rms_norm(embed[ids], w)] -> [..., 2D] for feats [..., D] and ids [...] (a draft head's
    input: one C call on CPU fp32 where the torch ops run with cold caches), None elsewhere.
    `embed`: fp32 [V, D], or Q8_0 rows (q [V, D] int8, d [V, D/32] fp16: models/embedding.Q8Rows).
    `at` [...]: feats is a store [R, D] read at its rows at[...]."""
    lib = library()
    D = feats.shape[-1]
    rows = feats.shape[:-1] if at is None else at.shape
    q8 = isinstance(embed, tuple)
    table = embed[0] if q8 else embed
    if (lib is None or any(t.device.type != "cpu" for t in (feats, table, ids, w, *(() if at is None else (at,))))
            or feats.requires_grad or any(t.dtype != torch.float32 for t in (feats, w)) or table.dim() != 2
            or table.shape[1] != D or w.shape != (D,) or ids.shape != rows or not table.is_contiguous()
            or not w.is_contiguous()
            or (table.dtype != torch.int8 or embed[1].dtype != torch.float16 or embed[1].shape != (len(table), D // QBLK)
                or D % QBLK or not embed[1].is_contiguous() if q8 else table.dtype != torch.float32)
            or (at is not None and (feats.dim() != 2 or not feats.is_contiguous()))):
        return None
    feats = feats.contiguous()
    at = None if at is None else at.to(torch.int64).contiguous()
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(*rows, 2 * D)
    E, Q, Qd = (None, table.data_ptr(), embed[1].data_ptr()) if q8 else (table.data_ptr(), None, None)
    if lib.head_inputs(feats.data_ptr(), None if at is None else at.data_ptr(), feats.shape[0], E, Q, Qd,
                       table.shape[0], ids.data_ptr(), w.data_ptr(), out.data_ptr(), ids.numel(), D, eps):
        raise IndexError(f"head_inputs: a token id or row out of range ({tuple(table.shape)}, {tuple(feats.shape)})")
    return out


def q8_rows(q: torch.Tensor, d: torch.Tensor, ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Rows `ids` [...] of a Q8_0 table (q [V, D] int8, d [V, D/32] fp16) in fp32 [..., D]: q * d per
    block of 32, one C call (torch's gather and broadcast multiply took 10x as long). None where the
    C kernels do not serve these tensors."""
    lib = library()
    if (lib is None or any(t.device.type != "cpu" for t in (q, d, ids)) or q.dtype != torch.int8
            or d.dtype != torch.float16 or q.dim() != 2 or q.shape[1] % QBLK or d.shape != (q.shape[0], q.shape[1] // QBLK)
            or not q.is_contiguous() or not d.is_contiguous()):
        return None
    flat = ids.to(torch.int64).contiguous()
    out = torch.empty(*ids.shape, q.shape[1])
    if lib.q8_rows(q.data_ptr(), d.data_ptr(), q.shape[0], flat.data_ptr(), out.data_ptr(), flat.numel(), q.shape[1]):
        raise IndexError(f"index out of range in the embedding (a token id >= {q.shape[0]} or < 0)")
    return out


def pick_rows(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """x [B, T, D] -> [B, D]: row at[b] of each x[b] (one C call on CPU fp32; else torch's indexing)."""
    lib = library()
    B, T, D = x.shape
    if (lib is None or x.device.type != "cpu" or at.device.type != "cpu" or x.dtype != torch.float32
            or at.shape != (B,) or not x.is_contiguous()):
        return x[torch.arange(B, device=x.device), at]
    at = at.to(torch.int64).contiguous()
    out = torch.empty(B, D)
    if lib.pick_rows(x.data_ptr(), at.data_ptr(), out.data_ptr(), B, T, D):
        raise IndexError(f"pick_rows: a row outside [0, {T})")
    return out


def scatter_rows(dst: torch.Tensor, at: torch.Tensor, src: torch.Tensor) -> bool:
    """dst[at] = src (dst [R, D], at [...], src [..., D]): row copies in one C call on contiguous CPU
    fp32 (IndexError, nothing written, for a row out of range). False (nothing done) elsewhere."""
    lib = library()
    if (lib is None or any(t.device.type != "cpu" for t in (dst, at, src)) or dst.dtype != torch.float32
            or src.dtype != torch.float32 or not dst.is_contiguous() or dst.dim() != 2
            or src.shape != (*at.shape, dst.shape[1])):
        return False
    src, at = src.contiguous(), at.to(torch.int64).contiguous()
    if lib.scatter_rows(dst.data_ptr(), dst.shape[0], src.data_ptr(), at.data_ptr(), at.numel(), dst.shape[1]):
        raise IndexError(f"scatter_rows: a row outside [0, {dst.shape[0]})")
    return True


def mask_logits_rows(logits: torch.Tensor, words: torch.Tensor, token_mask: torch.Tensor, rows: torch.Tensor,
                     vocab_size: int, d2t: Optional[torch.Tensor] = None) -> bool:
    """Grammar masks in place (guided/decoder.py `mask_logits` without its temporaries): logits
    [R, V'] fp32 get -inf where mask row rows[r] of words [N, W] (int32 bitmask) bans the token,
    in rows whose token_mask [N] (int32) is set; without `d2t`, ids >= vocab_size too; `d2t` [V']
    int64 maps a pruned vocabulary. False (nothing done) where the kernels or these CPU layouts are
    not there."""
    lib = library()
    tensors = (logits, rows) + (() if d2t is None else (d2t,))
    if (lib is None or any(t.device.type != "cpu" for t in tensors) or logits.dtype != torch.float32
            or not logits.is_contiguous() or not _cpu_masks(words, token_mask)):
        return False
    R, Vp = logits.shape
    rows = rows.to(torch.int64).contiguous()
    d = None if d2t is None else d2t.to(torch.int64).contiguous()
    assert rows.numel() == R and (d is None or d.numel() == Vp)
    lib.mask_logits_rows(logits.data_ptr(), R, Vp, words.data_ptr(), words.shape[1], token_mask.data_ptr(),
                         rows.data_ptr(), vocab_size, None if d is None else d.data_ptr())
    return True


def rope_attention_f32(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, block_table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                       num_heads: int, scale: float | None = None, window: int = 0,
                       softcap: float = 0.0, seg: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [B, T, nh + 2 kvh, hd] -> RoPE, K/V written to the paged cache at `positions`, causal
    attention -> [B, T, nh, hd]. Tables cos / sin_signed [P, hd]. Batch- and T-invariant. The cache:
    k_cache [blocks, kvh, hw, 16] (a block's keys, dims outermost), v_cache [blocks, kvh, 16, hw];
    position p of row b lives in block block_table[slots[b], p // 16] (int32 [rows, mb]), column (keys) or row
    (values) p % 16. Both fp32, both fp16 (stored rounded to nearest, saturated at +-65504) or both
    int8 (per position and KV head, q = round(x * 127 / max|x|) and the scale's 4 bytes: hw =
    `kv_row_width`; `kv_values` reads it).

    `scale` (default hd ** -0.5) multiplies q.k; `window` > 0 attends to the last `window` keys
    only (sliding-window layers); `softcap` > 0 caps scores to softcap * tanh(s / softcap).

    Rows of any length (`seg` int64 [B + 1]: row b is tokens seg[b] .. seg[b + 1] - 1): qkv
    [1, seg[B], ..], positions [1, seg[B]], slots [B]; each token's result is the one it has in a
    rectangular call."""
    lib = library()
    assert lib is not None
    B, T, H, hd = qkv.shape
    if seg is not None:
        seg = seg.to(torch.int64).contiguous()
        assert B == 1 and seg.dim() == 1 and int(seg[-1]) == T and slots.numel() == seg.numel() - 1
        B, T = seg.numel() - 1, 0
    _, kvh, kb, hw = v_cache.shape
    nh = num_heads
    assert k_cache.shape == (v_cache.shape[0], kvh, hw, KEY_BLOCK) and kb == KEY_BLOCK
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_KINDS
    assert H == nh + 2 * kvh and hw == kv_row_width(v_cache.dtype, hd) and qkv.dtype == torch.float32
    assert hd % 16 == 0 and hd <= MAX_HEAD_DIM
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous() and sin_signed.is_contiguous()
    assert cos.dtype == sin_signed.dtype == torch.float32
    assert block_table.dtype == torch.int32 and block_table.is_contiguous() and block_table.dim() == 2
    qkv = qkv.contiguous()
    slots = slots.to(torch.int64).contiguous()
    positions = positions.to(torch.int64).contiguous()
    qrot = torch.empty(*qkv.shape[:2], nh, hd, dtype=torch.float32)
    out = torch.empty_like(qrot)
    lib.rope_attn_f32(qkv.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                      KV_KINDS[k_cache.dtype], block_table.data_ptr(), block_table.shape[1], slots.data_ptr(),
                      positions.data_ptr(), None if seg is None else seg.data_ptr(), qrot.data_ptr(), out.data_ptr(),
                      B, T, nh, kvh, hd, hd ** -0.5 if scale is None else scale, window, softcap,
                      torch.get_num_threads())
    return out
