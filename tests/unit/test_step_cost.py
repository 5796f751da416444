"""Cost-aware speculation (StepCosts): explores both choices, then drafts only while repaid, and probes."""
from __future__ import annotations

import pytest

from specguide.speculative.step_cost import StepCosts


def decide(costs: StepCosts, ks, rates, t_off: float, t_spec: float, steps: int) -> list[bool]:
    """Run `steps` decisions, feeding back the wall time the chosen step would take."""
    out = []
    for _ in range(steps):
        spec = costs.speculate(ks, rates)
        costs.record(len(ks), max(ks) if spec else 0, t_spec if spec else t_off)
        out.append(spec)
    return out


def test_expected_tokens_is_the_geometric_sum():
    assert StepCosts.expected_tokens(0, 0.9) == 1.0
    assert StepCosts.expected_tokens(3, 1.0) == 4.0
    assert StepCosts.expected_tokens(2, 0.5) == pytest.approx(1.75)


def test_grammar_forced_drafts_count_as_accepted():
    assert StepCosts.expected_tokens(3, 0.5, forced=2) == pytest.approx(1 + 2 + 0.5)
    assert StepCosts.expected_tokens(2, 0.0, forced=5) == 3.0  # at most k of them
    # poor free drafts (10%) but the grammar forces all 3: a step 1.6x as long yields 4 tokens
    costs = StepCosts()
    costs.record(1, 3, 0.016)
    costs.record(1, 0, 0.010)
    assert costs.speculate([3], [0.1], [3])
    assert not costs.speculate([3], [0.1], [0])


def test_cheap_rows_and_good_drafts_keep_speculating():
    # 8 slots at 75% acceptance, K=1: 1.75 tokens each for a step 1.3x as long as a plain one
    got = decide(StepCosts(probe_spec_every=16, probe_off_every=32), [1] * 8, [0.75] * 8,
                 t_off=0.030, t_spec=0.039, steps=96)
    assert got[:2] == [True, False]  # explore: speculate, then one plain step
    assert [i + 1 for i, s in enumerate(got) if not s and i >= 2] == [32, 64, 96]  # only probes decode plainly


def test_costly_rows_and_poor_drafts_stop_speculating_and_probe_ever_more_rarely():
    # 8 slots at 23% acceptance, K=1: 1.23 tokens each for a step 1.4x as long
    got = decide(StepCosts(probe_spec_every=16, probe_spec_max=128, probe_off_every=32), [1] * 8, [0.23] * 8,
                 t_off=0.030, t_spec=0.042, steps=500)
    assert got[:2] == [True, False]
    # only probes speculate: after 16 steps, then at intervals doubling up to 128
    assert [i + 1 for i, s in enumerate(got) if s and i >= 2] == [16, 48, 112, 240, 368, 496]


def test_a_probe_that_pays_starts_the_probe_intervals_again():
    costs = StepCosts(probe_spec_every=16, probe_spec_max=128, probe_off_every=1000)
    # 20% acceptance, a step 1.35x as long: repaid at 35% (within reach of a probe)
    poor = decide(costs, [1] * 4, [0.2] * 4, t_off=0.02, t_spec=0.027, steps=100)
    assert [i + 1 for i, s in enumerate(poor) if s and i >= 2] == [16, 48]
    good = decide(costs, [1] * 4, [0.9] * 4, t_off=0.02, t_spec=0.027, steps=12)  # drafts got good: pays
    assert all(good)
    again = decide(costs, [1] * 4, [0.2] * 4, t_off=0.02, t_spec=0.027, steps=60)  # poor again, from step 113
    assert [113 + i for i, s in enumerate(again) if s] == [128, 160]  # 16 steps on, then 32 (not 128)


def test_probes_wait_longest_where_no_plausible_acceptance_would_repay_the_step():
    # 8 slots, K=1, a verification step 1.9x a plain one (Zen 3, guided): repaid only at 88%
    # acceptance, 28 points above today's 60%: after the first probe (the second sample of its cost)
    # the one due 32 steps later waits the longest interval instead, and so do the next
    got = decide(StepCosts(probe_spec_every=16, probe_spec_max=128, probe_off_every=1000), [1] * 8, [0.6] * 8,
                 t_off=0.025, t_spec=0.047, steps=320)
    assert got[:2] == [True, False]
    assert [i + 1 for i, s in enumerate(got) if s and i >= 2] == [16, 176, 304]  # was 16, 48, 112, 240
    # within reach (75% -> 88% would repay it): probes as before
    got = decide(StepCosts(probe_spec_every=16, probe_spec_max=128, probe_off_every=1000), [1] * 8, [0.75] * 8,
                 t_off=0.025, t_spec=0.047, steps=320)
    assert [i + 1 for i, s in enumerate(got) if s and i >= 2] == [16, 48, 112, 240]


def test_decision_follows_changing_costs_and_batch_sizes_separately():
    costs = StepCosts(probe_spec_every=1000, probe_off_every=1000)
    decide(costs, [3], [0.5], t_off=0.02, t_spec=0.022, steps=4)  # batch 1: 1.875 tokens for 1.1x: draft
    assert costs.speculate([3], [0.5])
    decide(costs, [1] * 4, [0.5] * 4, t_off=0.02, t_spec=0.05, steps=4)  # batch 4: 1.5x tokens for 2.5x
    assert not costs.speculate([1] * 4, [0.5] * 4)
    assert costs.speculate([3], [0.5])  # batch 1 unaffected
    for _ in range(30):  # batch 1 speculative steps get slow: the average follows, drafting stops
        costs.record(1, 3, 0.06)
    assert not costs.speculate([3], [0.5])
    assert not costs.speculate([0], [0.9])  # no budget: never drafts


def test_one_slow_first_verification_does_not_keep_drafting_off():
    # the first speculative step after start-up pays one-time costs (35 ms); the steps after it
    # take 11 ms against 5.5 ms plain, and 3 drafts at 90% repay that (3.4 tokens for 2x)
    costs = StepCosts(probe_spec_every=16, probe_spec_max=128, probe_off_every=1000)
    assert costs.speculate([3], [0.9])
    costs.record(1, 3, 0.035)
    got = decide(costs, [3], [0.9], t_off=0.0055, t_spec=0.011, steps=60)
    assert not got[0]  # one plain step, measured
    assert all(got[20:])  # from the first probe on, drafting again (was: off until several probes)
