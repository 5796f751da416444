"""The engine process's watchdog (`engine_stall_s`): an engine that is alive but stuck, with
requests in flight, is killed and restarted like a crashed one (its clients told with UNAVAILABLE,
the restart counted), and no wait of the stub on the engine process is without a limit: a frozen
process's submit, its start-up (`engine_start_timeout_s`). The real default model, in a process."""
from __future__ import annotations

import os
import signal
import time

import pytest

from specguide.engine import faults
from specguide.config import EngineConfig
from specguide.process.engine_process import EngineProcess
from specguide.request import EngineDeadError

from .test_engine_process import Collector, request, wait_alive

STALL_S = 3.0


@pytest.fixture(scope="module")
def engine():
    os.environ[faults.ENV] = "1"  # every engine process (restarts too) inherits it: the stall_engine fault
    try:
        ep = EngineProcess(EngineConfig(max_slots=2, max_queue=4, warmup=False, engine_stall_s=STALL_S,
                                        draft_head_training="off"))
        yield ep
        ep.shutdown(drain=False, timeout=10)
    finally:
        del os.environ[faults.ENV]


def wait_restart(ep: EngineProcess, restarts: int) -> None:
    """Until the engine has come back after its death (the restart after `restarts`)."""
    deadline = time.monotonic() + 120
    while ep.restarts == restarts:
        assert time.monotonic() < deadline, f"no restart: {ep.down_reason()}"
        time.sleep(0.05)
    wait_alive(ep)


def wait_running(c: Collector) -> None:
    deadline = time.monotonic() + 60
    while not c.outs:
        assert time.monotonic() < deadline, "no first token"
        time.sleep(0.01)


def test_a_stuck_engine_loop_is_restarted_and_its_clients_told(engine):
    reference = Collector()
    engine.submit(request(engine, 8), reference)
    reference = reference.ids()
    restarts, old = engine.restarts, engine.pid
    running = Collector()
    engine.submit(request(engine, 2000), running)
    wait_running(running)
    time.sleep(2 * STALL_S)  # a busy engine (each step under engine_stall_s) is left alone
    assert engine.pid == old and engine.restarts == restarts and not running.done.is_set()
    stuck = Collector()
    t0 = time.monotonic()
    engine.submit(request(engine, 4, fault="stall_engine:600"), stuck)  # its loop sleeps as it takes it
    for c in (running, stuck):
        last = c.last
        assert last.finish_reason == "error" and last.error_code == "UNAVAILABLE", last
        assert "the engine was stuck" in last.error and "engine_stall_s" in last.error, last.error
    assert STALL_S <= stuck.t_done - t0 < STALL_S + 30
    wait_restart(engine, restarts)
    assert engine.restarts == restarts + 1 and engine.stats()["restarts"] == restarts + 1 and engine.pid != old
    again = Collector()
    engine.submit(request(engine, 8), again)
    assert again.ids() == reference  # the new engine serves, as the old one did


def test_a_frozen_engine_process_fails_the_submit_in_time_and_is_restarted(engine):
    """SIGSTOP: the process neither answers a submit nor reports its stats; the submit must not
    wait for ever."""
    wait_alive(engine)
    restarts, old = engine.restarts, engine.pid
    os.kill(old, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="engine was stuck"):
        engine.submit(request(engine, 4), Collector())
    assert time.monotonic() - t0 < STALL_S + 30
    wait_restart(engine, restarts)
    assert engine.restarts == restarts + 1 and engine.pid != old
    after = Collector()
    engine.submit(request(engine, 4), after)
    assert len(after.ids()) == 4


def test_an_idle_engine_is_left_alone(engine):
    wait_alive(engine)
    restarts, pid = engine.restarts, engine.pid
    time.sleep(3 * STALL_S)
    assert engine.restarts == restarts and engine.pid == pid and engine.is_alive()


def test_an_engine_that_does_not_load_in_time_is_killed():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="not loaded within engine_start_timeout_s"):
        EngineProcess(EngineConfig(max_slots=1, warmup=False, engine_start_timeout_s=0.5))
    assert time.monotonic() - t0 < 30
