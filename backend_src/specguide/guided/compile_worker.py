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

from ..ipc import demote, read_msg, write_msg

PARENT_ENV = "SPECGUIDE_COMPILE_PARENT"


def main() -> None:
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")  # replies; stray prints from libraries go to stderr instead
    os.dup2(2, 1)
    demote(PARENT_ENV)  # the least CPU share; dies with the serving process
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
