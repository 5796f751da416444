"""EngineCore: one engine iteration (schedule, prefill chunks, one batched speculative decode
step, outputs), and everything it owns: the model, the runner and its step, the proposer, the
scheduler, the grammar compiler, intake and the output processor. No threads here: `loop.Engine`
builds it and runs it on its loop thread behind a thread-safe submit / cancel / shutdown.
A failure inside the iteration fails the request it belongs to (`_guarded`, `_recover`)."""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from .. import kernels
from ..util import memory
from ..config import CPU_SLOTS, EngineConfig, parse_adapters
from ..cuda.hostfunc import HostFuncError
from ..guided.compiler import GrammarCompilerService
from ..guided.limits import GuideLimits
from .intake import Intake
from .block_pool import BlockPool
from .kv_cache import block_bytes, kv_store, size_blocks, size_slots
from .lora_adapters import LoRAAdapters, lora_root
from ..models.loader import load_model, resolve_model_dir
from .output_processor import Finish, OutputProcessor
from ..request import InvalidRequestError, Request, RequestOutput, error_code
from .runner import Riders, Runner
from .scheduler import PrefillChunk, Scheduler, Sequence, Status, StepPlan
from ..speculative.head_drafter import HeadDrafter
from ..speculative.proposer import Proposer
from ..tokenizer import Tokenizer

log = logging.getLogger("specguide")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Callback = Callable[[RequestOutput], None]


def _detail(exc: BaseException) -> str:
    """What a client may read of an exception: its words where it says they are for clients
    (`client_readable`, e.g. an injected fault's), else only its type."""
    exc = _cause(exc)
    return str(exc) if getattr(exc, "client_readable", False) else type(exc).__name__


def _cause(exc: BaseException) -> BaseException:
    """The exception a grammar callback raised (host streams wrap it in HostFuncError)."""
    return exc.__cause__ if isinstance(exc, HostFuncError) and exc.__cause__ is not None else exc


class EngineCore:
    """The engine's state and one iteration (`step`); used on one thread only (Engine's loop).
    `arrivals` hands over the requests submitted since the iteration began (`step` lets them join
    its prefills within the chunk budget); `flush` sends the events callbacks held back."""

    def __init__(self, config: EngineConfig, arrivals: Callable[[], list[Sequence]] = list,
                 flush: Callable[[], None] = lambda: None):
        self._arrivals = arrivals
        self._flush = flush  # sends the events held back so far (Engine's `flush`): a first token at once
        self.config = config
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        if config.gil_switch_interval_ms > 0:
            sys.setswitchinterval(config.gil_switch_interval_ms / 1e3)
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cuda" and self.device.index is not None:
            # "cuda:N" (a KIND_GPU instance's GPU): the current device of this thread, which builds and
            # steps the engine, so that streams and graphs made without a device land on it too
            torch.cuda.set_device(self.device)
        folder = self.model_dir = resolve_model_dir(config.model_dir, config.gguf_file)
        self.tokenizer = Tokenizer(folder)
        self.model = load_model(folder, DTYPES[config.dtype], str(self.device), config.weight_dtype,
                                self.device.type == "cpu" and kernels.use_integer_dot(config.activation_dtype),
                                config.packed_weights_cache)
        if self.model.integer_dot:
            log.info("specguide: block-format weights x int8 activations (%s integer dot products)",
                     kernels.integer_dot_path())
        if config.max_seq_len == 0:  # the model's whole context
            config = self.config = dataclasses.replace(config, max_seq_len=self.model.cfg.max_position_embeddings)
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
        store = kv_store(config, self.model) or self.model.dtype
        per_block = block_bytes(self.model.cfg, store, self.model.dtype,
                                config.drafter in ("head", "hybrid") and config.num_draft_tokens > 0)
        num_blocks, config = size_blocks(config, self.model.cfg, self.device, per_block)
        self.config = config
        self.runner = Runner(self.model, config, self.device, num_blocks)
        self.guided = self.runner.guided
        self.proposer = Proposer(config, self.model, self.runner.kv, self.guided, folder, self.tokenizer.encode,
                                 DTYPES[config.dtype], self.device)
        self.runner.core.feature_sink = self.proposer.feature_sink
        self.adapters = LoRAAdapters(self.model, config.max_slots, config.max_loras,
                                     parse_adapters(config.lora_adapters), captured=self.runner.graphs is not None,
                                     lora_dtype=config.lora_dtype, host_bytes=config.lora_cache_host_memory_bytes,
                                     root=lora_root(config.lora_root))
        self.slot_state = (self.runner, self.proposer, self.adapters)  # every owner of per-slot state: admit / free
        self.scheduler = Scheduler(config.max_slots, config.max_seq_len, config.prefill_chunk,
                                   config.prefix_caching, config.prefix_min_tokens, self.model.chunk_invariant,
                                   BlockPool(self.runner.table.numpy(), num_blocks), config.num_draft_tokens,
                                   step_budget=(config.step_token_budget or config.prefill_chunk) if self.runner.varlen
                                   else 0, key_cost=self.model.cfg.key_cost,
                                   new_request_slots=config.max_slots // 8 if config.new_request_slots < 0
                                   else min(config.new_request_slots, config.max_slots - 1))
        self.outputs = OutputProcessor(self.guided, self.scheduler.check_stop_token, self.runner.vocab_size,
                                       self.runner.kv)
        self.intake = Intake(config, self.tokenizer, self.runner.vocab_size, self.eos_token_ids, self.compiler,
                             self.adapters)
        self.seqs: dict[int, Sequence] = {}  # every request in flight, by id
        self.num_steps = 0
        # the latest iteration, for the TensorRT-LLM metric families: (prefill chunks, decoding
        # sequences, prompt tokens in the chunks, wall clock in microseconds); plain ints, set by the
        # loop thread and read by stats() from another thread, never a device value
        self.last_step: tuple[int, int, int, int] = (0, 0, 0, 0)
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
        """While idle: `owner` (admit / free, and `record`) joins the per-slot owners
        and gets (slots, positions, hidden) after every target forward, next to the draft head's
        sink, until the block ends (training keeps f_p this way). Steps run eagerly meanwhile: a
        CUDA graph captured before would not call it."""
        assert not self.scheduler.running and not self.scheduler.waiting, "feature_recording needs an idle engine"
        self.scheduler.forget_prefixes()  # rows computed before the owner joined are not in its buffers
        sharing, self.scheduler.blocks.sharing = self.scheduler.blocks.sharing, False  # it records every position it is fed
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
            self.scheduler.blocks.sharing = sharing

    def make_sequence(self, request: Request, callback: Callback) -> Sequence:
        """Validate the request and build its sequence (Intake); raises InvalidRequestError. Any
        thread: it touches no state of the iteration."""
        return self.intake.sequence(request, callback)

    def add(self, seq: Sequence) -> None:
        """A submitted request joins the waiting queue."""
        self.seqs[seq.seq_id] = seq
        self.scheduler.waiting.append(seq)

    def cancel(self, seq_id: int, reason: str = "cancelled") -> None:
        """Stop a request (unknown or finished ids are ignored); its final event gives `reason`
        ("cancelled", or "stop" for a stop string found in its text)."""
        seq = self.seqs.get(seq_id)
        if seq is not None:
            seq.cancelled = True
            self.finish(seq, reason)

    def cancel_all(self) -> None:
        for seq in list(self.seqs.values()):
            self.finish(seq, "cancelled")

    def expire(self, now: float) -> None:
        """Finish requests past their deadline (`timeout_s`) with finish_reason "timeout"."""
        for seq in [s for s in self.seqs.values() if s.deadline is not None and now >= s.deadline]:
            self.finish(seq, "timeout")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def fail_all(self, extra: list[Sequence], message: str, code: str) -> None:
        """The engine is dying: end every request in flight and `extra` (taken, never added) with
        an error; where the state is too broken to finish one, its callback is told directly."""
        for seq in list(self.seqs.values()) + extra:
            try:
                self.finish(seq, "error", message, code)
            except Exception:
                seq.status = Status.FINISHED
                try:
                    seq.callback(RequestOutput(seq_id=seq.seq_id, finished=True, finish_reason="error",
                                               error=message, error_code=code))
                except Exception:
                    pass
        self.seqs.clear()

    def attach_head(self) -> bool:
        """Attach the configured draft head if its file is written now (the background training);
        graphs captured without its feature recording are dropped (recaptured on use)."""
        t0 = time.monotonic()
        if not self.proposer.attach_head():
            return False
        self.runner.core.feature_sink = self.proposer.feature_sink
        self.scheduler.forget_prefixes()  # blocks computed so far lack the head's features
        if self.runner.graphs is not None:
            self.runner.graphs.close()
        log.info("specguide: draft head %s attached while serving (%.2f s): drafter %r for requests "
                 "admitted from now on", self.proposer.head_path, time.monotonic() - t0, self.drafter)
        return True

    def close(self) -> None:
        """Stop the compile workers and the adapter reader; release the runner's resources (after the last step)."""
        self.compiler.shutdown()
        self.adapters.close()
        self.runner.close()

    # ---- one iteration (loop thread) ------------------------------------------------------
    def step(self) -> bool:
        """One engine iteration: schedule, run (prefill chunks, one batched decode), process outputs.
        Returns False when there was nothing to run (e.g. waiting on grammar compiles)."""
        self._poll_compiles()
        ready = lambda seq: seq.guide.compile is None and self.adapters.acquire(seq)  # noqa: E731
        plan: StepPlan = self.scheduler.schedule(ready=ready)
        if plan.empty:
            return False
        self._count(plan)
        for seq in plan.preempted:
            for owner in self.slot_state:
                owner.drop_rows(seq.slot)
        self.runner.blocks_changed()
        if self.runner.varlen:
            self._one_forward(plan)
            return True
        prefills = deque(plan.prefills)
        budget = self.scheduler.prefill_chunk - sum(c.end - c.start for c in plan.prefills)
        while prefills:
            # a request's first token goes out as soon as its prompt is in, not after the step's
            # other prefills and decode
            seq = self._prefill_chunk(prefills.popleft())
            if seq is not None and seq.status is not Status.FINISHED:
                self._emit(seq)
                self._flush()
            arrived = self._arrivals() if not prefills and budget > 0 else []
            for seq in arrived:
                self.add(seq)
            if arrived:
                # requests that came during the prefills join them, within the step's budget, rather
                # than wait for the decode of the batch already running
                more = self.scheduler.schedule_more(budget, {c.seq.seq_id for c in plan.prefills}, ready)
                self.runner.blocks_changed()
                plan.prefills += more.prefills
                prefills.extend(more.prefills)
                budget -= sum(c.end - c.start for c in more.prefills)
                self._note(plan)
        self._emit_live(self._decode_batch(plan.decodes))
        return True

    def _one_forward(self, plan: StepPlan) -> None:
        """The step's prompt chunks and decode rows in one forward (one pass over the weights; a
        long prompt's chunks no longer hold the running streams for a forward of their own); then
        the decode's tokens, then each last chunk's first token. Where it raises, the chunks run again one by
        one and the decode rows recover as a failed decode step does (K/V rewritten: the same bits)."""
        chunks = []
        for chunk in plan.prefills:
            self._guarded(chunk.seq, lambda: self._bind(chunk.seq))
            if chunk.seq.status is not Status.FINISHED:
                chunks.append(chunk)
        riders = self.runner.riders(chunks) if chunks else None
        try:
            if plan.decodes:
                results = self._decode(plan.decodes, riders)
            elif riders is not None:
                self.runner.ride(riders)
        except Exception as exc:
            log.exception("step failed (%d prompt chunks, %d decode rows)", len(chunks), len(plan.decodes))
            self._emit_live(self._prefill_chunk(chunk) for chunk in chunks)
            self._emit_live(self._recover(plan.decodes, exc) if plan.decodes else [])
            return
        # NOTE: the decode's tokens first: they confirm what its grammar commit fed, which the next
        # commit (a prompt's first token) replaces
        self._emit_live(self._appended(plan.decodes, results) if plan.decodes else [])
        self._emit_live(self._prefill_chunk(chunk, riders.rows(i)) for i, chunk in enumerate(chunks))

    def _emit_live(self, seqs: Iterable[Optional[Sequence]]) -> None:
        """Send the new output of each sequence still running (None: a chunk that produced none), each
        as it comes (a generator of prompt chunks: a request's first token before the next chunk's)."""
        for seq in seqs:
            if seq is not None and seq.status is not Status.FINISHED:
                self._emit(seq)

    def _count(self, plan: StepPlan) -> None:
        """The iteration's figures for stats() (read from another thread: plain ints)."""
        self.num_steps += 1
        self._note(plan)

    def _note(self, plan: StepPlan) -> None:
        self.last_step = (len(plan.prefills), len(plan.decodes),
                          sum(c.end - c.start for c in plan.prefills), time.time_ns() // 1000)

    def _prefill_chunk(self, chunk: PrefillChunk, hidden: Optional[torch.Tensor] = None) -> Optional[Sequence]:
        """Run one prompt chunk (`hidden`: its forward ran in the step's); the last one's token
        starts the request's output (returned)."""
        seq = chunk.seq
        tok = self._guarded(seq, lambda: self._prefill(chunk, hidden))
        if seq.status is Status.FINISHED:
            return None
        seq.num_cached = chunk.end
        if chunk.resumes:  # a preempted sequence's tokens are back in its blocks
            seq.status = Status.DECODE
        if tok is None:
            return None
        seq.status = Status.DECODE
        self._guarded(seq, lambda: self._append(seq, [tok]))
        return seq

    def _decode_batch(self, seqs: list[Sequence]) -> list[Sequence]:
        """One batched decode step and its bookkeeping; returns the sequences it appended to.
        A step that raises is run again on its rows apart (`_recover`), so that only the request
        that makes it fail fails."""
        if not seqs:
            return []
        try:
            results = self._decode(seqs)
        except Exception as exc:
            log.exception("decode step failed (%d rows)", len(seqs))
            return self._recover(seqs, exc)
        return self._appended(seqs, results)

    def _appended(self, seqs: list[Sequence], results: list[tuple[list[int], int, int]]) -> list[Sequence]:
        """A decode step's tokens appended; returns the sequences appended to."""
        touched = []
        for seq, (toks, drafted, accepted) in zip(seqs, results):
            seq.num_cached = seq.num_tokens + accepted  # the last token and the accepted drafts
            seq.stats.num_draft += drafted
            seq.stats.num_accepted += accepted
            self._guarded(seq, lambda: self._append(seq, toks))
            touched.append(seq)
        return touched

    def _decode(self, seqs: list[Sequence], riders: Optional[Riders] = None) -> list[tuple[list[int], int, int]]:
        """One decode step for every decoding sequence: speculative where drafts exist (`riders`:
        prompt chunks in its forward). Returns (tokens to append, drafts verified, drafts accepted)
        per sequence."""
        t0 = time.perf_counter()
        out = self.runner.step(seqs, self.proposer.plan(seqs), riders)
        # a step that carried prompt tokens says nothing of what drafting costs
        self.proposer.record(seqs, out, None if riders is not None else time.perf_counter() - t0)
        return out

    def _poll_compiles(self) -> None:
        """Move finished grammar compiles onto their sequences; a failed one fails its request."""
        for seq, message, code in self.intake.poll_compiles(self.scheduler.waiting):
            self.finish(seq, "error", message, code)
        for seq_id, message in self.adapters.poll_failures():
            if seq_id in self.seqs:
                self.finish(self.seqs[seq_id], "error", message, "INVALID_ARG")

    def _prefill(self, chunk: PrefillChunk, hidden: Optional[torch.Tensor] = None) -> Optional[int]:
        """One prompt chunk (`hidden`: its forward ran already); the first one binds the slot."""
        self._bind(chunk.seq)
        return self.runner.prefill(chunk, hidden)

    def _bind(self, seq: Sequence) -> None:
        """A sequence's first chunk (after a reused prefix; or, preempted before it ran, from 0): its
        slot's per-slot state (sampling rows, grammar matcher, drafters)."""
        if not seq.bound:
            for owner in self.slot_state:
                owner.admit(seq.slot, seq)
            seq.bound = True

    def _guarded(self, seq: Sequence, fn: Callable[[], Optional[int]]) -> Optional[int]:
        """Run one request's part of the step; an exception fails that request only."""
        try:
            return fn()
        except Exception as exc:
            if isinstance(_cause(exc), InvalidRequestError):  # its own guide hit a library limit: its message
                self.finish(seq, "error", str(_cause(exc)), error_code(_cause(exc)))
                return None
            log.exception("request %s failed", seq.seq_id)
            self.finish(seq, "error", f"this request failed in the engine ({_detail(exc)}; "
                                       f"the server log has the details)")
            return None

    def _recover(self, seqs: list[Sequence], exc: Exception) -> list[Sequence]:
        """A batched decode raised: fail the requests whose state is broken (a matcher that raises),
        put every other row's state back to its appended tokens (`Runner.restore`), then run those rows
        again: together when a culprit was failed, else in halves, each half split again while it
        raises. A row that raises alone fails alone; the others append what their step gave (each
        row's tokens are the same in any batch: batch invariance, lossless speculation). Returns
        the sequences appended to."""
        broken = [s for s in seqs if not self.runner.healthy(s)]
        if not broken and len(seqs) == 1:
            broken = seqs  # it raised alone: the fault is its own
        for seq in broken:
            if isinstance(_cause(exc), InvalidRequestError):  # a guide past a grammar library's limits
                self.finish(seq, "error", str(_cause(exc)), error_code(_cause(exc)))
            else:
                self.finish(seq, "error", f"decode failed ({_detail(exc)}; the server log has the details)")
        live = [s for s in seqs if s.status is not Status.FINISHED]
        for seq in live:
            self._guarded(seq, lambda: self.runner.restore(seq))
        live = [s for s in live if s.status is not Status.FINISHED]
        if not live:
            return []
        if broken:
            return self._decode_batch(live)
        half = len(live) // 2 or 1  # (rows sorted by slot: each part stays sorted)
        return self._decode_batch(live[:half]) + self._decode_batch(live[half:])

    # ---- outputs ---------------------------------------------------------------------------
    def _append(self, seq: Sequence, tokens: list[int]) -> None:
        """Append a step's tokens (OutputProcessor); finish the request when they end it."""
        end: Optional[Finish] = self.outputs.append(seq, tokens)
        if end is not None:
            self.finish(seq, *end)

    def finish(self, seq: Sequence, reason: str, error: Optional[str] = None,
               error_code: Optional[str] = None) -> None:
        """End a request: release its compile, grammar state and slot; send its final event."""
        if seq.status is Status.FINISHED:
            return
        self.outputs.close(seq, reason, error_code)
        self.intake.release(seq)
        if seq.slot is not None:
            for owner in self.slot_state:
                owner.free(seq.slot)
        self.adapters.release(seq)  # after its row is unbound: an unloaded adapter then leaves the bank
        self.scheduler.finish(seq, reason, error)
        self.seqs.pop(seq.seq_id, None)
        self.outputs.emit(seq, finished=True)

    def _emit(self, seq: Sequence) -> None:
        """Send a running request's new output; a callback that raises cancels its request."""
        if not self.outputs.emit(seq, finished=False):
            seq.cancelled = True
            self.finish(seq, "cancelled")
