"""The grammar's side of every step, as host functions on a stream: three objects, one per role.

  `CapturableGuidedDecoder` (here)        the host's per-slot facade: admit / free, the engine's
                                          append loop (`advance`, `is_terminated`), recovery;
  `GuidedStepper` (guided/stepper.py)     the step protocol the step body launches: streams,
                                          device copies, the mask and commit events;
  `GrammarWorker` (guided/grammar_worker.py)  the callbacks on the grammar stream and the state
                                          they own: the snapshot, pinned buffers, commit counts.

One protocol for every step that masks logits; the step body (engine/step.py) calls the stepper the same
way whether it runs eagerly or is captured in a CUDA graph (TensorRT-LLM's CapturableGuidedDecoder):
  host            `begin(GuidedStep)` queues a snapshot: the only request state a callback reads;
  grammar stream  `launch_begin`: fetch the snapshot, fill row 0 (or walk host-known drafts read
                  from `out_host`), stage masks / limits / hybrid proposals, record the mask event;
                  `launch_draft_advance(i)`: feed draft i (from `out_host`), fill row i + 1,
                  propose for position i + 1; `launch_draft_end`: publish the per-row limits
                  (the drafts fed); `launch_commit`: take back the drafts verification rejected,
                  feed each row's next token;
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

from typing import Optional

import torch

from ..cuda import hostfunc
from .backend import CompiledGuide
from .decoder import GuidedDecoder
from .stepper import GuidedStepper


class CapturableGuidedDecoder:
    """The host's view of a GuidedDecoder (`inner`, the matchers and bitmask): which slots are
    guided, and of the tokens the last commit fed, those the engine has not confirmed yet. Its
    step runs on `stepper` (a `GuidedStepper` on `stream`), which hands each commit over
    (`take_committed`)."""

    def __init__(self, inner: GuidedDecoder, stream: hostfunc.HostStream, device: torch.device):
        self.inner = inner
        self.stepper = GuidedStepper(inner, stream, device)
        self._confirm: dict[int, int] = {}  # slot -> tokens the last commit fed, not yet confirmed
        self._guided_slots: set[int] = set()  # which slots have matchers

    # ---- slots ----------------------------------------------------------------------------
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
            self.stepper.between_steps(self.inner.add, slot, compiled)

    def free(self, slot: int) -> None:
        """The slot's sequence ended: drop its matcher (no-op for an unguided slot)."""
        if slot in self._guided_slots:
            self._guided_slots.discard(slot)
            self._take(wait=False)
            self._confirm.pop(slot, None)
            self.stepper.between_steps(self.inner.remove, slot)

    def forced_tokens(self, slot: int, encode, k: int) -> list[int]:
        """The inner decoder's jump-forward tokens; call between steps (after the commit event)."""
        self._take()
        return self.inner.forced_tokens(slot, encode, k)

    # ---- the engine's append loop and recovery --------------------------------------------
    def advance(self, slot: int, token: int) -> bool:
        """Confirm that `commit` fed the slot's next emitted token, `token` (False: the grammar
        rejected it). Commit read the tokens from the same out_host rows the engine appends."""
        self._take()
        left = self._confirm.get(slot, 0)
        if left:
            self._confirm[slot] = left - 1
        return left > 0

    def is_terminated(self, slot: int) -> bool:
        """Terminated after the tokens confirmed so far (commit stops feeding at termination)."""
        self._take()
        return not self._confirm.get(slot, 0) and self.inner.is_terminated(slot)

    def violation(self, slot: int) -> Optional[str]:
        self.synchronize()
        return self.inner.violation(slot)

    def viable_now(self, slot: int, skip: frozenset[int] = frozenset()) -> Optional[int]:
        """GuidedDecoder.viable_now once every launched callback has run (after a rejected token:
        from the state before it)."""
        self.synchronize()
        return self.inner.viable_now(slot, skip)

    def restore(self, slot: int, n_tokens: int) -> None:
        """Recovery after a failed step: the slot's matcher back to the state after its first
        `n_tokens` tokens (those the engine appended), whatever the step had fed since."""
        self.synchronize()
        self._confirm.pop(slot, None)
        self.inner.rollback(slot, self.inner.num_tokens(slot) - n_tokens)

    def synchronize(self) -> None:
        """Wait for every launched callback (tests, shutdown, reading matcher state)."""
        self.stepper.synchronize()
        self._take(wait=False)

    def num_tokens(self, slot: int) -> int:
        """Tokens the slot's matcher holds once every launched callback has run."""
        self.synchronize()
        return self.inner.num_tokens(slot)

    def check_fresh(self, slot: int, tokens: list[int]) -> Optional[str]:
        self.synchronize()
        return self.inner.check_fresh(slot, tokens)

    def close(self) -> None:
        self.stepper.close()

    def _take(self, wait: bool = True) -> None:
        """The last commit's counts, once the stepper hands them over (`wait`: after its event)."""
        committed = self.stepper.take_committed(wait)
        if committed is not None:
            self._confirm = dict(committed)  # the host's own copy
