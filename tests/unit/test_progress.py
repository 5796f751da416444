"""Progress lines of the offline jobs (draft-head training): counts, rate, ETA, at most every few seconds."""
from __future__ import annotations

import logging
import threading

from specguide.util.progress import Progress, fmt_s


def test_progress_reports_counts_rate_and_eta_and_throttles(caplog):
    caplog.set_level(logging.INFO, logger="specguide")
    p = Progress("features", 10, "samples", every_s=3600)
    p.t0 -= 4.0  # 4 s ago
    p.update(4)  # throttled: no line before every_s unless finished
    assert [r.getMessage() for r in caplog.records] == ["features: 0/10 samples"]
    line = p.line(p.t0 + 4.0)
    assert line.startswith("features: 4/10 samples (40%), 1.0/s, ETA 6s"), line
    threads = [threading.Thread(target=p.update) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.done == 10 and caplog.records[-1].getMessage().endswith("done")  # the last item always logs


def test_eta_format():
    assert (fmt_s(5.4), fmt_s(125), fmt_s(float("inf"))) == ("5s", "2m05s", "?")
