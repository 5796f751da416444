"""ops.c's interface as Python sees it: the ctypes signatures of its functions and the constants
it defines (tile and block sizes, the KV cache layout, the codes of its weight and cache kinds)."""
from __future__ import annotations

import ctypes

import torch

TILE = 64  # ops.c TILE: outputs per packed weight tile
QBLK = 32  # ops.c QBLK: inputs per GGUF block
KEY_BLOCK = 16  # ops.c KB: positions a KV cache block holds (the kernels' keys: dims outermost in a block)
KV_SCALE_BYTES = 4  # ops.c KV_SB: an int8 cache position's fp32 scale, after its head_dim values
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}  # ops.c KV_*: what a kernel cache holds
WEIGHT_KINDS = {"float32": 0, "int8": 1, "bfloat16": 2, "q4_1": 3, "q8_0": 4, "q4_1_q8": 5, "q8_0_q8": 6}  # ops.c W_*
MAX_HEAD_DIM = 512  # ops.c MAX_HD: rope_write_for holds one rotated key on the stack
INT_DOT_PATHS = ("scalar", "maddubs", "vnni")  # ops.c's int_dot_path()


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (a build of ops.c) with every function's argument and result types set; returns it."""
    lib.gemv_f32.restype = None
    lib.gemv_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    lib.gemv_i8.restype = None
    lib.gemv_i8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
    lib.gemv_bf16.restype = None
    lib.gemv_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    for fn in (lib.gemv_q4_1, lib.gemv_q8_0, lib.gemv_q4_1_q8, lib.gemv_q8_0_q8):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
    lib.rope_attn_f32.restype = None
    lib.rope_attn_f32.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
                                  + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5
                                  + [ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_int])
    lib.int_dot_path.restype = ctypes.c_int
    lib.int_dot_path.argtypes = []
    lib.set_prefetch.restype = None
    lib.set_prefetch.argtypes = [ctypes.c_int]
    lib.forward_f32.restype = None  # (layers, nl, stack, x, slots, positions, seg, B, T, threads): kernels/stack.py
    lib.forward_f32.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3
    lib.gemv_tiles.restype = None  # (kind, x, Wp, aux, y, B, I, O, sel, nsel, threads)
    lib.gemv_tiles.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_void_p] \
        + [ctypes.c_int] * 2
    lib.mask_tiles.restype = ctypes.c_int  # (words, W, token_mask, rows, R, O, sel) -> tiles, -1: a row unmasked
    lib.mask_tiles.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_int, ctypes.c_void_p]
    lib.rms_norm_rows.restype = None  # (x, w, y, N, D, eps)
    lib.rms_norm_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int, ctypes.c_float]
    lib.argmax_rows.restype = None  # (x, R, V, idx, bad)
    lib.argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.greedy_verify_rows.restype = None  # (logits, B, T, V, drafts, ds_b, ds_k, num, accepted, next, bad_token)
    lib.greedy_verify_rows.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
                                       + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int64])
    lib.draft_pick_rows.restype = None  # (logits, B, V, d2t, fixed, fallback, unsure, out, out2)
    lib.draft_pick_rows.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_float]
                                    + [ctypes.c_void_p] * 2)
    lib.head_inputs.restype = ctypes.c_int  # (feats, at, R, E, Q, Qd, V, ids, w, out, N, D, eps) -> 0, -1
    lib.head_inputs.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
                                + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int, ctypes.c_float])
    lib.q8_rows.restype = ctypes.c_int  # (Q, Qd, V, ids, out, N, D) -> 0, -1: an id out of range
    lib.q8_rows.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int]
    lib.pick_rows.restype = ctypes.c_int  # (src, at, out, B, T, D) -> 0, -1: out of range
    lib.pick_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.scatter_rows.restype = ctypes.c_int  # (dst, R, src, at, N, D) -> 0, -1: out of range
    lib.scatter_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.mask_logits_rows.restype = None  # (logits, R, Vp, words, W, token_mask, rows, vocab, d2t)
    lib.mask_logits_rows.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
                                     + [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_void_p])
    return lib
