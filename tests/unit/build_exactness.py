"""The exactness invariants of one kernel build, in a process of its own.

    SPECGUIDE_KERNEL_MARCH="-march=x86-64-v3 -mtune=znver3" python tests/unit/build_exactness.py

The build (ISA and tuning) is chosen at the first kernel call of a process, so each build is
checked by running this file under its SPECGUIDE_KERNEL_MARCH (tests/unit/test_kernel_builds.py
runs every build this CPU can execute). Prints "ok" when every check holds, else raises:
- GEMV: a row's bits do not depend on the other rows of the call, for every weight format; the
  block formats (q4_1, q8_0) give the fp32 kernel's bits on their dequantized weights, and their
  integer-dot variants (int8 activations: q4_1_q8, q8_0_q8) stay close to them, and give the
  reference arithmetic's result with their integer sums at the largest;
- the row scans (argmax, non-finite rows) give torch's answers;
- attention: any chunk split of a prompt gives the same outputs and K/V (window, soft cap), with
  an fp32, an fp16 and an int8 KV cache, wherever the blocks of its paged cache lie;
- whole models (random weights, real layer shapes: SmolLM2's attention geometry in q4_1 as the
  default model is served, and a Gemma 2 layer pair in fp32 / q8_0; each with its block formats widened and
  in integer dot products, the latter with the fp16 KV cache it is served with and with an int8 one): a decode step's logits are
  the same alone or in a batch, a 4-query verification step equals 4 single-token steps, and a
  prompt's logits and K/V do not depend on how it was split into prefill chunks.
"""
from __future__ import annotations

import itertools
import sys
import tempfile
from pathlib import Path

import torch

from specguide import kernels
from specguide.engine.kv_cache import KVCache
from specguide.models.loader import load_model

from paged_cache import empty, unpaged


def check_gemv(g: torch.Generator) -> None:
    for O, I in ((130, 576), (960, 576), (49, 96)):
        W, x, r = torch.randn(O, I, generator=g) * 0.05, torch.randn(20, I, generator=g), torch.randn(20, O, generator=g)
        for fmt in kernels.FORMATS:
            if fmt.startswith("q") and I % kernels.QBLK:
                continue
            packed, aux = kernels.pack_weight(W, fmt)
            full = kernels.gemv(x, packed, aux, O, r)  # 20 rows: the widened-scratch path
            deq = kernels.dequantized(W, fmt)
            tol = 0.02 * float((x @ deq.t()).abs().max()) if fmt in kernels.INT_DOT.values() else 1e-4  # int8 x
            assert torch.allclose(full, x @ deq.t() + r, atol=tol, rtol=1e-5), (fmt, O, I)
            ref = kernels.pack_weight(deq, "float32")[0] if fmt in kernels.INT_DOT else None
            for lo, hi in ((0, 1), (3, 4), (5, 9), (2, 17), (0, 20)):  # in-register (< 16 rows) and scratch
                got = kernels.gemv(x[lo:hi], packed, aux, O, r[lo:hi])
                assert torch.equal(got, full[lo:hi]), (fmt, O, I, lo, hi)
                if ref is not None:
                    assert torch.equal(got, kernels.gemv(x[lo:hi], ref, None, O, r[lo:hi])), (fmt, O, I, lo, hi)


def check_int_dot_extremes(g: torch.Generator) -> None:
    """The integer sums at their largest (every |xq| = 127, Q4_1 nibbles 0 and 15, Q8_0 +-127): the
    reference arithmetic's result to fp32 rounding. The maddubs path sums Q4_1 blocks in int16
    (at most 8 x 2 x 15 x 127 = 30480 a lane): an overflow there would show here."""
    O, I = 130, 576
    sign = torch.where(torch.rand(O, I, generator=g) < 0.5, -1.0, 1.0)
    W = sign * torch.where(torch.rand(O, I, generator=g) < 0.9, 1.0, 0.999)
    W[:, ::32] = -sign[:, ::32]  # each block spans [-1, 1]: Q4_1 q in {0, 15}, Q8_0 q = +-127
    W[::2] = W[::2].abs()  # and rows of one sign: all-15 nibbles
    x = torch.where(torch.rand(6, I, generator=g) < 0.5, -2.0, 2.0)
    x[::2] = 2.0  # xq = +-127 everywhere, rows of one sign too
    for fmt in kernels.INT_DOT.values():
        packed, aux = kernels.pack_weight(W, fmt)
        B, blocks = x.shape[0], x.double().reshape(x.shape[0], I // 32, 32)
        amax = blocks.abs().amax(-1, keepdim=True)
        xq = torch.round(blocks * 127 / amax).clamp(-127, 127)
        want = (xq * amax / 127).reshape(B, I) @ kernels.dequantized(W, fmt).double().t()
        got = kernels.gemv(x, packed, aux, O).double()
        assert torch.allclose(got, want, atol=1e-3, rtol=1e-5), (fmt, (got - want).abs().max())
        for lo, hi in ((0, 1), (1, 2), (0, 6)):
            assert torch.equal(kernels.gemv(x[lo:hi], packed, aux, O).double(), got[lo:hi]), (fmt, lo, hi)


def check_attention(g: torch.Generator) -> None:
    for (nh, kvh, hd, window, cap), dtype in itertools.product(
            ((9, 3, 64, 0, 0.0), (4, 2, 48, 7, 2.0), (8, 1, 32, 0, 0.0)), tuple(kernels.KV_KINDS)):
        N, S = 45, 64
        qkv = torch.randn(2, N, nh + 2 * kvh, hd, generator=g)
        cos, sin = torch.randn(S, hd, generator=g), torch.randn(S, hd, generator=g)
        pos = torch.stack([torch.arange(N), torch.arange(N) + 5])

        def run(bounds, rows=(0, 1)):
            hw = kernels.kv_row_width(dtype, hd)
            kc, vc, table = empty(3, kvh, S, hw, dtype, seed=len(bounds))  # blocks placed anew for each split
            r = list(rows)
            outs = [kernels.rope_attention_f32(qkv[r, a:b], cos, sin, kc, vc, table, torch.tensor([2, 0])[r],
                                               pos[r, a:b], nh, 0.2, window, cap) for a, b in zip(bounds, bounds[1:])]
            return torch.cat(outs, 1), *unpaged(kc, vc, table)

        whole = run([0, N])
        for bounds, rows in (([0, 1, 18, 19, N], (0, 1)), (list(range(N + 1)), (0, 1)), ([0, 4, 8, N], (1,))):
            got = run(bounds, rows)
            want = whole[0][list(rows)]
            assert torch.equal(got[0], want), (nh, kvh, hd, dtype, bounds[:5], rows)
            assert all(torch.equal(a[[2, 0][r]], b[[2, 0][r]]) for r in rows for a, b in zip(got[1:], whole[1:]))


def check_row_scans(g: torch.Generator) -> None:
    """The C argmax and non-finite scan (vector lanes of this build) give torch's answers: ties,
    NaN, +inf and masked (-inf) rows, widths around a vector's."""
    for V in (3, 17, 1000, 49152):
        x = torch.randn(8, V, generator=g)
        x[1] = float("-inf")
        x[2, [V // 3, V - 1]] = x[2].max() + 1
        x[3, V - 1] = float("nan")
        x[4, V // 2] = float("inf")
        x[5, ::2] = float("-inf")
        assert torch.equal(kernels.argmax(x), x.argmax(dim=-1)), V
        top = x.amax(dim=-1)
        assert torch.equal(kernels.nonfinite_rows(x), top.isnan() | top.isposinf()), V
        acc, nxt = torch.empty(4, dtype=torch.int64), torch.empty(4, dtype=torch.int64)
        drafts = x.argmax(dim=-1).view(4, 2)[:, :1]  # every row's draft is its first position's token
        assert kernels.greedy_verify(x.view(4, 2, V), drafts, torch.ones(4, dtype=torch.int64), acc, nxt, -1)
        bad = (top.isnan() | top.isposinf()).view(4, 2).any(dim=1)
        assert acc.tolist() == [1] * 4, V
        assert torch.equal(nxt, torch.where(bad, -1, x.argmax(dim=-1).view(4, 2)[:, 1])), V
        if V < 17:  # too few tokens for an unsure drafter
            continue
        flat = torch.randn(4, V, generator=g) * 0.01  # the drafter unsure, then sure: its n-gram, then its own
        logits = torch.cat([flat, flat + torch.nn.functional.one_hot(flat.argmax(dim=-1), V) * 30])
        fallback, out = torch.full((8,), 7, dtype=torch.int64), torch.empty(8, dtype=torch.int64)
        assert kernels.draft_pick(logits, None, (torch.full((8,), -1, dtype=torch.int64), fallback), 0.3, out)
        assert out.tolist() == [7] * 4 + logits[4:].argmax(dim=-1).tolist(), V


def _q4_1_exact(model: torch.nn.Module) -> None:
    """Every linear weight replaced by its Q4_1 dequantization: the loader packs it as q4_1 (as it
    packs the default model's GGUF weights), so the served kernels run."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(kernels.dequantized(p, "q4_1"))


def _q8_0_mlp(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mlp" in name and name.endswith("proj.weight"):
                p.copy_(kernels.dequantized(p, "q8_0"))
            elif "norm" in name:  # Gemma's (1 + w) norms: random, so every one of them counts
                p.uniform_(-0.5, 0.5)


def make_models(folder: Path) -> dict[str, Path]:
    import transformers as tf

    torch.manual_seed(0)
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=256, tie_word_embeddings=True))
    _q4_1_exact(llama)
    gemma = tf.Gemma2ForCausalLM(tf.Gemma2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, max_position_embeddings=256))
    _q8_0_mlp(gemma)
    out = {}
    for name, model in (("llama_q4_1", llama), ("gemma2", gemma)):
        model.save_pretrained(folder / name)
        out[name] = folder / name
    return out


@torch.inference_mode()
def check_model(folder: Path, integer_dot: bool, store: torch.dtype | None) -> None:
    model = load_model(folder, torch.float32, weight_dtype="auto", integer_dot=integer_dot)
    assert model.chunk_invariant and model.fused is not None, folder
    cfg = model.cfg
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    nxt = [11, 12, 13, 14]

    def forward(kv, slots, ids, start):
        T = len(ids[0])
        pos = torch.arange(start, start + T).expand(len(slots), T)
        ctx = model.make_context(torch.tensor(slots), pos, slots, start + T)
        return model.logits(model(torch.tensor(ids), ctx, kv))

    def cache():
        return KVCache(cfg.num_layers, 6, cfg.num_kv_heads, 64, cfg.head_dim, torch.float32, store=store)

    # prefill in one chunk vs uneven chunks (1, 16, 23 tokens; one at a time): the same logits and K/V
    kv = cache()
    whole = forward(kv, [0], [prompt], 0)[0]
    for bounds in ([0, 1, 17, 40], list(range(41))):
        kv2 = cache()
        parts = torch.cat([forward(kv2, [0], [prompt[a:b]], a)[0] for a, b in zip(bounds, bounds[1:])])
        assert torch.equal(parts, whole), (folder.name, bounds[:4])
        assert all(torch.equal(a, b) for a, b in zip(kv2.rows(0, 0, 40), kv.rows(0, 0, 40))), folder.name
    for s in range(1, 6):
        forward(kv, [s], [prompt], 0)
    # a decode step alone == inside a batch of 6 / of 2
    alone = forward(kv, [3], [nxt[:1]], 40)[0, 0]
    assert torch.equal(forward(kv, list(range(6)), [nxt[:1]] * 6, 40)[3, 0], alone), folder.name
    assert torch.equal(forward(kv, [5, 3], [nxt[:1]] * 2, 40)[1, 0], alone), folder.name
    # a verification step (4 queries) == 4 single-token steps, alone and beside another slot
    four = forward(kv, [3], [nxt], 40)[0]
    beside = forward(kv, [1, 3], [nxt, nxt], 40)[1]
    assert torch.equal(beside, four), folder.name
    for i in range(4):
        assert torch.equal(forward(kv, [3], [nxt[i:i + 1]], 40 + i)[0, 0], four[i]), (folder.name, i)


def check_q8_rows(g: torch.Generator) -> None:
    """Q8_0 embedding rows (kernels.q8_rows, and the draft head's inputs read from them) are q * d in
    fp32, torch's bits: every int8, fp16 scales from subnormal to the largest."""
    V, D = 300, 96
    q = torch.randint(-128, 128, (V, D), generator=g, dtype=torch.int8)
    q[0] = torch.arange(-128, 128, 8, dtype=torch.int8).repeat(3)[:D]
    d = (torch.rand(V, D // 32, generator=g) * 0.05).half()
    d[1] = torch.tensor([1, 0x3FF, 0x7BFF], dtype=torch.int16).view(torch.float16)  # subnormals, 65504
    d[2] = torch.tensor([0, 0x8001 - 0x10000, 0xFBFF - 0x10000], dtype=torch.int16).view(torch.float16)  # 0, negative
    E = (q.float().view(V, D // 32, 32) * d.float()[..., None]).view(V, D)
    ids = torch.cat([torch.arange(3), torch.randint(0, V, (61,), generator=g)]).view(8, 8)
    assert torch.equal(kernels.q8_rows(q, d, ids).view(torch.int32), E[ids].view(torch.int32))
    feats, w = torch.randn(8, 8, D, generator=g), torch.rand(D, generator=g) + 0.5
    assert torch.equal(kernels.head_inputs(feats, (q, d), ids, w, 1e-5), kernels.head_inputs(feats, E, ids, w, 1e-5))


def main() -> None:
    assert kernels.library() is not None, kernels.unavailable_reason()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(3)
    check_gemv(g)
    check_int_dot_extremes(g)
    check_attention(g)
    check_row_scans(g)
    check_q8_rows(g)
    with tempfile.TemporaryDirectory() as tmp:
        for path in make_models(Path(tmp)).values():
            # block formats widened to fp32 / times int8 activations, with the fp16 KV cache served
            # beside them (kv_cache_dtype auto) and the int8 one
            for integer_dot, store in ((False, None), (True, torch.float16), (True, torch.int8)):
                check_model(path, integer_dot, store)
    print("ok")


if __name__ == "__main__":
    sys.exit(main())
