"""A grammar compile worker process (runs `specguide.guided.compile_worker.main()`).

The serving process sends length-prefixed pickles over stdin: first the init message
(`{"tokenizer_info": TokenizerInfo.serialize_json()}`), then one job per message (a
GuidedDecodingParams, compiled by the xgrammar backend). Each reply is `(ok, error_message, seconds)`. The worker only
proves that a guide compiles (and how fast): the compiled grammar itself is not sent back,
because xgrammar 0.2.8's `serialize_json` is far slower than compiling again (a 300-property
schema: 72 ms to compile, 3.7 s to serialize, 0.8 s to deserialize, 30 MB of JSON). The serving
process kills a worker whose job passes its deadline and starts a new one: that is what makes a
compile timeout free its worker.

A worker loads xgrammar's compiler without torch (`_import_xgrammar_compiler`): `import xgrammar`
imports torch (its matcher module, and tvm_ffi tries it first), ~125 MiB of anonymous memory and
about a second of start-up in every worker for nothing a compile uses.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
import types
from typing import Any

from ..process.ipc import demote, read_msg, write_msg

PARENT_ENV = "SPECGUIDE_COMPILE_PARENT"


def _import_xgrammar_compiler() -> Any:
    """xgrammar's package with only what compiling needs (GrammarCompiler, TokenizerInfo) loaded, and
    torch marked absent. Its `__init__` is not run (it imports the matcher, which needs torch); where
    that fails (another xgrammar layout) the whole package is imported as usual."""
    spec = importlib.util.find_spec("xgrammar")
    saved = {name: sys.modules.get(name) for name in ("torch", "xgrammar")}
    try:
        sys.modules["torch"] = None  # `import torch` fails, find_spec says absent: tvm_ffi and transformers skip it
        package = types.ModuleType("xgrammar")
        package.__path__, package.__spec__, package.__file__ = list(spec.submodule_search_locations), spec, spec.origin
        sys.modules["xgrammar"] = package
        for name in ("exception", "load_binding"):  # as its __init__ does first: error types, the library
            importlib.import_module(f"xgrammar.{name}")
        package.GrammarCompiler = importlib.import_module("xgrammar.compiler").GrammarCompiler
        package.TokenizerInfo = importlib.import_module("xgrammar.tokenizer_info").TokenizerInfo
        return package
    except Exception:  # noqa: BLE001 - fall back to the full import
        for name in [m for m in sys.modules if m == "xgrammar" or m.startswith("xgrammar.")]:
            del sys.modules[name]
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        return importlib.import_module("xgrammar")


def main() -> None:
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")  # replies; stray prints from libraries go to stderr instead
    os.dup2(2, 1)
    demote(PARENT_ENV)  # the least CPU share; dies with the serving process
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "PyTorch was not found" line
    xgr = _import_xgrammar_compiler()

    from ..util.heap import freeze_startup_heap
    from ..util.memory import trim
    from ..request import InvalidRequestError
    from .schema import json_schema_of
    from .xgrammar_compile import compile_guide

    init = read_msg(inp)
    if init is None:
        return
    info = xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_msg(out, ("ready", os.getpid(), freeze_startup_heap()))  # a compile walks no start-up object
    while True:
        job = read_msg(inp)
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            compile_guide(compiler, job, json_schema_of(job))
            reply = (True, None, time.perf_counter() - t0)
        except InvalidRequestError as e:
            reply = (False, str(e), time.perf_counter() - t0)
        except Exception as e:  # unexpected: say what, without a traceback
            reply = (False, f"the grammar compiler failed: {type(e).__name__}", time.perf_counter() - t0)
        write_msg(out, reply)
        trim()


if __name__ == "__main__":
    main()
