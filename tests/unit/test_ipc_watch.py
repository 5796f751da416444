"""ipc.process_identity / wait_until_gone: how a helper process sees the server it serves end."""
from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest

from specguide.process import ipc


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "600"])


def _waiter(identity: str) -> threading.Thread:
    t = threading.Thread(target=ipc.wait_until_gone, args=(identity, 0.05), daemon=True)
    t.start()
    return t


def test_an_identity_names_one_running_process():
    a, b = _sleeper(), _sleeper()
    try:
        ia, ib = ipc.process_identity(a.pid), ipc.process_identity(b.pid)
        assert ia and ib and ia != ib and ia.startswith(f"{a.pid}:")
        assert ipc.process_identity(a.pid) == ia  # stable while it runs
    finally:
        for p in (a, b):
            p.kill()
            p.wait()
    assert ipc.process_identity(a.pid) is None


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_the_wait_ends_when_the_process_dies_even_as_an_unreaped_zombie(monkeypatch, pidfd):
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    p = _sleeper()
    try:
        t = _waiter(ipc.process_identity(p.pid))
        t.join(0.5)
        assert t.is_alive(), "the wait ended while the process runs"
        os.kill(p.pid, signal.SIGKILL)  # not reaped: a zombie, as a server whose parent has not waited yet
        t.join(10)
        assert not t.is_alive(), "the wait did not end when the process died"
        with open(f"/proc/{p.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        p.kill()
        p.wait()


def test_the_wait_ends_at_once_for_a_process_already_gone():
    p = _sleeper()
    identity = ipc.process_identity(p.pid)
    p.kill()
    p.wait()
    t = _waiter(identity)
    t.join(10)
    assert not t.is_alive()
