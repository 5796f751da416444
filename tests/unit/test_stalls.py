"""util/stalls.py: a pause of SLOW_S or longer is logged with the monotonic clock it ended at; a
shorter one is not; a slow garbage collection is logged once the watch is installed."""
from __future__ import annotations

import gc
import re
import time

from specguide.util import stalls


def test_a_slow_pause_is_logged_with_when_it_ended_and_a_short_one_is_not(monkeypatch):
    lines: list[str] = []
    stalls.report("test turn", stalls.SLOW_S / 2, "x", lines.append)
    assert lines == []
    t = time.monotonic()
    stalls.report("test turn", stalls.SLOW_S + 0.5, "2 decode rows", lines.append)
    m = re.fullmatch(r"slow test turn: (\S+) s, ended at monotonic (\S+) \(2 decode rows\)", lines[0])
    assert m and float(m.group(1)) == round(stalls.SLOW_S + 0.5, 2) and abs(float(m.group(2)) - t) < 60
    # a second later at most: the next line counts what it left out
    stalls.report("test turn", stalls.SLOW_S + 1.0, "", lines.append)
    stalls.report("test turn", stalls.SLOW_S + 0.1, "", lines.append)
    assert len(lines) == 1
    monkeypatch.setattr(stalls, "EVERY_S", 0.0)
    stalls.report("test turn", stalls.SLOW_S, "", lines.append)
    assert lines[1].endswith(f"; 2 more since the last line, the longest {stalls.SLOW_S + 1.0:.2f} s")


def test_a_slow_collection_is_logged(caplog, monkeypatch):
    monkeypatch.setattr(stalls, "GC_SLOW_S", 0.0)  # every collection counts as slow here
    monkeypatch.setattr(stalls, "_installed", False)
    callback = stalls.watch_collections()
    try:
        with caplog.at_level("WARNING", logger="specguide"):
            gc.collect()
    finally:
        gc.callbacks.remove(callback)  # (the rest of this test process keeps quiet)
    assert any(r.getMessage().startswith("slow garbage collection:") for r in caplog.records)
