"""What the serving process and its helper processes (engine, compile workers) share: messages as
length-prefixed pickles over pipes, the Python binary to start them with, dying with the parent,
watching the server."""
from __future__ import annotations

import ctypes
import os
import pickle
import select
import shutil
import signal
import struct
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

_HEADER = struct.Struct("<Q")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def write_msg(f: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


class Outbox:
    """A loop turn's request events, sent as one message ("outs", [(key, RequestOutput), ...]) at
    `flush`: one pickle and one write a turn rather than one per request and step. `put` and
    `flush` run on one thread (the engine's loop)."""

    def __init__(self, send: Callable[[Any], None]):
        self._send = send
        self._items: list[tuple[int, Any]] = []

    def put(self, key: int, out: Any) -> None:
        self._items.append((key, out))

    def flush(self) -> None:
        if self._items:
            items, self._items = self._items, []
            self._send(("outs", items))


def read_msg(f: BinaryIO) -> Optional[Any]:
    """The next message, or None at end of file."""
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    n = _HEADER.unpack(head)[0]
    data = f.read(n)
    return pickle.loads(data) if len(data) == n else None


def python_executable() -> str:
    """This interpreter (inside Triton's stub `sys.executable` is not a Python binary)."""
    exe = sys.executable or ""
    if os.path.basename(exe).startswith("python"):
        return exe
    for cand in (Path(sys.prefix) / "bin" / "python3", Path(sys.prefix) / "bin" / "python"):
        if cand.exists():
            return str(cand)
    return shutil.which("python3") or "python3"


def child_env(parent_var: str) -> dict[str, str]:
    """The environment for a helper process: this package importable, the parent's pid in `parent_var`."""
    pkg_root = str(Path(__file__).resolve().parents[2])  # the folder holding `specguide`
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    env[parent_var] = str(os.getpid())
    return env


def die_with_parent(parent_var: str) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has.

    NOTE: Linux sends the signal when the *thread* that started this process ends: start helper
    processes from threads that live as long as the helper should."""
    parent_death_signal(signal.SIGKILL, int(os.environ.get(parent_var, os.getppid())))


def parent_death_signal(sig: int, parent: int) -> None:
    """Have Linux send `sig` to this process when its parent (pid `parent`) dies; exit now if it
    already has. Also usable as a Popen `preexec_fn` for a program that is not ours."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)  # the parent died before the death signal was armed


def demote(parent_var: str) -> None:
    """Give this helper process the least CPU share the OS offers, and die with its parent.

    NOTE: with autogroup scheduling (most desktop and server kernels) CPU is shared between
    sessions first: the serving process starts its helpers (compile workers, the draft head's
    training) in a session of their own (`start_new_session`), and only the session's autogroup
    nice counts against other sessions. At autogroup nice 0, or inside the server's session, two
    compile bombs beside a decoding engine starved every other process on a 2-core machine for up
    to 2-5 s (bench/probe_stalls.py); at autogroup nice 19 the largest stall was 0.3 s. Without
    autogroup the process nice applies.

    NOTE: /proc/self/autogroup is the whole session's: written from a process that does not lead a
    session of its own (a worker started by hand from a shell, or without `start_new_session`), it
    would put its parent's session (the shell, the server) at nice 19, where a busy engine in
    another session starved a test's clients for seconds. Only a session leader writes it."""
    steps = [lambda: renice(5)]
    if os.getsid(0) == os.getpid():
        steps.append(lambda: _write("/proc/self/autogroup", "19"))
    for step in steps:
        try:
            step()
        except OSError:
            pass
    die_with_parent(parent_var)  # a session of its own escapes the server's process group kill


def renice(increment: int) -> None:
    """os.nice(increment) for every thread of this process. NOTE: Linux keeps a nice value per
    thread (a new thread takes its creator's), and imports may already have started some."""
    if not increment:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread's
        os.nice(increment)
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
        except OSError:  # the thread ended
            pass


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def process_identity(pid: int) -> Optional[str]:
    """"pid:start time" of a running process, None once it has ended (gone, or a zombie not yet
    reaped): unlike the pid alone, it never names a later process that reuses the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name (which may hold spaces)
    return None if fields[0] in ("Z", "X") else f"{pid}:{fields[19]}"  # state; starttime (field 22)


def wait_until_gone(identity: str, poll_s: float = 0.5) -> None:
    """Block until the process that `identity` (process_identity) names has ended; a zombie has.
    A pidfd wakes the wait the moment it exits (Linux 5.3+); else it is checked every poll_s."""
    pid = int(identity.split(":", 1)[0])
    try:
        fd: Optional[int] = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    waiter = select.poll()  # not select(): no limit on the fd's number
    if fd is not None:
        waiter.register(fd, select.POLLIN)  # readable once the process has exited
    try:
        while process_identity(pid) == identity:
            if fd is not None:
                waiter.poll(poll_s * 1000)
            else:
                time.sleep(poll_s)
    finally:
        if fd is not None:
            os.close(fd)
