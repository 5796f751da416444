"""The hybrid drafter's host side: per row and draft position, the token that wins outright
(grammar-forced, else a trusted n-gram chain) and the n-gram fallback the step picks when the head
is unsure. Called from the grammar stream's callbacks after each draft (guided/grammar_worker.py); the
pick itself is a device-side select in the step (engine/step.py)."""
from __future__ import annotations

from typing import Callable, Optional

from .ngram import NgramDrafter

HEAD_UNSURE = 0.3  # below this top probability of the head, an n-gram continuation wins
NONE = -1


class HybridPicks:
    """One step's proposals. `histories[b]`: the row's prompt + output (a copy, extended with each
    picked draft); `forced(slot, k)`: up to k grammar-forced tokens from the slot's matcher state."""

    def __init__(self, histories: list[list[int]], forced: Callable[[int, int], list[int]],
                 ngram: NgramDrafter, trust: int, ks: list[int]):
        self.hist, self.forced, self.ngram, self.trust, self.ks = histories, forced, ngram, trust, ks
        self.chain: list[list[int]] = [[] for _ in histories]  # tokens that win the next positions

    def propose(self, b: int, i: int, slot: Optional[int]) -> tuple[int, int]:
        """(fixed, fallback) for draft position i of row b (`slot` None: no grammar to ask)."""
        if not self.chain[b]:
            k = self.ks[b] - i
            forced = self.forced(slot, k) if slot is not None else []
            self.chain[b], cont = self.ngram.chain(self.hist[b], forced, k, self.trust)
            if not self.chain[b]:
                return NONE, cont[0] if cont else NONE
        return self.chain[b][0], NONE

    def picked(self, b: int, token: int) -> None:
        """Draft i of row b was `token`: the chain goes on only if it was the chain's token."""
        self.hist[b].append(token)
        if self.chain[b] and self.chain[b][0] == token:
            self.chain[b].pop(0)
        else:
            self.chain[b] = []
