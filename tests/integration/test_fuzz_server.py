"""Issue 75's fuzzing suite, bounded: generated hostile requests beside a victim stream.

One real tritonserver (model_repository as shipped) and an OpenAI server in front of it. Victim
streams (greedy, one fixed prompt, EOS suppressed) run one after another on `specguide` while
hypothesis draws hostile requests (tests/integration/fuzz_strategies/: raw tensors for the three
served names, Triton HTTP bodies, OpenAI bodies; sampling_parameters and guides of every type) and
sends them one at a time, after issue 75's measured attacks (`known_attacks`). Then:

- every hostile request got a valid answer or a clear error (tests/integration/fuzz.py says
  precisely which answers count);
- every victim's tokens equal its solo run (taken before the first hostile request), and it ended;
- the server is healthy after: the three names ready, a normal request through each of them and the
  OpenAI server answers, and the server process, its stubs and the engine process are the ones it
  started with (no engine restart: specguide_engine_restarts_total stays 0).

Deterministic: hypothesis draws the same FUZZ_EXAMPLES cases on every run (derandomize, no example
database, no shrinking: a failing case is reported as drawn, with every other failure of the run).
The long run, with counts and the victim's longest gap: bench/bench_fuzz.py.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from .conftest import ROOT, Server, launch, stop_and_check
from .fuzz import GOOD, HANG, INTERNAL, VICTIM_PROMPT, Tally, Victims, engine_state, healthy, send, settle
from .fuzz_strategies import cases, known_attacks
from .openai_helpers import Api

FUZZ_EXAMPLES = int(os.environ.get("SPECGUIDE_FUZZ_EXAMPLES", "300"))
VICTIM_TOKENS = 160  # one victim after another for the whole run; each compared with the solo run
GIVE_UP_AFTER = 3  # hangs or connection failures in a row: the server is broken, stop sending


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> tuple[Server, Api]:
    root = tmp_path_factory.mktemp("fuzz")
    srv = launch(root / "server.log", ROOT / "model_repository")
    api = Api(srv.grpc, root / "api.log")
    api.wait_configured()
    yield srv, api
    api.stop()
    api_log = api.log.read_text(errors="replace")
    try:
        stop_and_check(srv)
    finally:
        assert "Traceback" not in api_log, api_log[-3000:]


def test_hostile_requests_get_answers_or_clear_errors_and_harm_no_victim(stack):
    srv, api = stack
    before = engine_state(srv)
    assert before["engine"] and before["engine_restarts"] == 0, before
    victims = Victims(srv, VICTIM_TOKENS).start()
    tally = Tally()
    broken = [0]

    def attack(case) -> None:
        if broken[0] >= GIVE_UP_AFTER:
            return
        out = send(srv, api.base, case)
        tally.add(case, out, victims.gap(out.t0, out.t1))
        lost = out.verdict == HANG or (out.verdict == INTERNAL and "connection failed" in out.detail)
        broken[0] = broken[0] + 1 if lost or srv.proc.poll() is not None else 0

    drawn = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                     phases=[Phase.generate], suppress_health_check=list(HealthCheck), print_blob=False)(
        given(cases())(attack))
    try:
        for case in known_attacks(victims.solo.ids[0], VICTIM_PROMPT):  # issue 75's measured attacks first
            attack(case)
        drawn()
    finally:
        victims.stop()
    total = sum(tally.per_target.values())
    summary = (f"{total} hostile requests {dict(tally.per_target)}, verdicts {dict(tally.verdicts)}, "
               f"{len(victims.runs)} victims; longest victim gap during one request {tally.max_gap:.2f} s "
               f"({tally.max_gap_case})")
    print(summary)

    failures = [f"{out.verdict} ({out.status}): {out.detail[:400]}\n    request: {case.describe()}"
                for case, out in tally.failures]
    harmed = [f"victim {i}: {why}\n    in flight: {tally.overlapping(victims.when_harmed(r))[:4]}"
              for i, r, why in victims.harmed()]
    settled = settle(srv)
    problems = healthy(srv, api.base) if srv.proc.poll() is None else ["the server exited"]
    problems += [] if settled else ["the engine did not come back (specguide_engine_alive 0)"]
    after = engine_state(srv)

    assert broken[0] < GIVE_UP_AFTER, f"the server stopped answering; {summary}\n" + "\n".join(failures[-GIVE_UP_AFTER:])
    assert not failures, f"{len(failures)} requests got no valid answer nor a clear error ({summary}):\n" + \
        "\n".join(failures[:25])
    assert not harmed, f"{len(harmed)} of {len(victims.runs)} victims harmed ({summary}):\n" + "\n".join(harmed[:10])
    assert victims.runs and all(v in GOOD for v in tally.verdicts), summary
    assert not problems, f"unhealthy after the run: {problems}"
    assert after == before, f"the server, a stub or the engine was restarted: {before} -> {after}"
