"""StepGraphs: the step (engine/step.py's `StepCore.body`) as one CUDA-graph replay per `StepKey`.

Graphs are captured lazily on first use (warm-up runs first, on all-padding inputs) into one
shared memory pool. With guided rows or the hybrid drafter, the grammar callbacks (fetch, fill,
per-draft advance and proposals, rollback, commit) and their host->device copies are captured on
the grammar stream, so the CPU grammar work overlaps the GPU forwards on every replay.
On CPU (tests) `replay` runs the body eagerly on the same padded, bucketed inputs: a dry run of
the captured code.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..engine.scheduler import Sequence
from . import hostfunc

log = logging.getLogger("specguide.graphs")
WARMUP_RUNS = 2
MIN_LENGTH = 64  # smallest key-length bucket


def batch_buckets(max_slots: int) -> list[int]:
    """1, 2, 4, 8, 16, ... capped at max_slots (the last bucket is max_slots itself)."""
    out, b = [], 1
    while b < max_slots:
        out.append(b)
        b *= 2
    return out + [max_slots]


@dataclass
class StepStats:
    steps: int = 0
    captures: int = 0
    capture_s: float = 0.0
    wait_s: float = 0.0  # host waiting for replayed steps


@dataclass
class _EagerStep:
    """CPU dry run: `replay` runs the step body eagerly."""

    body: Callable[[], None]

    def replay(self) -> None:
        self.body()


class StepGraphs:
    """Per-key CUDA graphs of a StepCore (any object with `body(key)`, `stage`, `kv`, `model`)."""

    def __init__(self, core: Any, capture: bool = True):
        self.core = core
        self.buckets = batch_buckets(core.kv.max_slots)
        self.capture = capture and core.kv.k.device.type == "cuda"  # False: the CPU dry run
        self.graphs: dict[Any, Any] = {}
        self.handles: dict[Any, set[int]] = {}  # captured host-function user data per graph
        self.pool = None
        self.stats = StepStats()

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def length(self, seqs: list[Sequence], T: int) -> int:
        """Power-of-two key-length bucket covering every position of the step."""
        need = max(s.num_tokens for s in seqs) + T
        n = MIN_LENGTH
        while n < need:
            n *= 2
        return min(n, self.core.kv.max_seq_len)

    def ensure(self, key: Any, plan: Any) -> None:
        """Capture the key's graph unless it exists (before the step's snapshot is queued:
        warm-up runs find none)."""
        if key not in self.graphs:
            self._capture(key, plan)

    def replay(self, key: Any) -> None:
        self.graphs[key].replay()
        self.stats.steps += 1

    def _capture(self, key: Any, plan: Any) -> None:
        """Warm up and capture `body(key)` on all-padding inputs (the plan gives its drafter)."""
        core, t0 = self.core, time.perf_counter()
        if not self.capture:
            self.graphs[key] = _EagerStep(lambda: core.body(key))
            return
        if plan.drafter is not None:
            plan.drafter.prepare([], key)
        core.stage([], plan, key)  # every row padding: warm-up writes only dead K/V
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):  # lazy init, cuBLAS workspaces, allocator state
                core.body(key)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        hostfunc.raise_pending()
        before = hostfunc.registered_keys()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            core.body(key)
        torch.cuda.synchronize()
        if self.pool is None:
            self.pool = graph.pool()
        self.handles[key] = hostfunc.registered_keys() - before
        self.graphs[key] = graph
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - t0
        log.info("captured %s in %.2fs", key, time.perf_counter() - t0)

    def close(self) -> None:
        """Drop the graphs, then free their host functions' user data."""
        if self.capture:
            torch.cuda.synchronize()
        self.graphs.clear()
        for keys in self.handles.values():
            for k in keys:
                hostfunc.free_host_func_user_data(k)
        self.handles.clear()
