"""Cost-aware speculation: draft only when the measured cost of a speculative step is repaid.

Per batch size b the engine measures the wall time of decode steps (CPU: a host clock, no device
sync) as two moving averages (a faster step resets one): plain steps t_off(b) and speculative
steps t_spec(b, K). A step
with per-slot budgets k_i, of which f_i are tokens the slot's grammar forces (taken as accepted),
and per-slot acceptance rates r_i of the other drafts is expected to yield
    E = sum_i (1 + f_i + r_i + r_i^2 + ... + r_i^(k_i - f_i))     tokens (accepted drafts + the bonus token)
against b for a plain step. It speculates iff E / t_spec(b, max k) >= b / t_off(b). Unmeasured
costs are explored first (speculate, then one plain step). While drafting does not pay at a batch
size, a probe step drafts anyway (fresh acceptance rates and t_spec): the first after
`probe_spec_every` steps, then at doubling intervals up to `probe_spec_max` while each probe
finds it still does not pay (a probe costs a verification's extra rows and the draft head's
catch-up of every row since the last one); a step that pays starts the intervals again. Where
even acceptance `reach` above today's rates would not repay the step as measured twice or more
(large batches on a CPU whose verification rows cost nearly a whole row each), probes wait the
longest interval. While
drafting pays, every `probe_off_every`-th step decodes plainly (fresh t_off; rarer, since a
needless plain step costs a whole step's worth of accepted drafts).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class StepCosts:
    """Moving averages of decode-step wall time, keyed by (batch size, K) with K = 0 for plain steps."""

    probe_spec_every: int = 16  # steps to the first probe while drafting does not pay
    probe_spec_max: int = 128  # the longest interval between probes (each doubles the last)
    probe_off_every: int = 64
    decay: float = 0.8  # weight of the old average
    reach: float = 0.2  # how far above a slot's acceptance estimate a probe may find it
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    samples: dict[tuple[int, int], int] = field(default_factory=dict)  # steps measured per key
    steps: dict[int, int] = field(default_factory=dict)  # decisions taken per batch size
    next_probe: dict[int, tuple[int, int]] = field(default_factory=dict)  # batch size -> (step, interval)

    def record(self, batch: int, k: int, seconds: float) -> None:
        key = (batch, k)
        old = self.seconds.get(key)
        # NOTE: a sample below the average replaces it; one above moves it by 1 - decay. Noise on a
        # shared CPU only adds time, and a shape's first step pays one-time costs (the first
        # verification after start-up takes several steps' time): averaged in, one such sample would
        # keep drafting off through several probes (hundreds of steps) where drafting pays
        self.samples[key] = self.samples.get(key, 0) + 1
        self.seconds[key] = seconds if old is None or seconds < old else self.decay * old + (1 - self.decay) * seconds

    @staticmethod
    def expected_tokens(k: int, rate: float, forced: int = 0) -> float:
        """Tokens one verification yields for a slot drafting k tokens, the first `forced` of them
        the grammar's (taken as accepted), the rest accepted at `rate` each."""
        f = min(forced, k)
        return 1 + f + sum(rate ** j for j in range(1, k - f + 1))

    def speculate(self, ks: list[int], rates: list[float], forced: Optional[list[int]] = None) -> bool:
        """Whether this step should verify drafts (True) or decode plainly (False)."""
        assert len(ks) == len(rates)
        forced = forced or [0] * len(ks)
        b, kmax = len(ks), max(ks)
        if kmax == 0:
            return False
        n = self.steps[b] = self.steps.get(b, 0) + 1
        t_spec, t_off = self.seconds.get((b, kmax)), self.seconds.get((b, 0))
        if t_spec is None:
            return True  # explore: measure speculation first
        if t_off is None:
            return False  # then one plain step
        def pays(up: float) -> bool:  # with every slot's acceptance `up` higher
            tokens = sum(self.expected_tokens(k, min(1.0, r + up), f) for k, r, f in zip(ks, rates, forced))
            return tokens / t_spec >= b / t_off
        if pays(0.0):
            self.next_probe.pop(b, None)  # pays: probes start again from the first interval
            return n % self.probe_off_every != 0
        every = self.probe_spec_every
        at, interval = self.next_probe.setdefault(b, ((n // every + 1) * every, every))
        if n < at:
            return False
        # out of reach (judged on two samples at least: a first step may pay one-time costs): no probe yet
        if interval < self.probe_spec_max and self.samples.get((b, kmax), 0) >= 2 and not pays(self.reach):
            self.next_probe[b] = (n + self.probe_spec_max, self.probe_spec_max)
            return False
        interval = min(2 * interval, self.probe_spec_max)
        self.next_probe[b] = (n + interval, interval)
        return True
