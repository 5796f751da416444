"""A grammar compile worker process (runs `specguide.guided.compile_worker.main()`).

The serving process sends length-prefixed pickles over stdin: first the init message
(`{"tokenizer_info": TokenizerInfo.serialize_json()}`), then one job per message (a
GuidedDecodingParams, compiled by the xgrammar backend). Each reply is `(ok, error_message, seconds)`. The worker only
proves that a guide compiles (and how fast): the compiled grammar itself is not sent back,
because xgrammar 0.2.8's `serialize_json` is far slower than compiling again (a 300-property
schema: 72 ms to compile, 3.7 s to serialize, 0.8 s to deserialize, 30 MB of JSON). The serving
process kills a worker whose job passes its deadline and starts a new one: that is what makes a
compile timeout free its worker.
"""
from __future__ import annotations

import os
import sys
import time

from ..ipc import die_with_parent, read_msg, write_msg

PARENT_ENV = "SPECGUIDE_COMPILE_PARENT"


def _demote() -> None:
    """Give compile work the least CPU share the OS offers, and die with the serving process.

    NOTE: with autogroup scheduling (most desktop and server kernels) CPU is shared between
    sessions first: the serving process starts this worker in a session of its own
    (`start_new_session`), and only the session's autogroup nice counts against other sessions.
    At autogroup nice 0, or inside the server's session, two compile bombs beside a decoding
    engine starved every other process on a 2-core machine for up to 2-5 s (bench/probe_stalls.py);
    at autogroup nice 19 the largest stall was 0.3 s. Without autogroup the process nice applies.
    """
    for step in (lambda: os.nice(5), lambda: _write("/proc/self/autogroup", "19")):
        try:
            step()
        except OSError:
            pass
    die_with_parent(PARENT_ENV)  # a session of its own escapes the server's process group kill


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def main() -> None:
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")  # replies; stray prints from libraries go to stderr instead
    os.dup2(2, 1)
    _demote()
    import xgrammar as xgr

    from ..memory import trim
    from ..request import InvalidRequestError
    from .schema import json_schema_of
    from .xgrammar_backend import XgrammarBackend

    init = read_msg(inp)
    if init is None:
        return
    info = xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"])
    backend = XgrammarBackend.__new__(XgrammarBackend)  # only its compile dispatch is used
    backend.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_msg(out, ("ready", os.getpid()))
    while True:
        job = read_msg(inp)
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            backend._compile(job, json_schema_of(job))
            reply = (True, None, time.perf_counter() - t0)
        except InvalidRequestError as e:
            reply = (False, str(e), time.perf_counter() - t0)
        except Exception as e:  # unexpected: say what, without a traceback
            reply = (False, f"the grammar compiler failed: {type(e).__name__}", time.perf_counter() - t0)
        write_msg(out, reply)
        trim()


if __name__ == "__main__":
    main()
