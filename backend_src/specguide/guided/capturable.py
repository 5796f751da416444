"""CapturableGuidedDecoder: the GuidedDecoder's grammar work as host functions on a grammar stream.

Protocol of one step (TensorRT-LLM's CapturableGuidedDecoder, blog 12):
  host:            `begin(GuidedStep)` puts a snapshot in a queue (the only request state a
                   callback ever reads) and launches the step's callbacks;
  grammar stream:  waits for the forward stream's work so far (the token event), runs
                   fetch + fill (+ per-draft advance/fill, rollback), copies the mask and the
                   per-row draft limits host->device, records the mask event;
  forward stream:  runs the forward, waits for the mask event, masks and samples, copies the
                   tokens device->host; the grammar stream's `commit` callback then feeds the
                   emitted tokens to the matchers.
Matchers are touched only by callbacks. The host's `advance(slot, t)` (the engine's append
loop) confirms a token that `commit` already fed, and `is_terminated` reads the matcher only
after the commit event. On CPU the stream is inline or a worker thread (`hostfunc`); on CUDA it
is a dedicated stream, and the same callbacks are captured in the step's CUDA graph.

NOTE: callbacks must not call CUDA APIs (see hostfunc); they read and write pinned host buffers
only. Stream ordering makes those buffers safe: a callback writes `token_mask_host` /
`limit_host` before the copy that follows it on the same stream, and the forward stream reads
the device copies only after waiting for the mask event.
"""
from __future__ import annotations

import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..cuda import hostfunc
from .backend import CompiledGuide
from .decoder import GuidedDecoder, Row, _BITS

NO_LIMIT = 1 << 30  # limit of a row the grammar does not cut


@dataclass
class GuidedStep:
    """Host snapshot of one step's grammar work, made when the batch is scheduled.

    Callbacks read the inputs and write the results; the host reads results only after the
    event that follows the writing callback (mask event: `limit`; commit event: committed tokens)."""

    slots: list[int]  # [B] slot of each batch row
    guided: list[bool]  # [B] the row's slot has a matcher
    drafts: Optional[list[list[int]]] = None  # host-known drafts (n-gram): masks walk them
    ks: Optional[list[int]] = None  # drafting inside the step (model drafter): budget per row
    limit: list[int] = field(default_factory=list)  # [B] drafts the grammar accepts (NO_LIMIT: all)
    live: list[bool] = field(default_factory=list)  # [B] still drafting (model drafter)
    drafted: list[int] = field(default_factory=list)  # [B] drafts fed to the matcher so far


class CapturableGuidedDecoder:
    """Wraps a GuidedDecoder; its grammar work runs as host functions on `stream`.

    `out_host` [2 + K, max_slots] int64 (pinned on CUDA): row 0 accepted drafts, row 1 the
    next token, row 2 + i draft i, per batch row; a captured step copies its tokens there and
    the callbacks read them (an eager step passes tokens as arguments instead)."""

    def __init__(self, inner: GuidedDecoder, stream: hostfunc.HostStream, device: torch.device):
        self.inner = inner
        self.stream = stream
        self.device = torch.device(device)
        self.on_cuda = stream.kind == "cuda"
        K, S = inner.max_draft_tokens, inner.max_slots
        pin = self.on_cuda
        self.token_mask_host = torch.zeros(inner.num_rows, dtype=torch.int32, pin_memory=pin)  # [rows]
        self.limit_host = torch.full((S,), NO_LIMIT, dtype=torch.int32, pin_memory=pin)  # [B]
        self.out_host = torch.zeros(2 + K, S, dtype=torch.int64, pin_memory=pin)
        if self.on_cuda:
            self.bitmask_dev = torch.zeros_like(inner.bitmask, device=self.device)  # [rows, ceil(V/32)]
            self.token_mask_dev = torch.zeros(inner.num_rows, dtype=torch.int32, device=self.device)
            self.limit_dev = torch.full((S,), NO_LIMIT, dtype=torch.int32, device=self.device)
            self._bits = _BITS.to(self.device)
        else:  # CPU: the "device" buffers are the host ones (read after the mask event)
            self.bitmask_dev, self.token_mask_dev, self.limit_dev = inner.bitmask, self.token_mask_host, self.limit_host
            self._bits = _BITS
        self._pending: "queue.SimpleQueue[GuidedStep]" = queue.SimpleQueue()
        self._cur: Optional[GuidedStep] = None  # callback-owned: the step being worked on
        self._committed: dict[int, deque[int]] = {}  # callback-written: slot -> tokens fed
        self._confirm: dict[int, deque[int]] = {}  # host-owned after the commit event
        self._guided_slots: set[int] = set()  # host view of which slots have matchers
        self._mask_ev = stream.record()
        self._commit_ev = self._mask_ev
        self._commit_pending = False
        self.step: Optional[GuidedStep] = None  # the open step (host side)
        self.callback_s = 0.0  # time spent inside callbacks (CPU work the GPU may overlap)

    # ---- host API: slots ------------------------------------------------------------------
    @property
    def max_slots(self) -> int:
        return self.inner.max_slots

    @property
    def rows_per_slot(self) -> int:
        return self.inner.rows_per_slot

    def forced_tokens(self, slot: int, encode, k: int) -> list[int]:
        """The inner decoder's jump-forward tokens; call between steps (after the commit event),
        when no callback of this slot is pending."""
        return self.inner.forced_tokens(slot, encode, k)

    def is_guided(self, slot: int) -> bool:
        return slot in self._guided_slots

    def add(self, slot: int, compiled: CompiledGuide) -> None:
        self._guided_slots.add(slot)
        self.stream.launch(self._timed(self.inner.add), slot, compiled)

    def remove(self, slot: int) -> None:
        self._guided_slots.discard(slot)
        self._confirm.pop(slot, None)
        self.stream.launch(self._timed(self.inner.remove), slot)

    # ---- host API: one step ---------------------------------------------------------------
    def begin(self, slots: Sequence[int], drafts: Optional[Sequence[Sequence[int]]] = None,
              ks: Optional[Sequence[int]] = None, launch: bool = True) -> GuidedStep:
        """Snapshot the step and (launch=True) launch fetch + fill; `launch=False` only queues it
        (a captured graph launches the callbacks itself)."""
        step = GuidedStep(slots=list(slots), guided=[self.is_guided(s) for s in slots],
                          drafts=None if drafts is None else [list(d) for d in drafts],
                          ks=None if ks is None else list(ks))
        self._pending.put(step)
        self.step = step
        if launch:
            self.launch_begin()
        return step

    def launch_begin(self) -> None:
        """Grammar stream: after the forward's work so far, fetch the next snapshot, fill, stage."""
        self.stream.wait_for_forward()
        self.stream.launch(self._fetch)
        self.stream.launch(self._timed(self._fill_step))
        self._stage()

    def launch_draft_advance(self, i: int, tokens: Optional[list[int]] = None) -> None:
        """After draft i was sampled: feed it, fill row i + 1 (tokens None: read out_host row 2 + i)."""
        self.stream.wait_for_forward()
        self.stream.launch(self._timed(self._draft_advance), i, tokens)
        self._stage()

    def launch_draft_end(self) -> None:
        """After the last draft: roll the drafts back, publish the per-row limits."""
        self.stream.launch(self._timed(self._draft_end))
        self._stage()

    def launch_commit(self, tokens: Optional[list[list[int]]] = None) -> None:
        """After sampling: feed each guided row's emitted tokens (None: read out_host)."""
        self.stream.wait_for_forward()
        self.stream.launch(self._timed(self._commit), tokens)
        self._commit_ev = self.stream.record()
        self._commit_pending = True
        self.step = None

    def join(self) -> None:
        """Forward stream waits for all grammar work so far (ends a captured step: no unjoined work)."""
        self._commit_ev.block_forward()

    def apply(self, logits: torch.Tensor, rows: Sequence[Row], d2t: Optional[torch.Tensor] = None) -> None:
        """Mask logits [R, V] with mask rows `rows` once the mask event is reached."""
        if not self.on_cuda or d2t is not None:
            self._mask_ev.synchronize()
            self.inner.apply(logits, rows, d2t)
            return
        idx = torch.tensor([self.inner.row(s, p) for s, p in rows], dtype=torch.int64, pin_memory=True)
        self.apply_rows(logits, idx.to(self.device, non_blocking=True))  # async: no GIL-held copy
        self._mask_ev.synchronize()  # NOTE: eager only: no pending callback behind a later GIL-held sync

    def apply_rows(self, logits: torch.Tensor, rows: torch.Tensor) -> None:
        """Capturable mask: logits [R, V] with device mask-row indices rows [R]; no host sync."""
        self._mask_ev.block_forward()
        R, V = logits.shape
        words = self.bitmask_dev.index_select(0, rows)  # [R, ceil(V/32)]
        banned = (words.unsqueeze(-1) & self._bits).eq(0).view(R, -1)[:, :V]  # [R, V]
        banned &= self.token_mask_dev.index_select(0, rows).bool()[:, None]
        logits.masked_fill_(banned, float("-inf"))

    def limits(self) -> list[int]:
        """The open step's per-row draft limits (host waits for the mask event)."""
        self._mask_ev.synchronize()
        assert self.step is not None and self.step.limit, "no step with limits"
        return list(self.step.limit)

    def graph_step_done(self) -> None:
        """A captured step was replayed and its stream synchronized: its commit has run."""
        self._commit_pending = False
        self._confirm = self._committed
        self.step = None

    # ---- host API: the engine's append loop -----------------------------------------------
    def advance(self, slot: int, token: int) -> bool:
        """Confirm that `commit` fed `token` next to the slot's matcher (False: it was rejected)."""
        self._wait_commit()
        dq = self._confirm.get(slot)
        if dq and dq[0] == int(token):
            dq.popleft()
            return True
        return False

    def violation(self, slot: int) -> Optional[str]:
        """The inner decoder's value-check verdict (waits for pending callbacks)."""
        self.synchronize()
        return self.inner.violation(slot)

    def is_terminated(self, slot: int) -> bool:
        """Terminated after the tokens confirmed so far (commit stops feeding at termination)."""
        self._wait_commit()
        return not self._confirm.get(slot) and self.inner.is_terminated(slot)

    def synchronize(self) -> None:
        """Wait for every launched callback (tests, shutdown, reading matcher state)."""
        self.stream.synchronize()
        self._wait_commit()

    def wait_commit(self) -> None:
        """Host waits for the last commit (eager CUDA steps: nothing stays pending behind later syncs)."""
        self._wait_commit()

    @property
    def history(self) -> list[list[int]]:
        self.synchronize()
        return self.inner.history

    def check_fresh(self, slot: int) -> Optional[str]:
        self.synchronize()
        return self.inner.check_fresh(slot)

    def close(self) -> None:
        self.stream.close()

    def _wait_commit(self) -> None:
        if self._commit_pending:
            self._commit_ev.synchronize()
            self._commit_pending = False
            self._confirm = self._committed

    # ---- callbacks (grammar stream; read only the snapshot and pinned buffers) -------------
    def _timed(self, fn):
        def run(*args):
            t0 = time.perf_counter()
            try:
                fn(*args)
            finally:
                self.callback_s += time.perf_counter() - t0
        run.__qualname__ = getattr(fn, "__qualname__", "callback")
        return run

    def _fetch(self) -> None:
        try:
            self._cur = self._pending.get_nowait()
        except queue.Empty:  # CUDA-graph warm-up runs the step with no snapshot queued
            self._cur = None

    def _fill_step(self) -> None:
        st, g = self._cur, self.inner
        if st is None:
            return
        B = len(st.slots)
        st.limit = [NO_LIMIT] * B
        rows = [b for b in range(B) if st.guided[b]]
        if st.drafts is not None:  # verification of known drafts: rows 0..len(d) walk them
            fed = g.fill_verify_rows({st.slots[b]: st.drafts[b] for b in rows})
            for b in rows:
                g.rollback(st.slots[b], fed[st.slots[b]])
                st.limit[b] = fed[st.slots[b]]
            return
        for b in rows:
            g.clear_slot(st.slots[b])
        g.fill([(st.slots[b], 0) for b in rows])
        if st.ks is not None:
            st.live = [st.guided[b] and st.ks[b] > 0 and not g.is_terminated(st.slots[b]) for b in range(B)]
            st.drafted = [0] * B

    def _draft_advance(self, i: int, tokens: Optional[list[int]]) -> None:
        st, g = self._cur, self.inner
        if st is None or st.ks is None:
            return
        B = len(st.slots)
        toks = tokens if tokens is not None else self.out_host.numpy()[2 + i, :B].tolist()
        fill = []
        for b in range(B):
            if not st.live[b]:
                continue
            s = st.slots[b]
            if not g.advance(s, toks[b]):  # grammar dead end: stop drafting (not an error)
                st.live[b] = False
                continue
            st.drafted[b] += 1
            fill.append((s, st.drafted[b]))
            st.live[b] = st.drafted[b] < st.ks[b] and not g.is_terminated(s)
        g.fill(fill)  # the mask of the next position (terminated slots: unconstrained)

    def _draft_end(self) -> None:
        st, g = self._cur, self.inner
        if st is None or st.ks is None:
            return
        for b, s in enumerate(st.slots):
            if st.guided[b]:
                g.rollback(s, st.drafted[b])
                st.limit[b] = st.drafted[b]

    def _stage(self) -> None:
        """Launch: pinned staging of token_mask / limit, then (CUDA) the host->device copies and the mask event."""
        self.stream.launch(self._stage_host)
        if self.on_cuda:
            with torch.cuda.stream(self.stream.stream):
                self.bitmask_dev.copy_(self.inner.bitmask, non_blocking=True)
                self.token_mask_dev.copy_(self.token_mask_host, non_blocking=True)
                self.limit_dev.copy_(self.limit_host, non_blocking=True)
        self._mask_ev = self.stream.record()

    def _stage_host(self) -> None:
        st = self._cur
        self.token_mask_host.numpy()[:] = self.inner.token_mask
        lim = self.limit_host.numpy()
        lim[:] = NO_LIMIT
        if st is not None and st.limit:
            lim[: len(st.limit)] = st.limit

    def _commit(self, tokens: Optional[list[list[int]]]) -> None:
        st, g = self._cur, self.inner
        self._cur = None
        committed: dict[int, deque[int]] = {}
        if st is not None:
            B = len(st.slots)
            if tokens is None:
                out = self.out_host.numpy()[:, :B].tolist()  # numpy: no torch dispatch in a callback
                tokens = []
                for b in range(B):
                    a = out[0][b]
                    d = st.drafts[b][:a] if st.drafts is not None else [out[2 + i][b] for i in range(a)]
                    tokens.append(d + [out[1][b]])
            for b, s in enumerate(st.slots):
                if st.guided[b]:
                    n = g.advance_many(s, tokens[b])
                    committed[s] = deque(int(t) for t in tokens[b][:n])
        self._committed = committed
