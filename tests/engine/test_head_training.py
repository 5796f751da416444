"""The draft head trained in the background (head_training.BackgroundTraining): a process of its own
at the least CPU share that dies with the server, logs its progress, holds a lock so a second
training of the same head waits for it, and writes the head atomically where the engine looks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

from specguide.config import EngineConfig
from specguide.engine.loop import Engine
from specguide.process.head_training import PREFIX, BackgroundTraining
from specguide.process.ipc import child_env

from .conftest import thread_nices


def _autogroup_nice(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return int(f.read().split()[-1])  # "/autogroup-123 nice 19"
    except (OSError, ValueError):
        return None


def _wait(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_background_training_writes_the_head_at_the_least_cpu_share(tmp_path):
    out = tmp_path / "head.pt"
    config = EngineConfig(drafter="hybrid", draft_head_path=str(out), max_slots=4, max_seq_len=512)
    logs: list[tuple[str, str]] = []
    bt = BackgroundTraining(config, str(out), lambda level, text: logs.append((level, text)), quick=True)
    try:
        pid = bt.proc.pid
        assert os.getsid(pid) == pid  # a session (and autogroup) of its own
        if os.path.exists(f"/proc/{pid}/autogroup"):
            assert _wait(lambda: _autogroup_nice(pid) == 19 or bt.proc.poll() is not None, 60)
            assert bt.proc.poll() is not None or _autogroup_nice(pid) == 19
        # plain nice 5 too (where there is no autogroup, the share it gets), on every thread: Linux
        # keeps one per thread, and the training's imports start one before it demotes itself
        assert _wait(lambda: bt.proc.poll() is not None or len(thread_nices(pid)) > 0, 60)
        nices = thread_nices(pid)
        assert bt.proc.poll() is not None or nices == {min(19, os.getpriority(os.PRIO_PROCESS, 0) + 5)}, nices
        # a second training of the same head (make draft-head meanwhile) waits, then finds it made
        second = subprocess.run(
            [sys.executable, "-m", "specguide.training.cli", "--quick", "--if-missing", "--out", str(out),
             "--engine-config", json.dumps(asdict(config))],
            env=child_env("UNUSED"), capture_output=True, text=True, timeout=900)
        assert second.returncode == 0, second.stderr[-2000:]
        assert "another process is training" in second.stdout and "delete it to retrain" in second.stdout
        assert bt.wait(600) == 0 and out.exists()
        assert not list(tmp_path.glob("*.tmp"))  # the atomic save left no partial file
        assert any(text.startswith(PREFIX + "training the draft head") for _, text in logs), logs[:5]
        assert logs[-1] == ("info", f"{PREFIX}done: {out}")
    finally:
        if bt.running:
            bt.proc.kill()
    eng = Engine(EngineConfig(drafter="hybrid", draft_head_path=str(out), max_slots=2, max_seq_len=256, warmup=False))
    try:
        assert eng.core.head_drafter is not None and eng.core.drafter == "hybrid"
    finally:
        eng.shutdown()


def test_the_training_dies_with_the_server(tmp_path):
    """The server (here a stand-in parent process) killed by SIGKILL takes the training with it."""
    out = tmp_path / "head.pt"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from specguide.config import EngineConfig
        from specguide.process.head_training import BackgroundTraining
        bt = BackgroundTraining(EngineConfig(drafter="hybrid", draft_head_path={str(out)!r}), {str(out)!r},
                                lambda level, text: None, quick=True)
        print(bt.proc.pid, flush=True)
        time.sleep(600)
        """)], env=child_env("UNUSED"), stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert Path(f"/proc/{pid}").exists()
        time.sleep(1.0)  # still importing, or armed: die_with_parent also exits when the parent is gone
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _wait(lambda: not Path(f"/proc/{pid}").exists()
                     or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", 30)
        assert not out.exists()
    finally:
        parent.kill()
