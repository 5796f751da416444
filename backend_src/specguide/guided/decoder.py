"""GuidedDecoder: per-slot grammar matchers (any backend) and one token bitmask buffer, allocated once.

Row layout: slot s owns rows [s*(K+1), (s+1)*(K+1)); row `s*(K+1) + i` is the mask for the token
at draft position i of slot s (i = 0 for plain decoding; 0..K for a verification step). A draft
step i and the target's position i share one mask row (same vocabulary), so each is computed once.

The operations (`advance`, `rollback`, `fill`, `apply`) are separate methods over slot-indexed
state and touch no request objects, so they can become host callbacks on a CUDA stream.
"""
from __future__ import annotations

from typing import Callable, Literal, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from .. import kernels
from .backend import CompiledGuide, Matcher, allocate_token_bitmask, fill_by_class

Row = tuple[int, int]  # (slot, draft position)
_BITS = (1 << torch.arange(32, dtype=torch.int64)).to(torch.int32)  # [32] bit j of an int32 word


class GuidedDecoder:
    """Grammar state for up to `max_slots` sequences with up to `max_draft_tokens` (K) drafts each."""

    def __init__(self, max_slots: int, max_draft_tokens: int, vocab_size: int, *,
                 num_threads: Union[int, Literal["auto"]] = "auto", pin_memory: Optional[bool] = None):
        assert max_slots >= 1 and max_draft_tokens >= 0 and vocab_size >= 1
        self.max_slots = max_slots
        self.max_draft_tokens = max_draft_tokens
        self.rows_per_slot = max_draft_tokens + 1
        self.num_rows = max_slots * self.rows_per_slot
        self.vocab_size = vocab_size  # the model's logits width == TokenizerInfo.vocab_size
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.bitmask = allocate_token_bitmask(self.num_rows, vocab_size, pin_memory)  # [max_slots*(K+1), ceil(V/32)]
        self.token_mask = np.zeros(self.num_rows, dtype=bool)  # [rows]: row holds a mask to apply
        self.matchers: list[Optional[Matcher]] = [None] * max_slots
        self.grammars: list[Optional[CompiledGuide]] = [None] * max_slots
        # tokens each matcher holds; the tokens themselves are the request's (Sequence.output_ids)
        self.fed = [0] * max_slots
        self.num_threads = num_threads

    # -- slots ---------------------------------------------------------------------------------

    def row(self, slot: int, pos: int = 0) -> int:
        assert 0 <= pos < self.rows_per_slot, f"draft position {pos} out of range"
        return slot * self.rows_per_slot + pos

    def add(self, slot: int, compiled: CompiledGuide) -> None:
        """Start a matcher for a newly admitted guided request (either backend)."""
        assert self.matchers[slot] is None, f"slot {slot} already has a matcher"
        assert compiled.vocab_size == self.vocab_size, "grammar compiled for another vocab size"
        self.matchers[slot] = compiled.matcher()
        self.grammars[slot] = compiled
        self.fed[slot] = 0
        self.clear_slot(slot)

    def remove(self, slot: int) -> None:
        """Free the slot's matcher (finish, cancel, error). A slot without one is a no-op."""
        self.matchers[slot] = None
        self.grammars[slot] = None
        self.fed[slot] = 0
        self.clear_slot(slot)

    def is_guided(self, slot: int) -> bool:
        return self.matchers[slot] is not None

    def clear_slot(self, slot: int) -> None:
        """Mark all of the slot's rows unconstrained."""
        self.token_mask[self.row(slot): self.row(slot) + self.rows_per_slot] = False

    # -- matcher state -------------------------------------------------------------------------

    def advance(self, slot: int, token: int) -> bool:
        """Feed one token; False (state unchanged) when the grammar rejects it or has terminated."""
        ok = self._matcher(slot).accept(int(token))
        self.fed[slot] += ok
        return ok

    def advance_many(self, slot: int, tokens: Sequence[int]) -> int:
        """Feed tokens until one is rejected or the grammar terminates; the number accepted."""
        m, n = self._matcher(slot), 0
        for t in tokens:
            if not m.accept(int(t)):
                break
            n += 1
        self.fed[slot] += n
        return n

    def rollback(self, slot: int, n: int) -> None:
        """Undo the last `n` accepted tokens (e.g. drafts rejected by verification)."""
        if n <= 0:
            return
        assert n <= self.fed[slot], f"slot {slot}: rollback of {n} tokens but only {self.fed[slot]} accepted"
        self._matcher(slot).rollback(n)
        self.fed[slot] -= n

    def is_terminated(self, slot: int) -> bool:
        """The grammar ended and its stop token was accepted."""
        return self._matcher(slot).is_terminated()

    def is_completed(self, slot: int) -> bool:
        """The accepted text is a complete match (the stop token may still be to come)."""
        return self._matcher(slot).is_completed()

    def forced_tokens(self, slot: int, encode: Callable[[str], list[int]], k: int) -> list[int]:
        """Up to k tokens the grammar forces next (xgrammar: its jump-forward string tokenized by
        `encode`; llguidance: its fast-forward tokens): every token returned is accepted in order
        from the slot's current state (the slot's own state is not changed)."""
        return self._matcher(slot).forced_tokens(encode, k)

    def violation(self, slot: int) -> Optional[str]:
        """Why a value-checked (best effort) slot's value cannot end here; None otherwise."""
        m = self.matchers[slot]
        return m.violation() if m is not None else None

    def num_tokens(self, slot: int) -> int:
        """Tokens the slot's matcher holds (fed and not rolled back)."""
        return self.fed[slot]

    # -- masks ---------------------------------------------------------------------------------

    def fill(self, rows: Sequence[Row]) -> None:
        """Fill the masks of `rows` from each slot's current state in one batched, multi-threaded call.

        A slot appears at most once (its matcher has one state). Rows of unguided or terminated
        slots are marked unconstrained."""
        ms: list[Matcher] = []
        idx: list[int] = []
        for slot, pos in rows:
            r, m = self.row(slot, pos), self.matchers[slot]
            if m is None or m.is_terminated():
                self.token_mask[r] = False
                continue
            ms.append(m)
            idx.append(r)
        assert len(set(map(id, ms))) == len(ms), "a slot appears twice in one fill"
        fill_by_class(ms, self.bitmask, idx, self.num_threads)  # one batched call per backend
        self.token_mask[idx] = True

    def fill_verify_rows(self, drafts: Mapping[int, Sequence[int]]) -> dict[int, int]:
        """Masks for a verification step whose drafts are known (n-gram drafter): rows 0..len(d).

        For each guided slot: fill row 0, feed d_0, fill row 1, ... (batched across slots at
        each position). Stops at a draft the grammar rejects or that terminates it; later rows
        stay unconstrained (verification rejects that draft anyway, so they are never used).
        Returns {slot: drafts fed}: after verification accepts `a` drafts, roll back `fed - a`."""
        fed = {s: 0 for s in drafts if self.is_guided(s)}
        for s in fed:
            self.clear_slot(s)
        active = [s for s in fed if not self.is_terminated(s)]
        self.fill([(s, 0) for s in active])
        for i in range(max((len(drafts[s]) for s in active), default=0)):
            active = [s for s in active if i < len(drafts[s])]
            if not active:
                break
            nxt = []
            for s in active:
                if self._matcher(s).accept(int(drafts[s][i])):
                    self.fed[s] += 1
                    fed[s] += 1
                    if not self.is_terminated(s):
                        nxt.append(s)
            active = nxt
            self.fill([(s, i + 1) for s in active])
        return fed

    def apply(self, logits: torch.Tensor, rows: Sequence[Row], d2t: Optional[torch.Tensor] = None) -> None:
        """Mask `logits` [B, V'] in place with mask rows `rows[b]` (host API: tests and tools; the
        step uses GuidedStepper.apply_rows). Unconstrained rows are not touched."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        idx = [self.row(s, p) for s, p in rows]
        constrained = torch.from_numpy(self.token_mask[idx]).to(logits.device)
        mask_logits(logits, self.bitmask[idx].to(logits.device), constrained, self.vocab_size,
                    _BITS.to(logits.device), None if d2t is None else d2t.to(logits.device))

    def allowed_tokens(self, slot: int, pos: int = 0) -> np.ndarray:
        """Token ids a mask row allows (tests and debugging); all ids when unconstrained."""
        r = self.row(slot, pos)
        if not self.token_mask[r]:
            return np.arange(self.vocab_size)
        return bitmask_to_ids(self.bitmask[r], self.vocab_size)

    def viable_now(self, slot: int, skip: frozenset[int] = frozenset(), tries: int = 1024) -> Optional[int]:
        """A token the slot's matcher takes next from its current state, outside `skip` (error paths
        only): its mask's ids, each tried and rolled back (llguidance's mask may allow a byte its
        matcher then refuses). -1 at a dead end, where the vocabulary cannot write what the guide
        requires; None when `tries` ids were refused and more are left (unknown)."""
        m = self._matcher(slot)
        if m.is_terminated():
            return -1
        bitmask = allocate_token_bitmask(1, self.vocab_size)
        m.fill(bitmask, 0)
        ids = [t for t in bitmask_to_ids(bitmask[0], self.vocab_size).tolist() if t not in skip]
        for t in ids[:tries]:
            if m.accept(t):
                m.rollback(1)
                return t
        return -1 if len(ids) <= tries else None

    # -- invariant 3 ---------------------------------------------------------------------------

    def check_fresh(self, slot: int, tokens: Sequence[int]) -> Optional[str]:
        """None when the slot's matcher equals a fresh matcher fed `tokens`, the slot's accepted
        tokens (same count, termination, completion and next-token mask); else what differs."""
        m, g = self.matchers[slot], self.grammars[slot]
        if m is None:
            return None
        if len(tokens) != self.fed[slot]:
            return f"the matcher holds {self.fed[slot]} tokens, the request {len(tokens)}"
        fresh = g.matcher()
        for i, t in enumerate(tokens):
            if not fresh.accept(int(t)):
                return f"a fresh matcher rejects token {i} ({t}) of the request's tokens"
        if fresh.is_terminated() != m.is_terminated():
            return f"terminated: slot {m.is_terminated()}, fresh {fresh.is_terminated()}"
        if fresh.is_completed() != m.is_completed():
            return f"completed: slot {m.is_completed()}, fresh {fresh.is_completed()}"
        if m.is_terminated():
            return None
        masks = allocate_token_bitmask(2, self.vocab_size)
        m.fill(masks, 0)
        fresh.fill(masks, 1)
        if not torch.equal(masks[0], masks[1]):
            diff = np.setxor1d(bitmask_to_ids(masks[0], self.vocab_size), bitmask_to_ids(masks[1], self.vocab_size))
            return f"next-token masks differ on {len(diff)} ids, e.g. {diff[:5].tolist()}"
        return None

    def _matcher(self, slot: int) -> Matcher:
        m = self.matchers[slot]
        if m is None:
            raise KeyError(f"slot {slot} has no grammar matcher")
        return m


def mask_logits(logits: torch.Tensor, words: torch.Tensor, constrained: torch.Tensor, vocab_size: int,
                bits: torch.Tensor, d2t: Optional[torch.Tensor] = None) -> None:
    """logits [R, V'] in place: -inf for the tokens bitmask words [R, ceil(V/32)] disallow, in rows
    where constrained [R] (bool) is set; ids past `vocab_size` too. `d2t` [V'] (int64): the logits
    are a drafter's pruned vocabulary, draft id j standing for target id d2t[j]. No host sync.
    A vectorized torch unpack (faster than xgrammar's CPU kernel; bench/bench_guided_compile.py times it)."""
    R = logits.shape[0]
    if d2t is not None:
        banned = ((words[:, d2t // 32] >> (d2t % 32).to(torch.int32)) & 1).eq(0)  # [R, V']
    else:
        V = min(logits.shape[-1], vocab_size)
        banned = (words.unsqueeze(-1) & bits).eq(0).view(R, -1)[:, :V]  # [R, V]
        if logits.shape[-1] > V:  # ids past the tokenizer's vocabulary
            banned = torch.cat([banned, banned.new_ones(R, logits.shape[-1] - V)], dim=1)
    banned &= constrained.bool()[:, None]
    logits.masked_fill_(banned, float("-inf"))


def mask_rows(logits: torch.Tensor, bitmask: torch.Tensor, token_mask: torch.Tensor, rows: torch.Tensor,
              vocab_size: int, bits: torch.Tensor, d2t: Optional[torch.Tensor] = None) -> None:
    """`mask_logits` with mask rows `rows` [R] of bitmask [N, ceil(V/32)] and token_mask [N]: on CPU
    one C loop in place (kernels.mask_logits_rows: torch's gather and unpack cost ~20x as much),
    elsewhere gathered and unpacked by torch."""
    if kernels.mask_logits_rows(logits, bitmask, token_mask, rows, vocab_size, d2t):
        return
    mask_logits(logits, bitmask.index_select(0, rows), token_mask.index_select(0, rows), vocab_size, bits, d2t)


def bitmask_to_ids(row: torch.Tensor, vocab_size: int) -> np.ndarray:
    """The ids whose bit is set in one bitmask row [ceil(V/32)] int32."""
    bits = np.unpackbits(row.cpu().numpy().view(np.uint8), bitorder="little")[:vocab_size]  # [V]
    return np.flatnonzero(bits)
