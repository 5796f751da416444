"""Slots, KV blocks, waiting queue, admission, chunked prefill under a token budget, preemption,
finish conditions.

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
from .sequence_state import GuideState, OutputState, SeqStats


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
    output_ids: list[int] = field(default_factory=list)
    slot: Optional[int] = None
    num_cached: int = 0
    num_reused: int = 0  # prompt tokens whose KV the slot already held at admission (prefix caching)
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


@dataclass
class PrefixCopy:
    """Copy the KV (and per-slot features) of positions [start, end) from slot src into slot dst."""

    src: int
    dst: int
    start: int
    end: int


class SlotOwner:
    """Something that keeps per-slot state beside the scheduler (the runner, the proposer, a
    feature recorder): told when a sequence takes a slot, when it leaves it, and when a prefix is
    copied between slots. Each is a no-op unless the owner keeps such state."""

    def admit(self, slot: int, seq: Sequence) -> None:
        pass

    def free(self, slot: int) -> None:
        pass

    def copy_prefix(self, c: PrefixCopy) -> None:
        pass

    def drop_rows(self, slot: int) -> None:
        """The slot's sequence was preempted: its KV blocks are gone (recomputed later)."""


@dataclass
class StepPlan:
    prefills: list[PrefillChunk]
    decodes: list[Sequence]  # sorted by slot
    copies: list[PrefixCopy] = field(default_factory=list)  # run first, in this order
    preempted: list[Sequence] = field(default_factory=list)  # lost their blocks in this plan

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.copies


class Scheduler:
    """Owns the waiting queue, the slot free list and the KV blocks (`pool`); decides each step's work.

    Blocks: a running sequence holds blocks for the positions its next forward writes (a decoding
    one: its tokens and `lookahead` draft positions, up to max_seq_len); a free slot keeps those of
    its last sequence's reusable tokens (prefix caching) until blocks run short. When they do,
    the newest running sequence is preempted: it keeps its slot, gives its blocks back and, once
    blocks are free again, recomputes its tokens (a prefill, the same K/V bits with the
    chunk-invariant kernels) and decodes on."""

    copy_min_tokens = 1  # copying a prefix from a busy slot beats computing it from 1 token up (bench_prefix_copy)

    def __init__(self, max_slots: int, max_seq_len: int, prefill_chunk: int, prefix_caching: bool = False,
                 prefix_min_tokens: int = 1, any_prefix: bool = False, pool: Optional[BlockPool] = None,
                 lookahead: int = 0, step_budget: int = 0, key_cost: float = 0.0, new_request_slots: int = 0):
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.prefix_caching, self.prefix_min_tokens = prefix_caching, prefix_min_tokens
        # any_prefix: the model's forwards are chunk-invariant (LlamaModel.chunk_invariant: a position's
        # K/V are the same bits whatever the chunk split, batch or query count, decode steps included),
        # so every position a slot computed is reusable, up to the first differing token; else only a
        # prompt's whole prefill chunks are (a prefill from scratch computes them with the same split)
        self.any_prefix = any_prefix
        self.free_slots: list[int] = list(range(max_slots))
        self.slot_tokens: list[list[int]] = [[] for _ in range(max_slots)]  # tokens whose KV a free slot holds
        self.slot_hits = [0] * max_slots  # admissions that reused (a prefix of) the slot's tokens
        self.slot_freed = [0] * max_slots  # when the slot was last freed (a tick): least recently used first
        self._tick = 0
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        # whether a slot's rows may be reused at all (the engine: a draft head attached while
        # serving lacks the features of rows computed before it, so their slots are not)
        self.reusable: Callable[[int], bool] = lambda slot: True
        self.reused_blocks = 0  # whole KV blocks of prompt prefixes reused at admission, all told (metrics)
        self.lookahead = lookahead  # positions past a decoding sequence's tokens its step may write (drafts)
        # step_budget > 0: prompt chunks and decode rows share one forward (Runner.varlen). While
        # sequences decode, a step takes `step_budget` tokens' worth of work: the decode rows'
        # (lookahead + 1 each) first, prompt chunks the rest (at least a quarter, so that waiting
        # prompts always move), cut to fit; with nothing decoding, prompt chunks take
        # `prefill_chunk` tokens. A token at position p is worth 1 + p * key_cost tokens (its
        # attention: key_cost = a key's work / a token's other work), so that a long prompt's last
        # chunks, each token attending to thousands of keys, hold the streams no longer than its first
        assert not step_budget or any_prefix, "chunks cut to the budget need chunk-invariant forwards"
        self.step_budget, self.key_cost = step_budget, key_cost
        # the last `new_request_slots` free slots go only to a request none of whose rows holds one: a
        # request of many rows (a batch, n > 1) leaves them to the requests that come after it
        self.new_request_slots = new_request_slots
        if pool is None:  # every slot can hold max_seq_len + lookahead + 1 positions at once
            mb = blocks_per_seq(max_seq_len, lookahead)
            pool = BlockPool(np.zeros((max_slots, mb), np.int32), 1 + max_slots * mb)
        self.pool = pool
        self.num_preemptions = 0  # all told (metrics)
        self._pinned: set[int] = set()  # slots whose blocks this plan's copies read or write
    # ---- admission (the engine appends to `waiting`; it enforces max_queue) ------------------
    def schedule(self, ready: Callable[[Sequence], bool] = lambda s: True) -> StepPlan:
        """Blocks for the running sequences' next writes (preempting the newest where they run
        short), preempted sequences back to their recompute, waiting sequences into free slots;
        then the prefill chunks and the decode batch."""
        preempted = self._grow_decodes()
        self._resume()
        copies = self._admit(ready)
        prefills = self._chunks(*self._prefill_budget(), planned=set(), preempted=preempted)
        decodes = [self.running[s] for s in sorted(self.running) if self.running[s].status is Status.DECODE]
        self._pinned.clear()
        return StepPlan(prefills, decodes, copies, preempted)

    def schedule_more(self, budget: int, planned: set[int],
                      ready: Callable[[Sequence], bool] = lambda s: True) -> StepPlan:
        """Mid-step, after a prefill chunk: admit sequences that arrived since `schedule` and plan
        chunks of prefilling sequences not yet in this step (`planned`: their seq_ids) within the
        `budget` tokens left; no decodes (the step's own batch runs after its prefills). Nothing
        is preempted for them: a chunk whose blocks are not free waits."""
        copies = self._admit(ready)
        prefills = self._chunks(budget, False, planned, preempted=None)
        self._pinned.clear()
        return StepPlan(prefills, [], copies)

    def _prefill_budget(self) -> tuple[float, bool]:
        """(what this step's prompt chunks may take, whether in tokens' worth of work: see
        `step_budget`; else in tokens)."""
        decoding = [s for s in self.running.values() if s.status is Status.DECODE]
        if not self.step_budget or not decoding:
            return self.prefill_chunk, False
        rows = sum(self._cost(s.num_tokens - 1, self.lookahead + 1) for s in decoding)
        return max(self.step_budget - rows, self.step_budget / 4), True

    def _cost(self, start: int, n: int) -> float:
        """Tokens' worth of work of n tokens at positions start ..: sum of 1 + p * key_cost."""
        return n + self.key_cost * (n * start + n * (n - 1) / 2)

    def _fit(self, start: int, n: int, budget: float) -> int:
        """The most of n tokens at positions start .. whose work fits `budget`."""
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._cost(start, mid) <= budget else (lo, mid - 1)
        return lo

    def _decode_need(self, seq: Sequence) -> int:
        """Positions a decoding sequence's next step may write: its tokens and its drafts."""
        return min(seq.num_tokens + self.lookahead, self.max_seq_len)

    def _grow_decodes(self) -> list[Sequence]:
        """Blocks for every decoding sequence's next step, oldest first; where they run short, the
        newest running sequences are preempted. Returns the preempted."""
        preempted: list[Sequence] = []
        for seq in sorted(self.running.values(), key=lambda s: s.seq_id):
            while seq.status is Status.DECODE and not self._grow(seq.slot, self._decode_need(seq)):
                victim = self._newest()
                assert victim is not None, "a decoding sequence holds blocks"
                self._preempt(victim)
                preempted.append(victim)
        return preempted

    def _newest(self) -> Optional[Sequence]:
        """The running sequence to preempt first: the newest one holding blocks (not the source of
        a copy in this plan). NOTE: one sequence alone always fits the pool (the engine caps
        max_seq_len to it), so a sequence short of blocks finds one, itself at worst."""
        return max((s for s in self.running.values() if self.pool.held[s.slot] and s.slot not in self._pinned),
                   key=lambda s: s.seq_id, default=None)

    def _preempt(self, seq: Sequence) -> None:
        self.pool.shrink(seq.slot, 0)
        seq.status = Status.PREEMPTED
        seq.num_cached = seq.num_reused = 0
        seq.preemptions += 1
        self.num_preemptions += 1

    def _grow(self, slot: int, positions: int) -> bool:
        """Blocks for the slot's positions [0, positions), taking free slots' kept blocks (least
        useful first) when too few are free; False when even those do not make enough."""
        need = self.pool.missing(slot, positions)
        if need > self.pool.num_free:
            for s in sorted(self.free_slots, key=self._evict_order):
                if self.pool.num_free >= need:
                    break
                if self.pool.held[s] and s not in self._pinned:
                    self.pool.shrink(s, 0)
                    self.slot_tokens[s] = []
        return self.pool.grow(slot, positions)

    def _reserve(self) -> int:
        """Blocks the decoding sequences' next steps may take: kept free for them at admission."""
        return sum(self.pool.missing(s.slot, self._decode_need(s) + self.lookahead + 1)
                   for s in self.running.values() if s.status is Status.DECODE)

    def _fits(self, positions: int, slot: Optional[int] = None) -> bool:
        """Whether positions [0, positions) of a (new or resumed) sequence fit beside the decoding
        ones' growth, counting free slots' kept blocks as free."""
        kept = sum(self.pool.held[s] for s in self.free_slots if s != slot and s not in self._pinned)
        have = self.pool.held[slot] if slot is not None else 0
        return BlockPool.blocks_for(positions) - have <= self.pool.num_free + kept - self._reserve()

    def _resume(self) -> None:
        """Preempted sequences, oldest first, back to prefilling while their first chunk fits."""
        for seq in sorted((s for s in self.running.values() if s.status is Status.PREEMPTED), key=lambda s: s.seq_id):
            if not self._fits(min(self.prefill_chunk, seq.prefill_end), seq.slot):
                break
            seq.status = Status.PREFILL

    def _admit(self, ready: Callable[[Sequence], bool]) -> list[PrefixCopy]:
        """Waiting sequences into free slots (a prefix reused or copied where one is held) while
        their first chunk's blocks fit; returns the copies to run before any chunk."""
        blocked: list[Sequence] = []
        copies: list[PrefixCopy] = []
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
            if any(s.status is Status.PREEMPTED for s in self.running.values()):
                break  # the preempted go first
            if not self._fits(min(self.prefill_chunk, len(seq.prompt_ids)) + 1):
                break  # (+1: a whole-prompt reuse still leaves a token to compute)
            self.waiting.popleft()
            seq.slot, seq.num_reused, copy = self._pick_slot(seq)
            seq.num_cached = seq.num_reused
            self.reused_blocks += seq.num_reused // BLOCK
            self.pool.shrink(seq.slot, copy.start if copy is not None else seq.num_reused)
            if copy is not None:
                if self._grow(seq.slot, copy.end):
                    copies.append(copy)
                    self._pinned.update((copy.src, copy.dst))  # kept until the copy ran
                else:  # no room for the copied rows: computed instead
                    seq.num_cached = seq.num_reused = copy.start
            self.slot_tokens[seq.slot] = []
            seq.status = Status.PREFILL
            seq.stats.first_scheduled_time_ns = time.time_ns()
            self.running[seq.slot] = seq
            holding.add(seq.group)
        self.waiting.extendleft(reversed(blocked))
        return copies

    def _chunks(self, budget: float, weighted: bool, planned: set[int],
                preempted: Optional[list[Sequence]]) -> list[PrefillChunk]:
        """The next chunk of each prefilling sequence not in `planned`, oldest first, within `budget`
        (`weighted`: tokens' worth of work, chunks cut to fit) and with its blocks; `preempted`
        (None: nothing may be) collects the sequences preempted to make room for a chunk."""
        # NOTE: a request's chunks are [r + k*chunk, r + (k+1)*chunk) after r reused tokens (r a
        # multiple of chunk unless `any_prefix`), whatever else is running, so its prompt's numerics
        # never depend on its neighbours; a chunk that does not fit the remaining budget waits for
        # the next step (a step's first one always fits: n <= prefill_chunk)
        prefills: list[PrefillChunk] = []
        prefilling = [s for s in self.running.values() if s.status is Status.PREFILL and s.seq_id not in planned]
        for seq in sorted(prefilling, key=lambda s: s.seq_id):
            if seq.status is not Status.PREFILL:  # preempted below for an older one's chunk
                continue
            n = min(self.prefill_chunk, seq.prefill_end - seq.num_cached)
            if weighted:  # cut to what is left (any split gives the same bits); a step's first chunk moves
                n = max(self._fit(seq.num_cached, n, budget), 0 if prefills else 1)
            elif self.step_budget:
                n = min(n, int(budget))
            if n <= 0 or (not weighted and n > budget):
                break
            while not self._grow(seq.slot, seq.num_cached + n):
                victim = self._newest() if preempted is not None else None
                if victim is None or victim.seq_id <= seq.seq_id:
                    break
                self._preempt(victim)
                preempted.append(victim)
            if self.pool.missing(seq.slot, seq.num_cached + n):
                break  # waits for blocks (an older sequence's step frees them or a preemption does)
            prefills.append(PrefillChunk(seq, seq.num_cached, seq.num_cached + n))
            budget -= self._cost(seq.num_cached, n) if weighted else n
        return prefills

    def _pick_slot(self, seq: Sequence) -> tuple[int, int, Optional[PrefixCopy]]:
        """(slot, prompt tokens to reuse, rows to copy first). Reuse is the longest prefix of the
        prompt that any slot holds (`_reusable`), leaving at least one token to prefill (cut to
        whole prefill chunks unless `any_prefix`). A free slot holding it is taken; when a busy slot holds more, its rows
        past what the taken slot holds are copied (far cheaper than computing them: bench_prefix_copy).
        Without reuse, the free slot whose tokens are least useful is taken (`_evict_order`)."""
        match = [0] * self.max_slots
        if self.prefix_caching and not seq.params.return_context_logits and seq.params.prompt_logprobs is None:
            for s in range(self.max_slots):
                match[s] = self._common(self._reusable(s), seq.prompt_ids)
        own = max(self.free_slots, key=lambda s: (match[s], -s))  # the best free slot, lowest on ties
        src = max(range(self.max_slots), key=lambda s: (match[s], s in self.free_slots, -s))
        least_useful = min(self.free_slots, key=self._evict_order)
        copy = None
        if match[src] >= self.prefix_min_tokens and match[src] - match[own] >= max(1, self.copy_min_tokens):
            slot, reuse = (own, match[own]) if match[own] else (least_useful, 0)
            copy, reuse = PrefixCopy(src, slot, reuse, match[src]), match[src]
        elif match[own] and match[own] >= self.prefix_min_tokens:
            slot, reuse = own, match[own]
        else:
            slot, reuse = least_useful, 0
        self.free_slots.remove(slot)
        self.slot_hits[slot] = (self.slot_hits[src if copy else slot] + 1) if reuse else 0
        if copy is not None:
            self.slot_hits[src] += 1
        return slot, reuse, copy

    def _reusable(self, slot: int) -> list[int]:
        """Tokens whose KV the slot holds as a prefill from scratch computes it: a free slot's kept
        tokens; a busy slot's (`_kept`)."""
        if not self.reusable(slot):
            return []
        seq = self.running.get(slot)
        return self.slot_tokens[slot] if seq is None else self._kept(seq)

    def _kept(self, seq: Sequence) -> list[int]:
        """The tokens whose K/V rows the sequence's slot holds exactly as a prefill of them computes
        them: with `any_prefix` every cached position (prompt and output, `num_cached`: all but the
        newest token), else the prompt positions prefilled so far in whole chunks (positions computed
        by a partial chunk or by decode steps differ in the last bits from a prefill's)."""
        if self.any_prefix:
            return (seq.prompt_ids + seq.output_ids)[: seq.num_cached]
        n = min(seq.num_cached, len(seq.prompt_ids))
        return seq.prompt_ids[: n - n % self.prefill_chunk]

    def _common(self, held: list[int], prompt: list[int]) -> int:
        """Common prefix length, leaving >= 1 prompt token to compute (cut to whole prefill chunks
        unless `any_prefix`)."""
        n = 0
        for a, b in zip(held[: len(prompt) - 1], prompt):
            if a != b:
                break
            n += 1
        return n if self.any_prefix else n - n % self.prefill_chunk

    def _evict_order(self, slot: int) -> tuple[int, ...]:
        """Free slots to overwrite first: empty ones, then the fewest hits, then least recently freed
        (without prefix caching: the lowest, which keeps the batch's rows packed). NOTE: which free
        slot a request gets never changes its output (test_prefix_cache places the same greedy
        requests in each slot after dirtying traffic); a test helper that writes a slot's KV behind
        the scheduler's back can make it look so: the fault is the helper's, not this order."""
        if not self.prefix_caching:
            return (slot,)
        return bool(self.slot_tokens[slot]), self.slot_hits[slot], self.slot_freed[slot], slot

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
            # what later prompts may reuse (what its blocks hold of it)
            kept = self._kept(seq)[: self.pool.held[seq.slot] * BLOCK] if self.prefix_caching else []
            self.slot_tokens[seq.slot] = kept
            self.pool.shrink(seq.slot, len(kept))
            del self.running[seq.slot]
            self._tick += 1
            self.slot_freed[seq.slot] = self._tick
            self.free_slots.append(seq.slot)
            seq.slot = None
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def forget_prefixes(self) -> None:
        """Free slots keep no reusable tokens (for a per-slot owner that joins now: it has none of
        their rows)."""
        for slot in self.free_slots:
            self.slot_tokens[slot] = []
            self.pool.shrink(slot, 0)

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
            assert self.pool.held[s] == self.pool.blocks_for(len(self.slot_tokens[s])), f"free slot {s}'s blocks"
