"""The step's logits live in one static buffer on CPU: every eager decode step of a batch (plain,
speculative, guided with the sparse head) writes its [B, T, V] logits into the StepCore's
`logits_buf` rather than a new tensor (one past glibc's mmap threshold is mapped, faulted in and
unmapped each step), and the tokens are the same as with a new tensor each step."""
from __future__ import annotations

import json

import pytest
import torch

from specguide import kernels
from specguide.request import GuidedDecodingParams, Request, SamplingParams

from .test_guided_engine import run_many

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
          "required": ["city", "year"]}


def requests(engine) -> list[Request]:
    chat = engine.tokenizer.apply_chat_template
    guided = GuidedDecodingParams("json_schema", json.dumps(SCHEMA))
    return [Request(prompt=chat([{"role": "user", "content": f"Name a city founded before {y}, as JSON."}]),
                    params=SamplingParams(max_tokens=24, temperature=0.0), guided=guided if y % 2 else None)
            for y in (1200, 1301, 1500, 1701)]


@pytest.fixture
def recorded(engine, monkeypatch):
    """Every logits tensor the step returns, while the test runs: (its storage's address, shape)."""
    step = engine.core.runner.core
    seen: list[tuple[int, tuple[int, ...]]] = []
    original = type(step).logits

    def logits(self, key, hidden):
        out = original(self, key, hidden)
        seen.append((out.untyped_storage().data_ptr(), tuple(out.shape)))
        return out

    monkeypatch.setattr(type(step), "logits", logits)
    return step, seen


@pytest.mark.skipif(kernels.library() is None, reason="the C kernels are not built")
def test_every_eager_cpu_step_writes_its_logits_into_the_one_static_buffer(engine, recorded):
    step, seen = recorded
    results = run_many(engine, requests(engine))
    assert all(final.finish_reason in ("stop", "length") for _, _, final in results)
    assert seen, "no decode step ran"
    buf = step.logits_buf
    assert buf is not None and buf.shape == (step.kv.max_slots * step.rows_per_slot, engine.core.model.head.out_features)
    assert {ptr for ptr, _ in seen} == {buf.untyped_storage().data_ptr()}, "a step's logits in a tensor of its own"
    assert any(shape[0] > 1 for _, shape in seen), "no batched step"


@pytest.mark.skipif(kernels.library() is None, reason="the C kernels are not built")
def test_the_static_buffer_gives_the_tokens_a_new_tensor_gives(engine, monkeypatch):
    with_buffer = run_many(engine, requests(engine))
    monkeypatch.setattr(type(engine.core.runner.core), "_logits_out", lambda self, key, hidden: None)
    without = run_many(engine, requests(engine))
    assert [toks for toks, _, _ in with_buffer] == [toks for toks, _, _ in without]


@pytest.mark.skipif(kernels.library() is None, reason="the C kernels are not built")
def test_gemv_writes_into_a_given_output_the_bits_it_returns_otherwise():
    torch.manual_seed(0)
    w = torch.randn(200, 128)
    packed, scale = kernels.pack_weight(w, "q8_0")
    x = torch.randn(5, 128)
    out = torch.full((5, 200), float("nan"))
    y = kernels.gemv(x, packed, scale, 200, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(out, kernels.gemv(x, packed, scale, 200))
    with pytest.raises(AssertionError):
        kernels.gemv(x, packed, scale, 200, out=torch.empty(4, 200))
