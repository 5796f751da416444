"""Cost-aware speculation: draft only when the measured cost of a speculative step is repaid.

Per batch size b the engine measures the wall time of decode steps (CPU: a host clock, no device
sync) as two moving averages: plain steps t_off(b) and speculative steps t_spec(b, K). A step
with per-slot budgets k_i and per-slot acceptance rates r_i is expected to yield
    E = sum_i (1 + r_i + r_i^2 + ... + r_i^k_i)     tokens (accepted drafts + the bonus token)
against b for a plain step. It speculates iff E / t_spec(b, max k) >= b / t_off(b). Unmeasured
costs are explored first (speculate, then one plain step); then, at each batch size, every
`probe_spec_every`-th step drafts even when not worth it (fresh acceptance rates and t_spec) and
every `probe_off_every`-th step decodes plainly even when drafting pays (fresh t_off; rarer, since
a needless plain step costs a whole step's worth of accepted drafts).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepCosts:
    """Moving averages of decode-step wall time, keyed by (batch size, K) with K = 0 for plain steps."""

    probe_spec_every: int = 16
    probe_off_every: int = 64
    decay: float = 0.8  # weight of the old average
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)  # decisions taken per batch size

    def record(self, batch: int, k: int, seconds: float) -> None:
        key = (batch, k)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    @staticmethod
    def expected_tokens(k: int, rate: float) -> float:
        """Tokens one verification yields for a slot drafting k tokens accepted at `rate` each."""
        return sum(rate ** j for j in range(k + 1))

    def speculate(self, ks: list[int], rates: list[float]) -> bool:
        """Whether this step should verify drafts (True) or decode plainly (False)."""
        assert len(ks) == len(rates)
        b, kmax = len(ks), max(ks)
        if kmax == 0:
            return False
        n = self.steps[b] = self.steps.get(b, 0) + 1
        t_spec, t_off = self.seconds.get((b, kmax)), self.seconds.get((b, 0))
        if t_spec is None:
            return True  # explore: measure speculation first
        if t_off is None:
            return False  # then one plain step
        gain = sum(self.expected_tokens(k, r) for k, r in zip(ks, rates)) / t_spec
        if gain >= b / t_off:
            return n % self.probe_off_every != 0
        return n % self.probe_spec_every == 0
