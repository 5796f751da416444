"""Engine: thread-safe submit / cancel / shutdown around one background loop thread."""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

from . import faults, kernels, memory
from .config import CPU_SLOTS, EngineConfig
from .cuda.hostfunc import HostFuncError
from .guided.compiler import GrammarCompilerService
from .guided.limits import GuideLimits
from .intake import Intake
from .kv_cache import slot_bytes, slots_for_memory
from .models.loader import load_model, resolve_model_dir
from .outputs import Finish, OutputProcessor
from .request import EngineDeadError, InvalidRequestError, QueueFullError, Request, RequestOutput
from .runner import Runner
from .scheduler import PrefillChunk, Scheduler, Sequence, Status, StepPlan
from .speculative.head_drafter import HeadDrafter
from .speculative.proposer import Proposer
from .tokenizer import Tokenizer

log = logging.getLogger("specguide")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Callback = Callable[[RequestOutput], None]
IDLE_WAIT_S = 0.005
HEAD_POLL_S = 2.0  # how often a missing draft head's file is looked for (one stat)


def _detail(exc: BaseException) -> str:
    """What a client may read of an exception: our injected faults' words, else only its type."""
    exc = _cause(exc)
    return str(exc) if isinstance(exc, faults.InjectedFault) else type(exc).__name__


def _cause(exc: BaseException) -> BaseException:
    """The exception a grammar callback raised (host streams wrap it in HostFuncError)."""
    return exc.__cause__ if isinstance(exc, HostFuncError) and exc.__cause__ is not None else exc


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
    from the loop thread: one per step with new text, and exactly one with `finished=True`."""

    supports_guided_decoding = True

    def __init__(self, config: EngineConfig):
        # NOTE: the engine builds itself on its loop thread and runs every torch op and C kernel
        # there. libgomp keeps a pool of worker threads per thread that starts parallel regions,
        # and once it manages more threads than CPUs it stops spin-waiting between regions: with
        # the model loaded on the caller's thread and stepped on this one, every decode step paid
        # futex wake-ups at each of its ~300 barriers (9.5 ms instead of 5.1 on 2 cores).
        self._ready = threading.Event()
        self._init_error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(config,), name="specguide-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            self._thread.join()
            raise self._init_error

    def _run(self, config: EngineConfig) -> None:
        """The loop thread: build, then serve until shutdown."""
        try:
            self._build(config)
        except BaseException as exc:  # re-raised by __init__ on the caller's thread
            self._init_error = exc
            return
        finally:
            self._ready.set()
        self._loop()

    def _build(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cuda" and self.device.index is not None:
            # "cuda:N" (a KIND_GPU instance's GPU): the current device of this thread, which builds and
            # steps the engine, so that streams and graphs made without a device land on it too
            torch.cuda.set_device(self.device)
        folder = self.model_dir = resolve_model_dir(config.model_dir, config.gguf_file)
        self.tokenizer = Tokenizer(folder)
        self.model = load_model(folder, DTYPES[config.dtype], str(self.device), config.weight_dtype,
                                self.device.type == "cpu" and kernels.use_integer_dot(config.activation_dtype))
        if self.model.integer_dot:
            log.info("specguide: block-format weights x int8 activations (%s integer dot products)",
                     kernels.integer_dot_path())
        if config.max_seq_len > self.model.cfg.max_position_embeddings:  # RoPE past its trained range: noise
            raise ValueError(f"max_seq_len {config.max_seq_len} exceeds {folder.name}'s max_position_embeddings "
                             f"{self.model.cfg.max_position_embeddings} (config.json): lower max_seq_len")
        if config.max_slots == 0:  # CUDA: as many slots as the free memory holds; CPU: CPU_SLOTS
            config = self.config = (size_slots(config, self.model.cfg, self.device) if self.device.type == "cuda"
                                    else dataclasses.replace(config, max_slots=CPU_SLOTS))
        model_eos = getattr(self.model, "eos_token_ids", frozenset())
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids | set(model_eos))
        vocab = self.model.cfg.vocab_size
        self.compiler = GrammarCompilerService(
            self.tokenizer.hf, vocab, stop_token_ids=sorted(self.eos_token_ids),
            cache_limit_bytes=config.guided_cache_bytes, max_workers=config.guided_compile_workers,
            timeout_s=config.guided_compile_timeout_s or None, default_backend=config.guided_backend,
            limits=GuideLimits.from_config(config), undeclared_keys=config.guided_undeclared_keys)
        self.faults = faults.injector()
        self.runner = Runner(self.model, config, self.device, poison=self.faults.poison)
        self.guided = self.runner.guided
        self.proposer = Proposer(config, self.model, self.runner.kv, self.guided, folder, self.tokenizer.encode,
                                 DTYPES[config.dtype], self.device)
        self.runner.core.feature_sink = self.proposer.feature_sink
        self.slot_state = (self.runner, self.proposer)  # every owner of per-slot state: admit / free / copy_prefix
        self.scheduler = Scheduler(config.max_slots, config.max_seq_len, config.prefill_chunk,
                                   config.prefix_caching, config.prefix_min_tokens, self.model.chunk_invariant)
        self.outputs = OutputProcessor(self.guided, self.scheduler.check_stop_token, self.runner.vocab_size,
                                       self.runner.kv)
        self.intake = Intake(config, self.tokenizer, self.runner.vocab_size, self.eos_token_ids, self.compiler,
                             self.faults)
        self._seqs: dict[int, Sequence] = {}  # loop thread only
        self._inbox: list[tuple[str, object]] = []
        self._cv = threading.Condition()
        self._pending_submits = 0
        self._stopping = False
        self._drain = True
        self._dead: Optional[BaseException] = None
        self.num_steps = 0
        self._next_head_poll = 0.0
        # the latest iteration, for the TensorRT-LLM metric families: (prefill chunks, decoding
        # sequences, prompt tokens in the chunks, wall clock in microseconds); plain ints, set by the
        # loop thread and read by stats() from another thread, never a device value
        self.last_step: tuple[int, int, int, int] = (0, 0, 0, 0)
        self.scheduler.tokens_per_block = self.runner.kv.tokens_per_block
        self.scheduler.reusable = self.proposer.reusable
        t0 = time.perf_counter()
        if config.warmup:  # before the loop starts, so initialize() (and readiness) waits for it
            self.runner.warmup()
        self.warmup_s = time.perf_counter() - t0
        # the load's temporaries (fp32 weights before packing) were freed in this thread's malloc
        # arena, which glibc keeps mapped: 1.97-2.03 GiB of RSS after start-up, 1.92 trimmed
        memory.trim()

    @property
    def drafter(self) -> str:
        """The drafter in use ("hybrid"/"head" fall back to "grammar" without a trained head)."""
        return self.proposer.drafter

    @property
    def head_drafter(self) -> Optional[HeadDrafter]:
        """The trained draft head in use, if any."""
        return self.proposer.head

    @property
    def step_graphs(self):
        return self.runner.graphs

    @step_graphs.setter
    def step_graphs(self, graphs) -> None:
        self.runner.graphs = graphs

    @contextmanager
    def feature_recording(self, owner: Any) -> Iterator[None]:
        """While idle: `owner` (admit / free / copy_prefix, and `record`) joins the per-slot owners
        and gets (slots, positions, hidden) after every target forward, next to the draft head's
        sink, until the block ends (training keeps f_p this way). Steps run eagerly meanwhile: a
        CUDA graph captured before would not call it."""
        assert not self.scheduler.running and not self.scheduler.waiting, "feature_recording needs an idle engine"
        self.scheduler.forget_prefixes()  # rows computed before the owner joined are not in its buffers
        sink, graphs = self.runner.core.feature_sink, self.runner.graphs

        def both(slots: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> None:
            if sink is not None:
                sink(slots, positions, hidden)
            owner.record(slots, positions, hidden)

        self.slot_state += (owner,)
        self.runner.core.feature_sink, self.runner.graphs = both, None
        try:
            yield
        finally:
            self.runner.core.feature_sink, self.runner.graphs = sink, graphs
            self.slot_state = tuple(o for o in self.slot_state if o is not owner)

    # ---- public API (any thread) ------------------------------------------------------------
    def submit(self, request: Request, callback: Optional[Callback] = None) -> int:
        """Validate and queue a request; returns its sequence id. Raises InvalidRequestError,
        QueueFullError or EngineDeadError; never blocks on generation."""
        seq = self._make_sequence(request, callback or (lambda out: None))
        with self._cv:
            if self._dead is not None or not self._thread.is_alive():
                raise EngineDeadError(self._dead_message())
            if self._stopping:
                raise EngineDeadError("the engine is shutting down")
            if self.scheduler.num_waiting + self._pending_submits >= self.config.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.config.max_queue} requests)")
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
        with self._cv:
            self._inbox.append(("cancel", seq_id))
            self._cv.notify()

    def stats(self) -> dict[str, int]:
        """Active slots, queue depth, steps run and liveness (for metrics and readiness), and the
        batch and KV-cache figures the TensorRT-LLM metric families report (triton/peer_metrics.py).

        Called from another thread (the engine process's stats thread): it reads Python ints the
        loop thread keeps (a snapshot of the running sequences, the latest step's counts) and the
        allocators' own counters; nothing here waits on the device or on the loop."""
        sched, kv = self.scheduler, self.runner.kv
        running = list(sched.running.values())  # one C-level copy: the loop thread may change the dict
        prefills, decodes, prompt_tokens, step_us = self.last_step
        if not running:  # the latest step is over and nothing runs: no request is scheduled now
            prefills = decodes = prompt_tokens = 0
        return {"active_slots": len(running),
                "queue_depth": sched.num_waiting + self._pending_submits,
                "steps": self.num_steps, "alive": int(self.is_alive()),
                "draft_head": int(self.proposer.head is not None),
                "max_slots": sched.max_slots,
                "context_requests": prefills, "generation_requests": decodes,
                "context_tokens": prompt_tokens, "step_time_us": step_us,
                "kv_tokens_per_block": kv.tokens_per_block,
                "kv_blocks_max": sched.max_slots * kv.blocks(self.config.max_seq_len),
                "kv_blocks_used": sum(kv.blocks(s.num_tokens) for s in running),
                "kv_blocks_reused": sched.reused_blocks,
                **_memory_bytes(self.device)}

    def is_alive(self) -> bool:
        """False once the loop thread has died (its process then ends: engine_process starts a new one)."""
        return self._dead is None and self._thread.is_alive()

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
        self.compiler.shutdown()
        self.runner.close()

    def _make_sequence(self, request: Request, callback: Callback) -> Sequence:
        """Validate the request and build its sequence (Intake); raises InvalidRequestError."""
        return self.intake.sequence(request, callback)

    # ---- loop thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._stopping or self.scheduler.has_work()):
                        if not self._cv.wait(HEAD_POLL_S if self.proposer.awaits_head else None):
                            break  # idle, awaiting a draft head: look for its file
                    inbox, self._inbox = self._inbox, []
                    self._pending_submits -= sum(1 for kind, _ in inbox if kind == "submit")
                    stopping, drain = self._stopping, self._drain
                self._apply(inbox)
                self._expire()
                self._poll_head()
                if stopping and not drain:
                    for seq in list(self._seqs.values()):
                        self._finish(seq, "cancelled")
                if stopping and not self.scheduler.has_work():
                    return
                if self.scheduler.has_work() and not self.step():
                    with self._cv:  # only grammar compiles are pending: doze instead of spinning
                        self._cv.wait(IDLE_WAIT_S)
        except BaseException as exc:  # the loop must never die silently
            log.exception("engine loop crashed")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """The loop crashed: refuse new requests, fail every in-flight and queued one (UNAVAILABLE)."""
        with self._cv:
            self._dead = exc
            inbox, self._inbox = self._inbox, []
            self._pending_submits = 0
        victims = list(self._seqs.values()) + [s for kind, s in inbox if kind == "submit"]
        message = self._dead_message()
        for seq in victims:
            assert isinstance(seq, Sequence)
            try:
                self._finish(seq, "error", message, "UNAVAILABLE")
            except Exception:  # the state may be broken: tell the client directly
                seq.status = Status.FINISHED
                try:
                    seq.callback(RequestOutput(seq_id=seq.seq_id, finished=True, finish_reason="error",
                                               error=message, error_code="UNAVAILABLE"))
                except Exception:
                    pass
        self._seqs.clear()

    def _dead_message(self) -> str:
        return f"the engine stopped ({type(self._dead).__name__}; see the server log); a new engine is starting"

    def _expire(self) -> None:
        """Finish requests past their deadline (`timeout_s`) with finish_reason "timeout"."""
        now = time.monotonic()
        for seq in [s for s in self._seqs.values() if s.deadline is not None and now >= s.deadline]:
            self._finish(seq, "timeout")

    def _apply(self, inbox: list[tuple[str, object]]) -> None:
        for kind, item in inbox:
            if kind == "submit":
                assert isinstance(item, Sequence)
                self._seqs[item.seq_id] = item
                self.scheduler.waiting.append(item)
                self.faults.on_submit(item)
            elif kind == "cancel":
                seq = self._seqs.get(item)  # type: ignore[arg-type]
                if seq is not None:
                    seq.cancelled = True
                    self._finish(seq, "cancelled")

    def step(self) -> bool:
        """One engine iteration: schedule, run (prefill chunks, one batched decode), process outputs.
        Returns False when there was nothing to run (e.g. waiting on grammar compiles)."""
        self._poll_compiles()
        plan: StepPlan = self.scheduler.schedule(ready=lambda seq: seq.compile is None)
        if plan.empty:
            return False
        self.num_steps += 1
        self.last_step = (len(plan.prefills), len(plan.decodes),
                          sum(c.end - c.start for c in plan.prefills), time.time_ns() // 1000)
        for copy in plan.copies:  # prefix rows from another slot, before any chunk overwrites a source
            for owner in self.slot_state:
                owner.copy_prefix(copy)
        touched = [seq for seq in map(self._prefill_chunk, plan.prefills) if seq is not None]
        touched += self._decode_batch(plan.decodes)
        for seq in touched:
            if seq.status is not Status.FINISHED:
                self._emit(seq)
        return True

    def _prefill_chunk(self, chunk: PrefillChunk) -> Optional[Sequence]:
        """Run one prompt chunk; the last one's token starts the request's output (returned)."""
        seq = chunk.seq
        tok = self._guarded(seq, lambda: self._prefill(chunk))
        if seq.status is Status.FINISHED:
            return None
        seq.num_cached = chunk.end
        if tok is None:
            return None
        seq.status = Status.DECODE
        self._guarded(seq, lambda: self._append(seq, [tok]))
        return seq

    def _decode_batch(self, seqs: list[Sequence]) -> list[Sequence]:
        """One batched decode step and its bookkeeping; returns the sequences it appended to."""
        if not seqs:
            return []
        try:
            results = self._decode(seqs)
        except Exception as exc:
            log.exception("decode step failed")
            self._recover(seqs, exc)
            return []  # the survivors retry at the next step
        touched = []
        for seq, (toks, drafted, accepted) in zip(seqs, results):
            seq.num_cached = seq.num_tokens + accepted  # the last token and the accepted drafts
            seq.num_draft += drafted
            seq.num_accepted += accepted
            self._guarded(seq, lambda: self._append(seq, toks))
            touched.append(seq)
        return touched

    def _decode(self, seqs: list[Sequence]) -> list[tuple[list[int], int, int]]:
        """One decode step for every decoding sequence: speculative where drafts exist.
        Returns (tokens to append, drafts verified, drafts accepted) per sequence."""
        t0 = time.perf_counter()
        out = self.runner.step(seqs, self.proposer.plan(seqs))
        self.proposer.record(seqs, out, time.perf_counter() - t0)
        return out

    def _poll_head(self) -> None:
        """Every HEAD_POLL_S while a configured draft head is missing: attach it once its file
        is written (by the background training); graphs captured without its feature recording
        are dropped (recaptured on use)."""
        now = time.monotonic()
        if not self.proposer.awaits_head or now < self._next_head_poll:
            return
        self._next_head_poll = now + HEAD_POLL_S
        if self.proposer.attach_head():
            self.runner.core.feature_sink = self.proposer.feature_sink
            if self.runner.graphs is not None:
                self.runner.graphs.close()
            log.info("specguide: draft head %s attached while serving (%.2f s): drafter %r for requests "
                     "admitted from now on", self.proposer.head_path, time.monotonic() - now, self.drafter)

    def _poll_compiles(self) -> None:
        """Move finished grammar compiles onto their sequences; a failed one fails its request."""
        for seq, message, code in self.intake.poll_compiles(self.scheduler.waiting):
            self._finish(seq, "error", message, code)

    def _prefill(self, chunk: PrefillChunk) -> Optional[int]:
        """One prompt chunk; the first one binds the slot (sampling rows, grammar matcher)."""
        seq = chunk.seq
        if chunk.start == seq.num_reused:  # the first chunk (after a reused prefix)
            for owner in self.slot_state:
                owner.admit(seq.slot, seq)
        self.faults.before_prefill(seq)
        return self.runner.prefill(chunk)

    def _guarded(self, seq: Sequence, fn: Callable[[], Optional[int]]) -> Optional[int]:
        """Run one request's part of the step; an exception fails that request only."""
        try:
            return fn()
        except Exception as exc:
            if isinstance(_cause(exc), InvalidRequestError):  # its own guide hit a library limit: its message
                self._finish(seq, "error", str(_cause(exc)), "INVALID_ARG")
                return None
            log.exception("request %s failed", seq.seq_id)
            self._finish(seq, "error", f"this request failed in the engine ({_detail(exc)}; "
                                       f"the server log has the details)")
            return None

    def _recover(self, seqs: list[Sequence], exc: Exception) -> None:
        """A batched decode raised: fail the requests whose state is broken (a matcher that raises),
        put the others' grammar state back to their accepted tokens; they retry at the next step.
        When no culprit is found the whole batch fails (the fault cannot be pinned on one request)."""
        broken = [s for s in seqs if not self._healthy(s)] or seqs
        for seq in broken:
            if isinstance(_cause(exc), InvalidRequestError):  # a guide past a grammar library's limits
                self._finish(seq, "error", str(_cause(exc)), "INVALID_ARG")
            else:
                self._finish(seq, "error", f"decode failed ({_detail(exc)}; the server log has the details)")
        for seq in seqs:
            if seq.status is not Status.FINISHED and seq.grammar is not None:
                self._guarded(seq, lambda: self.guided.rollback(
                    seq.slot, self.guided.num_tokens(seq.slot) - len(seq.output_ids)))

    def _healthy(self, seq: Sequence) -> bool:
        try:
            if seq.grammar is not None:
                self.guided.is_terminated(seq.slot)
            return True
        except Exception:
            return False

    # ---- outputs ---------------------------------------------------------------------------
    def _append(self, seq: Sequence, tokens: list[int]) -> None:
        """Append a step's tokens (OutputProcessor); finish the request when they end it."""
        end: Optional[Finish] = self.outputs.append(seq, tokens)
        if end is not None:
            self._finish(seq, *end)
        else:
            self.faults.after_append(seq, self.guided)

    def _finish(self, seq: Sequence, reason: str, error: Optional[str] = None,
                error_code: Optional[str] = None) -> None:
        """End a request: release its compile, grammar state and slot; send its final event."""
        if seq.status is Status.FINISHED:
            return
        self.outputs.close(seq, reason, error_code)
        if seq.compile is not None:
            seq.compile.cancel()
            seq.compile = None
        if seq.slot is not None:
            for owner in self.slot_state:
                owner.free(seq.slot)
        self.scheduler.finish(seq, reason, error)
        self._seqs.pop(seq.seq_id, None)
        self.outputs.emit(seq, finished=True)

    def _emit(self, seq: Sequence) -> None:
        """Send a running request's new output; a callback that raises cancels its request."""
        if not self.outputs.emit(seq, finished=False):
            seq.cancelled = True
            self._finish(seq, "cancelled")


def size_slots(config: EngineConfig, cfg: Any, device: torch.device, free_bytes: Optional[int] = None) -> EngineConfig:
    """`config` with max_slots from `kv_cache_memory_fraction` of the device's free memory (read
    after the weights are loaded, or `free_bytes`), logged."""
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
    positions = config.max_seq_len + config.num_draft_tokens + 1
    per_slot = slot_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, positions,
                          torch.finfo(DTYPES[config.dtype]).bits // 8)
    n = slots_for_memory(free_bytes, config.kv_cache_memory_fraction, per_slot)
    log.info("max_slots %d: %d slots x %d positions = %.2f GiB of %.2f GiB free (kv_cache_memory_fraction %.2f)",
             n, n, positions, n * per_slot / 2**30, free_bytes / 2**30, config.kv_cache_memory_fraction)
    return dataclasses.replace(config, max_slots=n)
