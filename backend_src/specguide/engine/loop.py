"""Engine: thread-safe submit / cancel / shutdown around one background loop thread, which
builds the EngineCore (core.py) and runs its iterations."""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterator, Optional

import torch

from ..config import EngineConfig
from ..util import memory, stalls
from ..request import EngineDeadError, QueueFullError, Request, RequestOutput
from ..text_stream import TextStream
from .core import Callback, EngineCore, log
from .scheduler import Sequence, Status

IDLE_WAIT_S = 0.005
HEAD_POLL_S = 2.0  # how often a missing draft head's file is looked for (one stat)


def _memory_bytes(device: torch.device) -> dict[str, int]:
    """The engine process's memory, by where it lives: resident host memory, device memory its
    tensors hold, pinned host memory (torch's caching allocators' own counters: no device sync)."""
    gpu = pinned = 0
    if device.type == "cuda":
        gpu = int(torch.cuda.memory_allocated(device))
        stats = getattr(torch.cuda, "host_memory_stats", None)
        try:
            pinned = int(stats().get("allocated_bytes.current", 0)) if stats is not None else 0
        except RuntimeError:
            pinned = 0
    return {"cpu_mem_bytes": memory.rss_bytes(), "gpu_mem_bytes": gpu, "pinned_mem_bytes": pinned}


class Engine:
    """In-flight batched generation. `submit` returns at once; events arrive on the callback
    from the loop thread: one per step with new tokens, and exactly one with `finished=True`.
    `core` is the EngineCore the loop runs: read its parts (tokenizer, config, scheduler ...)
    from any thread, change them only from the loop's."""

    def __init__(self, config: EngineConfig, flush: Optional[Callable[[], None]] = None, text: bool = True):
        """`flush`: called on the loop thread after each turn's callbacks (and where a prompt's first
        token should go out at once), for a caller whose callbacks hold their events back to send
        them together (the engine process's Outbox). `text`: events carry their text, and stop
        strings end requests (text_stream.py, on the loop thread); False: token ids only, for a
        caller that makes the text itself (the engine process's parent) and calls `stop`."""
        self._flush = flush or (lambda: None)
        self._text = text
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, object]] = []  # ("submit", Sequence) | ("cancel" | "stop", seq id)
        self._pending_submits = 0
        self._stopping = False
        self._drain = True
        self._dead: Optional[BaseException] = None
        self._next_head_poll = 0.0
        self.turns = 0  # loop iterations: the engine process's watchdog sees the loop move (stats)
        self._ready = threading.Event()
        self._init_error: Optional[BaseException] = None
        # NOTE: the core is built on the loop thread, which then runs every torch op and C kernel.
        # libgomp keeps a pool of worker threads per thread that starts parallel regions, and once
        # it manages more threads than CPUs it stops spin-waiting between regions: a model loaded
        # on one thread and stepped on another pays futex wake-ups at each of a step's barriers.
        self._thread = threading.Thread(target=self._run, args=(config,), name="specguide-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            self._thread.join()
            raise self._init_error

    def _run(self, config: EngineConfig) -> None:
        """The loop thread: build, then serve until shutdown."""
        try:
            self.core = EngineCore(config, arrivals=self._take_arrivals, flush=self._flush_outputs)
        except BaseException as exc:  # re-raised by __init__ on the caller's thread
            self._init_error = exc
            return
        finally:
            self._ready.set()
        self._loop()

    # ---- public API (any thread) ------------------------------------------------------------
    def submit(self, request: Request, callback: Optional[Callback] = None) -> int:
        """Validate and queue a request; returns its sequence id. Raises InvalidRequestError,
        QueueFullError or EngineDeadError; never blocks on generation."""
        callback = callback or (lambda out: None)
        if self._text:
            callback = TextStream.wrap(self.core.tokenizer, request, callback, lambda: self.stop(seq.seq_id))
        seq = self.core.make_sequence(request, callback)
        with self._cv:
            if self._dead is not None or not self._thread.is_alive():
                raise EngineDeadError(self._dead_message())
            if self._stopping:
                raise EngineDeadError("the engine is shutting down")
            if self.core.scheduler.num_waiting + self._pending_submits >= self.core.config.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.core.config.max_queue} requests)")
            self._pending_submits += 1
            self._inbox.append(("submit", seq))
            self._cv.notify()
        return seq.seq_id

    def generate(self, request: Request) -> Iterator[RequestOutput]:
        """Submit and iterate over the request's events until the final one."""
        events: queue.Queue[RequestOutput] = queue.Queue()
        self.submit(request, events.put)
        while True:
            out = events.get()
            yield out
            if out.finished:
                return

    def cancel(self, seq_id: int) -> None:
        """Stop a request; its slot is freed at the next step and a final 'cancelled' event follows."""
        self._post("cancel", seq_id)

    def stop(self, seq_id: int) -> None:
        """End a request whose text reached a stop string: as `cancel`, its final event says "stop"."""
        self._post("stop", seq_id)

    def _post(self, kind: str, seq_id: int) -> None:
        with self._cv:
            self._inbox.append((kind, seq_id))
            self._cv.notify()

    def load_adapter(self, name: str, lora_path: str, replace: bool = False) -> str:
        """Serve the LoRA adapter in folder `lora_path` (under config `lora_root`) as `name` (`replace`:
        in place of one served so); returns the folder. Raises InvalidRequestError saying what is
        refused (engine/lora_adapters.py)."""
        return self.core.adapters.load(name, lora_path, replace)

    def unload_adapter(self, name: str) -> None:
        """Serve the LoRA adapter `name` no more (its running requests finish with it)."""
        self.core.adapters.unload(name)

    def adapters(self) -> list[str]:
        """The LoRA adapters served by name (config and run-time loads)."""
        return self.core.adapters.served()

    def stats(self) -> dict[str, int]:
        """Active slots, queue depth, steps run, loop turns (the watchdog's sign of life) and
        liveness (for metrics and readiness), and the batch and KV-cache figures the TensorRT-LLM
        metric families report (triton/peer_metrics.py).

        Any thread (the engine process's stats thread): it reads Python ints the loop thread keeps
        (a snapshot of the running sequences, the latest step's counts) and the allocators' own
        counters; nothing here waits on the device or on the loop."""
        core = self.core
        sched, kv, pool = core.scheduler, core.runner.kv, core.scheduler.pool
        running = list(sched.running.values())  # one C-level copy: the loop thread may change the dict
        prefills, decodes, prompt_tokens, step_us = core.last_step
        if not running:  # the latest step is over and nothing runs: no request is scheduled now
            prefills = decodes = prompt_tokens = 0
        return {"active_slots": len(running), "queue_depth": sched.num_waiting + self._pending_submits,
                "steps": core.num_steps, "loop_turns": self.turns, "alive": int(self.is_alive()),
                "draft_head": int(core.proposer.head is not None), "max_slots": sched.max_slots,
                "context_requests": prefills, "generation_requests": decodes,
                "context_tokens": prompt_tokens, "step_time_us": step_us,
                "kv_tokens_per_block": kv.tokens_per_block,
                "kv_blocks_max": pool.num_blocks - 1,
                "kv_blocks_used": pool.num_used,  # held by running sequences (a shared block once)
                "kv_blocks_free": pool.num_free,  # free or cached (a prefix's blocks nobody holds)
                "kv_blocks_cached": len(pool.by_key),  # keyed for sharing (held or not)
                "kv_blocks_reused": sched.reused_blocks,
                "preempted": sum(s.status is Status.PREEMPTED for s in running),
                "preemptions": sched.num_preemptions,
                **core.adapters.stats(),
                **_memory_bytes(core.device)}

    @property
    def config(self) -> EngineConfig:
        """The settings as the engine resolved them (e.g. max_slots sized to memory)."""
        return self.core.config

    @property
    def tokenizer(self):
        """The model's tokenizer (for building requests and reading outputs)."""
        return self.core.tokenizer

    def is_alive(self) -> bool:
        """False once the loop thread has died (its process then ends: engine_process starts a new one)."""
        return self._dead is None and self._thread.is_alive()

    @property
    def failure(self) -> Optional[BaseException]:
        """What killed the loop thread (None while it lives or after a clean shutdown)."""
        return self._dead

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the loop thread to end (after a shutdown or its death: by then every request
        in flight has had its final event)."""
        self._thread.join(timeout)

    def shutdown(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stop the loop: finish in-flight requests first when `drain`, else cancel them.
        After `timeout` seconds of draining, whatever is left is cancelled."""
        with self._cv:
            self._stopping = True
            self._drain = drain
            self._cv.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cv:
                self._drain = False
                self._cv.notify()
            self._thread.join()
        self.core.close()

    # ---- loop thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        core = self.core
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._stopping or core.has_work()):
                        if not self._cv.wait(HEAD_POLL_S if core.proposer.awaits_head else None):
                            break  # idle, awaiting a draft head: look for its file
                    inbox, self._inbox = self._inbox, []
                    self._pending_submits -= sum(1 for kind, _ in inbox if kind == "submit")
                    stopping, drain = self._stopping, self._drain
                self.turns += 1
                t0 = time.perf_counter()
                self._apply(inbox)
                core.expire(time.monotonic())
                self._poll_head()
                if stopping and not drain:
                    core.cancel_all()
                if stopping and not core.has_work():
                    self._flush_outputs()
                    return
                t1 = time.perf_counter()
                stepped = core.has_work() and core.step()
                self._flush_outputs()
                self._report(t0, t1, stepped, len(inbox))
                if core.has_work() and not stepped:
                    with self._cv:  # only grammar compiles are pending: doze instead of spinning
                        self._cv.wait(IDLE_WAIT_S)
        except BaseException as exc:  # the loop must never die silently
            log.exception("engine loop crashed")
            self._die(exc)

    def _report(self, t0: float, t1: float, stepped: bool, arrivals: int) -> None:
        """A loop turn that held every stream SLOW_S or longer goes to the log, with what it did."""
        now = time.perf_counter()
        if now - t0 < stalls.SLOW_S:
            return
        prefills, decodes, prompt_tokens, step_us = self.core.last_step if stepped else (0, 0, 0, 0)
        stalls.report("engine loop turn", now - t0,
                      f"{arrivals} arrivals and cancels {t1 - t0:.2f} s; step {now - t1:.2f} s: {prefills} prefill "
                      f"rows of {prompt_tokens} prompt tokens, {decodes} decode rows; "
                      f"{len(self.core.scheduler.running)} running, {self.core.scheduler.num_waiting} waiting")

    def _die(self, exc: BaseException) -> None:
        """The loop crashed: refuse new requests, fail every in-flight and queued one (UNAVAILABLE)."""
        with self._cv:
            self._dead = exc
            inbox, self._inbox = self._inbox, []
            self._pending_submits = 0
        taken = [s for kind, s in inbox if kind == "submit"]
        self.core.fail_all(taken, self._dead_message(), EngineDeadError.code)  # type: ignore[arg-type]
        self._flush_outputs()

    def _flush_outputs(self) -> None:
        """The caller's `flush` (loop thread); a failure to send is logged, the loop goes on."""
        try:
            self._flush()
        except Exception:
            log.exception("sending the engine's events failed")

    def _dead_message(self) -> str:
        return f"the engine stopped ({type(self._dead).__name__}; see the server log); a new engine is starting"

    def _take_arrivals(self) -> list[Sequence]:
        """Mid-step: the inbox's submissions, for the core's waiting queue (cancels wait for the
        loop: a sequence of this step's decode batch must not finish under it)."""
        with self._cv:
            arrived = [x for x in self._inbox if x[0] == "submit"]
            if self._stopping or not arrived:
                return []
            self._inbox = [x for x in self._inbox if x[0] != "submit"]
            self._pending_submits -= len(arrived)
        return [seq for _, seq in arrived]  # type: ignore[misc]

    def _apply(self, inbox: list[tuple[str, object]]) -> None:
        for kind, item in inbox:
            if kind == "submit":
                assert isinstance(item, Sequence)
                self.core.add(item)
            elif kind in ("cancel", "stop"):
                self.core.cancel(item, "cancelled" if kind == "cancel" else "stop")  # type: ignore[arg-type]

    def _poll_head(self) -> None:
        """Every HEAD_POLL_S while a configured draft head is missing: attach it once its file is written."""
        now = time.monotonic()
        if self.core.proposer.awaits_head and now >= self._next_head_poll:
            self._next_head_poll = now + HEAD_POLL_S
            self.core.attach_head()
