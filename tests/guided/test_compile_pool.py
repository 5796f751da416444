"""Issue 19: a compile past its timeout frees its worker (killed and replaced); small guides never
wait behind big ones; a bomb that timed out is refused at once the next time."""
from __future__ import annotations

import json
import time

import pytest
import xgrammar as xgr

from specguide.guided import GrammarCompilerService
from specguide.guided.limits import GuideLimits
from specguide.request import GuidedDecodingParams as G
from specguide.request import InvalidRequestError

from .conftest import VOCAB

TIMEOUT_S = 2.0


def bomb(tag: str, n: int = 3000) -> G:
    """An object with n optional integer properties: tens of seconds to compile (cubic in n)."""
    props = {f"{tag}{i}": {"type": "integer"} for i in range(n)}
    return G("json_schema", json.dumps({"type": "object", "properties": props}), backend="xgrammar")


def medium(tag: str) -> G:
    """Not 'small' (so it goes through a worker), but compiles in well under a second."""
    props = {f"{tag}{i}": {"type": "integer"} for i in range(120)}
    return G("json_schema", json.dumps({"type": "object", "properties": props, "required": list(props)[:60]}),
             backend="xgrammar")


def is_xgrammar(guide) -> bool:
    return guide.backend == "xgrammar" and isinstance(guide.grammar, xgr.CompiledGrammar)


@pytest.fixture(scope="module")
def svc(hf_tokenizer):
    s = GrammarCompilerService(hf_tokenizer, VOCAB, max_workers=2, timeout_s=TIMEOUT_S,
                               limits=GuideLimits(max_properties=0))
    assert s.scheduler.wait_started(60)
    yield s
    s.shutdown()


def wait(handle, limit: float = 60.0):
    t0 = time.monotonic()
    while not handle.ready():
        assert time.monotonic() - t0 < limit, "the compile never finished"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_bombs_time_out_free_their_workers_and_never_delay_small_guides(svc):
    # warm the workers (process start) with a medium guide each, so timings below are the compiles'
    for h in [svc.submit(medium("w")), svc.submit(medium("v"))]:
        wait(h)
        assert is_xgrammar(h.result())
    bombs = [svc.submit(bomb("a")), svc.submit(bomb("b"))]  # both workers busy with bombs
    time.sleep(0.3)
    t0 = time.monotonic()
    small = svc.submit(G("regex", "[0-9]{3}-[0-9]{4}"))
    assert wait(small) < 1.0  # the fast lane: not behind the bombs
    assert is_xgrammar(small.result())
    for h in bombs:
        took = wait(h)
        with pytest.raises(InvalidRequestError, match="grammar compilation timed out after 2 s"):
            h.result()
        assert took < TIMEOUT_S + 2.0
    t1 = time.monotonic()
    while svc.scheduler.kills < 2 and time.monotonic() - t1 < 3:  # the probe threads notice at the deadline too
        time.sleep(0.02)
    assert svc.scheduler.kills >= 2
    # the killed workers were replaced: a guide that needs a worker compiles, within the timeout
    after = svc.submit(medium("z"))
    wait(after)
    assert is_xgrammar(after.result())
    assert time.monotonic() - t0 < 20
    # the same bomb again is refused at once, without taking a worker
    again = svc.submit(bomb("a"))
    assert again.ready()
    with pytest.raises(InvalidRequestError, match="timed out before"):
        again.result()


def test_a_guide_compiled_once_is_served_from_the_fast_lane(svc):
    g = medium("c")
    wait(svc.submit(g))
    t0 = time.monotonic()
    h = svc.submit(g)
    wait(h)
    assert time.monotonic() - t0 < 0.5 and is_xgrammar(h.result())


def test_a_bad_big_guide_gets_the_compilers_message_from_the_worker(svc):
    bad = json.loads(medium("d").guide)
    bad["properties"]["d0"] = {"type": "no-such-type"}
    h = svc.submit(G("json_schema", json.dumps(bad), backend="xgrammar"))
    wait(h)
    with pytest.raises(InvalidRequestError, match="invalid json_schema guide"):
        h.result()


def test_cheaper_big_guides_go_first(svc):
    """Shortest expected cost first: with both workers busy, a medium guide queued after a bomb
    is proved before it."""
    blockers = [svc.submit(bomb("e")), svc.submit(bomb("f"))]
    time.sleep(0.2)
    late_bomb = svc.submit(bomb("g"))
    cheap = svc.submit(medium("h"))
    wait(cheap)
    assert is_xgrammar(cheap.result())
    assert not late_bomb.ready() or blockers[0].ready()
    for h in blockers + [late_bomb]:
        wait(h)
