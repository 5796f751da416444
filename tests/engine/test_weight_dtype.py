"""Weight-only quantization (`weight_dtype` bfloat16 / int8) on the real SmolLM2: the weights really
shrink, the model stays close to fp32, and speculation stays lossless against the same weights. The
served arithmetic (`weight_dtype` auto: the GGUF's Q4_1 / Q8_0 blocks; `activation_dtype` int8:
integer dot products) stays close to fp32, batch-invariant and lossless under speculation."""
from __future__ import annotations

import pytest
import torch

from specguide import kernels
from specguide.config import EngineConfig
from specguide.engine.loop import Engine
from specguide.models.linear import InvariantLinear
from specguide.request import Request, SamplingParams
from specguide.speculative.draft_head import DraftHead

from .conftest import run_alone, stale_blocks
from .test_drafters import outputs
from .test_speculative import prompts, requests

pytestmark = pytest.mark.skipif(kernels.library() is None, reason=f"no C compiler: {kernels.unavailable_reason()}")

TEXT = ("The Roman Empire was the post-Republican state of ancient Rome. It included territory around the "
        "Mediterranean in Europe, North Africa and Western Asia, and was ruled by emperors. {\"name\": \"Ada\", "
        "\"age\": 36, \"languages\": [\"English\", \"French\"]}")


def packed_bytes(model) -> int:
    return sum(m.packed.numel() * m.packed.element_size() for m in model.modules() if isinstance(m, InvariantLinear))


def teacher_forced_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] of one sequence through the engine's model (positions 0..T-1), on a KV cache
    of its own: the engine's cache is the engine's (a free slot keeps its prompt's rows for prefix
    caching; writing slot 0 behind the scheduler's back changed later outputs that reused it)."""
    m, kv = engine.core.model, engine.core.runner.kv
    own = kv.like(1)
    positions = torch.arange(len(ids))[None]
    ctx = m.make_context(torch.tensor([0]), positions, [0], len(ids))
    with torch.no_grad():
        return m.logits(m(torch.tensor([ids]), ctx, own))[0]


def agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Teacher-forced logits [T, vocab] against a reference's: argmax agreement and KL(ref || got)."""
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    return agree, kl


def assert_same_alone_batched_and_speculated(engine: Engine) -> None:
    """A request's greedy tokens do not depend on the batch, and speculation (4-row verification
    steps, every step drafting) gives speculation-off's output."""
    reqs = lambda k: requests(engine, lambda i: k, max_tokens=40)  # noqa: E731
    off, _ = outputs(engine, reqs(0))
    got, finals = outputs(engine, reqs(3))
    assert got == off
    assert sum(f.total_draft_tokens for f in finals) > 0
    for req, (reason, toks) in list(zip(reqs(0), off))[:2]:
        assert run_alone(engine, req)[0] == toks


def test_teacher_forcing_leaves_the_engines_cached_prefixes_alone(engine):
    """The helper runs on a cache of its own. It used to write slot 0 of the engine's: with prefix
    caching, a request that then reused slot 0's kept prompt rows decoded from the helper's rows
    (the greedy outputs of the test below changed when slot 0 kept a prompt of theirs)."""
    prompt, _ = prompts(engine)[0]  # its blocks stay cached (a 64-token chunk and more)
    ids = engine.tokenizer.encode(prompt)
    req = Request(prompt=prompt, params=SamplingParams(max_tokens=24, temperature=0.0), num_draft_tokens=0)
    want, _, _ = run_alone(engine, req)
    teacher_forced_logits(engine, engine.tokenizer.encode(TEXT))
    assert stale_blocks(engine, [ids]) == []
    got, _, final = run_alone(engine, req)
    # its blocks were shared: all but the one holding its last token
    assert final.num_cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    assert got == want


@pytest.fixture(scope="module")
def quantized(random_head):
    engines = {wd: Engine(EngineConfig(max_slots=8, max_seq_len=512, num_draft_tokens=3, drafter="head",
                                       draft_head_path=str(random_head), cost_aware_k=False,  # every step drafts
                                       weight_dtype=wd))
               for wd in ("bfloat16", "int8")}
    yield engines
    for e in engines.values():
        e.shutdown()


@pytest.mark.parametrize("wd, ratio", [("bfloat16", 0.5), ("int8", 0.25)])
def test_weights_shrink_and_stay_close_to_fp32(fp32_engine, quantized, wd, ratio):
    engine, q = fp32_engine, quantized[wd]
    assert q.core.model.head.weight_dtype == wd and q.core.model.layers[0].gate_up.weight_dtype == wd
    full, small = packed_bytes(engine.core.model), packed_bytes(q.core.model)
    assert small <= ratio * full * 1.001, (small, full)
    ids = engine.tokenizer.encode(TEXT)
    ref, got = teacher_forced_logits(engine, ids), teacher_forced_logits(q, ids)
    agree, kl = agreement(ref, got)
    # measured on TEXT: bf16 agreement 1.0, KL 7e-5; int8 0.97, KL 4e-3
    assert agree >= (0.97 if wd == "bfloat16" else 0.9), agree
    assert kl < (0.01 if wd == "bfloat16" else 0.05), kl
    assert not torch.equal(ref, got)  # really other weights


@pytest.mark.parametrize("wd", ["bfloat16", "int8"])
def test_speculation_is_lossless_against_the_same_quantized_weights(quantized, wd):
    q = quantized[wd]
    reqs = lambda k: requests(q, lambda i: k, max_tokens=40)  # noqa: E731
    off, _ = outputs(q, reqs(0))
    got, finals = outputs(q, reqs(3))
    assert got == off
    assert sum(f.total_draft_tokens for f in finals) > 0


@pytest.fixture(scope="module")
def shipped():
    e = Engine(EngineConfig(max_slots=8, max_seq_len=512, num_draft_tokens=3, weight_dtype="auto",
                            activation_dtype="float32"))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def integer(random_head):
    """The served arithmetic, forced (auto picks it only on a build with a vector integer path)."""
    e = Engine(EngineConfig(max_slots=8, max_seq_len=512, num_draft_tokens=3, weight_dtype="auto",
                            activation_dtype="int8", drafter="head", draft_head_path=str(random_head),
                            cost_aware_k=False))  # every step drafts
    yield e
    e.shutdown()


def test_auto_serves_the_gguf_at_its_shipped_precision_with_the_fp32_logits(fp32_engine, shipped):
    """weight_dtype auto on the default model (a dequantized Q4_1 GGUF): every layer's linears are
    held as Q4_1 blocks and the tied head as Q8_0, exactly; the logits are the float32 path's, bit
    for bit (the same fp32 sums in the same order), at under a fifth of the bytes."""
    engine, m = fp32_engine, shipped.core.model
    assert m.head.weight_dtype == "q8_0"
    assert {lin.weight_dtype for lin in m.layers.modules() if isinstance(lin, InvariantLinear)} == {"q4_1"}
    def nbytes(model):  # noqa: E306
        return sum(x.packed.numel() * x.packed.element_size() + (0 if x.scale is None else x.scale.numel() * 4)
                   for x in model.modules() if isinstance(x, InvariantLinear))
    assert nbytes(m) < 0.22 * nbytes(engine.core.model), (nbytes(m), nbytes(engine.core.model))
    ids = engine.tokenizer.encode(TEXT)
    assert torch.equal(teacher_forced_logits(shipped, ids), teacher_forced_logits(engine, ids))


def test_auto_greedy_output_equals_float32_with_and_without_speculation(fp32_engine, shipped):
    engine = fp32_engine
    reqs = lambda e, k: requests(e, lambda i: k, max_tokens=40)  # noqa: E731
    ref, _ = outputs(engine, reqs(engine, 0))
    assert outputs(shipped, reqs(shipped, 0))[0] == ref
    assert outputs(shipped, reqs(shipped, 3))[0] == ref


def test_integer_dot_holds_the_same_blocks_and_stays_close_to_fp32(fp32_engine, shipped, integer):
    """activation_dtype int8: the same Q4_1 / Q8_0 blocks (bytes) in the integer-dot layout; the
    logits are no longer fp32's bits but close: KL 3e-3 on TEXT, and the argmax is fp32's wherever
    fp32's top two logits are 0.5 apart (its median gap is 0.8). Overall agreement moves with the
    last bits of any kernel: 0.98 or 0.93 on TEXT's 60 tokens (1 or 4 near-ties, gaps 0.04-0.21,
    flipped by a reordered fp32 sum), 0.948 either way on 500 README tokens."""
    engine, m = fp32_engine, integer.core.model
    assert m.integer_dot and m.head.weight_dtype == "q8_0_q8"
    assert {lin.weight_dtype for lin in m.layers.modules() if isinstance(lin, InvariantLinear)} == {"q4_1_q8"}
    assert packed_bytes(m) == packed_bytes(shipped.core.model)
    ids = engine.tokenizer.encode(TEXT)
    ref, got = teacher_forced_logits(engine, ids), teacher_forced_logits(integer, ids)
    agree, kl = agreement(ref, got)
    assert agree >= 0.9 and kl < 0.01, (agree, kl)
    top2 = ref.topk(2, -1).values
    decisive = top2[:, 0] - top2[:, 1] >= 0.5
    assert decisive.sum() >= len(ids) // 2
    assert torch.equal(ref.argmax(-1)[decisive], got.argmax(-1)[decisive])
    assert not torch.equal(ref, got)  # really the integer path


def test_integer_dot_output_is_the_same_alone_batched_and_speculated(integer):
    """Per-row activation scales and exact integer sums: a request's greedy tokens do not depend on
    the batch, and speculation (4-row verification steps) gives speculation-off's output."""
    assert_same_alone_batched_and_speculated(integer)


def test_activation_dtype_auto_follows_the_builds_integer_path():
    path = kernels.integer_dot_path()
    assert path in kernels.INT_DOT_PATHS
    assert kernels.use_integer_dot("auto") == (path != "scalar")
    assert kernels.use_integer_dot("int8") and not kernels.use_integer_dot("float32")
    with pytest.raises(ValueError, match="activation_dtype"):
        EngineConfig(activation_dtype="int4")


def test_unknown_weight_dtype_is_refused():
    with pytest.raises(ValueError, match="weight_dtype"):
        EngineConfig(weight_dtype="int4")
    with pytest.raises(ValueError, match="% 32"):
        kernels.pack_weight(torch.zeros(64, 40), "q4_1")
    with pytest.raises(ValueError, match="draft_head_weight_dtype"):
        EngineConfig(draft_head_weight_dtype="int4")


def test_draft_head_weights_follow_their_own_setting(fp32_engine, random_head):
    """draft_head_weight_dtype: the head's linears and its LM-head slice are held as asked ("" = the
    target's float32) and compute close to the float32 head (drafts only: output never changes)."""
    engine = fp32_engine  # the head's "" follows the target's float32 weights
    heads = {wd: DraftHead.load(random_head, engine.core.model, wd) for wd in ("", "bfloat16", "int8")}
    linears = lambda h: [h.lm, h.fc, h.layer.qkv, h.layer.o, h.layer.gate_up, h.layer.down]  # noqa: E731
    assert {m.weight_dtype for m in linears(heads[""])} == {"float32"}
    torch.manual_seed(1)
    H = engine.core.model.cfg.hidden_size
    g, attn = torch.randn(64, H), torch.randn(64, H)
    ref_top = heads[""].logits(g).argmax(-1)
    ref_mlp = heads[""].layer.out_mlp(g, attn)
    for wd, agree, err in (("bfloat16", 0.97, 0.005), ("int8", 0.9, 0.01)):
        h = heads[wd]
        assert {m.weight_dtype for m in linears(h)} == {wd}
        assert (h.logits(g).argmax(-1) == ref_top).float().mean() >= agree
        mlp = h.layer.out_mlp(g, attn)
        assert 0 < ((mlp - ref_mlp).norm() / ref_mlp.norm()).item() < err


def test_the_served_draft_head_multiplies_int8_activations_like_the_target(fp32_engine, integer, random_head):
    """draft_head_weight_dtype's default (q8_0) under activation_dtype int8: the head's linears and
    LM-head slice take the integer-dot path as the target's layers do (its prompt catch-up 2.5x
    cheaper on Zen 3 than the widened int8 path: bench/HISTORY.md), and its drafts stay the float32
    head's."""
    head = integer.core.proposer.head.head
    linears = [head.lm, head.fc, head.layer.qkv, head.layer.o, head.layer.gate_up, head.layer.down]
    assert {m.weight_dtype for m in linears} == {"q8_0_q8"}
    ref = DraftHead.load(random_head, fp32_engine.core.model, "")
    torch.manual_seed(2)
    g = torch.randn(64, fp32_engine.core.model.cfg.hidden_size)
    assert (head.logits(g).argmax(-1) == ref.logits(g).argmax(-1)).float().mean() >= 0.9
    assert not torch.equal(head.logits(g), ref.logits(g))


def test_an_int8_kv_cache_holds_half_the_bytes_and_keeps_outputs_invariant(integer, random_head):
    """kv_cache_dtype int8: K and V as int8 with a scale per position and KV head (68 bytes a 64-dim
    head against fp16's 128); each value stored once, so a request's greedy tokens are the same
    alone, batched and speculated; the logits stay close to the fp16 cache's (measured on schema
    prompts against the float32 model: KL 1.1-9.0e-3 against fp16's 0.8-6.3e-3, bench/HISTORY.md)."""
    e = Engine(EngineConfig(max_slots=8, max_seq_len=512, num_draft_tokens=3, weight_dtype="auto",
                            activation_dtype="int8", kv_cache_dtype="int8", drafter="head",
                            draft_head_path=str(random_head), cost_aware_k=False))  # every step drafts
    try:
        kv, half = e.core.runner.kv, integer.core.runner.kv
        assert kv.k.dtype == kv.v.dtype == torch.int8 and half.k.dtype == torch.float16
        assert kv.nbytes / half.nbytes == pytest.approx((64 + 4) / (2 * 64), rel=0.01)
        assert_same_alone_batched_and_speculated(e)
        ids = e.tokenizer.encode(TEXT * 3)
        ref, got = teacher_forced_logits(integer, ids), teacher_forced_logits(e, ids)
        agree, kl = agreement(ref, got)
        assert agree >= 0.9 and kl < 0.02, (agree, kl)
        assert not torch.equal(ref, got)  # really another cache
    finally:
        e.shutdown()


def test_a_narrow_kv_cache_needs_the_attention_kernel():
    from specguide.engine.kv_cache import KVCache

    for store in (torch.float16, torch.int8):
        with pytest.raises(ValueError, match="C attention kernel"):
            KVCache(2, 1, 2, 32, 64, torch.float32, store=store, kernel_layout=False)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
