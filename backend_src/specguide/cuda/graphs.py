"""StepGraphs: the whole decode / speculative step as one CUDA-graph replay.

A step is [K early-exit draft forwards, each masked by its grammar row] + one forward over
[last, d_0..d_{T-2}] (T = 1: plain decode) + grammar masks + greedy acceptance or rejection
sampling. With guided rows, the CapturableGuidedDecoder's callbacks (fetch, fill, per-draft
advance, rollback, commit) and its host->device mask copies are captured on its grammar stream,
so the CPU grammar work overlaps the GPU forwards on every replay.

Graphs are keyed by `GraphKey` and captured lazily on first use (warm-up runs first) into one
shared memory pool. Inputs and outputs live in static buffers indexed by batch row. Padding rows
(batch < bucket) read slot 0 and write K/V only at positions >= max_seq_len (the cache's spare,
dead positions): no-ops. Prefill, penalties, bad words, min_tokens and the draft-model drafter
stay eager (`run` returns None).

NOTE: nothing in `_body` may make the host wait on the GPU: no .item() / .tolist() / .nonzero(),
no data-dependent shapes, no torch.compile. A captured host function takes the GIL; a host
thread that holds the GIL while waiting on the GPU would deadlock it (pytorch 163061 / 163062).
The host reads `out_host` only after `synchronize()` (which releases the GIL).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..config import EngineConfig
from ..guided.capturable import CapturableGuidedDecoder
from ..models.llama import AttnContext
from ..runner import Runner
from ..sampling import SamplingBatch, probabilities, sample
from ..scheduler import Sequence
from ..speculative import acceptance
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


@dataclass(frozen=True)
class GraphKey:
    batch: int  # batch bucket
    T: int  # positions per row: 1 = plain decode, else verification of T - 1 drafts
    drafting: str  # "none" | "host" (drafts given: n-gram) | "early_exit" (draft forwards in the graph)
    length: int  # keys attended (power-of-two bucket >= the longest row's last position + 1)
    greedy: bool  # every row greedy: argmax acceptance
    top_k_p: bool  # a sampled row uses top-k / top-p
    guided: bool  # grammar callbacks and masks in the graph


@dataclass
class StepStats:
    steps: int = 0
    host_s: float = 0.0  # host time in run() outside the wait for the GPU (exposed CPU time)
    wait_s: float = 0.0  # host waiting for the replayed step
    captures: int = 0
    capture_s: float = 0.0


class StepGraphs:
    """Per-key CUDA graphs of the step over the runner's model, KV cache and slot buffers."""

    def __init__(self, runner: Runner, drafter: str, propose: Callable[[Sequence, int], list[int]],
                 max_seq_len: int, mask_drafts: bool = True):
        self.runner, self.model, self.kv = runner, runner.model, runner.kv
        self.device = runner.device
        self.K = runner.K
        self.draft_layers = runner.draft_layers
        g = runner.guided
        self.guided: Optional[CapturableGuidedDecoder] = g if isinstance(g, CapturableGuidedDecoder) else None
        self.drafter, self.propose = drafter, propose
        self.mask_drafts = mask_drafts  # off: guided early-exit steps stay eager (the ablation)
        self.max_seq_len = max_seq_len  # padding rows write at positions >= this
        S = self.kv.k.shape[1]
        self.buckets = batch_buckets(S)
        self.rows_per_slot = self.K + 1
        # capture=False (CPU): `replay` runs the step body eagerly, a dry run of the same code for tests
        self.capture = self.device.type == "cuda"
        i64, dev, pin = torch.int64, self.device, self.capture
        W = max(self.K, 1)
        self.inp_host = torch.zeros(5, S, dtype=i64, pin_memory=pin)  # rows: last, pos0, slot, counter, num
        self.drafts_host = torch.zeros(S, W, dtype=i64, pin_memory=pin)  # [B, K] host-known drafts, 0-padded
        self.inp = torch.zeros(5, S, dtype=i64, device=dev)
        self.drafts = torch.zeros(S, W, dtype=i64, device=dev)
        self.out = torch.zeros(2 + self.K, S, dtype=i64, device=dev)  # accepted, next, draft 0..K-1
        self.out_host = (self.guided.out_host if self.guided is not None
                         else torch.zeros(2 + self.K, S, dtype=i64, pin_memory=pin))
        self.arange = torch.arange(self.K + 1, device=dev)
        self.kpos = torch.arange(self.kv.max_seq_len, device=dev)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.handles: dict[GraphKey, set[int]] = {}  # captured host-function user data per graph
        self.pool = None
        self.stats = StepStats()

    # ---- host side -----------------------------------------------------------------------
    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def eligible(self, seqs: list[Sequence]) -> bool:
        """Rows the graph handles: no penalties, bad words or pending min_tokens bans."""
        if len(seqs) > self.buckets[-1]:
            return False
        for s in seqs:
            p = s.params
            if p.penalized or p.bad_words_ids or len(s.output_ids) < p.min_tokens:
                return False
        return True

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], ks: list[int]) -> Optional[list[tuple[list[int], int, int]]]:
        """One step for `seqs` (sorted by slot) with draft budgets `ks`; per row (tokens to
        append, drafts proposed, drafts accepted), or None when the step must run eagerly."""
        r = self.runner
        guided = r.guided is not None and any(r.guided.is_guided(s.slot) for s in seqs)
        if not self.eligible(seqs) or (guided and self.guided is None):
            return None
        kmax = max(ks, default=0)
        if kmax > 0 and (self.drafter not in ("ngram", "early_exit")
                         or (self.drafter == "early_exit" and guided and not self.mask_drafts)):
            return None  # draft model (its own cache and catch-up), unmasked guided drafts: eager
        t0 = time.perf_counter()
        drafts = None
        if kmax > 0 and self.drafter == "ngram":
            drafts = [self.propose(s, k) for s, k in zip(seqs, ks)]
            kmax = max(len(d) for d in drafts)
            if kmax == 0:
                drafts = None
        drafting = "none" if kmax == 0 else ("host" if drafts is not None else "early_exit")
        T = kmax + 1
        flags = [r._slot_params[s.slot] for s in seqs]
        key = GraphKey(batch=self.bucket(len(seqs)), T=T, drafting=drafting, length=self._length(seqs, T),
                       greedy=all(g for g, _ in flags), top_k_p=any(f for g, f in flags if not g), guided=guided)
        graph = self.graphs.get(key) or self._capture(key)  # before the snapshot: warm-up finds none
        self._stage(seqs, ks, drafts, drafting)
        step = None
        if guided:
            assert self.guided is not None
            step = self.guided.begin([s.slot for s in seqs], drafts=drafts,
                                     ks=ks if drafting == "early_exit" else None, launch=False)
        graph.replay()
        t1 = time.perf_counter()
        if self.capture:
            torch.cuda.current_stream().synchronize()  # GIL released; the graph joined the grammar stream
        t2 = time.perf_counter()
        hostfunc.raise_pending()
        if self.guided is not None and guided:
            self.guided.graph_step_done()
        out = self.out_host.tolist()
        res = []
        for b, s in enumerate(seqs):
            a, nxt = out[0][b], out[1][b]
            if drafting == "host":
                d = drafts[b]
            elif drafting == "early_exit":
                n = min(ks[b], step.limit[b]) if step is not None else ks[b]
                d = [out[2 + i][b] for i in range(n)]
            else:
                d = []
            res.append((d[:a] + [nxt], len(d), a))
        self.stats.steps += 1
        self.stats.host_s += (t1 - t0) + (time.perf_counter() - t2)
        self.stats.wait_s += t2 - t1
        return res

    def _length(self, seqs: list[Sequence], T: int) -> int:
        need = max(s.num_tokens for s in seqs) + T
        n = MIN_LENGTH
        while n < need:
            n *= 2
        return min(n, self.kv.max_seq_len)

    def _stage(self, seqs: list[Sequence], ks: list[int], drafts: Optional[list[list[int]]], drafting: str) -> None:
        """Write the step's inputs to the pinned staging rows and copy them to the static buffers."""
        h, dh = self.inp_host.numpy(), self.drafts_host.numpy()
        h[:] = 0
        h[1, :] = self.max_seq_len  # padding rows: dead positions of slot 0
        dh[:] = 0
        for b, s in enumerate(seqs):
            h[:4, b] = (s.last_token, s.num_tokens - 1, s.slot, len(s.output_ids))
            if drafting == "host":
                h[4, b] = len(drafts[b])
                dh[b, : len(drafts[b])] = drafts[b]
            elif drafting == "early_exit":
                h[4, b] = ks[b]
        self.inp.copy_(self.inp_host, non_blocking=True)
        self.drafts.copy_(self.drafts_host, non_blocking=True)

    def _capture(self, key: GraphKey) -> "torch.cuda.CUDAGraph":
        t0 = time.perf_counter()
        if not self.capture:
            self.graphs[key] = _EagerStep(lambda: self._body(key))  # type: ignore[assignment]
            return self.graphs[key]
        self._stage([], [], None, "none")  # every row padding: warm-up writes only dead K/V
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):  # lazy init, cuBLAS workspaces, allocator state
                self._body(key)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        hostfunc.raise_pending()
        before = hostfunc.registered_keys()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._body(key)
        torch.cuda.synchronize()
        if self.pool is None:
            self.pool = graph.pool()
        self.handles[key] = hostfunc.registered_keys() - before
        self.graphs[key] = graph
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - t0
        log.info("captured %s in %.2fs", key, time.perf_counter() - t0)
        return graph

    def close(self) -> None:
        """Drop the graphs, then free their host functions' user data."""
        if self.capture:
            torch.cuda.synchronize()
        self.graphs.clear()
        for keys in self.handles.values():
            for k in keys:
                hostfunc.free_host_func_user_data(k)
        self.handles.clear()

    # ---- the captured step ---------------------------------------------------------------
    def _ctx(self, slots: torch.Tensor, positions: torch.Tensor, length: int) -> AttnContext:
        mask = (self.kpos[:length][None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B, 1, T, L]
        return AttnContext(slots, positions, mask, length, None)

    def _sampling(self, rows: torch.Tensor, counter: torch.Tensor, key: GraphKey) -> SamplingBatch:
        r = self.runner
        return SamplingBatch(temperature=r.temperature[rows], top_k=r.top_k[rows], top_p=r.top_p[rows],
                             greedy=r.greedy[rows], seed=r.seed[rows], counter=counter,
                             all_greedy=key.greedy, any_top_k_p=key.top_k_p)

    def _body(self, key: GraphKey) -> None:
        """The step on the static buffers; every shape depends only on `key`."""
        B, T, R, L = key.batch, key.T, self.rows_per_slot, key.length
        m, kv = self.model, self.kv
        g = self.guided if key.guided else None
        last, pos0, slots, counter, num = (self.inp[j, :B] for j in range(5))
        if g is not None:
            g.launch_begin()  # grammar stream: fetch the snapshot, fill, copy masks, mask event
        if key.drafting == "early_exit":
            cur = last[:, None]
            for i in range(T - 1):
                ctx = self._ctx(slots, pos0[:, None] + i, L)
                logits = m.logits(m(cur, ctx, kv, num_layers=self.draft_layers)[:, -1])  # [B, V]
                if g is not None:
                    g.apply_rows(logits, slots * R + i)
                tok = logits.argmax(dim=-1)
                self.out[2 + i, :B].copy_(tok)
                if g is not None:  # the callback reads draft i from pinned memory
                    self.out_host[2 + i].copy_(self.out[2 + i], non_blocking=True)
                    g.launch_draft_advance(i)
                cur = tok[:, None]
            if g is not None:
                g.launch_draft_end()
            drafts = self.out[2: 1 + T, :B].t()  # [B, T-1]
            ids = torch.cat([last[:, None], drafts], dim=1)
        elif key.drafting == "host":
            drafts = self.drafts[:B, : T - 1]
            ids = torch.cat([last[:, None], drafts], dim=1)  # 0-padded drafts: dead positions
        else:
            ids = last[:, None]
        positions = pos0[:, None] + self.arange[:T]  # [B, T]
        logits = m.logits(m(ids, self._ctx(slots, positions, L), kv))  # [B, T, V]
        V = logits.shape[-1]
        flat = logits.view(B * T, V)
        if g is not None:
            g.apply_rows(flat, (slots[:, None] * R + self.arange[:T]).reshape(-1))
        if T == 1:
            nxt = sample(logits[:, 0], self._sampling(slots, counter, key))
            accepted = torch.zeros_like(nxt)
        else:
            n = num if g is None else torch.minimum(num, g.limit_dev[:B].long())
            if key.greedy:
                target = logits.argmax(dim=-1)  # [B, T]
                ok = (drafts == target[:, : T - 1]) & (self.arange[: T - 1][None, :] < n[:, None])
                accepted = ok.int().cumprod(dim=1).sum(dim=1)
                nxt = target.gather(1, accepted[:, None])[:, 0]
            else:
                rows = slots.repeat_interleave(T)
                cnt = (counter[:, None] + self.arange[:T]).reshape(-1)
                p = probabilities(flat, self._sampling(rows, cnt, key)).view(B, T, V)
                u_acc, u_res = acceptance.uniforms(self.runner.seed[slots], counter, T - 1, V)
                accepted, nxt = acceptance.verify(p, drafts, n, u_acc, u_res)
        self.out[0, :B].copy_(accepted)
        self.out[1, :B].copy_(nxt)
        self.out_host.copy_(self.out, non_blocking=True)
        if g is not None:
            g.launch_commit()  # feeds drafts[:accepted] + next from out_host to the matchers
            g.join()  # the forward stream waits for the grammar stream: no unjoined capture work


@dataclass
class _EagerStep:
    """CPU dry run: `replay` runs the step body eagerly (tests the body's logic without CUDA)."""

    body: Callable[[], None]

    def replay(self) -> None:
        self.body()


def make_step_graphs(runner: Runner, config: EngineConfig,
                     propose: Callable[[Sequence, int], list[int]]) -> Optional[StepGraphs]:
    """StepGraphs on a CUDA device with `cuda_graphs` on; None otherwise (eager steps)."""
    if runner.device.type != "cuda" or not config.cuda_graphs:
        return None
    return StepGraphs(runner, config.drafter, propose, config.max_seq_len, config.mask_drafts)
