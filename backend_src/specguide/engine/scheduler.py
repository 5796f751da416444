"""Slots, waiting queue, admission, chunked prefill, preemption, finish conditions (what each
sequence holds in the KV blocks: kv_blocks.py; the step's token budget: step_budget.py).

Pure Python: no torch. The runner turns a `StepPlan` into tensors."""
from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ..request import RequestOutput, SamplingParams
from .block_pool import BLOCK, BlockPool, blocks_per_seq
from .kv_blocks import KVBlocks
from .sequence_state import GuideState, OutputState, SeqStats
from .step_budget import StepBudget


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    PREEMPTED = "preempted"  # holds its slot, not its KV blocks: recomputed when blocks are free again
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """Per-request state. `num_cached` tokens of prompt+output are in the slot's KV cache.

    The fields here are the scheduler's (slot, status, cached tokens, finish) and the request's own,
    set once by `Intake`; `output_ids` is appended to by `OutputProcessor.append` and read by every
    per-slot owner. What other owners write is in one part each (`sequence_state.py`): `out`
    (`OutputProcessor`), `guide` (`Intake`), `stats` (timestamps and draft counters)."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    callback: Callable[[RequestOutput], None]
    stop_ids: frozenset[int]  # tokens that end the sequence (EOS, end_id, stop_token_ids)
    num_draft_tokens: int = 0
    request_id: str = ""
    group: int = 0  # the client request it is a row of (Request.group): fair shares are per group
    adapter: str = ""  # its LoRA adapter's name ("": the base model) and key (engine/lora_adapters.py)
    adapter_key: bytes = b""
    output_ids: list[int] = field(default_factory=list)
    slot: Optional[int] = None
    num_cached: int = 0
    num_reused: int = 0  # prompt tokens whose KV blocks it shares at admission (prefix caching)
    block_keys: list[bytes] = field(default_factory=list)  # its full blocks' keys (block_pool.block_keys), so far
    registered: int = 0  # its first blocks that are computed and registered for sharing (or shared)
    shares: bool = True  # its computed blocks may be shared (not when computed without a state others need)
    preemptions: int = 0  # times it gave its KV blocks back (its slot's other state stays)
    bound: bool = False  # the slot's owners admitted it (at its first chunk; a preemption keeps them)
    status: Status = Status.WAITING
    cancelled: bool = False
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    deadline: Optional[float] = None  # time.monotonic() past which the request finishes with "timeout"
    out: OutputState = field(default_factory=OutputState)
    guide: GuideState = field(default_factory=GuideState)
    stats: SeqStats = field(default_factory=SeqStats)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def tokens(self, a: int, b: int) -> list[int]:
        """(prompt_ids + output_ids)[a:b], without building the whole list (0 <= a <= b)."""
        n = len(self.prompt_ids)
        if b <= n:
            return self.prompt_ids[a:b]
        if a >= n:
            return self.output_ids[a - n: b - n]
        return self.prompt_ids[a:] + self.output_ids[: b - n]

    @property
    def prefill_end(self) -> int:
        """Where its prefill ends: the prompt's end, or for a sequence recomputed after preemption
        every token but its last (the next decode step feeds that)."""
        return self.num_tokens - 1 if self.output_ids else len(self.prompt_ids)


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # first prompt position in this chunk
    end: int  # one past the last

    @property
    def is_last(self) -> bool:
        """The chunk ends the prompt: its last position's logits give the first output token."""
        return self.end == len(self.seq.prompt_ids) and not self.seq.output_ids

    @property
    def resumes(self) -> bool:
        """The chunk ends the recompute of a preempted sequence's tokens: it decodes next."""
        return bool(self.seq.output_ids) and self.end == self.seq.prefill_end


class SlotOwner:
    """Something that keeps per-slot state beside the scheduler (the runner, the proposer, a
    feature recorder): told when a sequence takes a slot and when it leaves it. Each is a no-op
    unless the owner keeps such state."""

    def admit(self, slot: int, seq: Sequence) -> None:
        pass

    def free(self, slot: int) -> None:
        pass

    def drop_rows(self, slot: int) -> None:
        """The slot's sequence was preempted: its KV blocks are gone (recomputed later)."""


@dataclass
class StepPlan:
    prefills: list[PrefillChunk]
    decodes: list[Sequence]  # sorted by slot
    preempted: list[Sequence] = field(default_factory=list)  # lost their blocks in this plan

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """Owns the waiting queue and the slot free list; decides each step's work. What each running
    sequence holds in the KV blocks is `blocks`' (kv_blocks.KVBlocks: prefix sharing included);
    how much of a step prompt chunks take is `budget`'s (step_budget.StepBudget).

    When blocks run short a running sequence is preempted (`_victim`: the newest, or the newest row
    of a request of many rows holding more than its share): it keeps its slot, gives its
    blocks back (its computed ones stay cached) and, once blocks are free again, shares what is
    still cached of them, recomputes the rest (a prefill: the same K/V bits with the
    chunk-invariant kernels) and decodes on."""

    def __init__(self, max_slots: int, max_seq_len: int, prefill_chunk: int, prefix_caching: bool = False,
                 prefix_min_tokens: int = 1, any_prefix: bool = False, pool: Optional[BlockPool] = None,
                 lookahead: int = 0, step_budget: int = 0, key_cost: float = 0.0, new_request_slots: int = 0):
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        # any_prefix: the model's forwards are chunk-invariant (LlamaModel.chunk_invariant: a position's
        # K/V, and the drafters' rows, are the same bits whatever the chunk split, batch or query count,
        # decode steps included), so a block computed by any sequence is the block every other sequence
        # with its tokens would compute. Blocks are shared only then, and chunks cut to a budget.
        self.any_prefix = any_prefix
        assert not step_budget or any_prefix, "chunks cut to the budget need chunk-invariant forwards"
        self.budget = StepBudget(prefill_chunk, step_budget, key_cost, lookahead)
        self.free_slots: list[int] = list(range(max_slots))
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self.reused_blocks = 0  # whole KV blocks of prompt prefixes reused at admission, all told (metrics)
        # the last `new_request_slots` free slots go only to a request none of whose rows holds one: a
        # request of many rows (a batch, n > 1) leaves them to the requests that come after it
        self.new_request_slots = new_request_slots
        if pool is None:  # every slot can hold max_seq_len + lookahead + 1 positions at once
            mb = blocks_per_seq(max_seq_len, lookahead)
            pool = BlockPool(np.zeros((max_slots, mb), np.int32), 1 + max_slots * mb)
        self.blocks = KVBlocks(pool, max_seq_len, lookahead, prefix_caching and any_prefix, prefix_min_tokens)
        self.num_preemptions = 0  # all told (metrics)

    @property
    def pool(self) -> BlockPool:
        return self.blocks.pool

    @property
    def prefill_chunk(self) -> int:
        return self.budget.prefill_chunk

    # ---- admission (the engine appends to `waiting`; it enforces max_queue) ------------------
    def schedule(self, ready: Callable[[Sequence], bool] = lambda s: True) -> StepPlan:
        """The blocks the last step computed registered for sharing; blocks for the running sequences'
        next writes (preempting the newest where they run short), preempted sequences back to their
        recompute, waiting sequences into free slots; then the prefill chunks and the decode batch."""
        for seq in self.running.values():
            self.blocks.register(seq)
        preempted = self._grow_decodes()
        self._resume()
        self._admit(ready)
        budget = self.budget.for_prompts([s.num_tokens - 1 for s in self._with(Status.DECODE)],
                                         len(self._with(Status.PREFILL)))
        prefills = self._chunks(*budget, planned=set(), preempted=preempted)
        decodes = [self.running[s] for s in sorted(self.running) if self.running[s].status is Status.DECODE]
        return StepPlan(prefills, decodes, preempted)

    def schedule_more(self, budget: int, planned: set[int],
                      ready: Callable[[Sequence], bool] = lambda s: True) -> StepPlan:
        """Mid-step, after a prefill chunk: admit sequences that arrived since `schedule` and plan
        chunks of prefilling sequences not yet in this step (`planned`: their seq_ids) within the
        `budget` tokens left; no decodes (the step's own batch runs after its prefills). Nothing
        is preempted for them: a chunk whose blocks are not free waits."""
        for seq in self.running.values():
            self.blocks.register(seq)  # what this step's prefills computed
        self._admit(ready)
        return StepPlan(self._chunks(budget, False, planned, preempted=None), [])

    def _with(self, status: Status) -> list[Sequence]:
        return [s for s in self.running.values() if s.status is status]

    def _grow_decodes(self) -> list[Sequence]:
        """Blocks for every decoding sequence's next step, oldest first; where they run short, the
        newest running sequences are preempted. Returns the preempted."""
        preempted: list[Sequence] = []
        for seq in sorted(self.running.values(), key=lambda s: s.seq_id):
            while seq.status is Status.DECODE and not self.blocks.grow(seq, self.blocks.decode_need(seq)):
                victim = self._victim()
                assert victim is not None, "a decoding sequence holds blocks"
                self._preempt(victim)
                preempted.append(victim)
        return preempted

    def _victim(self) -> Optional[Sequence]:
        """The running sequence to preempt first: the newest row of a request of several rows (a
        batch, n > 1) that holds more than an equal share of the blocks held (one share per request
        holding any), so that one client's many rows never push another's few out again and again;
        where none does, the newest sequence holding blocks (the cheapest to recompute, usually).
        NOTE: one sequence alone always fits the pool (the engine caps max_seq_len to it), so a
        sequence short of blocks finds one, itself at worst."""
        holders = [s for s in self.running.values() if self.blocks.holds(s)]
        if not holders:
            return None
        held: dict[int, int] = {}
        rows: dict[int, int] = {}
        for s in holders:
            held[s.group] = held.get(s.group, 0) + int(self.pool.held[s.slot])
            rows[s.group] = rows.get(s.group, 0) + 1
        share = sum(held.values()) / len(held)
        over = [s for s in holders if rows[s.group] > 1 and held[s.group] > share]
        return max(over or holders, key=lambda s: s.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)  # what it computed stays cached: its recompute shares what is left of it
        seq.status = Status.PREEMPTED
        seq.num_cached = seq.num_reused = 0
        seq.preemptions += 1
        self.num_preemptions += 1

    def _fits(self, positions: int) -> bool:
        return self.blocks.fits(positions, self._with(Status.DECODE))

    def _resume(self) -> None:
        """Preempted sequences, oldest first, back to prefilling (what is still cached of their
        blocks shared) while their first chunk fits."""
        for seq in sorted(self._with(Status.PREEMPTED), key=lambda s: s.seq_id):
            if not self._fits(min(self.prefill_chunk, seq.prefill_end)):
                break
            self.blocks.share(seq, seq.prefill_end)
            seq.status = Status.PREFILL

    def _admit(self, ready: Callable[[Sequence], bool]) -> None:
        """Waiting sequences into free slots (the lowest first), sharing the cached blocks of their
        prompt's prefix, while their first chunk's blocks fit."""
        blocked: list[Sequence] = []
        holding = {s.group for s in self.running.values()}  # requests with a row in a slot
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            if seq.cancelled:
                self.waiting.popleft()
                continue
            if not ready(seq):  # e.g. its grammar is still compiling
                blocked.append(self.waiting.popleft())
                continue
            if seq.group in holding and len(self.free_slots) <= self.new_request_slots:
                blocked.append(self.waiting.popleft())  # kept for a request that holds none
                continue
            if self._with(Status.PREEMPTED):
                break  # the preempted go first
            if not self._fits(min(self.prefill_chunk, len(seq.prompt_ids)) + 1):
                break
            shares = self.blocks.sharing and not seq.params.return_context_logits and seq.params.prompt_logprobs is None
            if shares and self.blocks.in_flight(seq, self._with(Status.PREFILL)):
                blocked.append(self.waiting.popleft())  # shares it once computed instead of computing it too
                continue
            self.waiting.popleft()
            seq.slot = self._take_slot(seq)
            if shares:
                self.blocks.share(seq, len(seq.prompt_ids))
            self.reused_blocks += seq.num_reused // BLOCK
            seq.status = Status.PREFILL
            seq.stats.first_scheduled_time_ns = time.time_ns()
            self.running[seq.slot] = seq
            holding.add(seq.group)
        self.waiting.extendleft(reversed(blocked))

    def _take_slot(self, seq: Sequence) -> int:
        """A free slot for the sequence: the lowest (which slot a sequence gets never changes its output)."""
        slot = min(self.free_slots)
        self.free_slots.remove(slot)
        return slot

    def _chunks(self, budget: float, weighted: bool, planned: set[int],
                preempted: Optional[list[Sequence]]) -> list[PrefillChunk]:
        """The next chunk of each prefilling sequence not in `planned`, oldest first, within `budget`
        (`weighted`: tokens' worth of work, chunks cut to fit) and with its blocks; `preempted`
        (None: nothing may be) collects the sequences preempted to make room for a chunk."""
        # NOTE: a request's chunks are [r + k*chunk, r + (k+1)*chunk) after r shared tokens (whole
        # blocks), whatever else is running, so its prompt's numerics never depend on its neighbours;
        # a chunk that does not fit the remaining budget waits for the next step (a step's first one
        # always fits: n <= prefill_chunk)
        prefills: list[PrefillChunk] = []
        for seq in sorted((s for s in self._with(Status.PREFILL) if s.seq_id not in planned), key=lambda s: s.seq_id):
            if seq.status is not Status.PREFILL:  # preempted below for an older one's chunk
                continue
            n = min(self.prefill_chunk, seq.prefill_end - seq.num_cached)
            if weighted:  # cut to what is left (any split gives the same bits); a step's first chunk moves
                n = max(self.budget.fit(seq.num_cached, n, budget), 0 if prefills else 1)
            elif self.budget.step_budget:
                n = min(n, int(budget))
            if n <= 0 or (not weighted and n > budget):
                break
            while not self.blocks.grow(seq, seq.num_cached + n):
                victim = self._victim() if preempted is not None else None
                if victim is None or victim.seq_id <= seq.seq_id:
                    break
                self._preempt(victim)
                preempted.append(victim)
            if self.blocks.missing(seq, seq.num_cached + n):
                break  # waits for blocks (an older sequence's step frees them or a preemption does)
            prefills.append(PrefillChunk(seq, seq.num_cached, seq.num_cached + n))
            budget -= self.budget.cost(seq.num_cached, n) if weighted else n
        return prefills

    # ---- bookkeeping -----------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str, error: Optional[str] = None) -> None:
        """Mark finished and free the slot (idempotent)."""
        if seq.status is Status.FINISHED:
            return
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.error = error
        if seq.slot is not None:
            assert self.running.get(seq.slot) is seq
            self.blocks.release(seq)  # what it computed stays cached: what later prompts may share
            del self.running[seq.slot]
            self.free_slots.append(seq.slot)
            seq.slot = None
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def forget_prefixes(self) -> None:
        """No block computed so far is shared, nor any the running sequences compute from now on (for
        a per-slot owner that joins now, e.g. a draft head: it has none of their rows)."""
        self.blocks.forget(self.running.values())

    def check_stop_token(self, seq: Sequence) -> Optional[str]:
        """Finish reason after the newest output token, or None to go on."""
        n = len(seq.output_ids)
        if n >= seq.params.min_tokens and seq.output_ids[-1] in seq.stop_ids:
            return "stop"
        if n >= seq.params.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_seq_len:
            return "length"
        return None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def check_integrity(self) -> None:
        """Every slot is either free or held by exactly one running sequence."""
        held = set(self.running)
        free = set(self.free_slots)
        assert not held & free, f"slots both free and held: {held & free}"
        assert held | free == set(range(self.max_slots)), "a slot leaked"
        assert len(self.free_slots) == len(free), "a slot was freed twice"
        self.pool.check_integrity()
        for s in self.free_slots:
            assert self.pool.held[s] == 0, f"free slot {s} holds blocks"
