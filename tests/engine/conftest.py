"""Fixtures for engine tests: the real SmolLM2 (default model) and a transformers reference."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from specguide.config import EngineConfig
from specguide.engine import faults
from specguide.engine.loop import Engine
from specguide.models.loader import resolve_model_dir

from ..guided.helpers import save_random_head

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nList three primary colors.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="session")
def model_dir():
    return resolve_model_dir()


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def random_head(tmp_path_factory, engine):
    """An untrained head over a pruned vocabulary (every 3rd id): lossless whatever it proposes."""
    return save_random_head(tmp_path_factory.mktemp("head") / "random.pt", engine.core.model.cfg)


@pytest.fixture(scope="session")
def engine():
    """The served engine: EngineConfig's defaults are config.pbtxt's (weights auto, int8 activations
    where the CPU has an integer path, the hybrid drafter with the trained head, cost-aware K), sized down."""
    eng = Engine(EngineConfig(max_slots=8, max_seq_len=512, prefill_chunk=64))
    yield eng
    eng.shutdown()
    eng.join(timeout=0)
    assert not eng.is_alive()


@pytest.fixture
def inject_faults(monkeypatch):
    """`inject_faults(*engines)`: until the test ends, injection is on (the environment) and each
    engine has a FaultInjector, so requests that name a fault get it."""
    monkeypatch.setenv(faults.ENV, "1")
    installed: list[faults.FaultInjector] = []
    yield lambda *engines: installed.extend(faults.FaultInjector(e.core).install() for e in engines)
    for injector in reversed(installed):
        injector.remove()


@pytest.fixture(scope="session")
def fp32_engine():
    """The float32 model (weights and activations): what transformers' float32 logits are compared
    with, and the reference of the other weight formats."""
    eng = Engine(EngineConfig(max_slots=8, max_seq_len=512, prefill_chunk=64, weight_dtype="float32",
                              activation_dtype="float32"))
    yield eng
    eng.shutdown()


def run_alone(engine: Engine, request):
    """All events of one request; returns (token ids, text, final event)."""
    outs = list(engine.generate(request))
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs), outs[-1]


@contextlib.contextmanager
def placed_in(engine: Engine, slot: int):
    """Requests admitted meanwhile (one at a time: `slot` must be free) take `slot`, as if it were
    the only free slot: reuse from it, or a copy into it from another slot, as the scheduler picks."""
    sched = engine.core.scheduler
    pick = sched._pick_slot

    def forced(seq):
        assert slot in sched.free_slots, (slot, sched.free_slots)
        others = [s for s in sched.free_slots if s != slot]
        sched.free_slots = [slot]
        try:
            return pick(seq)
        finally:
            sched.free_slots = others + sched.free_slots

    sched._pick_slot = forced
    try:
        yield
    finally:
        del sched._pick_slot


@torch.inference_mode()
def stale_kept_prefixes(engine: Engine) -> list[int]:
    """Free slots whose kept rows (prefix caching) are not, bit for bit, what prefilling the
    tokens they stand for computes (call with the engine idle). A chunk-invariant model is checked
    against another split than the engine's chunks (a first chunk of 7 tokens)."""
    m, kv, chunk = engine.core.model, engine.core.runner.kv, engine.config.prefill_chunk
    bad = []
    for slot in sorted(engine.core.scheduler.free_slots):
        tokens = engine.core.scheduler.slot_tokens[slot]
        if not tokens:
            continue
        own = kv.like(1)
        starts = [0, *range(7, len(tokens), chunk)] if m.chunk_invariant else range(0, len(tokens), chunk)
        for a, b in zip(starts, [*starts[1:], len(tokens)]):
            ctx = m.make_context(torch.tensor([0]), torch.arange(a, b)[None], [0], b)
            m(torch.tensor([tokens[a:b]]), ctx, own)
        n = len(tokens)
        if not all(torch.equal(a, b) for a, b in zip(kv.rows(slot, 0, n), own.rows(0, 0, n))):
            bad.append(slot)
    return bad


@torch.inference_mode()
def stale_draft_rows(engine: Engine) -> list[int]:
    """Free slots whose drafter rows that a new sequence sharing the slot's kept tokens would reuse
    (the draft head's K/V rows and the target features it reads; a draft model's K/V rows) are not,
    bit for bit, what computing them from scratch over those tokens gives (call with the engine idle)."""
    m, head, dm = engine.core.model, engine.core.proposer.head, engine.core.proposer.draft_model
    bad = []
    for slot in sorted(engine.core.scheduler.free_slots):
        tokens = engine.core.scheduler.slot_tokens[slot]
        n, ok = len(tokens), True
        rows = min(head.valid[slot], n - 1) if head is not None else 0
        if rows > 0:  # row p: (f_p, x_{p+1})
            kv = engine.core.runner.kv.like(1, n)  # the target's features as the engine computes them
            feats = m(torch.tensor([tokens]), m.make_context(torch.tensor([0]), torch.arange(n)[None], [0], n), kv)
            own = head.kv.like(1)
            ctx = m.make_context(torch.tensor([0]), torch.arange(rows)[None], [0], rows)
            head.head(feats[:, :rows], torch.tensor([tokens[1: rows + 1]]), ctx, own)
            ok = (torch.equal(head.features(slot, 0, rows), feats[0, :rows])
                  and all(torch.equal(a, b) for a, b in zip(head.kv.rows(slot, 0, rows), own.rows(0, 0, rows))))
        rows = min(dm.cached[slot], n) if dm is not None else 0
        if rows > 0:
            d = dm.model
            own = dm.kv.like(1, rows)
            d(torch.tensor([tokens[:rows]]), d.make_context(torch.tensor([0]), torch.arange(rows)[None], [0], rows), own)
            ok = ok and all(torch.equal(a, b) for a, b in zip(dm.kv.rows(slot, 0, rows), own.rows(0, 0, rows)))
        if not ok:
            bad.append(slot)
    return bad


def thread_nices(pid: int) -> set[int]:
    """The nice value of each thread of a process (Linux keeps one per thread); empty once it ended."""
    out = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except OSError:  # the thread ended
            pass
    return out
