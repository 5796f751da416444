"""GrammarWorker: what runs on the grammar stream (the protocol is in guided/capturable.py).

The worker owns the state only its callbacks write: the queue of step snapshots and the step
being worked on, the pinned staging buffers and the tokens the last commit fed. `GuidedStepper`
(guided/stepper.py) launches the callbacks in stream order; nothing else calls them.

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

from ..engine.step_layout import Drafting, StepOutputs
from .decoder import GuidedDecoder

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
    fed: list[int] = field(default_factory=list)  # [B] drafts the matcher holds from drafting until the commit
    live: list[bool] = field(default_factory=list)  # [B] guided row still drafting
    drafted: list[int] = field(default_factory=list)  # [B] drafts fed to the matcher so far
    props: list[tuple[int, int]] = field(default_factory=list)  # [B] (fixed, fallback) for the next draft


class GrammarWorker:
    """The grammar stream's callbacks over a GuidedDecoder (`inner`, the matchers and bitmask) and
    the state they own: the snapshot queue, `_cur` (the step being worked on), the pinned staging
    (`token_mask_host`, `limit_host`, `prop_host`; the bitmask is `inner.bitmask`) and
    `committed` (slot -> tokens the last commit fed; the host reads it after the commit event).

    `out_host` [2 + K, max_slots] int64 (pinned on CUDA), rows as step_layout.StepOutputs names
    them (accepted drafts, the next token, draft i), per batch row; the step copies its tokens
    there, callbacks read them."""

    def __init__(self, inner: GuidedDecoder, pin: bool):
        self.inner = inner
        K, S = inner.max_draft_tokens, inner.max_slots
        self.token_mask_host = torch.zeros(inner.num_rows, dtype=torch.int32, pin_memory=pin)  # [rows]
        self.limit_host = torch.full((S,), NO_LIMIT, dtype=torch.int32, pin_memory=pin)  # [B]
        self.prop_host = torch.full((2, S), NONE, dtype=torch.int64, pin_memory=pin)  # [2, B] fixed, fallback
        self.out_host = torch.zeros(StepOutputs.rows(K), S, dtype=torch.int64, pin_memory=pin)
        self._out = StepOutputs(self.out_host.numpy())  # the callbacks' view (numpy: no torch dispatch)
        self._pending: "queue.SimpleQueue[GuidedStep]" = queue.SimpleQueue()
        self._cur: Optional[GuidedStep] = None  # the step being worked on
        self.committed: dict[int, int] = {}  # slot -> tokens the last commit fed
        self.callback_s = 0.0  # time spent inside callbacks (CPU work the device may overlap)

    # ---- host side ------------------------------------------------------------------------
    def queue(self, step: GuidedStep) -> None:
        """Queue a step's snapshot (the host's only write; the next `fetch` takes it)."""
        self._pending.put(step)

    def timed(self, fn):
        """`fn` as a callback that adds its run time to `callback_s`."""
        def run(*args):
            t0 = time.perf_counter()
            try:
                fn(*args)
            finally:
                self.callback_s += time.perf_counter() - t0
        run.__qualname__ = getattr(fn, "__qualname__", "callback")
        return run

    # ---- callbacks (grammar stream; read only the snapshot and pinned buffers) -------------
    def fetch(self) -> None:
        try:
            self._cur = self._pending.get_nowait()
        except queue.Empty:  # CUDA-graph warm-up runs the step with no snapshot queued
            self._cur = None

    def fill_step(self) -> None:
        st, g = self._cur, self.inner
        if st is None:
            return
        B = len(st.slots)
        st.limit = [NO_LIMIT] * B
        st.fed = [0] * B
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
        self._keep(st, rows, [fed[st.slots[b]] for b in rows])

    def draft_advance(self, i: int) -> None:
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

    def draft_end(self) -> None:
        st = self._cur
        if st is None:
            return
        rows = [b for b in range(len(st.slots)) if st.guided[b]]
        if st.drafting is Drafting.UNMASKED:
            self._walk(st, rows)
            return
        self._keep(st, rows, [st.drafted[b] for b in rows])

    def _keep(self, st: GuidedStep, rows: list[int], fed: list[int]) -> None:
        """The fed[i] drafts the matcher of row rows[i] took while its masks were filled stay fed
        (the commit takes back those verification rejects), and that count is the row's limit
        (drafts past it are not verified)."""
        for b, n in zip(rows, fed):
            st.fed[b] = st.limit[b] = n

    def stage_host(self) -> None:
        """The pinned staging of token_mask / limits / proposals (the stepper copies it on)."""
        st = self._cur
        self.token_mask_host.numpy()[:] = self.inner.token_mask
        lim, prop = self.limit_host.numpy(), self.prop_host.numpy()
        lim[:] = NO_LIMIT
        prop[:] = NONE
        if st is not None and st.limit:
            lim[: len(st.limit)] = st.limit
        if st is not None and st.props:
            prop[:, : len(st.props)] = list(zip(*st.props))

    def commit(self) -> None:
        st, g = self._cur, self.inner
        self._cur = None
        committed: dict[int, int] = {}
        if st is not None:
            out = StepOutputs(self._out.buf[:, : len(st.slots)].tolist())
            for b, s in enumerate(st.slots):
                if st.guided[b]:  # the step's one rollback: the drafts verification rejected
                    a = out.accepted[b]
                    keep = min(a, st.fed[b])
                    g.rollback(s, st.fed[b] - keep)
                    committed[s] = keep + g.advance_many(s, [out.drafts[i][b] for i in range(keep, a)] + [out.next[b]])
        self.committed = committed
