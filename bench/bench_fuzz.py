"""The fuzzing suite's long run (issue 75): generated hostile requests through the three served names
and the OpenAI server beside victim streams, with counts.

    python bench/bench_fuzz.py [--count 10000] [--seed 0] [--concurrency 2] [--victim-tokens 400]
                               [--targets specguide,specguide_unary,specguide_vllm,http,openai_completions,openai_chat]
                               [--settings key=value,...] [--autogroup off|keep] [--no-known] [--json out.json] [--failures out.jsonl]
                               [--logs DIR] [--record FILE | --replay FILE [--range a:b]]

Starts `scripts/tritonserver.py serve` (under specguide.process.supervisor, which restarts a server whose
stub died and counts it in specguide_server_restarts_total) on free ports with a copy of
model_repository/ (`--settings` applied to specguide's config.pbtxt), and an OpenAI server in front of
it. Victim streams (greedy, one fixed prompt, `--victim-tokens` long, EOS suppressed) run one after
another on `specguide` for the whole run; each is compared with the solo run taken first. Hypothesis
draws `--count` cases from tests/integration/fuzz_strategies/ (`--seed` picks the draw; the same
seed draws the same cases), after issue 75's measured attacks (`known_attacks`, unless `--no-known`), sent `--concurrency` at a time and judged as tests/integration/fuzz.py
says (ok / refused: a valid answer or a clear error; internal / hang / malformed: a finding).

The client (this process: drawing cases, sending them) runs at nice 5 once the server and the victims'
process run (and its session's scheduler autogroup too; the victims' process has a session of its
own): it stands for a client on another machine, whose CPU is not the server's (drawing a
[64, 49152] float tensor in Python takes a core for seconds, and on 2 cores that slowed the engine's
steps under it to 1-2 s). The kernel's session autogroups are off for the run where this process may
turn them off (root; `--autogroup keep` leaves them): with them on, the victims' own process stood
still for seconds beside the busy server (see `autogroups`). The victims' process reports its own
stalls (a heartbeat), and each long wait printed says how much of it the victims themselves stood still.

`--record` writes every request in the order sent; `--replay` sends them again (a slice of them with
`--range`), to find which one a crash or a harmed victim followed.

Prints: the CPU, requests per target, verdicts, error classes (the message with its numbers and
quoted values cut), each finding (first of its class, with the request), victims run and harmed
(with the requests in flight when each went wrong), the longest victim gap between tokens during
any single hostile request (and which), engine and server restarts, and the health check after.
Goals (issue 75): >= 10,000 requests, 0 victims harmed, 0 engine restarts, 0 server restarts; a
victim's longest gap during any single hostile request under 1 s.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from tests.integration.conftest import _stop, launch, repository_with  # noqa: E402
from tests.integration.fuzz import GOOD, OWN_STALL_S, VICTIM_PROMPT, Tally, Victims, engine_state, healthy, send, settle  # noqa: E402
from tests.integration.fuzz_strategies import TARGETS, cases, known_attacks  # noqa: E402
from tests.integration.openai_helpers import Api  # noqa: E402

from machine import cpu_header, cpu_model  # noqa: E402  (bench/ is on sys.path when run as a script)
from specguide.process.ipc import renice  # noqa: E402

CLIENT_NICE = 5  # the hostile client's priority (and its autogroup's) once the server and the victims run (see run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=10_000, help="hostile requests")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed (the same seed draws the same cases)")
    ap.add_argument("--concurrency", type=int, default=2, help="hostile requests in flight at once")
    ap.add_argument("--victim-tokens", type=int, default=400)
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--settings", default="", help="config.pbtxt overrides, key=value,...")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds a request may take before it counts as a hang")
    ap.add_argument("--autogroup", choices=("off", "keep"), default="off",
                    help="off: turn the kernel's session autogroups off for the run (root; restored after)")
    ap.add_argument("--no-known", action="store_true", help="leave out issue 75's measured attacks (sent first)")
    ap.add_argument("--json", type=Path, help="write the counts here")
    ap.add_argument("--failures", type=Path, help="write every finding here (one JSON object a line)")
    ap.add_argument("--logs", type=Path, help="copy the server's and the OpenAI server's logs into this folder")
    ap.add_argument("--record", type=Path, help="write every request, in the order sent, here (pickle) for --replay")
    ap.add_argument("--replay", type=Path, help="send the requests a --record run wrote (its --range a:b) instead of drawing")
    ap.add_argument("--range", default=":", help="with --replay: which of the recorded requests, as a Python slice a:b")
    args = ap.parse_args()
    targets = tuple(t for t in args.targets.split(",") if t)
    settings_ = dict(kv.split("=", 1) for kv in args.settings.split(",") if kv)
    print(cpu_header() + f"; load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    print(f"settings: {settings_ or 'model_repository defaults'}; {args.count} requests to {', '.join(targets)}, "
          f"{args.concurrency} at a time, seed {args.seed}", flush=True)
    with autogroups(args.autogroup == "keep"), tempfile.TemporaryDirectory() as tmp:
        server = launch(Path(tmp) / "server.log", repository_with(Path(tmp), settings_), command="serve")
        api = Api(server.grpc, Path(tmp) / "api.log")
        try:
            api.wait_configured()
            result = run(server, api, args, targets)
        finally:
            api.stop()
            _stop(server.proc)
            server_log = server.log.read_text(errors="replace")
            api_log = api.log.read_text(errors="replace")
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                (args.logs / "server.log").write_text(server_log)
                (args.logs / "api.log").write_text(api_log)
    result["server_log_tracebacks"] = server_log.count("Traceback")
    result["openai_log_tracebacks"] = api_log.count("Traceback")
    print(f"tracebacks in the logs: server {result['server_log_tracebacks']}, OpenAI server {result['openai_log_tracebacks']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


@contextlib.contextmanager
def autogroups(keep: bool):
    """The kernel's session autogroups off for the run, where this process may (root), and as before after.

    NOTE: with autogroups on (the default of most kernels, for processes outside a container's cgroup),
    the victims' process, a session of its own that sleeps between tokens, stood still for 0.5-2.7 s at
    a time beside the busy server and client on 2 cores (its own heartbeat overslept over exactly the
    waits counted), while the engine made each token and the stub sent it on time. Clients on other
    machines, and a server in a container's cgroup, see no such thing. Off, the same repro's longest
    victim wait was under 60 ms; the client then yields by its own nice alone."""
    path = Path("/proc/sys/kernel/sched_autogroup_enabled")
    try:
        before = path.read_text().strip()
    except OSError:
        before = ""
    if keep or before != "1":
        print(f"scheduler autogroups: {'on' if before == '1' else 'off' if before == '0' else 'not in this kernel'} (kept)")
        yield
        return
    try:
        path.write_text("0")
    except OSError as e:
        print(f"scheduler autogroups: on (turning them off failed: {e}); the victims' own stalls are reported")
        yield
        return
    print("scheduler autogroups: off for the run (on again after)")
    try:
        yield
    finally:
        path.write_text(before)


def replayed(path: Path, where: str) -> list:
    """The requests a --record run sent, sliced by `where` ("a:b")."""
    cases = []
    with open(path, "rb") as f:
        while True:
            try:
                cases.append(pickle.load(f))
            except EOFError:
                break
    a, _, b = where.partition(":")
    return cases[int(a) if a else None:int(b) if b else None]


def run(server, api, args, targets) -> dict:
    before = engine_state(server)
    victims = Victims(server, args.victim_tokens).start()
    # NOTE: the hostile client's own work (hypothesis draws tensors of megabytes in Python, tritonclient
    # serializes them) stands for a client on another machine: from here this process (its later
    # threads too) yields the 2 cores to the server and the victims' process, started above at the
    # default priority. Taking them, it slowed every engine step under it (1-2 s steps of 2 rows).
    renice(CLIENT_NICE)
    try:  # and so does its session's scheduler autogroup, which the server's (a session of its own) competes with
        Path("/proc/self/autogroup").write_text(str(CLIENT_NICE))
    except OSError:
        pass
    tally = Tally()
    gaps: list[float] = []
    pool = ThreadPoolExecutor(args.concurrency)
    slots = threading.Semaphore(args.concurrency)
    t_start = time.perf_counter()
    sent = [0]
    stopping = threading.Event()  # SIGINT / SIGTERM: stop drawing, finish what is in flight, print the counts

    class Interrupted(Exception):
        pass

    def on_signal(signum, frame) -> None:
        print(f"  signal {signum}: stopping after the requests in flight", flush=True)
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    def take_slot() -> None:
        while not slots.acquire(timeout=1.0):
            if stopping.is_set():
                raise Interrupted
        if stopping.is_set():
            slots.release()
            raise Interrupted

    def one(case) -> None:
        tally.began(case)
        try:
            out = send(server, api.base, case, timeout=args.timeout)
            gap = victims.gap(out.t0, out.t1)
            if gap is not None:
                gaps.append(gap)
            tally.add(case, out, gap)
        finally:
            slots.release()

    record = open(args.record, "wb") if args.record else None

    def submit(case) -> None:
        take_slot()
        if record is not None:
            pickle.dump(case, record)
            record.flush()
        pool.submit(one, case)

    @seed(args.seed)
    @settings(max_examples=max(args.count, 1), deadline=None, derandomize=False, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(cases(targets))
    def draw(case) -> None:
        submit(case)
        sent[0] += 1
        if sent[0] % 500 == 0:
            el = time.perf_counter() - t_start
            print(f"  {sent[0]} sent in {el:.0f} s: {dict(tally.verdicts)}; victims {victims.progress()} "
                  f"({len(victims.harmed())} harmed); longest gap {tally.max_gap:.2f} s", flush=True)

    done = threading.Event()

    def monitor() -> None:  # what is slow, while it is slow
        while not done.wait(30):
            for line in tally.slow(30):
                print(f"  in flight {line}", flush=True)

    threading.Thread(target=monitor, daemon=True).start()
    finished = False
    try:
        if args.replay:
            for case in replayed(args.replay, args.range):
                submit(case)
                sent[0] += 1
        else:
            if not args.no_known:
                for case in known_attacks(victims.solo.ids[0], VICTIM_PROMPT):  # issue 75's measured attacks first
                    if case.target in targets:
                        submit(case)
            if args.count:
                draw()
    except Interrupted:
        pass
    finally:
        pool.shutdown(wait=True)
        if record is not None:
            record.close()
        finished = not stopping.is_set()
        done.set()
        victims.stop(abandon=not finished)
    elapsed = time.perf_counter() - t_start
    harmed = victims.harmed()
    settle(server)  # an engine restarted by the watchdog or after a crash: counted once it is back
    after = engine_state(server)
    problems = healthy(server, api.base) if server.proc.poll() is None else ["the server exited"]
    after_health = engine_state(server)

    total = sum(tally.per_target.values())
    if not finished:
        print(f"\nINTERRUPTED after {sent[0]} drawn requests (a signal): the counts below are partial")
    print(f"\n{total} hostile requests in {elapsed:.0f} s ({total / elapsed:.1f}/s; load average {os.getloadavg()[0]:.1f} "
          f"at the end)")
    print("per target: " + ", ".join(f"{t} {n}" for t, n in sorted(tally.per_target.items())))
    print("verdicts: " + ", ".join(f"{v} {n}" for v, n in tally.verdicts.most_common()))
    print("answers by class (most common 40):")
    for cls, n in tally.classes.most_common(40):
        print(f"  {n:6d}  {cls}")
    print(f"findings (no valid answer nor a clear error): {len(tally.failures)}")
    seen: set[str] = set()
    for case, out in tally.failures:
        cls = out.error_class()
        if cls in seen:
            continue
        seen.add(cls)
        n = sum(1 for _, o in tally.failures if o.error_class() == cls)
        print(f"  [{n}x] {out.verdict} ({out.status}) {out.detail[:300]}\n      request: {case.describe(500)}")
    print(f"victims: {len(victims.runs)} of {args.victim_tokens} tokens, {len(harmed)} harmed")
    for i, r, why in harmed[:20]:
        print(f"  victim {i}: {why}\n      in flight: {tally.overlapping(victims.when_harmed(r))[:4]}")
    if gaps:
        q = statistics.quantiles(gaps, n=100) if len(gaps) > 1 else [gaps[0]] * 99
        print(f"victim gap between tokens during one hostile request: p50 {statistics.median(gaps) * 1e3:.0f} ms, "
              f"p99 {q[98] * 1e3:.0f} ms, longest {tally.max_gap * 1e3:.0f} ms (goal < 1 s) during\n  {tally.max_gap_case}")
        # what was in flight over the longest waits themselves (a short request queued behind a long
        # one in the same model instance has the long one's wait in its window)
        waits = sorted(((b - a, a, b, lag) for r in victims.runs
                        for a, b, lag in zip(r.times, r.times[1:], r.lags[1:])), reverse=True)
        for w, a, b, lag in waits[:3]:
            # the token that ended the wait left the engine `lag` before it arrived: a wait the engine
            # made (it produced the token late) has a small lag; one made after it (the stub, Triton,
            # gRPC) a lag near the wait
            left = "" if lag is None else f"; its token left the engine {lag * 1e3:.0f} ms before it arrived"
            own = victims.own_stall(a, b)  # the victims' process not run at all: the machine's, not the server's
            still = f"; the victims' own process stood still {own * 1e3:.0f} ms of it" if own else ""
            print(f"  a {w * 1e3:.0f} ms wait at {a - t_start:.1f} s (monotonic {a:.3f} to {b:.3f}{left}{still}); "
                  f"in flight over it:")
            for d in tally.spanning(a, b)[:4]:
                print(f"      {d}")
    own = sorted((b - a for a, b in victims.stalls), reverse=True)
    print(f"the victims' own process stood still {len(own)} times for {1e3 * OWN_STALL_S:.0f} ms or more"
          + (f" (longest {own[0] * 1e3:.0f} ms): a wait over such a stall is the client machine's" if own else ""))
    restarts = {"engine": after_health["engine_restarts"] - before["engine_restarts"],
                "server": after_health["server_restarts"] - before["server_restarts"]}
    same = {k: before[k] == after[k] for k in ("stubs", "engine")}
    print(f"engine restarts {restarts['engine']:.0f}, server restarts {restarts['server']:.0f} "
          f"(same stubs {same['stubs']}, same engine process {same['engine']})")
    print(f"health after: {'ok' if not problems else problems}")
    if args.failures:
        with open(args.failures, "w") as f:
            for case, out in tally.failures:
                f.write(json.dumps({"verdict": out.verdict, "status": out.status, "detail": out.detail[:2000],
                                    "request": case.describe(4000)}) + "\n")
    return {
        "cpu": cpu_model(), "count": total, "seed": args.seed, "concurrency": args.concurrency, "elapsed_s": elapsed,
        "per_target": dict(tally.per_target), "verdicts": dict(tally.verdicts),
        "classes": dict(tally.classes.most_common(200)), "findings": len(tally.failures),
        "finding_classes": sorted(seen), "victims": len(victims.runs), "victims_harmed": len(harmed),
        "victim_gap_p50_s": statistics.median(gaps) if gaps else None, "victim_gap_max_s": tally.max_gap,
        "victim_gap_max_case": tally.max_gap_case, "victim_own_stall_max_s": own[0] if own else 0.0,
        "autogroup": args.autogroup, "engine_restarts": restarts["engine"],
        "server_restarts": restarts["server"], "health_problems": problems,
        "interrupted": not finished,
        "all_good": finished and not tally.failures and not harmed and not problems and not any(restarts.values())
        and all(v in GOOD for v in tally.verdicts),
    }


if __name__ == "__main__":
    main()
