"""What an idle served replica costs: CPU and memory of every process under tritonserver while no
request runs.

    python bench/bench_idle.py [--seconds 30] [--settle 15]

Starts tritonserver over the whole repository (`specguide` and both proxies, as `make serve`
serves them: `bench_interfaces.Server`), waits until it is ready and `--settle` seconds more (the
engine's warm-up, the compile workers' imports), then reads each process's CPU time (utime +
stime, every thread) over `--seconds` with nothing sent, and each one's memory at the end: RSS,
PSS (shared pages split between their users: the column that adds up) and anonymous RSS. A fleet
keeps many replicas idle; on a 2-core machine each percent of a core here is half a percent of
the machine.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_interfaces import Server  # noqa: E402
from bench_openai import cpu_seconds, wait  # noqa: E402
from machine import cpu_header  # noqa: E402
from specguide.process.supervisor import descendants  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--settle", type=float, default=15.0)
    args = ap.parse_args()
    print(cpu_header(), flush=True)
    srv = Server(("specguide", "specguide_vllm", "specguide_unary"))
    try:
        wait(f"http://127.0.0.1:{srv.http}/v2/health/ready", "tritonserver", srv.proc)
        time.sleep(args.settle)
        pids = [srv.proc.pid, *descendants(srv.proc.pid)]
        names = {p: Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace").split("\0") for p in pids}
        before = {p: cpu_seconds(p) for p in pids}
        time.sleep(args.seconds)
        rows = [(100 * (cpu_seconds(p) - before[p]) / args.seconds, memory_mib(p), names[p]) for p in pids]
    finally:
        srv.stop()
    print(f"\nidle for {args.seconds:g} s after {args.settle:g} s settling\n")
    print("| process | % of one core | RSS MiB | PSS MiB | anonymous MiB |\n| --- | ---: | ---: | ---: | ---: |")
    for pct, mem, argv in rows:
        line = " ".join(argv)
        short = ("tritonserver" if argv[0].endswith("bin/tritonserver") else
                 f"stub of {Path(argv[1]).parts[-3]}" if argv[0].endswith("python_backend_stub") else
                 "engine process" if "engine_process" in line else
                 "compile worker" if "compile_worker" in line else line[:60])
        print(f"| {short} | {pct:.2f} | " + " | ".join(f"{v:.0f}" for v in mem) + " |")
    totals = [sum(r[1][i] for r in rows) for i in range(3)]
    print(f"| all | {sum(r[0] for r in rows):.2f} | {totals[0]:.0f} | {totals[1]:.0f} | {totals[2]:.0f} |")


def memory_mib(pid: int) -> tuple[float, float, float]:
    """(RSS, PSS, anonymous RSS) of `pid` in MiB, from /proc/PID/smaps_rollup; zeros once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            kib = {k.strip(): int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in f if ":" in ln)
                   if v.strip().endswith("kB")}
    except OSError:
        return 0.0, 0.0, 0.0
    return kib["Rss"] / 1024, kib["Pss"] / 1024, kib["Anonymous"] / 1024


if __name__ == "__main__":
    main()
