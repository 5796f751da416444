"""The C row kernels: the scans (kernels.argmax, kernels.nonfinite_rows, kernels.greedy_verify,
kernels.draft_pick) give torch's answers; the RMS norm (kernels.rms_norm) is torch's to rounding, a
row's bits independent of the other rows; kernels.head_inputs builds a draft head's input rows with
that norm; kernels.scatter_rows is torch's index_put, and refuses an index out of range."""
from __future__ import annotations

import pytest
import torch

from specguide import kernels
from specguide.speculative import acceptance
from specguide.engine.step import nonfinite_rows


def rows(V: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(V)
    x = torch.randn(12, V, generator=g)
    x[1] = float("-inf")  # every token masked
    x[2, V // 3] = x[2, V - 1] = x[2].max() + 1  # a tie: the first one wins
    x[3, V - 1] = float("nan")  # NaN last: it counts as the maximum
    x[4, [1, V // 2]] = float("nan")  # the first NaN
    x[5, V // 2] = float("inf")
    x[6, ::2] = float("-inf")  # a grammar mask
    x[7] = 0.0  # all equal
    x[8, 0] = float("inf")
    x[8, 1] = float("nan")
    return x


@pytest.mark.parametrize("V", [2, 7, 16, 64, 1000, 49152])  # below, at and past a vector's width
def test_argmax_is_torchs_first_maximum_nan_included(V):
    assert kernels.library() is not None
    x = rows(V)
    assert torch.equal(kernels.argmax(x), x.argmax(dim=-1))
    assert torch.equal(kernels.argmax(x.view(3, 4, V)), x.view(3, 4, V).argmax(dim=-1))  # [..., V]


@pytest.mark.parametrize("V", [2, 7, 64, 1000])
def test_nonfinite_rows_are_nan_or_plus_inf_rows(V):
    x = rows(V)
    top = x.amax(dim=-1)
    assert torch.equal(kernels.nonfinite_rows(x), top.isnan() | top.isposinf())
    assert torch.equal(nonfinite_rows(x.view(2, 6, V)), (top.isnan() | top.isposinf()).view(2, 6))


def reference_tail(logits, drafts, num):
    """What the step computed before the one-scan tail: acceptance.verify, then the non-finite rows' -1."""
    B, T, _ = logits.shape
    if T == 1:
        acc, nxt = torch.zeros(B, dtype=torch.int64), logits[:, 0].argmax(dim=-1)
    else:
        acc, nxt = acceptance.verify(logits, drafts, num)
    return acc, torch.where(nonfinite_rows(logits).any(dim=1), -1, nxt)


@pytest.mark.parametrize("V", [2, 7, 64, 49152])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_greedy_verify_is_acceptance_and_the_nonfinite_check_in_one_scan(V, T):
    g = torch.Generator().manual_seed(V * 10 + T)
    pool = torch.cat([rows(V), torch.randn(12, V, generator=g)])  # rows 3, 4, 5, 8: NaN or +inf
    order = [12, 13, 3, 14, 15, 16, 17, 5, 18, 19, 20, 2, 21, 22, 6, 23, 9, 10, 11, 0, 1, 7, 4, 8]
    logits = pool[order[: 6 * T]].view(6, T, V).contiguous() if T > 1 else pool[[12, 3, 13, 5, 2, 6]][:, None]
    target = logits.argmax(dim=-1)
    drafts = target[:, : T - 1].clone()  # drafts the target agrees with, then some it does not
    drafts[1::2, T // 2:] = (drafts[1::2, T // 2:] + 1) % V
    num = torch.tensor([T - 1, 0, 1, T - 1, max(T - 2, 0), T - 1])[:6]
    want = reference_tail(logits, drafts if T > 1 else None, num)
    assert bool((want[1] == -1).any()) and bool((want[1] >= 0).any())
    if T > 1:  # whole, partial and no acceptance among the rows
        assert {0, T - 1} <= set(want[0].tolist())
    acc, nxt = torch.full((6,), 9, dtype=torch.int64), torch.full((6,), 9, dtype=torch.int64)
    args = (drafts.t().contiguous().t(), num) if T > 1 else (None, None)  # drafts as the step has them: a view
    assert kernels.greedy_verify(logits, *args, acc, nxt, -1)
    assert torch.equal(acc, want[0]) and torch.equal(nxt, want[1])
    buf = torch.zeros(3, 10, dtype=torch.int64)  # rows of the step's static buffers, written in place
    assert kernels.greedy_verify(logits, *args, buf[0, :6], buf[1, :6], -1)
    assert torch.equal(buf[0, :6], want[0]) and torch.equal(buf[1, :6], want[1])
    assert not buf[2].any() and not buf[:2, 6:].any()
    assert not kernels.greedy_verify(logits.transpose(0, 1), *args, acc, nxt, -1)  # not contiguous: nothing done
    assert not kernels.greedy_verify(logits, *args, acc.int(), nxt, -1)


def test_greedy_verify_sends_the_bad_token_for_a_nonfinite_row_at_any_position():
    logits = torch.randn(3, 4, 50)
    logits[0, 3, 7] = float("nan")  # past the accepted drafts: still the whole row's
    logits[1, 0, 2] = float("inf")
    drafts, num = logits.argmax(dim=-1)[:, :3].clone(), torch.tensor([3, 3, 3])
    acc, nxt = torch.empty(3, dtype=torch.int64), torch.empty(3, dtype=torch.int64)
    assert kernels.greedy_verify(logits, drafts, num, acc, nxt, -1)
    assert nxt.tolist()[:2] == [-1, -1] and nxt[2] == logits[2, 3].argmax()
    assert acc.tolist() == [3, 3, 3]


def reference_pick(logits, d2t, fixed, fallback):
    """The draft loop's torch ops before kernels.draft_pick."""
    tok = logits.argmax(dim=-1)
    tok = d2t[tok] if d2t is not None else tok
    if fixed is None:
        return tok
    unsure = logits.softmax(dim=-1).amax(dim=-1) < 0.3
    return torch.where(fixed >= 0, fixed, torch.where(unsure & (fallback >= 0), fallback, tok))


@pytest.mark.parametrize("V", [5, 64, 1000, 8192])
def test_draft_pick_is_the_draft_loops_argmax_and_pick(V):
    g = torch.Generator().manual_seed(V)
    flat = torch.randn(8, V, generator=g) * 0.01  # unsure: the top probability ~1/V
    sure = flat.clone()
    sure[torch.arange(8), torch.randint(0, V, (8,), generator=g)] += 20.0  # sure: ~1
    logits = torch.cat([flat, sure, rows(V)[[1, 3, 6]]])  # + all masked, NaN, half masked
    B = logits.shape[0]
    fixed = torch.full((B,), -1, dtype=torch.int64)
    fixed[::4] = 11
    fallback = torch.full((B,), -1, dtype=torch.int64)
    fallback[::3] = 22
    fallback[-3:] = 33
    d2t = torch.randperm(V * 3, generator=g)[:V]
    unsure = logits.softmax(dim=-1).amax(dim=-1) < 0.3
    assert unsure[:8].all() and not unsure[8:16].any()  # no row near the threshold
    for dt in (None, d2t):
        for props in (None, (fixed, fallback)):
            want = reference_pick(logits, dt, *(props or (None, None)))
            out, host = torch.full((B,), 5, dtype=torch.int64), torch.full((B,), 5, dtype=torch.int64)
            assert kernels.draft_pick(logits, dt, props, 0.3, out, host)
            assert torch.equal(out, want) and torch.equal(host, want)
            if props is not None:  # every choice is made somewhere
                assert {11, 22} <= set(out.tolist()) and (out[8:16] != 22).any()
    assert not kernels.draft_pick(logits.double(), None, None, 0.3, out)


def test_head_inputs_are_the_features_and_the_normed_embedding_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    E, w = torch.randn(100, 64, generator=g), torch.rand(64, generator=g) + 0.5
    feats, ids = torch.randn(3, 4, 64, generator=g), torch.randint(0, 100, (3, 4), generator=g)
    got = kernels.head_inputs(feats, E, ids, w, 1e-5)
    assert torch.equal(got, torch.cat([feats, kernels.rms_norm(E[ids], w, 1e-5)], dim=-1))
    g1 = kernels.head_inputs(feats[:, 1:2], E, ids[:, 1:2], w, 1e-5)  # a strided view: the same rows
    assert torch.equal(g1, got[:, 1:2])
    assert kernels.head_inputs(feats.double(), E, ids, w, 1e-5) is None
    store = torch.randn(45, 64, generator=g)  # features read in place: store[at]
    at = torch.tensor([[36, 8], [3, 3], [25, 1]])
    got = kernels.head_inputs(store, E, ids[:, :2], w, 1e-5, at=at)
    assert torch.equal(got, torch.cat([store[at], kernels.rms_norm(E[ids[:, :2]], w, 1e-5)], dim=-1))
    for bad in (torch.tensor([[45, 8], [3, 3], [25, 1]]), torch.tensor([[36, 8], [-1, 3], [25, 1]])):
        with pytest.raises(IndexError):
            kernels.head_inputs(store, E, ids[:, :2], w, 1e-5, at=bad)
    with pytest.raises(IndexError):  # a token id outside the embedding
        kernels.head_inputs(feats, E, ids + 100, w, 1e-5)


def test_head_inputs_read_q8_0_rows_as_the_fp32_table_they_equal():
    """The embedding held as Q8_0 rows (models/embedding.Q8Rows) gives the draft head the same input
    bits as the fp32 table of the same values."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (100, 64), generator=g, dtype=torch.int8)
    d = (torch.rand(100, 2, generator=g) / 50).half()
    E = (q.float().view(100, 2, 32) * d.float()[..., None]).view(100, 64)
    w = torch.rand(64, generator=g) + 0.5
    feats, ids = torch.randn(3, 4, 64, generator=g), torch.randint(0, 100, (3, 4), generator=g)
    got = kernels.head_inputs(feats, (q, d), ids, w, 1e-5)
    assert got is not None and torch.equal(got, kernels.head_inputs(feats, E, ids, w, 1e-5))
    store, at = torch.randn(45, 64, generator=g), torch.tensor([[36, 8], [3, 3], [25, 1]])
    assert torch.equal(kernels.head_inputs(store, (q, d), ids[:, :2], w, 1e-5, at=at),
                       kernels.head_inputs(store, E, ids[:, :2], w, 1e-5, at=at))
    assert kernels.head_inputs(feats, (q, d.float()), ids, w, 1e-5) is None  # d must be fp16 bits
    with pytest.raises(IndexError):
        kernels.head_inputs(feats, (q, d), ids + 100, w, 1e-5)


def test_pick_rows_takes_each_batch_rows_own_row():
    x, at = torch.randn(4, 3, 8), torch.tensor([2, 0, 1, 2])
    assert torch.equal(kernels.pick_rows(x, at), x[torch.arange(4), at])
    with pytest.raises(IndexError):
        kernels.pick_rows(x, torch.tensor([2, 0, 3, 2]))
    assert torch.equal(kernels.pick_rows(x.double(), at), x.double()[torch.arange(4), at])  # torch's


def test_scatter_rows_is_an_index_put_and_checks_its_indices():
    g = torch.Generator().manual_seed(1)
    dst = torch.randn(40, 33, generator=g)
    src = torch.randn(3, 2, 33, generator=g)
    at = torch.tensor([[24, 25], [0, 9], [37, 38]])
    ref = dst.clone()
    ref[at] = src
    assert kernels.scatter_rows(dst, at, src)
    assert torch.equal(dst, ref)
    before = dst.clone()
    for bad in (torch.tensor([[24, 25], [0, 40], [37, 38]]), torch.tensor([[24, 25], [-1, 9], [37, 38]])):
        with pytest.raises(IndexError):
            kernels.scatter_rows(dst, bad, src)
        assert torch.equal(dst, before)  # nothing written
    assert not kernels.scatter_rows(dst.double(), at, src.double())  # torch's then


def test_other_layouts_fall_back_to_torch():
    x = rows(64)
    t = x.t()  # not contiguous
    assert torch.equal(kernels.argmax(t), t.argmax(dim=-1))
    assert kernels.nonfinite_rows(t) is None
    assert torch.equal(kernels.argmax(x.double()), x.double().argmax(dim=-1))


def test_rms_norm_is_torchs_to_rounding_and_row_by_row():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3, 576, generator=g) * 3, torch.rand(576, generator=g) + 0.5
    got = kernels.rms_norm(x, w, 1e-5)
    ref = torch.nn.functional.rms_norm(x, w.shape, w, 1e-5)
    assert got.shape == x.shape and torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got, x)
    for i in range(5):  # alone, a row gives the bits it gives among others
        assert torch.equal(kernels.rms_norm(x[i, 1:2], w, 1e-5), got[i, 1:2])
    t = x.clone().requires_grad_()  # training: torch's, with gradients
    assert kernels.rms_norm(t, w, 1e-5).requires_grad
