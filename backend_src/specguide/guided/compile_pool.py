"""Where grammar compiles run, so that one client's big grammar never holds up another's.

Three lanes:
- fast (one in-process thread): guides judged small by `limits.GuideSize.small()`, and guides
  already compiled in this process (xgrammar's cache answers them at once). No process round trip.
- probe (`workers` killable processes, smallest expected cost first): every other guide is first
  compiled in a worker process (`compile_worker.py`, at the lowest CPU share). Past the compile
  timeout (the worker's CPU seconds, capped in wall time) the worker is killed and replaced, so a
  compile bomb frees its worker at its deadline; a guide that timed out or failed is remembered
  and refused at once the next time.
- big (one in-process thread, lower OS priority): a guide the probe proved compiles in time is
  compiled again in-process (xgrammar cannot ship a compiled grammar cheaply: see
  compile_worker.py), then counts as cached.

The engine loop never waits on any lane: it polls the Future through compiler.CompileHandle.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import select
import subprocess
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..util.memory import cpu_seconds, rss_bytes, trim
from ..request import GuidedDecodingParams, InvalidRequestError
from ..process.ipc import child_env, python_executable, read_msg, write_msg
from .compile_worker import PARENT_ENV
from .limits import GuideSize

log = logging.getLogger("specguide")
_REMEMBER = 512  # guides remembered as proven / refused
_POLL_S = 0.05  # how often a waiting probe checks for abandonment
_RECYCLE_RSS = 1 << 30  # a worker past this resident size is replaced after its job
_WALL_FACTOR = 5.0  # a starved worker's compile still stops after this many timeouts of wall time
_WORKER_MAIN = "from specguide.guided.compile_worker import main; main()"


class AbandonableFuture(Future):
    """A Future whose `cancel()` also marks a running job abandoned (its worker is then killed)."""

    def __init__(self) -> None:
        super().__init__()
        self.abandoned = threading.Event()
        # the compile timeout counts from when a worker starts the job (not while it waits in the
        # queue): None until then, and again once the worker proved it compiles in time.
        # compiler.CompileHandle reads it.
        self.deadline: Optional[float] = None

    def cancel(self) -> bool:
        self.abandoned.set()
        return super().cancel()


@dataclass(order=True)
class _Job:
    cost: float
    order: int
    params: GuidedDecodingParams = field(compare=False)
    future: AbandonableFuture = field(compare=False)
    timeout_s: Optional[float] = field(compare=False)
    deadline: Optional[float] = field(default=None, compare=False)  # set when a worker starts it


def timeout_message(timeout_s: Optional[float], again: bool = False) -> str:
    what = "timed out before" if again else "was stopped"
    return (f"grammar compilation timed out after {timeout_s:g} s (the compile {what}; "
            f"the setting guided_compile_timeout_s raises the limit)")


class _Worker:
    """One compile worker process and the pipes to it."""

    def __init__(self, init: dict):
        env = child_env(PARENT_ENV)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen([python_executable(), "-c", _WORKER_MAIN], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
                                     start_new_session=True)  # its own autogroup: ipc.demote
        write_msg(self.proc.stdin, init)
        ready = read_msg(self.proc.stdout)  # ("ready", pid, start-up objects frozen)
        if ready is None:
            self.kill()
            raise RuntimeError("the grammar compile worker did not start (see the server log)")
        self.frozen_objects: int = ready[2]

    def run(self, params: GuidedDecodingParams, job: _Job) -> Optional[tuple]:
        """The worker's reply, or None when the deadline passed or the job was abandoned first."""
        write_msg(self.proc.stdin, params)
        fd = self.proc.stdout.fileno()
        started, cpu0 = time.monotonic(), cpu_seconds(self.proc.pid)
        while True:
            if job.timeout_s is not None:
                job.deadline = job.future.deadline = self._deadline(job.timeout_s, started, cpu0)
            wait = _POLL_S if job.deadline is None else min(_POLL_S, job.deadline - time.monotonic())
            if wait <= 0 or job.future.abandoned.is_set():
                return None
            ready, _, _ = select.select([fd], [], [], wait)
            if ready:
                return read_msg(self.proc.stdout)

    def _deadline(self, timeout_s: float, started: float, cpu0: Optional[float]) -> float:
        """The timeout counts the worker's CPU seconds, not the wall clock: it runs at the lowest
        priority (ipc.demote), so a busy machine slows its compile without making it a
        bomb. Capped at _WALL_FACTOR timeouts of wall time."""
        now = time.monotonic()
        cpu = cpu_seconds(self.proc.pid)
        used = now - started if cpu is None or cpu0 is None else cpu - cpu0
        return min(now + timeout_s - used, started + _WALL_FACTOR * timeout_s)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 5)  # this thread only (Linux)
    except (AttributeError, OSError):
        pass


class CompileLanes:
    """Runs `compile_fn(params)` for each guide in the right lane; see the module docstring."""

    def __init__(self, compile_fn: Callable[[GuidedDecodingParams], Any], tokenizer_info: Any, *,
                 workers: int = 2, route: Callable[[GuidedDecodingParams], str] = lambda p: "xgrammar"):
        self.compile_fn = compile_fn
        self.route = route  # the backend that compiles a guide: only xgrammar's go through a worker
        self._tokenizer_info = tokenizer_info
        self._init: Optional[dict] = None
        self.fast = ThreadPoolExecutor(1, thread_name_prefix="grammar-fast")
        self.big = ThreadPoolExecutor(1, thread_name_prefix="grammar-big", initializer=_lower_priority)
        self._heap: list[_Job] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._cached: OrderedDict[tuple, bool] = OrderedDict()  # compiled in this process
        self._proven: OrderedDict[tuple, bool] = OrderedDict()  # compiled in a worker in time
        self._refused: OrderedDict[tuple, str] = OrderedDict()  # failed or timed out: the message
        self.num_workers = workers
        self._workers: list[Optional[_Worker]] = [None] * workers
        self._threads: list[threading.Thread] = []
        self._started = [threading.Event() for _ in range(workers)]
        self._running: dict[int, _Job] = {}  # worker index -> its job
        self.kills = 0  # workers killed at a deadline (a metric for tests and benchmarks)

    # ---------------------------------------------------------------- public

    def start(self) -> None:
        """Start the worker processes now (else: at the first guide that needs one)."""
        with self._cv:
            if self._threads or self._closed:
                return
            for i in range(self.num_workers):
                t = threading.Thread(target=self._serve, args=(i,), name=f"grammar-probe-{i}", daemon=True)
                self._threads.append(t)
                t.start()

    def wait_started(self, timeout: Optional[float] = None) -> bool:
        """Block until every worker process has started (tests, benchmarks)."""
        self.start()
        end = None if timeout is None else time.monotonic() + timeout
        return all(e.wait(None if end is None else max(0.0, end - time.monotonic())) for e in self._started)

    def submit(self, params: GuidedDecodingParams, size: GuideSize, timeout_s: Optional[float]) -> Future:
        backend = self.route(params)
        key = params.cache_key(backend)
        with self._cv:
            if self._closed:
                raise RuntimeError("the grammar compiler is shut down")
            refused = self._refused.get(key)
            if refused is not None:
                fut: Future = Future()
                fut.set_exception(InvalidRequestError(refused))
                return fut
            # llguidance compiles lazily and fast and enforces its own limits: no worker needed
            if backend != "xgrammar" or size.small() or key in self._cached:
                return self.fast.submit(self._in_process, key, params)
            if key in self._proven:
                return self.big.submit(self._in_process, key, params, True)
            job = _Job(size.cost, next(self._order), params, AbandonableFuture(), timeout_s)
            heapq.heappush(self._heap, job)
            self._cv.notify()
        self.start()
        return job.future

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            pending, self._heap = self._heap, []
            self._cv.notify_all()
        for job in pending + list(self._running.values()):
            job.future.cancel()  # a running one is abandoned: its probe thread stops waiting
        self.fast.shutdown(wait=False, cancel_futures=True)
        self.big.shutdown(wait=False, cancel_futures=True)
        for t in self._threads:
            t.join(timeout=5)
        for w in self._workers:
            if w is not None:
                w.kill()

    # ---------------------------------------------------------------- lanes

    def _in_process(self, key: tuple, params: GuidedDecodingParams, big: bool = False) -> Any:
        grammar = self.compile_fn(params)
        with self._cv:
            _remember(self._cached, key, True)
        if big:
            trim(force=False)  # a big compile's scratch memory back to the OS
        return grammar

    def _serve(self, i: int) -> None:
        """One probe lane: take the cheapest queued job, prove it in worker i, hand it on."""
        try:
            self._worker(i)  # start the process now, not at the first job
        except Exception:
            log.exception("grammar compile worker %d did not start; retrying at its first job", i)
        self._started[i].set()
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = heapq.heappop(self._heap)
            if not job.future.set_running_or_notify_cancel():
                continue
            self._running[i] = job
            try:
                self._probe(i, job)
            except Exception as exc:  # a broken worker: fail this job, start afresh next time
                log.exception("grammar compile worker failed")
                self._drop_worker(i)
                if not job.future.done():
                    job.future.set_exception(InvalidRequestError(
                        f"the grammar compile worker failed ({type(exc).__name__}); try again"))
            finally:
                self._running.pop(i, None)

    def _probe(self, i: int, job: _Job) -> None:
        key = job.params.cache_key(self.route(job.params))
        worker = self._worker(i)
        reply = worker.run(job.params, job)
        if reply is None:  # past the deadline, or nobody waits any more: stop the compile now
            self._drop_worker(i)
            self.kills += 1
            if job.future.abandoned.is_set() and (job.deadline is None or time.monotonic() < job.deadline):
                job.future.set_exception(InvalidRequestError("the request was cancelled while compiling"))
                return
            with self._cv:  # refuse it at once next time
                _remember(self._refused, key, timeout_message(job.timeout_s, again=True))
            job.future.set_exception(InvalidRequestError(timeout_message(job.timeout_s)))
            if not self._closed:
                self._worker(i)  # start the replacement now, not when the next job comes
            return
        ok, message, _seconds = reply
        if rss_bytes(worker.proc.pid) > _RECYCLE_RSS:
            self._drop_worker(i)
        if not ok:
            with self._cv:
                _remember(self._refused, key, message)
            job.future.set_exception(InvalidRequestError(message))
            return
        with self._cv:
            _remember(self._proven, key, True)
        job.future.deadline = None  # proven: the in-process compile takes about as long, let it finish
        try:
            inner = self.big.submit(self._in_process, key, job.params, True)
        except RuntimeError:  # shut down meanwhile
            job.future.set_exception(RuntimeError("the grammar compiler is shut down"))
            return
        inner.add_done_callback(lambda f: _copy_result(f, job.future))

    def _worker(self, i: int) -> _Worker:
        w = self._workers[i]
        if w is None or not w.alive():
            if w is not None:
                w.kill()
            if self._init is None:
                self._init = {"tokenizer_info": self._tokenizer_info.serialize_json()}
            w = self._workers[i] = _Worker(self._init)
        return w

    def _drop_worker(self, i: int) -> None:
        w, self._workers[i] = self._workers[i], None
        if w is not None:
            w.kill()
        trim(force=False)


def _remember(d: OrderedDict, key: tuple, value: Any) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > _REMEMBER:
        d.popitem(last=False)


def _copy_result(src: Future, dst: Future) -> None:
    if dst.done():
        return
    if src.cancelled():
        dst.set_exception(RuntimeError("the grammar compiler is shut down"))
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())
