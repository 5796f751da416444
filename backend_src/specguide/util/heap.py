"""The serving processes' start-up heap, kept out of the garbage collector's full collections.

A full collection walks every tracked object, and every stream the process carries waits for it.
Most of a serving process's objects are made while it starts (imports: torch, transformers,
FastAPI, pydantic's schemas; the model) and live until it exits, and each full collection walked
them all again: 40-55 ms in the OpenAI server and in a compile worker, 200-260 ms in the engine;
49-232 ms of the OpenAI server's streams under load (bench/bench_gc_pauses.py). Frozen after
start-up (`gc.freeze`, as vLLM and SGLang do), they are never walked again: collections walk
only the objects made since.
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive now; returns how many are frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
