"""The embedding held as Q8_0 rows (models/embedding.py): only a table whose every row is Q8_0
values becomes one, and its rows are the fp32 table's bits; unpacked from a Q8_0 LM head packed from
the same rows, the blocks are the ones quantizing finds."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from specguide import kernels
from specguide.models.embedding import Q8Rows, _unpack_head
from specguide.models.linear import make_head
from specguide.models.llama import LlamaModel, ModelConfig

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the C kernels did not build")


def q8_table(V: int = 130, D: int = 96, seed: int = 0) -> torch.Tensor:
    """An fp32 [V, D] table of Q8_0 values, as a GGUF's Q8_0 embedding dequantizes (V not a multiple
    of the head's 64-row tiles)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (V, D), generator=g, dtype=torch.int8)
    q[:, ::32] = 127  # each block's largest |q| is 127, as Q8_0 quantization makes it
    d = (torch.rand(V, D // 32, generator=g) / 40 + 1e-3).half().float()
    return (q.float().view(V, D // 32, 32) * d[..., None]).view(V, D)


@pytest.mark.parametrize("head_format", [None, "q8_0", "q8_0_q8"])
def test_q8_rows_give_back_the_tables_bits(head_format):
    E = q8_table()
    head = None if head_format is None else make_head(E, "q8_0", head_format == "q8_0_q8")
    if head is not None:
        assert head.weight_dtype == head_format
        q, d, exact = kernels.quantize_q8_0(E)
        unpacked = _unpack_head(head, E.shape)
        assert exact and torch.equal(unpacked[0], q) and torch.equal(unpacked[1], d.half())
    rows = Q8Rows.of(E, head)
    assert rows is not None and rows.dtype == torch.float32
    ids = torch.tensor([[0, 129, 64], [5, 5, 63]])
    assert torch.equal(rows(ids).view(torch.int32), E[ids].view(torch.int32))
    assert rows.q.nbytes + rows.d.nbytes < E.nbytes / 3


def test_a_table_that_is_not_q8_0_values_stays_fp32():
    E = q8_table()
    assert Q8Rows.of(torch.randn(130, 96)) is None  # plain fp32 values
    sampled = set(torch.linspace(0, 129, 64).long().tolist())  # the rows Q8Rows.of tries first
    for row in (min(sampled), min(set(range(130)) - sampled)):  # one value off, in a row tried first or not
        nudged = E.clone()
        nudged[row, 5] = torch.nextafter(nudged[row, 5], torch.tensor(10.0))
        assert Q8Rows.of(nudged) is None
    signed_zero = E.clone()
    signed_zero[3, 40] = -0.0  # equal to q * d = +0.0, but not the same bits
    assert Q8Rows.of(signed_zero) is None
    assert Q8Rows.of(E[:, :80]) is None  # rows not whole blocks of 32
    assert Q8Rows.of(E.double()) is None


def test_a_tied_model_with_a_q8_0_embedding_keeps_it_so():
    """A tied model whose embedding is Q8_0 values, finalized as the loader does: its embedding is
    Q8Rows, its rows and the head's unchanged, and the fp32 table is no longer held."""
    E = q8_table(V=256, D=64)
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=True)
    model = LlamaModel(cfg, torch.ones(16)).eval().requires_grad_(False)
    model.embed.weight = nn.Parameter(E, requires_grad=False)
    model.finalize("auto", True)
    assert isinstance(model.embed, Q8Rows) and model.dtype == torch.float32
    ids = torch.arange(256)
    assert torch.equal(model.embed(ids), E) and torch.equal(model.head_rows(ids[:10]), E[:10])
    assert not any(t.data_ptr() == E.data_ptr() for t in model.state_dict().values())


def test_a_lookup_outside_the_table_is_an_index_error():
    rows = Q8Rows.of(q8_table())
    for bad in ([130], [0, -1]):
        with pytest.raises(IndexError):
            rows(torch.tensor(bad))
    assert rows(torch.zeros(0, dtype=torch.int64)).shape == (0, 96)
