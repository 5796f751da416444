"""One token budget per step: how much of a forward the prompt chunks may take beside the decode
rows, and where a chunk is cut to fit. Pure Python."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepBudget:
    """`step_budget` > 0: prompt chunks and decode rows share one forward (Runner.varlen). While
    sequences decode, a step takes `step_budget` tokens' worth of work: the decode rows'
    (lookahead + 1 each) first, prompt chunks the rest (at least a quarter, so that waiting prompts
    always move, and at least each prefilling sequence's fair share: `for_prompts`), cut to fit;
    with nothing decoding, prompt chunks take `prefill_chunk` tokens.
    A token at position p is worth 1 + p * key_cost tokens (its attention: key_cost = a key's
    work / a token's other work), so that a long prompt's last chunks, each token attending to
    thousands of keys, hold the streams no longer than its first. 0: chunks of `prefill_chunk`
    tokens, then the decode batch."""

    prefill_chunk: int
    step_budget: int = 0
    key_cost: float = 0.0
    lookahead: int = 0

    def for_prompts(self, decode_positions: list[int], prompts: int = 0) -> tuple[float, bool]:
        """(what this step's prompt chunks may take, whether in tokens' worth of work; else in
        tokens), beside decode rows whose last tokens sit at `decode_positions`, with `prompts`
        sequences prefilling. Each of those gets as much of the step as a decoding sequence's
        rows on average (up to `prefill_chunk` in all): a burst of requests is not held to a
        quarter of the budget behind the streams its first ones started."""
        if not self.step_budget or not decode_positions:
            return self.prefill_chunk, False
        rows = sum(self.cost(p, self.lookahead + 1) for p in decode_positions)
        share = min(rows * prompts / len(decode_positions), max(self.prefill_chunk, self.step_budget))
        return max(self.step_budget - rows, self.step_budget / 4, share), True

    def cost(self, start: int, n: int) -> float:
        """Tokens' worth of work of n tokens at positions start ..: sum of 1 + p * key_cost."""
        return n + self.key_cost * (n * start + n * (n - 1) / 2)

    def fit(self, start: int, n: int, budget: float) -> int:
        """The most of n tokens at positions start .. whose work fits `budget`."""
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.cost(start, mid) <= budget else (lo, mid - 1)
        return lo
