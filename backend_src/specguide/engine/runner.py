"""Runner: the model, its KV cache, the per-slot sampling state and the step (step.py), run
eagerly or as a CUDA-graph replay; prefill chunks."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import EngineConfig
from ..cuda import hostfunc
from ..cuda.graphs import StepGraphs
from ..guided.capturable import CapturableGuidedDecoder
from ..guided.decoder import GuidedDecoder
from .block_pool import blocks_per_seq
from .kv_cache import KVCache, kv_store
from ..models.llama import LlamaModel
from .scheduler import PrefillChunk, Sequence, SlotOwner
from .slot_params import SlotSampling
from ..speculative.plan import DraftPlan
from .step import StepCore
from .step_layout import Drafting
from .step_extras import prompt_logprobs

Result = tuple[list[int], int, int]  # tokens to append, drafts verified, drafts accepted


@dataclass
class Riders:
    """Prompt chunks whose tokens go through one forward as rows of any length (the C kernels'
    varlen rows), beside a decode step's rows or alone. `hidden` [1, n, H] after that forward."""

    ids: torch.Tensor  # [1, n] the chunks' tokens, one after another
    positions: torch.Tensor  # [1, n]
    slots: torch.Tensor  # [rows] each chunk's cache row
    token_slots: torch.Tensor  # [n] each token's
    starts: torch.Tensor  # [rows + 1] each chunk's first token (0, .., n)
    hidden: Optional[torch.Tensor] = None

    def rows(self, i: int) -> torch.Tensor:
        """Chunk i's hidden states [1, len, H]."""
        assert self.hidden is not None
        return self.hidden[:, int(self.starts[i]): int(self.starts[i + 1])]


def resolve_executor(config: EngineConfig, device: torch.device) -> str:
    """Where grammar callbacks run: "inline" (CPU default), "worker"
    (a thread: the race test mode) or "cuda" (a CUDA stream, captured in the step graphs)."""
    kind = config.guided_executor
    if kind == "auto":
        return "cuda" if device.type == "cuda" else "inline"
    if kind == "cuda" and device.type != "cuda":
        raise ValueError("guided_executor 'cuda' needs a CUDA device")
    return kind


class Runner(SlotOwner):
    """Owns the model, the KV cache, the slot sampling buffers and the step core."""

    def __init__(self, model: LlamaModel, config: EngineConfig, device: torch.device, num_blocks: int):
        cfg = model.cfg
        self.model, self.device, self.vocab_size = model, device, cfg.vocab_size
        K, S = config.num_draft_tokens, config.max_slots
        spare = K + 1  # +1: padding rows of captured steps
        # the block table [slots, blocks_per_seq]: the scheduler's BlockPool writes it (host), the
        # caches read it (on CUDA a copy on the device, refreshed by blocks_changed)
        self.table = torch.zeros(S, blocks_per_seq(config.max_seq_len, K), dtype=torch.int32,
                                 pin_memory=device.type == "cuda")
        table = self.table.to(device) if device.type == "cuda" else self.table
        self.kv = KVCache(cfg.num_layers, S, cfg.num_kv_heads, config.max_seq_len, cfg.head_dim,
                          model.dtype, device, spare=spare, store=kv_store(config, model), table=table,
                          num_blocks=num_blocks)
        self.params = SlotSampling(S, cfg.vocab_size, device)
        inner = GuidedDecoder(S, K, cfg.vocab_size, num_threads=config.guided_mask_threads)
        self.guided = CapturableGuidedDecoder(inner, hostfunc.make_stream(resolve_executor(config, device)), device)
        self.core = StepCore(model, self.kv, self.params, self.guided, config.max_seq_len,
                             sparse_lm_head=config.sparse_lm_head)
        self.graphs = StepGraphs(self.core) if device.type == "cuda" and config.cuda_graphs else None

    def admit(self, slot: int, seq: Sequence) -> None:
        """A newly admitted sequence's sampling parameters and grammar matcher."""
        self.params.admit(slot, seq)
        self.guided.admit(slot, seq.guide.grammar)

    def free(self, slot: int) -> None:
        self.params.free(slot)
        self.guided.free(slot)

    def blocks_changed(self) -> None:
        """After the scheduler handed out or took back blocks: the device's table follows the host's."""
        if self.kv.table is not self.table:
            self.kv.table.copy_(self.table, non_blocking=True)  # NOTE: stream-ordered before the next forward

    # ---- forward passes ---------------------------------------------------------------------
    @property
    def varlen(self) -> bool:
        """Prompt chunks and decode rows share one forward (rows of any length: the C kernels)."""
        return self.model.chunk_invariant

    @staticmethod
    def _tokens(chunk: PrefillChunk) -> list[int]:
        seq = chunk.seq
        toks = seq.prompt_ids if chunk.end <= len(seq.prompt_ids) else seq.prompt_ids + seq.output_ids  # (recompute)
        return toks[chunk.start: chunk.end]

    def riders(self, chunks: list[PrefillChunk]) -> Riders:
        """The inputs of `chunks` as varlen rows of one forward."""
        lens = [c.end - c.start for c in chunks]

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        return Riders(longs([t for c in chunks for t in self._tokens(c)])[None],
                      longs([p for c in chunks for p in range(c.start, c.end)])[None],
                      longs([c.seq.slot for c in chunks]),
                      longs([c.seq.slot for c, n in zip(chunks, lens) for _ in range(n)]),
                      longs([0] + lens).cumsum(0))

    @torch.inference_mode()
    def ride(self, riders: Riders) -> None:
        """The riders' forward alone (a step with no decode rows): K/V written, features recorded."""
        ctx = self.model.make_varlen_context(riders.slots, riders.positions, riders.starts)
        riders.hidden = hidden = self.model(riders.ids, ctx, self.kv)  # [1, n, H]
        if self.core.feature_sink is not None:
            n, H = hidden.shape[1:]
            self.core.feature_sink(riders.token_slots, riders.positions.view(n, 1), hidden.view(n, 1, H))

    @torch.inference_mode()
    def prefill(self, chunk: PrefillChunk, hidden: Optional[torch.Tensor] = None) -> Optional[int]:
        """Run one prompt chunk (`hidden` [1, n, H]: its forward ran already, riding in a step's);
        returns the first output token when the chunk ends the prompt."""
        seq, core = chunk.seq, self.core
        plan = DraftPlan([0], drafts=[[]])
        key = core.key([seq], plan) if chunk.is_last else None
        if key is not None:
            core.stage([seq], plan, key)
            core.open(key)  # the grammar fills row 0 during the forward
        if hidden is None:
            ids = torch.tensor([self._tokens(chunk)], dtype=torch.int64, device=self.device)
            positions = torch.arange(chunk.start, chunk.end, device=self.device)[None, :]
            slots = torch.tensor([seq.slot], device=self.device)
            hidden = self.model(ids, self.model.make_context(slots, positions, [seq.slot], chunk.end), self.kv)
            if core.feature_sink is not None:
                core.feature_sink(slots, positions, hidden)
        p = seq.params
        if (p.return_context_logits or p.prompt_logprobs is not None) and not seq.output_ids:  # every prompt position
            full = self.model.logits(hidden[0])  # [n, V]
            if p.return_context_logits:
                if chunk.start == 0:  # (a prompt prefilled again after a preemption starts over)
                    seq.out.context_logits.clear()
                seq.out.context_logits.append(full.to("cpu", torch.float32, copy=True))
            if p.prompt_logprobs is not None and seq.out.prompt_logprobs is not None:  # None: already sent
                done = seq.out.prompt_logprobs if chunk.start else []  # a prompt prefilled again starts over
                seq.out.prompt_logprobs = done + prompt_logprobs(full, seq.prompt_ids, chunk.start, p.prompt_logprobs)
            logits = full[-1:][:, None]
        elif key is not None:
            logits = core.logits(key, hidden[:, -1:])  # [1, 1, V]
        if key is None:
            return None
        core.tail(key, logits, None)
        core.finish(key)
        return core.results([seq], plan, key)[0][0][0]

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], plan: DraftPlan, riders: Optional[Riders] = None) -> list[Result]:
        """One decode step for `seqs` (sorted by slot): plain, or verification of the plan's drafts;
        a CUDA-graph replay when the step is eligible. `riders`: prompt chunks whose tokens go in the
        verification forward (eager steps; before a replayed one, in a forward of their own)."""
        core, graphs = self.core, self.graphs
        key = core.key(seqs, plan)
        if graphs is not None and not key.extras and len(seqs) <= graphs.buckets[-1]:
            key = dataclasses.replace(key, batch=graphs.bucket(len(seqs)), length=graphs.length(seqs, key.T),
                                      captured=True)
            graphs.ensure(key, plan)  # captured before this step's snapshot is queued
        if riders is not None and key.captured:
            self.ride(riders)
            riders = None
        if plan.drafter is not None and key.drafting is not Drafting.NONE:
            plan.drafter.prepare(seqs, key)
        core.stage(seqs, plan, key)
        if key.captured and graphs is not None:
            graphs.replay(key)
            t0 = time.perf_counter()
            core.finish(key)
            graphs.stats.wait_s += time.perf_counter() - t0  # host waiting for the replayed step
        else:
            core.riders = riders
            try:
                core.body(key)
            finally:
                core.riders = None
            core.finish(key)
        out = core.results(seqs, plan, key)
        if plan.drafter is not None and key.drafting is not Drafting.NONE:
            plan.drafter.done(seqs, [a for _, _, a in out], key.T - 1)
        return out

    @torch.inference_mode()
    def restore(self, seq: Sequence) -> None:
        """A failed step's row back to the state of its appended tokens, so that running it again
        gives what the step would have: its grammar matcher, and its penalty counts (the step may
        have counted its token). Its KV rows past its tokens are rewritten by the next step; the
        drafters re-feed their rows (`HeadDrafter.prepare`); sampling is keyed by token index."""
        if seq.guide.grammar is not None:
            self.guided.restore(seq.slot, len(seq.output_ids))
        params = self.params
        if seq.slot in params.penalized:  # counts: the output's tokens; seen: the prompt's and the output's
            out = torch.tensor(seq.output_ids, dtype=torch.int64, device=params.counts.device)
            params.counts[seq.slot] = torch.bincount(out, minlength=params.counts.shape[1]).to(params.counts.dtype)
            params.seen[seq.slot] = False
            params.seen[seq.slot, torch.tensor(seq.prompt_ids + seq.output_ids, device=params.seen.device)] = True

    def healthy(self, seq: Sequence) -> bool:
        """False when the row's grammar matcher raises (its state is broken: the request fails)."""
        try:
            if seq.guide.grammar is not None:
                self.guided.is_terminated(seq.slot)
            return True
        except Exception:
            return False

    def warmup(self) -> None:
        """One tiny forward so the first request does not pay for lazy initialisation."""
        slots = torch.tensor([0], device=self.device)  # (position 0 of slot 0: block 0 until a sequence holds it)
        ctx = self.model.make_context(slots, torch.zeros(1, 1, dtype=torch.int64, device=self.device), [0], 1)
        self.model.logits(self.model(torch.zeros(1, 1, dtype=torch.int64, device=self.device), ctx, self.kv))

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
        self.guided.close()

