"""hostfunc: run a Python callable in stream order.

On CUDA a host function is launched with the driver's `cuLaunchHostFunc` (ctypes on libcuda, one
module-lifetime `CFUNCTYPE` trampoline, an integer registry key as user data). A launch made while
the stream is being captured is kept in the registry, so every replay of the graph finds its
callable and arguments again, until `free_host_func_user_data` (or interpreter exit) frees it; an
uncaptured launch frees its entry after its one run. This avoids the trap of wrappers that free
their user data after the first run (cuda-python issue 790, cupy issue 9274).

On CPU the same protocol runs on a `HostStream`: `InlineStream` calls the function at once;
`WorkerStream` (a test mode) runs callbacks in FIFO order on one worker thread, like a CUDA
stream would, so code that reads host state too early shows up as a data race on CPU too.

NOTE (GIL hazard): a CUDA host function runs on a driver thread, holds a CUDA-internal lock and
then takes the GIL. So (1) a host function must never call a CUDA API (no CUDA tensor ops,
no synchronize); (2) the launching thread must never wait on CUDA while holding the GIL when a
host function may be pending: no `.item()`, `.tolist()`, `.nonzero()` or data-dependent shapes on
CUDA tensors, no `torch.compile` (pytorch issues 163061 / 163062). ctypes releases the GIL around
the `cuLaunchHostFunc` call itself (TensorRT-LLM PR 15855), and torch releases it in
`Event.synchronize`, `Stream.synchronize` and `CUDAGraph.replay`.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

log = logging.getLogger("specguide.hostfunc")

CUhostFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class HostFuncError(RuntimeError):
    """A host function raised; re-raised on the thread that waits for its stream."""


@dataclass
class _Entry:
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    keep: bool  # captured: survives its runs until freed explicitly
    runs: int = 0


_registry: dict[int, _Entry] = {}
_keys = itertools.count(1)
_lock = threading.Lock()
_errors: list[BaseException] = []  # exceptions raised by CUDA host functions, not yet surfaced


def _trampoline(user_data: Optional[int]) -> None:
    # runs on a CUDA driver thread; ctypes takes the GIL for us. NOTE: no CUDA calls in here.
    key = int(user_data or 0)
    with _lock:
        entry = _registry.get(key)
        if entry is not None and not entry.keep:
            del _registry[key]
    if entry is None:
        log.error("host function with unknown key %d (freed while a graph still uses it?)", key)
        return
    entry.runs += 1
    try:
        entry.fn(*entry.args, **entry.kwargs)
    except BaseException as exc:  # never propagate into the driver: keep it for raise_pending()
        log.exception("host function %r raised", getattr(entry.fn, "__qualname__", entry.fn))
        with _lock:
            _errors.append(exc)


_TRAMPOLINE = CUhostFn(_trampoline)  # module lifetime: graphs hold its address


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")  # CDLL (not PyDLL): the GIL is released during each call
    lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, CUhostFn, ctypes.c_void_p]
    lib.cuLaunchHostFunc.restype = ctypes.c_int
    lib.cuStreamIsCapturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    lib.cuStreamIsCapturing.restype = ctypes.c_int
    return lib


def stream_is_capturing(stream: "torch.cuda.Stream") -> bool:
    """Whether `stream` is being captured into a CUDA graph (cuStreamIsCapturing)."""
    status = ctypes.c_int(0)
    rc = _libcuda().cuStreamIsCapturing(ctypes.c_void_p(stream.cuda_stream), ctypes.byref(status))
    if rc != 0:
        raise RuntimeError(f"cuStreamIsCapturing failed with CUresult {rc}")
    return status.value == 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE


def _register(fn: Callable[..., Any], args: tuple, kwargs: dict, keep: bool) -> int:
    """Keep `fn(*args, **kwargs)` under a new key (the user data the trampoline receives)."""
    key = next(_keys)
    with _lock:
        _registry[key] = _Entry(fn, args, kwargs, keep=keep)
    return key


def _launch_cuda(stream: "torch.cuda.Stream", fn: Callable[..., Any], args: tuple, kwargs: dict) -> Optional[int]:
    capturing = stream_is_capturing(stream)
    key = _register(fn, args, kwargs, keep=capturing)
    rc = _libcuda().cuLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), _TRAMPOLINE, ctypes.c_void_p(key))
    if rc != 0:
        with _lock:
            _registry.pop(key, None)
        raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {rc}")
    return key if capturing else None


def free_host_func_user_data(key: int) -> None:
    """Free a captured launch's callable and arguments (after its graph is destroyed)."""
    with _lock:
        if _registry.pop(key, None) is None:
            raise ValueError(f"no host function user data with key {key}")


def free_all_host_func_user_data() -> None:
    with _lock:
        _registry.clear()


atexit.register(free_all_host_func_user_data)


def registered_keys() -> set[int]:
    """Keys of the launches currently kept alive (captured ones, and uncaptured ones not yet run)."""
    with _lock:
        return set(_registry)


def runs_of(key: int) -> int:
    """How many times the captured launch `key` has run (tests)."""
    with _lock:
        return _registry[key].runs


def raise_pending() -> None:
    """Raise the first exception a CUDA host function raised since the last call (then forget them)."""
    with _lock:
        errs = _errors[:]
        _errors.clear()
    if errs:
        raise HostFuncError(f"{len(errs)} host function(s) raised; first: {errs[0]!r}") from errs[0]


# ---- CPU streams ---------------------------------------------------------------------------

class HostEvent:
    """A CPU stand-in for a CUDA event recorded on a host stream."""

    def __init__(self, stream: "WorkerStream | InlineStream"):
        self._set = threading.Event()
        self._stream = stream

    def set(self) -> None:
        self._set.set()

    def query(self) -> bool:
        return self._set.is_set()

    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Block the host until the event is reached; surface callback errors."""
        if not self._set.wait(timeout):
            raise TimeoutError("host stream event not reached")
        self._stream.raise_pending()

    block_forward = synchronize  # on CPU the forward "stream" is the calling thread


class InlineStream:
    """Runs each host function at once on the calling thread (the CPU default)."""

    kind = "inline"

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            raise HostFuncError(f"host function {getattr(fn, '__qualname__', fn)!r} raised: {exc!r}") from exc

    def record(self) -> HostEvent:
        ev = HostEvent(self)
        ev.set()
        return ev

    def wait_for_forward(self) -> None:
        """Order later launches after the forward stream's work so far (nothing to do on CPU)."""

    def synchronize(self) -> None:
        pass

    def raise_pending(self) -> None:
        pass

    def close(self) -> None:
        pass


class WorkerStream:
    """Runs host functions in FIFO order on one worker thread (test mode for data races).

    `delay_s` sleeps before each callback, widening any window in which the host reads state a
    callback has not written yet. The first exception of a callback is re-raised (HostFuncError)
    by the next `synchronize()` or event wait; later callbacks still run, as on a CUDA stream."""

    kind = "worker"

    def __init__(self, delay_s: float = 0.0, name: str = "specguide-hostfunc"):
        self.delay_s = delay_s
        self._q: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args, kwargs = item
            if self.delay_s:
                time.sleep(self.delay_s)
            try:
                fn(*args, **kwargs)
            except BaseException as exc:
                log.exception("host function %r raised", getattr(fn, "__qualname__", fn))
                with self._lock:
                    self._errors.append(exc)

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._q.put((fn, args, kwargs))

    def record(self) -> HostEvent:
        ev = HostEvent(self)
        self._q.put((ev.set, (), {}))
        return ev

    def wait_for_forward(self) -> None:
        """The forward "stream" is the launching thread: its work is done when it launches."""

    def synchronize(self, timeout: Optional[float] = None) -> None:
        self.record().synchronize(timeout)

    def raise_pending(self) -> None:
        with self._lock:
            errs = self._errors[:]
            self._errors.clear()
        if errs:
            raise HostFuncError(f"{len(errs)} host function(s) raised; first: {errs[0]!r}") from errs[0]

    def close(self) -> None:
        if self.thread.is_alive():
            self._q.put(None)
            self.thread.join()


# ---- CUDA stream wrapper -------------------------------------------------------------------

class CudaEvent:
    """A torch CUDA event with the HostEvent interface."""

    def __init__(self, event: "torch.cuda.Event"):
        self.event = event

    def block_forward(self) -> None:
        """Make the current (forward) stream wait for the event; the host does not block."""
        torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        """Block the host (GIL released by torch) and surface host function errors."""
        self.event.synchronize()
        raise_pending()

    def query(self) -> bool:
        return self.event.query()


@dataclass
class CudaHostStream:
    """A dedicated CUDA stream for host functions (the grammar stream)."""

    stream: "torch.cuda.Stream" = field(default_factory=lambda: torch.cuda.Stream())
    kind = "cuda"

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Optional[int]:
        return _launch_cuda(self.stream, fn, args, kwargs)

    def record(self) -> CudaEvent:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return CudaEvent(ev)

    def wait_for_forward(self) -> None:
        """Order later work on this stream after everything issued so far on the current stream."""
        self.stream.wait_stream(torch.cuda.current_stream())

    def synchronize(self) -> None:
        self.stream.synchronize()
        raise_pending()

    def raise_pending(self) -> None:
        raise_pending()

    def close(self) -> None:
        pass


HostStream = Union[InlineStream, WorkerStream, CudaHostStream]
INLINE = InlineStream()


def make_stream(kind: str, delay_s: float = 0.0) -> HostStream:
    """"inline" | "worker" | "cuda"."""
    if kind == "inline":
        return InlineStream()
    if kind == "worker":
        return WorkerStream(delay_s)
    if kind == "cuda":
        return CudaHostStream()
    raise ValueError(f"unknown host stream kind {kind!r}")
