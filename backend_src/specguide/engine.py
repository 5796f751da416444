"""Engine: thread-safe submit / cancel / shutdown around one background loop thread."""
from __future__ import annotations

import itertools
import logging
import math
import queue
import random
import threading
import time
from typing import Callable, Iterator, Optional

import torch

from . import faults
from .config import EngineConfig
from .cuda.hostfunc import HostFuncError
from .guided.compiler import GrammarCompilerService
from .guided.limits import GuideLimits
from .models.loader import load_model, resolve_model_dir
from .request import (EngineDeadError, InvalidRequestError, QueueFullError, Request, RequestOutput)
from .runner import Runner
from .scheduler import PrefillChunk, Scheduler, Sequence, Status, StepPlan
from .speculative.head_drafter import HeadDrafter
from .speculative.proposer import Proposer
from .tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("specguide")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Callback = Callable[[RequestOutput], None]
STAGES = {Status.WAITING: "queued", Status.PREFILL: "prefill", Status.DECODE: "decode", Status.FINISHED: "finished"}
IDLE_WAIT_S = 0.005


def _detail(exc: BaseException) -> str:
    """What a client may read of an exception: our injected faults' words, else only its type."""
    exc = _cause(exc)
    return str(exc) if isinstance(exc, faults.InjectedFault) else type(exc).__name__


def _cause(exc: BaseException) -> BaseException:
    """The exception a grammar callback raised (host streams wrap it in HostFuncError)."""
    return exc.__cause__ if isinstance(exc, HostFuncError) and exc.__cause__ is not None else exc


class Engine:
    """In-flight batched generation. `submit` returns at once; events arrive on the callback
    from the loop thread: one per step with new text, and exactly one with `finished=True`."""

    supports_guided_decoding = True

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.resolved_device())
        folder = resolve_model_dir(config.model_dir, config.gguf_file)
        self.tokenizer = Tokenizer(folder)
        self.model = load_model(folder, DTYPES[config.dtype], str(self.device), config.weight_dtype)
        model_eos = getattr(self.model, "eos_token_ids", frozenset())
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids | set(model_eos))
        vocab = self.model.cfg.vocab_size
        self.compiler = GrammarCompilerService(
            self.tokenizer.hf, vocab, stop_token_ids=sorted(self.eos_token_ids),
            cache_limit_bytes=config.guided_cache_bytes, max_workers=config.guided_compile_workers,
            timeout_s=config.guided_compile_timeout_s or None, default_backend=config.guided_backend,
            limits=GuideLimits.from_config(config))
        self.runner = Runner(self.model, config, self.device,
                             poison=faults.poison)  # only rows with an injected fault (tests)
        self.guided = self.runner.guided
        self.proposer = Proposer(config, self.model, self.runner.kv, self.guided, folder, self.tokenizer.encode,
                                 DTYPES[config.dtype], self.device)
        self.runner.core.feature_sink = self.proposer.feature_sink
        self.slot_state = (self.runner, self.proposer)  # every owner of per-slot state: admit / free
        self.scheduler = Scheduler(config.max_slots, config.max_seq_len, config.prefill_chunk, config.max_queue)
        self._ids = itertools.count(1)
        self._seqs: dict[int, Sequence] = {}  # loop thread only
        self._inbox: list[tuple[str, object]] = []
        self._cv = threading.Condition()
        self._pending_submits = 0
        self._stopping = False
        self._drain = True
        self._dead: Optional[BaseException] = None
        self.num_steps = 0
        t0 = time.perf_counter()
        if config.warmup:  # before the loop starts, so initialize() (and readiness) waits for it
            self.runner.warmup()
        self.warmup_s = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._loop, name="specguide-engine", daemon=True)
        self._thread.start()

    @property
    def drafter(self) -> str:
        """The drafter in use ("hybrid"/"head" fall back to "grammar" without a trained head)."""
        return self.proposer.drafter

    @property
    def head_drafter(self) -> Optional[HeadDrafter]:
        return self.proposer.head

    @property
    def step_graphs(self):
        return self.runner.graphs

    @step_graphs.setter
    def step_graphs(self, graphs) -> None:
        self.runner.graphs = graphs

    # ---- public API (any thread) ------------------------------------------------------------
    def submit(self, request: Request, callback: Optional[Callback] = None) -> int:
        """Validate and queue a request; returns its sequence id. Raises InvalidRequestError,
        QueueFullError or EngineDeadError; never blocks on generation."""
        seq = self._make_sequence(request, callback or (lambda out: None))
        with self._cv:
            if self._dead is not None or not self._thread.is_alive():
                raise EngineDeadError(f"the engine has stopped: {self._dead!r}")
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
        return {"active_slots": self.scheduler.num_active,
                "queue_depth": self.scheduler.num_waiting + self._pending_submits,
                "steps": self.num_steps, "alive": int(self.is_alive())}

    def is_alive(self) -> bool:
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

    # ---- validation -------------------------------------------------------------------------
    def _make_sequence(self, request: Request, callback: Callback) -> Sequence:
        cfg = self.config
        if request.prompt_ids is not None:
            ids = [int(t) for t in request.prompt_ids]
            bad = [t for t in ids if not 0 <= t < self.runner.vocab_size]
            if bad:
                raise InvalidRequestError(f"input token ids out of range [0, {self.runner.vocab_size}): {bad[:5]}")
        elif request.prompt is not None:
            ids = self.tokenizer.encode(request.prompt)
        else:
            raise InvalidRequestError("a request needs a prompt (text_input) or input_ids")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) >= cfg.max_seq_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; max_seq_len is {cfg.max_seq_len} "
                f"(the prompt must leave room for at least one generated token)")
        p = request.params
        p.validate(cfg.max_tokens_limit)
        p.normalize(self.runner.vocab_size)
        k = request.num_draft_tokens
        if k is not None and not 0 <= k <= cfg.num_draft_tokens:
            raise InvalidRequestError(f"num_draft_tokens must be in [0, {cfg.num_draft_tokens}] "
                                      f"(the configured maximum), got {k}")
        if p.end_id is not None and not 0 <= p.end_id < self.runner.vocab_size:
            raise InvalidRequestError(f"end_id {p.end_id} is outside the vocabulary")
        if any(not 0 <= t < self.runner.vocab_size for word in p.stop_token_seqs for t in word):
            raise InvalidRequestError(f"stop token sequences hold ids outside [0, {self.runner.vocab_size})")
        timeout = request.timeout_s if request.timeout_s is not None else cfg.request_timeout_s
        if not (timeout >= 0 and math.isfinite(timeout)):
            raise InvalidRequestError(f"timeout_s must be a finite number >= 0 (0 = none), got {timeout}")
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= {p.end_id} if p.end_id is not None else set(self.eos_token_ids)
        seq = Sequence(
            seq_id=next(self._ids), prompt_ids=ids, params=p,
            seed=p.seed if p.seed is not None else random.getrandbits(64), callback=callback,
            stop_ids=frozenset(stop_ids), guided=request.guided,
            num_draft_tokens=cfg.num_draft_tokens if k is None else k, request_id=request.request_id,
            fault=faults.parse(request.fault))
        if timeout > 0:
            seq.deadline = seq.arrival + timeout
        seq.detok = IncrementalDetokenizer(self.tokenizer)
        if request.guided is not None:  # a malformed guide raises here; compile errors come later
            seq.compile = self.compiler.submit(request.guided)
        return seq

    # ---- loop thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._stopping or self.scheduler.has_work()):
                        self._cv.wait()
                    inbox, self._inbox = self._inbox, []
                    self._pending_submits -= sum(1 for kind, _ in inbox if kind == "submit")
                    stopping, drain = self._stopping, self._drain
                self._apply(inbox)
                self._expire()
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
        message = f"the engine stopped ({type(exc).__name__}; see the server log); the model must be reloaded"
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
                if item.fault is not None and item.fault.kind == "crash_engine":
                    raise faults.InjectedFault("injected engine crash")
            elif kind == "cancel":
                seq = self._seqs.get(item)  # type: ignore[arg-type]
                if seq is not None:
                    seq.cancelled = True
                    self._finish(seq, "cancelled")

    def step(self) -> bool:
        """One engine iteration: admit, prefill chunks, one batched decode, emit events.
        Returns False when there was nothing to run (e.g. waiting on grammar compiles)."""
        self._poll_compiles()
        plan: StepPlan = self.scheduler.schedule(ready=lambda seq: seq.compile is None)
        if plan.empty:
            return False
        self.num_steps += 1
        touched: list[Sequence] = []
        for chunk in plan.prefills:
            seq = chunk.seq
            tok = self._guarded(seq, lambda: self._prefill(chunk))
            if seq.status is Status.FINISHED:
                continue
            seq.num_cached = chunk.end
            if tok is not None:
                seq.status = Status.DECODE
                self._guarded(seq, lambda: self._append(seq, [tok]))
                touched.append(seq)
        if plan.decodes:
            try:
                results = self._decode(plan.decodes)
            except Exception as exc:
                log.exception("decode step failed")
                self._recover(plan.decodes, exc)
                results = []  # the survivors retry at the next step
            for seq, (toks, drafted, accepted) in zip(plan.decodes, results):
                seq.num_cached = seq.num_tokens + accepted  # the last token and the accepted drafts
                seq.num_draft += drafted
                seq.num_accepted += accepted
                self._guarded(seq, lambda: self._append(seq, toks))
                touched.append(seq)
        for seq in touched:
            if seq.status is not Status.FINISHED:
                self._emit(seq, finished=False)
        return True

    def _decode(self, seqs: list[Sequence]) -> list[tuple[list[int], int, int]]:
        """One decode step for every decoding sequence: speculative where drafts exist.
        Returns (tokens to append, drafts verified, drafts accepted) per sequence."""
        t0 = time.perf_counter()
        out = self.runner.step(seqs, self.proposer.plan(seqs))
        self.proposer.record(seqs, out, time.perf_counter() - t0)
        return out

    def _poll_compiles(self) -> None:
        """Move finished grammar compiles onto their sequences; a failed one fails its request."""
        for seq in [q for q in self.scheduler.waiting if q.compile is not None]:
            handle = seq.compile
            if not (handle.ready() or handle.timed_out()):
                continue
            if seq.fault is not None and seq.fault.kind == "compile_delay" and \
                    time.monotonic() < seq.arrival + seq.fault.seconds:
                continue
            try:
                seq.grammar = handle.result(timeout=0)
                seq.compile = None
            except InvalidRequestError as exc:
                self._finish(seq, "error", str(exc), "INVALID_ARG")
            except Exception as exc:
                log.error("grammar compile of request %s failed: %r", seq.seq_id, exc)
                self._finish(seq, "error", f"the grammar compile failed ({type(exc).__name__}; "
                                           f"the server log has the details)", "INTERNAL")

    def _prefill(self, chunk: PrefillChunk) -> Optional[int]:
        """One prompt chunk; the first one binds the slot (sampling rows, grammar matcher)."""
        seq = chunk.seq
        if chunk.start == 0:
            for owner in self.slot_state:
                owner.admit(seq.slot, seq)
        if seq.fault is not None and seq.fault.kind == "prefill_delay":
            time.sleep(seq.fault.seconds)
        return self.runner.prefill(chunk)

    def _guarded_violation(self, slot: int) -> Optional[str]:
        """A best-effort guide's value-check verdict for an error message (None when unknown)."""
        try:
            return self.guided.violation(slot)
        except Exception:  # noqa: BLE001 - a broken matcher: the plain message will do
            return None

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

    # ---- per-request bookkeeping -----------------------------------------------------------
    def _append(self, seq: Sequence, tokens: list[int]) -> None:
        """Append accepted tokens up to the first finish condition; detokenize; check stop strings."""
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
            seq.first_token_time_ns = time.time_ns()
        seq.last_token_time_ns = time.time_ns()
        lps, tops, rows = seq.step_logprobs, seq.step_top_logprobs, seq.step_logits  # aligned with tokens
        seq.step_logprobs = seq.step_top_logprobs = seq.step_logits = None
        reason = None
        new: list[int] = []
        guided = seq.grammar is not None
        if any(t < 0 for t in tokens):  # the runner's mark for non-finite logits in this row
            self._finish(seq, "error", "the model produced non-finite logits (NaN/inf) for this request")
            return
        for t in tokens:
            if guided and not self.guided.advance(seq.slot, t):
                why = self._guarded_violation(seq.slot)
                self._finish(seq, "error", f"the output violates the JSON schema: {why}" if why else
                             f"token {t} violates the grammar (its mask allowed no token outside bad_words/end_id?)",
                             "INTERNAL")
                return
            if lps is not None:
                seq.logprobs.append(lps[len(new)])
            if tops is not None:
                seq.top_logprobs.append(tops[len(new)])
            if rows is not None:
                seq.logits_unsent.append(rows[len(new)])
            seq.output_ids.append(t)
            new.append(t)
            reason = self.scheduler.check_stop_token(seq)
            if guided and self.guided.is_terminated(seq.slot):
                reason = "stop"
            if len(seq.output_ids) >= seq.params.min_tokens and any(
                    seq.output_ids[-len(w):] == w for w in seq.params.stop_token_seqs):
                reason = "stop"  # TRT-LLM stop words: the tokens stay in the output
            if reason:
                break
        seq.pending_text += seq.detok.add(new)
        if self._cut_stop_string(seq, final=reason is not None):
            reason = "stop"
        if reason:
            self._finish(seq, reason)
        elif seq.fault is not None and seq.fault.kind == "matcher_error" and guided:
            self.guided.synchronize()
            self.guided.inner.matchers[seq.slot] = faults.FaultyMatcher()  # type: ignore[assignment]

    def _cut_stop_string(self, seq: Sequence, final: bool) -> bool:
        """Move pending text to emitted text, holding back a possible stop-string prefix.
        Returns True when a stop string was found (the text is cut right before it)."""
        if final:
            seq.pending_text += seq.detok.finish()
        stops = seq.params.stop
        if stops:
            hits = [i for i in (seq.pending_text.find(s) for s in stops) if i >= 0]
            if hits:
                seq.delta += seq.pending_text[: min(hits)]
                seq.text += seq.pending_text[: min(hits)]
                seq.pending_text = ""
                return True
            keep = 0 if final else max(len(s) for s in stops) - 1
            cut = max(len(seq.pending_text) - keep, 0)
        else:
            cut = len(seq.pending_text)
        seq.delta += seq.pending_text[:cut]
        seq.text += seq.pending_text[:cut]
        seq.pending_text = seq.pending_text[cut:]
        return False

    def _finish(self, seq: Sequence, reason: str, error: Optional[str] = None,
                error_code: Optional[str] = None) -> None:
        if seq.status is Status.FINISHED:
            return
        seq.stage = "compiling" if seq.compile is not None else STAGES[seq.status]
        if reason in ("cancelled", "error"):
            seq.pending_text = ""
        elif reason == "timeout":  # keep what was generated; flush the held-back text
            self._cut_stop_string(seq, final=True)
        if seq.compile is not None:
            seq.compile.cancel()
            seq.compile = None
        if seq.slot is not None:
            for owner in self.slot_state:
                owner.free(seq.slot)
        seq.error_code = error_code or ("INTERNAL" if reason == "error" else None)
        self.scheduler.finish(seq, reason, error)
        self._seqs.pop(seq.seq_id, None)
        self._emit(seq, finished=True)

    def _emit(self, seq: Sequence, finished: bool) -> None:
        delta, seq.delta = seq.delta, ""
        new_ids = seq.output_ids[seq.ids_sent:]
        if not finished and not delta and not new_ids:
            return
        p, sent = seq.params, seq.ids_sent
        context = None
        if seq.context_logits and sum(len(c) for c in seq.context_logits) == len(seq.prompt_ids):
            context = torch.cat(seq.context_logits).numpy()  # once, with the first event after prefill
            seq.context_logits = []
        gen_logits = None
        if p.return_generation_logits:
            rows, seq.logits_unsent = seq.logits_unsent, []
            gen_logits = (torch.stack(rows) if rows else torch.empty(0, self.runner.vocab_size)).numpy()
        blocks = self.runner.kv.blocks(seq.num_tokens) if seq.first_scheduled_time_ns else 0  # static slot: no reuse
        out = RequestOutput(
            seq_id=seq.seq_id, text=delta, token_ids=new_ids, finished=finished,
            finish_reason=seq.finish_reason if finished else None, error=seq.error,
            error_code=seq.error_code if finished else None, stage=seq.stage if finished else None,
            guide_notes=tuple(getattr(seq.grammar, "unenforced", ())) if finished else (),
            total_draft_tokens=seq.num_draft, total_accepted_draft_tokens=seq.num_accepted,
            num_input_tokens=len(seq.prompt_ids), num_output_tokens=len(seq.output_ids),
            first_token=seq.ids_sent == 0 and bool(new_ids),
            logprobs=seq.logprobs[sent:] if p.wants_logprobs else None,
            top_logprobs=seq.top_logprobs[sent:] if p.top_logprobs else None,
            cum_logprob=sum(seq.logprobs) if p.wants_logprobs else None,
            generation_logits=gen_logits, context_logits=context,
            arrival_time_ns=seq.arrival_time_ns, first_scheduled_time_ns=seq.first_scheduled_time_ns,
            first_token_time_ns=seq.first_token_time_ns, last_token_time_ns=seq.last_token_time_ns,
            kv_cache_alloc_new_blocks=blocks, kv_cache_reused_blocks=0, kv_cache_alloc_total_blocks=blocks,
            kv_cache_hit_rate=0.0)
        seq.ids_sent = len(seq.output_ids)
        try:
            seq.callback(out)
        except Exception:
            log.exception("callback of request %s raised; cancelling it", seq.seq_id)
            if not finished:
                seq.cancelled = True
                self._finish(seq, "cancelled")
