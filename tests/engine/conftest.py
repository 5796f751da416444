"""Fixtures for engine tests: the real SmolLM2 (default model) and a transformers reference."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from specguide.config import EngineConfig
from specguide.engine import faults
from specguide.engine.block_pool import BLOCK, block_keys
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
    """Requests admitted meanwhile (one at a time: `slot` must be free) take `slot`."""
    sched = engine.core.scheduler

    def forced(seq):
        assert slot in sched.free_slots, (slot, sched.free_slots)
        sched.free_slots.remove(slot)
        return slot

    sched._take_slot = forced
    try:
        yield
    finally:
        del sched._take_slot


@torch.inference_mode()
def stale_blocks(engine: Engine, token_lists: list[list[int]]) -> list[int]:
    """The token lists whose cached prefix blocks (those a prompt starting with them shares) do not
    hold, bit for bit, what prefilling those tokens computes: the target's K/V in every layer, and
    the target features the draft head reads (call with the engine idle: the blocks are read
    through slot 0's row of the block table)."""
    sched, m, kv, head = engine.core.scheduler, engine.core.model, engine.core.runner.kv, engine.core.proposer.head
    assert not sched.running
    bad = []
    for i, tokens in enumerate(token_lists):
        blocks = sched.pool.match(block_keys(tokens, [], len(tokens)))
        if not blocks:
            continue
        n = len(blocks) * BLOCK
        own = kv.like(1, n)
        feats = m(torch.tensor([tokens[:n]]), m.make_context(torch.tensor([0]), torch.arange(n)[None], [0], n), own)
        sched.pool.table[0, : len(blocks)] = blocks
        try:
            ok = all(torch.equal(a, b) for a, b in zip(kv.rows(0, 0, n), own.rows(0, 0, n)))
            ok = ok and (head is None or torch.equal(head.features(0, 0, n), feats[0]))
        finally:
            sched.pool.table[0] = 0
        if not ok:
            bad.append(i)
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
