"""The serving processes freeze their start-up heap (heap.py): full collections walk only what came
after, and what comes after is still collected. Run in a process of its own: a freeze is for good."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import specguide

PROBE = """
import gc, json, weakref
from specguide.util.heap import freeze_startup_heap
held = [[i] for i in range(50000)]  # the start-up heap: alive for good
walked_before = len(gc.get_objects())
frozen = freeze_startup_heap()
walked_after = len(gc.get_objects())
class Node: pass
a, b = Node(), Node()  # garbage made later, in a cycle: only a collection frees it
a.other, b.other = b, a
gone = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps({"before": walked_before, "frozen": frozen, "after": walked_after, "collected": gone() is None,
                  "held": len(held)}))
"""


def test_frozen_objects_are_never_walked_again_and_later_cycles_are_still_collected():
    env = {**os.environ, "PYTHONPATH": str(Path(specguide.__file__).parents[1])}
    out = json.loads(subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                                    check=True).stdout)
    assert out["before"] > 50000 and out["frozen"] >= 50000
    assert out["after"] < 1000  # what a full collection walks now (was every object of the heap)
    assert out["collected"] and out["held"] == 50000
