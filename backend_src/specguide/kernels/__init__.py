"""Small C kernels (ops.c) for fp32 CPU inference, compiled once per machine and loaded with ctypes.

The modules, by job: `build` compiles ops.c and owns the loaded library (`library()`, None without
a C compiler: `unavailable_reason()` says why and the callers take torch ops); `bindings` holds
ops.c's ctypes signatures and constants; `quantize` makes and packs the weight formats (int8, GGUF
Q4_1 / Q8_0 and their integer-dot variants); `ops` wraps the kernels' operations on tensors;
`tune` measures the build's rows per pass and prefetch distance; `stack` runs a whole decoder
stack in one call. The names below are the package's interface (`kernels.gemv`, ...)."""
from __future__ import annotations

from .bindings import (INT_DOT_PATHS, KEY_BLOCK, KV_KINDS, KV_SCALE_BYTES, MAX_HEAD_DIM, QBLK, TILE,
                       WEIGHT_KINDS)
from .build import FLAGS, HERE, integer_dot_path, library, unavailable_reason, use_integer_dot, variant
from .ops import (argmax, draft_pick, gemv, gemv_tiles, greedy_verify, head_inputs,
                  kv_row_width, kv_values, mask_logits_rows, mask_tiles, nonfinite_rows, pick_rows, q8_rows,
                  rms_norm, rope_attention_f32, scatter_rows, serves_attention)
from .quantize import (FORMATS, INT_DOT, dequantized, exact_format, int_dot, pack_exact, pack_weight,
                       quantize_int8, quantize_q4_1, quantize_q8_0, unpack_q8_0)

__all__ = [
    "FLAGS", "FORMATS", "HERE", "INT_DOT", "INT_DOT_PATHS", "KEY_BLOCK", "KV_KINDS", "KV_SCALE_BYTES",
    "MAX_HEAD_DIM", "QBLK", "TILE", "WEIGHT_KINDS", "argmax", "dequantized", "draft_pick",
    "exact_format", "gemv", "gemv_tiles", "greedy_verify", "head_inputs", "int_dot", "integer_dot_path",
    "kv_row_width", "kv_values", "library", "mask_logits_rows", "mask_tiles", "nonfinite_rows",
    "pack_exact", "pack_weight", "pick_rows", "q8_rows", "quantize_int8", "quantize_q4_1", "quantize_q8_0",
    "rms_norm", "rope_attention_f32", "scatter_rows", "serves_attention", "unavailable_reason", "unpack_q8_0",
    "use_integer_dot", "variant",
]
