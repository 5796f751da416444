"""GuidedStepper: the step protocol the step body launches (the protocol is in guided/capturable.py).

The stepper owns where a step's grammar work runs and when others may read it: the stream its
callbacks are launched on, the device copies of the worker's staging, the mask event the forward
stream waits for and the commit event the host waits for. Its callbacks are a `GrammarWorker`'s
(guided/grammar_worker.py), which it owns.

NOTE: callbacks must not call CUDA APIs (see hostfunc); the host->device copies and events are
launched here, on the launching thread, never inside a callback.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import kernels
from ..cuda import hostfunc
from .decoder import _BITS, GuidedDecoder, mask_rows
from .grammar_worker import NO_LIMIT, NONE, GrammarWorker, GuidedStep


class GuidedStepper:
    """Launches a `GrammarWorker`'s callbacks on `stream` (the `configured` one when captured) for
    the step body (engine/step.py), stages their results to the device and hands the commit to the host
    (`take_committed`)."""

    def __init__(self, inner: GuidedDecoder, stream: hostfunc.HostStream, device: torch.device):
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.worker = GrammarWorker(inner, pin=self.on_cuda)
        self.configured = stream
        self.stream: hostfunc.HostStream = stream
        w, S = self.worker, inner.max_slots
        if self.on_cuda:
            self.bitmask_dev = torch.zeros_like(inner.bitmask, device=self.device)  # [rows, ceil(V/32)]
            self.token_mask_dev = torch.zeros(inner.num_rows, dtype=torch.int32, device=self.device)
            self.limit_dev = torch.full((S,), NO_LIMIT, dtype=torch.int32, device=self.device)
            self.prop_dev = torch.full((2, S), NONE, dtype=torch.int64, device=self.device)
            self._bits = _BITS.to(self.device)
        else:  # CPU: the "device" buffers are the host ones (read after the mask event)
            self.bitmask_dev, self.token_mask_dev = inner.bitmask, w.token_mask_host
            self.limit_dev, self.prop_dev, self._bits = w.limit_host, w.prop_host, _BITS
        self._mask_ev = stream.record()
        self._commit_ev = self._mask_ev
        self._commit_pending = False
        self._handoff: Optional[dict[int, int]] = None  # the waited commit's counts, not yet taken by the host
        self._handed: Optional[dict[int, int]] = None  # the worker's counts last handed over
        self.step: Optional[GuidedStep] = None  # the last step begun (its callbacks write its limits)

    @property
    def out_host(self) -> torch.Tensor:
        """[2 + K, max_slots] int64: the step copies its tokens here, the callbacks read them."""
        return self.worker.out_host

    def between_steps(self, fn: Callable, *args) -> None:
        """Run `fn(*args)` on the matchers between steps. CUDA: inline (every step's callbacks have
        run by then); CPU: on the configured stream (FIFO)."""
        (hostfunc.INLINE if self.on_cuda else self.configured).launch(self.worker.timed(fn), *args)

    # ---- one step -------------------------------------------------------------------------
    def select_stream(self, captured: bool) -> None:
        """Captured steps (CUDA graphs) use the configured stream; an uncaptured step on CUDA runs
        its callbacks inline (no host function pending behind a GIL-holding sync)."""
        self.stream = hostfunc.INLINE if self.on_cuda and not captured else self.configured

    def begin(self, step: GuidedStep) -> None:
        """Queue the step's snapshot (the next `launch_begin` fetches it). Its commit is awaited
        by the next `wait_commit`: a replayed graph calls no `launch_commit`, so the wait is for
        the step's end on the forward stream (the graph ends joined to its commit) unless an
        eager step's `launch_commit` records an event (CPU: always)."""
        self.worker.queue(step)
        self.step = step
        if self.on_cuda:
            self._commit_ev = None
            self._commit_pending = True

    def launch_begin(self) -> None:
        """After the forward's work so far: fetch the next snapshot, fill, stage."""
        self.stream.wait_for_forward()
        self.stream.launch(self.worker.fetch)
        self.stream.launch(self.worker.timed(self.worker.fill_step))
        self._stage()

    def launch_draft_advance(self, i: int) -> None:
        """After draft i was picked (and copied to out_host's drafts row i): feed it, fill row i + 1."""
        self.stream.wait_for_forward()
        self.stream.launch(self.worker.timed(self.worker.draft_advance), i)
        self._stage()

    def launch_draft_end(self) -> None:
        """After the last draft: publish limits, the drafts fed (or walk unmasked ones)."""
        self.stream.wait_for_forward()
        self.stream.launch(self.worker.timed(self.worker.draft_end))
        self._stage()

    def launch_commit(self) -> None:
        """After sampling (tokens in out_host): feed each guided row's emitted tokens."""
        self.stream.wait_for_forward()
        self.stream.launch(self.worker.timed(self.worker.commit))
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
        mask_rows(logits, self.bitmask_dev, self.token_mask_dev, rows, self.worker.inner.vocab_size, self._bits, d2t)

    def mask_tiles(self, rows: torch.Tensor, out_features: int) -> Optional[torch.Tensor]:
        """CPU, after the mask event: the LM head's output tiles that mask rows `rows` allow any token
        of (kernels.mask_tiles); None on CUDA or when a row has no mask."""
        if self.on_cuda:
            return None
        self._mask_ev.block_forward()
        return kernels.mask_tiles(self.bitmask_dev, self.token_mask_dev, rows, out_features)

    def proposals(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hybrid: (fixed [B], fallback [B]) device proposals for the next draft, after the mask event."""
        self._mask_ev.block_forward()
        return self.prop_dev[0, :B], self.prop_dev[1, :B]

    def step_done(self) -> None:
        """The step's device work was waited for: its commit has run."""
        self.wait_commit()
        self.stream.raise_pending()

    def limits(self) -> list[int]:
        """The last step's per-row draft limits (read after `step_done`)."""
        st = self.step
        return list(st.limit) if st is not None and st.limit else []

    def _stage(self) -> None:
        """Launch: pinned staging of token_mask / limits / proposals, then (CUDA) the host->device
        copies (on the grammar stream when captured; blocking when inline) and the mask event."""
        w = self.worker
        self.stream.launch(w.stage_host)
        if self.on_cuda:
            inline = self.stream is hostfunc.INLINE
            with torch.cuda.stream(torch.cuda.current_stream() if inline else self.stream.stream):
                for dev, host in ((self.bitmask_dev, w.inner.bitmask), (self.token_mask_dev, w.token_mask_host),
                                  (self.limit_dev, w.limit_host), (self.prop_dev, w.prop_host)):
                    dev.copy_(host, non_blocking=not inline)
        self._mask_ev = self.stream.record()

    # ---- the commit handoff to the host ----------------------------------------------------
    def wait_commit(self) -> None:
        """Wait for the last begun step's commit (no-op once waited)."""
        if self._commit_pending:
            if self._commit_ev is not None:
                self._commit_ev.synchronize()
            else:  # a replayed step: its graph ends joined to its commit
                torch.cuda.current_stream().synchronize()
                self.stream.raise_pending()
            self._commit_pending = False
            committed = self.worker.committed
            if committed is not self._handed:  # a commit ran since (a step that failed before it: none did)
                self._handoff = self._handed = committed

    def take_committed(self, wait: bool = True) -> Optional[dict[int, int]]:
        """Slot -> tokens the last commit fed, once per commit (None: nothing new). `wait`: wait
        for a pending commit first; else only a commit already waited for is handed over."""
        if wait:
            self.wait_commit()
        out, self._handoff = self._handoff, None
        return out

    def synchronize(self) -> None:
        """Wait for every launched callback and the last commit."""
        self.stream.synchronize()
        self.wait_commit()

    def close(self) -> None:
        self.configured.close()
