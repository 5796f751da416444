"""CapturableGuidedDecoder: the grammar's side of every step, as host functions on a stream.

One protocol for every step that masks logits; the step body (step.py) calls it the same way
whether it runs eagerly or is captured in a CUDA graph (TensorRT-LLM's CapturableGuidedDecoder):
  host            `begin(GuidedStep)` queues a snapshot: the only request state a callback reads;
  grammar stream  `launch_begin`: fetch the snapshot, fill row 0 (or walk host-known drafts read
                  from `out_host`), stage masks / limits / hybrid proposals, record the mask event;
                  `launch_draft_advance(i)`: feed draft i (from `out_host`), fill row i + 1,
                  propose for position i + 1; `launch_draft_end`: roll the drafts back, publish
                  the per-row limits; `launch_commit`: feed each row's emitted tokens;
  forward stream  `apply_rows` / `proposals` wait for the mask event, then read device copies.
Matchers are touched only by callbacks. The host's `advance(slot, t)` (the engine's append loop)
confirms a token that `commit` already fed; `is_terminated` reads the matcher after the commit event.

Streams: CPU runs the callbacks inline or on a worker thread (`hostfunc`, the race test mode);
CUDA runs them on a dedicated stream inside captured graphs, and inline in uncaptured steps (no
host function is ever pending behind a GIL-holding wait there).

NOTE: callbacks must not call CUDA APIs (see hostfunc); they read and write pinned host buffers
only. A callback writes `token_mask_host` / `limit_host` / `prop_host` before the copy that
follows it on the same stream; the forward stream reads the device copies after the mask event.
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..cuda import hostfunc
from ..step_layout import Drafting, StepOutputs
from .backend import CompiledGuide
from .decoder import _BITS, GuidedDecoder, mask_logits

NO_LIMIT = 1 << 30  # limit of a row the grammar does not cut
NONE = -1  # an empty proposal


@dataclass
class GuidedStep:
    """Host snapshot of one step. `drafting`: NONE (row 0 only), HOST (walk the `ks[b]` drafts
    staged in out_host's drafts rows), MODEL (drafts made in the step, masked one by one),
    UNMASKED (drafts made in the step without masks, walked after the last one)."""

    slots: list[int]  # [B] slot of each batch row
    guided: list[bool]  # [B] the row's slot has a matcher
    drafting: Drafting = Drafting.NONE
    ks: list[int] = field(default_factory=list)  # [B] drafts per row (host count or model budget)
    picker: Any = None  # hybrid: speculative.hybrid.HybridPicks (propose / picked)
    limit: list[int] = field(default_factory=list)  # [B] drafts the grammar accepts (NO_LIMIT: all)
    live: list[bool] = field(default_factory=list)  # [B] guided row still drafting
    drafted: list[int] = field(default_factory=list)  # [B] drafts fed to the matcher so far
    props: list[tuple[int, int]] = field(default_factory=list)  # [B] (fixed, fallback) for the next draft


class CapturableGuidedDecoder:
    """Wraps a GuidedDecoder (`inner`, the matchers and bitmask); its work runs on `stream`.

    `out_host` [2 + K, max_slots] int64 (pinned on CUDA), rows as step_layout.StepOutputs names
    them (accepted drafts, the next token, draft i), per batch row; the step copies its tokens
    there, callbacks read them."""

    def __init__(self, inner: GuidedDecoder, stream: hostfunc.HostStream, device: torch.device):
        self.inner = inner
        self.configured = stream
        self.stream: hostfunc.HostStream = stream
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        K, S = inner.max_draft_tokens, inner.max_slots
        pin = self.on_cuda
        self.token_mask_host = torch.zeros(inner.num_rows, dtype=torch.int32, pin_memory=pin)  # [rows]
        self.limit_host = torch.full((S,), NO_LIMIT, dtype=torch.int32, pin_memory=pin)  # [B]
        self.prop_host = torch.full((2, S), NONE, dtype=torch.int64, pin_memory=pin)  # [2, B] fixed, fallback
        self.out_host = torch.zeros(StepOutputs.rows(K), S, dtype=torch.int64, pin_memory=pin)
        self._out = StepOutputs(self.out_host.numpy())  # the callbacks' view (numpy: no torch dispatch)
        if self.on_cuda:
            self.bitmask_dev = torch.zeros_like(inner.bitmask, device=self.device)  # [rows, ceil(V/32)]
            self.token_mask_dev = torch.zeros(inner.num_rows, dtype=torch.int32, device=self.device)
            self.limit_dev = torch.full((S,), NO_LIMIT, dtype=torch.int32, device=self.device)
            self.prop_dev = torch.full((2, S), NONE, dtype=torch.int64, device=self.device)
            self._bits = _BITS.to(self.device)
        else:  # CPU: the "device" buffers are the host ones (read after the mask event)
            self.bitmask_dev, self.token_mask_dev = inner.bitmask, self.token_mask_host
            self.limit_dev, self.prop_dev, self._bits = self.limit_host, self.prop_host, _BITS
        self._pending: "queue.SimpleQueue[GuidedStep]" = queue.SimpleQueue()
        self._cur: Optional[GuidedStep] = None  # callback-owned: the step being worked on
        self._committed: dict[int, int] = {}  # callback-written: slot -> tokens the last commit fed
        self._confirm: dict[int, int] = {}  # host-owned after the commit event: of those, not yet confirmed
        self._guided_slots: set[int] = set()  # host view of which slots have matchers
        self._mask_ev = stream.record()
        self._commit_ev = self._mask_ev
        self._commit_pending = False
        self.step: Optional[GuidedStep] = None  # the last step begun (its callbacks write its limits)
        self.callback_s = 0.0  # time spent inside callbacks (CPU work the device may overlap)

    # ---- host API: slots ------------------------------------------------------------------
    @property
    def max_slots(self) -> int:
        return self.inner.max_slots

    @property
    def rows_per_slot(self) -> int:
        return self.inner.rows_per_slot

    def is_guided(self, slot: int) -> bool:
        return slot in self._guided_slots

    def admit(self, slot: int, compiled: Optional[CompiledGuide]) -> None:
        """A new sequence in the slot: its matcher (None: an unguided request)."""
        if compiled is not None:
            self._guided_slots.add(slot)
            self._between_steps().launch(self._timed(self.inner.add), slot, compiled)

    def free(self, slot: int) -> None:
        """The slot's sequence ended: drop its matcher (no-op for an unguided slot)."""
        if slot in self._guided_slots:
            self._guided_slots.discard(slot)
            self._confirm.pop(slot, None)
            self._between_steps().launch(self._timed(self.inner.remove), slot)

    def _between_steps(self) -> hostfunc.HostStream:
        """CUDA: inline (every step's callbacks have run by then); CPU: the configured stream (FIFO)."""
        return hostfunc.INLINE if self.on_cuda else self.configured

    def forced_tokens(self, slot: int, encode, k: int) -> list[int]:
        """The inner decoder's jump-forward tokens; call between steps (after the commit event)."""
        self._wait_commit()
        return self.inner.forced_tokens(slot, encode, k)

    # ---- host API: one step ---------------------------------------------------------------
    def select_stream(self, captured: bool) -> None:
        """Captured steps (CUDA graphs) use the configured stream; an uncaptured step on CUDA runs
        its callbacks inline (no host function pending behind a GIL-holding sync)."""
        self.stream = hostfunc.INLINE if self.on_cuda and not captured else self.configured

    def begin(self, step: GuidedStep) -> None:
        """Queue the step's snapshot (the next `launch_begin` fetches it). Its commit is awaited
        by the next `_wait_commit`: a replayed graph calls no `launch_commit`, so the wait is for
        the step's end on the forward stream (the graph ends joined to its commit) unless an
        eager step's `launch_commit` records an event (CPU: always)."""
        self._pending.put(step)
        self.step = step
        if self.on_cuda:
            self._commit_ev = None
            self._commit_pending = True

    def launch_begin(self) -> None:
        """After the forward's work so far: fetch the next snapshot, fill, stage."""
        self.stream.wait_for_forward()
        self.stream.launch(self._fetch)
        self.stream.launch(self._timed(self._fill_step))
        self._stage()

    def launch_draft_advance(self, i: int) -> None:
        """After draft i was picked (and copied to out_host's drafts row i): feed it, fill row i + 1."""
        self.stream.wait_for_forward()
        self.stream.launch(self._timed(self._draft_advance), i)
        self._stage()

    def launch_draft_end(self) -> None:
        """After the last draft: roll the drafts back (or walk unmasked ones), publish limits."""
        self.stream.wait_for_forward()
        self.stream.launch(self._timed(self._draft_end))
        self._stage()

    def launch_commit(self) -> None:
        """After sampling (tokens in out_host): feed each guided row's emitted tokens."""
        self.stream.wait_for_forward()
        self.stream.launch(self._timed(self._commit))
        # NOTE: an event recorded while capturing belongs to the graph: the host must not wait on
        # it (cudaErrorInvalidValue); a replay's commit is done when its forward stream is
        self._commit_ev = None if self.capturing() else self.stream.record()
        self._commit_pending = True

    def capturing(self) -> bool:
        """Whether the launches now go into a CUDA graph being captured."""
        return self.on_cuda and torch.cuda.is_current_stream_capturing()

    def join(self) -> None:
        """Forward stream waits for all grammar work so far (a captured step ends joined)."""
        self.stream.record().block_forward()

    def apply_rows(self, logits: torch.Tensor, rows: torch.Tensor, d2t: Optional[torch.Tensor] = None) -> None:
        """Mask logits [R, V'] with device mask-row indices rows [R] after the mask event; no host
        sync. `d2t` [V'] maps a drafter's pruned vocabulary to target ids."""
        self._mask_ev.block_forward()
        mask_logits(logits, self.bitmask_dev.index_select(0, rows), self.token_mask_dev.index_select(0, rows),
                    self.inner.vocab_size, self._bits, d2t)

    def proposals(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hybrid: (fixed [B], fallback [B]) device proposals for the next draft, after the mask event."""
        self._mask_ev.block_forward()
        return self.prop_dev[0, :B], self.prop_dev[1, :B]

    def step_done(self) -> None:
        """The step's device work was waited for: its commit has run."""
        self._wait_commit()
        self.stream.raise_pending()

    def limits(self) -> list[int]:
        """The last step's per-row draft limits (read after `step_done`)."""
        st = self.step
        return list(st.limit) if st is not None and st.limit else []

    # ---- host API: the engine's append loop and recovery ----------------------------------
    def advance(self, slot: int, token: int) -> bool:
        """Confirm that `commit` fed the slot's next emitted token, `token` (False: the grammar
        rejected it). Commit read the tokens from the same out_host rows the engine appends."""
        self._wait_commit()
        left = self._confirm.get(slot, 0)
        if left:
            self._confirm[slot] = left - 1
        return left > 0

    def is_terminated(self, slot: int) -> bool:
        """Terminated after the tokens confirmed so far (commit stops feeding at termination)."""
        self._wait_commit()
        return not self._confirm.get(slot, 0) and self.inner.is_terminated(slot)

    def violation(self, slot: int) -> Optional[str]:
        self.synchronize()
        return self.inner.violation(slot)

    def restore(self, slot: int, n_tokens: int) -> None:
        """Recovery after a failed step: the slot's matcher back to the state after its first
        `n_tokens` tokens (those the engine appended), whatever the step had fed since."""
        self.synchronize()
        self._confirm.pop(slot, None)
        self.inner.rollback(slot, self.inner.num_tokens(slot) - n_tokens)

    def synchronize(self) -> None:
        """Wait for every launched callback (tests, shutdown, reading matcher state)."""
        self.stream.synchronize()
        self._wait_commit()

    def num_tokens(self, slot: int) -> int:
        """Tokens the slot's matcher holds once every launched callback has run."""
        self.synchronize()
        return self.inner.num_tokens(slot)

    def check_fresh(self, slot: int, tokens: list[int]) -> Optional[str]:
        self.synchronize()
        return self.inner.check_fresh(slot, tokens)

    def close(self) -> None:
        self.configured.close()

    def _wait_commit(self) -> None:
        if self._commit_pending:
            if self._commit_ev is not None:
                self._commit_ev.synchronize()
            else:  # a replayed step: its graph ends joined to its commit
                torch.cuda.current_stream().synchronize()
                self.stream.raise_pending()
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
        for b in rows:
            g.clear_slot(st.slots[b])
        if st.drafting is Drafting.HOST:
            self._walk(st, rows)
        elif st.drafting is not Drafting.UNMASKED:
            g.fill([(st.slots[b], 0) for b in rows])
        st.live = [st.guided[b] and st.drafting is Drafting.MODEL and st.ks[b] > 0 and not g.is_terminated(st.slots[b])
                   for b in range(B)]
        st.drafted = [0] * B
        self._propose(st, 0)

    def _walk(self, st: GuidedStep, rows: list[int]) -> None:
        """Masks of rows 0..k for drafts known to the host (out_host's drafts); limit = drafts fed."""
        drafts = {st.slots[b]: self._out.drafts[: st.ks[b], b].tolist() for b in rows}
        fed = self.inner.fill_verify_rows(drafts)
        self._take_back(st, rows, [fed[st.slots[b]] for b in rows])

    def _draft_advance(self, i: int) -> None:
        st, g = self._cur, self.inner
        if st is None:
            return
        B = len(st.slots)
        toks = self._out.drafts[i, :B].tolist()
        fill = []
        for b in range(B):
            if st.picker is not None:
                st.picker.picked(b, toks[b])
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
        self._propose(st, i + 1)

    def _propose(self, st: GuidedStep, i: int) -> None:
        """Hybrid proposals for draft position i of each row still drafting (grammar-forced
        tokens from the matcher's state after the drafts so far)."""
        if st.picker is None:
            return
        st.props = [st.picker.propose(b, i, st.slots[b] if st.live[b] else None)
                    if i < st.ks[b] and (st.live[b] or not st.guided[b]) else (NONE, NONE)
                    for b in range(len(st.slots))]

    def _draft_end(self) -> None:
        st = self._cur
        if st is None:
            return
        rows = [b for b in range(len(st.slots)) if st.guided[b]]
        if st.drafting is Drafting.UNMASKED:
            self._walk(st, rows)
            return
        self._take_back(st, rows, [st.drafted[b] for b in rows])

    def _take_back(self, st: GuidedStep, rows: list[int], fed: list[int]) -> None:
        """The one rollback of a step: the fed[i] drafts the matcher of row rows[i] took while its
        masks were filled are taken back (the commit feeds what verification accepts), and that
        count is the row's limit (drafts past it are not verified)."""
        for b, n in zip(rows, fed):
            self.inner.rollback(st.slots[b], n)
            st.limit[b] = n

    def _stage(self) -> None:
        """Launch: pinned staging of token_mask / limits / proposals, then (CUDA) the host->device
        copies (on the grammar stream when captured; blocking when inline) and the mask event."""
        self.stream.launch(self._stage_host)
        if self.on_cuda:
            inline = self.stream is hostfunc.INLINE
            with torch.cuda.stream(torch.cuda.current_stream() if inline else self.stream.stream):
                for dev, host in ((self.bitmask_dev, self.inner.bitmask), (self.token_mask_dev, self.token_mask_host),
                                  (self.limit_dev, self.limit_host), (self.prop_dev, self.prop_host)):
                    dev.copy_(host, non_blocking=not inline)
        self._mask_ev = self.stream.record()

    def _stage_host(self) -> None:
        st = self._cur
        self.token_mask_host.numpy()[:] = self.inner.token_mask
        lim, prop = self.limit_host.numpy(), self.prop_host.numpy()
        lim[:] = NO_LIMIT
        prop[:] = NONE
        if st is not None and st.limit:
            lim[: len(st.limit)] = st.limit
        if st is not None and st.props:
            prop[:, : len(st.props)] = list(zip(*st.props))

    def _commit(self) -> None:
        st, g = self._cur, self.inner
        self._cur = None
        committed: dict[int, int] = {}
        if st is not None:
            out = StepOutputs(self._out.buf[:, : len(st.slots)].tolist())
            for b, s in enumerate(st.slots):
                if st.guided[b]:
                    a = out.accepted[b]
                    committed[s] = g.advance_many(s, [out.drafts[i][b] for i in range(a)] + [out.next[b]])
        self._committed = committed
