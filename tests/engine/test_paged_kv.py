"""The paged KV cache in the engine: blocks follow the work, and when they run short the newest
sequence is preempted and recomputed later, with every request's output as alone (greedy,
seeded sampling, a JSON-schema guide, speculation on)."""
from __future__ import annotations

import json
import queue
import threading

import pytest

from specguide.config import EngineConfig
from specguide.engine.block_pool import BlockPool
from specguide.engine.kv_cache import block_bytes
from specguide.engine.loop import Engine
from specguide.engine.scheduler import Status
from specguide.request import GuidedDecodingParams, Request, SamplingParams

from .conftest import PROMPTS, run_alone

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


def requests() -> list[Request]:
    out = [Request(prompt=p, params=SamplingParams(max_tokens=72, temperature=0.0, ignore_eos=True))
           for p in PROMPTS]
    out.append(Request(prompt=PROMPTS[0] + " Paris, and", params=SamplingParams(
        max_tokens=72, temperature=0.8, seed=7, ignore_eos=True)))
    out.append(Request(prompt="<|im_start|>user\nA person as JSON.<|im_end|>\n<|im_start|>assistant\n",
                       params=SamplingParams(max_tokens=72, temperature=0.0),
                       guided=GuidedDecodingParams("json_schema", json.dumps(SCHEMA))))
    return out


@pytest.fixture(scope="module")
def tight(engine):
    """The session engine's settings with KV memory for 24 blocks (384 positions): the 7 requests
    below need about 40 at once."""
    core = engine.core
    per = block_bytes(core.model.cfg, core.runner.kv.store, core.model.dtype, core.proposer.head is not None)
    eng = Engine(EngineConfig(max_slots=8, max_seq_len=256, prefill_chunk=64, kv_cache_bytes=25 * per))
    assert eng.core.scheduler.pool.num_blocks == 25
    yield eng
    eng.shutdown()


def test_when_blocks_run_short_the_newest_are_preempted_and_every_output_is_as_alone(engine, tight):
    reqs = requests()
    want = [run_alone(engine, r)[0] for r in reqs]
    sched = tight.core.scheduler
    events: list[queue.Queue] = [queue.Queue() for _ in reqs]
    held: list[int] = []  # blocks the running sequences hold, after each step
    seen_preempted = threading.Event()

    def on_output(q):
        def cb(out):
            q.put(out)
            s = tight.stats()
            held.append(s["kv_blocks_used"])
            if s["preempted"]:
                seen_preempted.set()
        return cb

    for q, r in zip(events, reqs):
        tight.submit(r, on_output(q))
    got = []
    for q in events:
        ids, out = [], None
        while out is None or not out.finished:
            out = q.get(timeout=300)
            ids += out.token_ids
        assert out.finish_reason in ("length", "stop") and out.error is None
        got.append(ids)
    assert got == want
    s = tight.stats()
    assert s["preemptions"] > 0 and seen_preempted.is_set()
    assert max(held) <= 24 and s["kv_blocks_used"] == 0 and s["preempted"] == 0
    sched.check_integrity()


def test_blocks_follow_the_length_of_what_runs(engine):
    """A decoding sequence holds the blocks of its tokens and its step's draft positions, no more;
    a finished one leaves its slot only the blocks of the prefix it keeps for reuse."""
    sched, K = engine.core.scheduler, engine.config.num_draft_tokens
    seen = []
    req = Request(prompt="Blocks: " + PROMPTS[3], params=SamplingParams(max_tokens=60, temperature=0.0,
                                                                         ignore_eos=True))

    def cb(out):
        seq = next(s for s in sched.running.values())
        seen.append((seq.num_tokens, sched.pool.held[seq.slot], seq.status, seq.slot))

    done = threading.Event()
    engine.submit(req, lambda out: (cb(out) if not out.finished else done.set()))
    assert done.wait(120)
    for n, held, status, _ in seen[1:]:
        assert status is Status.DECODE
        # blocks for the step that made these tokens: positions < (n - accepted - 1) + K, at most n + K
        assert BlockPool.blocks_for(n - K - 1) <= held <= BlockPool.blocks_for(n + K)
    slot = seen[-1][3]
    assert sched.pool.held[slot] == 0 and len(sched.pool.cached) >= (seen[-1][0] - 1) // 16  # its blocks, cached
    sched.check_integrity()


def test_the_model_serves_its_whole_context_by_default():
    """max_seq_len 0 (the default) is the model's 8,192 positions: a 3,003-token prompt (refused by
    the 2,048 of before) is answered, and the limits derived from it follow (prompt bytes, max_tokens);
    one past the context is refused up front."""
    from specguide.request import InvalidRequestError

    eng = Engine(EngineConfig(max_slots=2, num_draft_tokens=0, warmup=False))
    try:
        cfg = eng.config
        assert cfg.max_seq_len == eng.core.model.cfg.max_position_embeddings == 8192
        assert cfg.max_tokens_limit == 8192 and cfg.max_prompt_bytes == 16 * 8192
        ids = (eng.tokenizer.encode(" ".join(PROMPTS)) * 200)[:3003]
        toks, _, final = run_alone(eng, Request(prompt_ids=ids, params=SamplingParams(max_tokens=4, temperature=0.0)))
        assert len(toks) == 4 and final.finish_reason == "length" and final.num_input_tokens == 3003
        with pytest.raises(InvalidRequestError, match="max_seq_len is 8192"):
            eng.core.make_sequence(Request(prompt_ids=ids * 3, params=SamplingParams(max_tokens=4)), lambda o: None)
    finally:
        eng.shutdown()
