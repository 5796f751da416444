"""The engine in a process of its own, restarted when it dies: a crash costs seconds, not the replica.

Everything that can kill a process (the weights, the KV cache, native kernels, grammar matchers,
the kernel's OOM killer's choice: the biggest process) lives in the engine process; the Triton
stub that owns an `EngineProcess` holds the clients' requests and only a tokenizer. So when the
engine process dies, or its loop thread does, the stub is still there to tell every client:

- at once (the pipe from the engine closes), every request in flight or queued ends with
  UNAVAILABLE naming the cause ("killed by SIGKILL ...");
- while it is down, new requests get UNAVAILABLE at once (`submit` raises EngineDeadError);
- a new engine process starts by itself: at once after the first crash, then backing off when
  crashes repeat (restarts.Backoff). Each restart is logged and counted (`stats()["restarts"]`,
  the metric specguide_engine_restarts_total).

An engine process that is alive but stuck is treated the same way (the watchdog, `engine_stall_s`):
with requests in flight, its loop turning no more (its stats carry `loop_turns`) or a request it
takes no answer to within `engine_stall_s` gets it killed (after it dumps every thread's stack to
the log, SIGUSR1) and restarted. No wait here on the engine process is without a limit: its ready
message (`engine_start_timeout_s`), a submit's answer, the end of a shutdown.

Here: `EngineProcess`, the engine's interface, its reader thread (the engine's messages) and its
supervisor thread (restarts, the watchdog).
Elsewhere: the messages and EngineInfo (engine_protocol.py), one engine process and its pipes
(engine_handle.py), the child's own side (engine_process_child.py).

Given the server's pid (the Triton stub's parent), the engine process also ends when the server
does, and ends the stub first: Triton 2.51's stub never finishes exiting after its server was
killed (SIGKILL, the OOM killer), so the stub, this process and its compile workers would stay,
holding their memory, beside the server that a supervisor starts again.
"""
from __future__ import annotations

import itertools
import logging
import signal
import subprocess
import threading
import time
from typing import Callable, Optional

from ..config import EngineConfig
from .engine_handle import EngineHandle
from .engine_protocol import Callback, EngineInfo, describe_exit
from .head_training import BackgroundTraining
from .ipc import process_identity, read_msg
from ..request import EngineDeadError, Request, RequestOutput
from ..text_stream import TextStream
from .restarts import Backoff, sleep_unless

Log = Callable[[str, str], None]  # (level: "info" | "warn" | "error", message)

SUBMIT_WAIT_S = 60.0  # without the watchdog: how long a submit waits for the engine's answer
CALL_WAIT_S = 120.0  # how long a control call (an adapter's load: files read) waits for its answer
WATCH_S = 1.0  # how often the watchdog looks (at most)
DUMP_WAIT_S = 1.0  # a stuck engine process's time to write its threads' stacks before it is killed


class EngineProcess:
    """The engine's interface (`submit`, `cancel`, `stats`, `is_alive`, `shutdown`, the LoRA adapters'
    `load_adapter`, `unload_adapter`, `adapters`) over an engine process that is restarted when it
    dies. Callbacks run on this object's reader thread. Adapters loaded or unloaded at run time are
    loaded or unloaded again in a restarted engine before it takes requests.

    The first start happens in the constructor and raises if the engine cannot load. `server_pid`:
    the server process (a Triton stub's parent) whose end ends this process and the engine's.
    Restarts and the watchdog run on the supervisor thread (`_supervise`)."""

    def __init__(self, config: EngineConfig, log: Optional[Log] = None, server_pid: Optional[int] = None):
        self._log = log or (lambda level, text: logging.getLogger("specguide").log(
            {"info": logging.INFO, "warn": logging.WARNING}.get(level, logging.ERROR), text))
        self._config = config
        self._server = process_identity(server_pid) if server_pid else None
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._callbacks: dict[int, Callback] = {}  # requests the engine holds, by key
        self._pending: dict[int, tuple[threading.Event, list]] = {}  # submits and calls awaiting the engine's
        # answer: [error or None] for a submit, [error or None, value] for a call
        self._adapter_lock = threading.Lock()  # one adapter change at a time: `_adapter_log` in their order
        self._adapter_log: dict[str, Optional[str]] = {}  # name -> folder loaded at run time; None: unloaded
        self._stats: dict[str, int] = {}
        self._down: Optional[str] = None  # why the engine is down (None while it serves)
        self._closing = False
        self.restarts = 0
        self._backoff = Backoff()  # crashes in a row
        self._restart_delay = 0.0
        self._wake = threading.Event()
        self._progress_at = time.monotonic()  # the engine's last sign of progress, or when work began (the watchdog)
        self._turns = -1  # its loop's turns as last reported
        self._child = EngineHandle(config, self._server)
        self._reader = self._start_reader(self._child)
        self._supervisor = threading.Thread(target=self._supervise, name="specguide-engine-supervisor", daemon=True)
        self._supervisor.start()
        self.info = self._child.info
        self.tokenizer = self._text_tokenizer(self.info)
        # a missing draft head is trained beside the engine (its own process: it outlives engine restarts)
        self.training = BackgroundTraining.start_if_needed(self.info.config, self.info.awaited_head, self._log)

    def _text_tokenizer(self, info: EngineInfo):
        """The tokenizers-only TokenizerFile when it gives the engine's ids, else the engine's own kind."""
        from ..tokenizer import Tokenizer, TokenizerFile

        try:
            light = TokenizerFile(info.model_dir)
            if light.matches(info.probes):
                return light
            self._log("warn", "specguide: tokenizer.json alone does not give transformers' ids for this model: "
                              "the stub loads transformers' tokenizer too")
        except Exception as e:  # no tokenizer.json (a slow-only tokenizer)
            self._log("info", f"specguide: the stub loads transformers' tokenizer ({type(e).__name__}: {e})")
        return Tokenizer(info.model_dir)

    @property
    def config(self) -> EngineConfig:
        """The settings as the engine resolved them (slots sized, ...)."""
        return self.info.config

    @property
    def drafter(self) -> str:
        return self.info.drafter

    @property
    def head_drafter(self) -> bool:
        """Whether a trained draft head is in use."""
        return self.info.head

    @property
    def warmup_s(self) -> float:
        return self.info.warmup_s

    @property
    def frozen_objects(self) -> int:
        """The engine process's start-up heap, frozen out of full collections (util/heap.py)."""
        return self.info.frozen_objects

    @property
    def pid(self) -> int:
        """The engine process's."""
        return self.info.pid

    # ---- the engine's interface ------------------------------------------------------------
    def submit(self, request: Request, callback: Optional[Callback] = None) -> int:
        """Queue a request in the engine; returns its key (the seq_id its outputs carry). Raises
        what the engine raises (InvalidRequestError, QueueFullError, ...) and EngineDeadError
        while the engine is down."""
        key = next(self._keys)
        done, result = threading.Event(), []
        with self._lock:
            if self._down is not None or self._closing:
                raise EngineDeadError(self._down or "the engine is shutting down")
            if not self._callbacks:  # the engine has work from now on: the watchdog counts from here
                self._progress_at = time.monotonic()
            # the text is made here, on the reader thread: only token ids cross the pipe
            self._callbacks[key] = TextStream.wrap(self.tokenizer, request, callback or (lambda out: None),
                                                   lambda: self._send_held(key, "stop"))
            self._pending[key] = (done, result)
            child = self._child
        child.send(("submit", key, request))
        stall = self._config.engine_stall_s
        if not done.wait(stall if stall > 0 else SUBMIT_WAIT_S):
            self._unanswered(child, key, done)
        if result and result[0] is not None:
            raise result[0]
        return key

    def _unanswered(self, child: EngineHandle, key: int, done: threading.Event) -> None:
        """A submit got no answer in time: with the watchdog on, the engine process is stuck (killed
        and restarted; the submit fails with the others); without it the request is given up."""
        with self._lock:
            waiting = self._pending.pop(key, None) is not None
            if waiting:
                self._callbacks.pop(key, None)
        if not waiting:  # answered just now
            done.wait(WATCH_S)
            return
        stall = self._config.engine_stall_s
        if stall > 0:
            self._stalled(child, f"no answer to a request for {stall:g} s; engine_stall_s {stall:g}")
            raise EngineDeadError(f"{child.stalled or 'the engine did not answer'}; a new engine is starting")
        child.send(("cancel", key))  # should it take the request after all
        raise EngineDeadError(f"the engine did not take the request within {SUBMIT_WAIT_S:g} s")

    def load_adapter(self, name: str, lora_path: str, replace: bool = False) -> str:
        """Serve the LoRA adapter in `lora_path` (under config `lora_root`) as `name` (`replace`: in
        place of one served so), in this engine and any restarted one; returns its folder. Raises
        InvalidRequestError (refused), EngineDeadError (the engine is down)."""
        with self._adapter_lock:
            folder = self._call(self._serving(), "load_adapter", (name, lora_path, replace))
            self._adapter_log[name] = lora_path
        return folder

    def unload_adapter(self, name: str) -> None:
        """Serve the LoRA adapter `name` no more, in this engine and any restarted one."""
        with self._adapter_lock:
            self._call(self._serving(), "unload_adapter", (name,))
            if self._adapter_log.get(name) is not None:
                del self._adapter_log[name]  # loaded at run time: a new engine will not know it
            else:
                self._adapter_log[name] = None  # the config's: a new engine must unload it again
        self._log("info", f"specguide: LoRA adapter {name!r} unloaded")

    def adapters(self) -> list[str]:
        """The LoRA adapters the engine serves by name."""
        return self._call(self._serving(), "adapters", ())

    def _serving(self) -> EngineHandle:
        with self._lock:
            if self._down is not None or self._closing:
                raise EngineDeadError(self._down or "the engine is shutting down")
            return self._child

    def _call(self, child: EngineHandle, method: str, args: tuple) -> object:
        """One of the engine's CALLS (engine_protocol.py), answered by `child`."""
        key = next(self._keys)
        done, result = threading.Event(), []
        with self._lock:
            self._pending[key] = (done, result)
        child.send(("call", key, method, args))
        if not done.wait(CALL_WAIT_S):
            with self._lock:
                self._pending.pop(key, None)
            raise EngineDeadError(f"the engine did not answer ({method}) within {CALL_WAIT_S:g} s")
        if result[0] is not None:
            raise result[0]
        return result[1]

    def _replay_adapters(self, child: EngineHandle) -> None:
        """A new engine process serves the adapters its predecessor was given at run time."""
        with self._adapter_lock:
            for name, path in list(self._adapter_log.items()):
                try:
                    self._call(child, "load_adapter" if path is not None else "unload_adapter",
                               (name, path, True) if path is not None else (name,))
                except Exception as e:
                    self._log("error", f"specguide: the restarted engine could not "
                                       f"{'load' if path is not None else 'unload'} LoRA adapter {name!r}: {e}")
                    if path is not None:
                        del self._adapter_log[name]

    def cancel(self, key: int) -> None:
        """Stop a request; a final 'cancelled' event follows (or the engine's death's error)."""
        self._send_held(key, "cancel")

    def _send_held(self, key: int, kind: str) -> None:
        """Send `kind` for a request the engine holds: "cancel", or "stop" (its TextStream found a stop
        string: the engine ends it, its final event saying "stop")."""
        with self._lock:
            child = self._child if key in self._callbacks else None
        if child is not None:
            child.send((kind, key))

    def stats(self) -> dict[str, int]:
        """The engine's last reported slots / queue / steps, its liveness and the restart count."""
        with self._lock:
            alive = self.is_alive()
            stats = dict(self._stats) if alive else {"active_slots": 0, "queue_depth": 0}
        return {**stats, "alive": int(alive), "restarts": self.restarts}

    def is_alive(self) -> bool:
        """False while the engine is down (a new one is starting) or shutting down."""
        return self._down is None and not self._closing

    def down_reason(self) -> Optional[str]:
        """Why new requests are refused now; None while the engine serves."""
        return self._down

    def shutdown(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stop the engine (draining in-flight requests first when `drain`) and its process."""
        with self._lock:
            self._closing = True
            child = self._child
        self._wake.set()
        child.send(("shutdown", drain, timeout))
        deadline = None if timeout is None else time.monotonic() + timeout + 30.0
        while True:  # its drain, watched as its serving was (a stuck engine is killed)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._log("warn", "specguide: the engine process did not stop in time; killing it")
                break
            period = self._watch_period()
            try:
                child.proc.wait(left if period is None else period if left is None else min(left, period))
                break
            except subprocess.TimeoutExpired:
                self._watch()
        child.kill()
        if self.training is not None:
            self.training.stop()
        self._reader.join(timeout=10.0)
        self._supervisor.join(timeout=10.0)

    # ---- reader thread: the engine's messages ------------------------------------------------
    def _start_reader(self, child: EngineHandle) -> threading.Thread:
        t = threading.Thread(target=self._read, args=(child,), name="specguide-engine-reader", daemon=True)
        t.start()
        return t

    def _read(self, child: EngineHandle) -> None:
        dead = ""
        while True:
            try:
                msg = read_msg(child.proc.stdout)
            except Exception as e:  # a torn message: treat as the end
                self._log("error", f"specguide: reading from the engine process: {e!r}")
                msg = None
            if msg is None:
                break
            kind = msg[0]
            if kind == "outs":  # a loop turn's events
                self._progress_at = time.monotonic()
                for key, out in msg[1]:
                    self._deliver(key, out)
            elif kind == "refused":
                self._answer(msg[1], msg[2])
            elif kind == "submitted":
                self._answer(msg[1], None)
            elif kind == "reply":
                self._answer(msg[1], None, msg[2])
            elif kind == "stats":
                with self._lock:
                    self._stats = msg[1]
                    if msg[1].get("loop_turns") != self._turns:  # its loop moved
                        self._turns, self._progress_at = msg[1].get("loop_turns"), time.monotonic()
            elif kind == "dead":
                dead = msg[1]
        try:
            returncode = child.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            child.kill()
            returncode = child.proc.returncode
        self._on_exit(child, child.stalled or describe_exit(returncode, dead))

    def _deliver(self, key: int, out: RequestOutput) -> None:
        with self._lock:
            callback = self._callbacks.pop(key, None) if out.finished else self._callbacks.get(key)
        if callback is not None:
            out.seq_id = key  # the parent's key (this object was just unpickled: ours alone)
            try:
                callback(out)
            except Exception as e:  # the reader thread must live on
                self._log("error", f"specguide: a request's callback failed: {e!r}")

    def _answer(self, key: int, error: Optional[BaseException], value: object = None) -> None:
        with self._lock:
            done, result = self._pending.pop(key, (None, None))
            if error is not None:
                self._callbacks.pop(key, None)
        if done is not None:
            result.extend((error, value))
            done.set()

    def _on_exit(self, child: EngineHandle, cause: str) -> None:
        """The engine process ended: fail what it held, then (unless closing) restart it."""
        with self._lock:
            closing = self._closing
            child.exited = True
            if not closing:
                self._restart_delay = self._backoff.failed()
                self._down = f"{cause}; a new engine is starting"
            callbacks, self._callbacks = self._callbacks, {}
            pending, self._pending = self._pending, {}
        message = (f"{cause}; the request was lost (a new engine is starting: retry in a few seconds)"
                   if not closing else "the model was unloaded")
        for done, result in pending.values():
            result.extend((EngineDeadError(message), None))
            done.set()
        for key, callback in callbacks.items():
            try:
                callback(RequestOutput(seq_id=key, finished=True, finish_reason="error", error=message,
                                       error_code=EngineDeadError.code))
            except Exception as e:
                self._log("error", f"specguide: failing a request of the dead engine: {e!r}")
        child.kill()
        if not closing:
            self._log("error", f"specguide: {cause}; {len(callbacks)} request(s) failed with UNAVAILABLE; "
                               f"restarting the engine (crash {self._backoff.failures} in a row)")
            self._wake.set()

    # ---- the watchdog ------------------------------------------------------------------------
    def _watch_period(self) -> Optional[float]:
        stall = self._config.engine_stall_s
        return min(WATCH_S, stall / 4) if stall > 0 else None

    def _watch(self) -> None:
        """Kill the engine process when, with requests in flight, its loop has not moved for
        `engine_stall_s` (the reader then fails its requests and the supervisor restarts it)."""
        stall = self._config.engine_stall_s
        if stall <= 0:
            return
        with self._lock:
            now, child = time.monotonic(), self._child
            if not self._callbacks or self._down is not None:  # idle: nothing is owed
                self._progress_at = now
            idle = now - self._progress_at
        if idle >= stall:
            self._stalled(child, f"no step for {idle:.0f} s with requests in flight; engine_stall_s {stall:g}")

    def _stalled(self, child: EngineHandle, why: str) -> None:
        """The engine process is stuck: it writes every thread's stack to the log (SIGUSR1:
        faulthandler), then is killed; its reader reports the death (cause: `child.stalled`)."""
        with self._lock:
            if child.stalled or child is not self._child or self._down is not None:
                return
            child.stalled = f"the engine was stuck ({why}) and was killed"
        self._log("error", f"specguide: {child.stalled}; its threads' stacks follow in the log")
        try:
            child.proc.send_signal(signal.SIGUSR1)  # (Popen's: never a reaped pid)
            child.proc.wait(DUMP_WAIT_S)
        except (OSError, subprocess.TimeoutExpired):
            pass
        child.proc.kill()

    # ---- supervisor thread: restarts, and the watchdog ---------------------------------------
    def _supervise(self) -> None:
        while True:
            self._wake.wait(self._watch_period())
            self._wake.clear()
            if self._closing:
                return
            if self._down is None:
                self._watch()
                continue
            delay = self._restart_delay
            if delay > 0:
                self._log("warn", f"specguide: waiting {delay:g} s before restarting the engine "
                                  f"(crash {self._backoff.failures} in a row)")
                if sleep_unless(delay, lambda: self._closing):
                    return
            t0 = time.monotonic()
            self._backoff.started()
            try:
                child = EngineHandle(self._config, self._server)
            except Exception as e:
                self._restart_delay = self._backoff.failed()
                with self._lock:
                    self._down = f"the engine failed to restart ({e}); retrying"
                self._log("error", f"specguide: {self._down}")
                self._wake.set()
                continue
            with self._lock:
                if self._closing:
                    child.kill()
                    return
                self._child, self.info = child, child.info
                self.restarts += 1
                self._stats, self._turns, self._progress_at = {}, -1, time.monotonic()
            self._reader = self._start_reader(child)
            self._replay_adapters(child)  # before it takes requests: they may name those adapters
            with self._lock:
                if not child.exited:  # (else its end was handled: the next restart is due)
                    self._down = None
            self._log("info", f"specguide: engine restarted in {time.monotonic() - t0:.1f} s "
                              f"(restart {self.restarts}, pid {child.info.pid})")
