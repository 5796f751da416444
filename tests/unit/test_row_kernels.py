"""The C row kernels: the scans (kernels.argmax, kernels.nonfinite_rows) give torch's answers; the
RMS norm (kernels.rms_norm) is torch's to rounding, a row's bits independent of the other rows."""
from __future__ import annotations

import pytest
import torch

from specguide import kernels
from specguide.step import nonfinite_rows


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
