"""Grammar compilation: the grammar backends for one model, a cache, and compile lanes.

`submit(params)` checks the guide's size limits (limits.py) and returns at once with a
CompileHandle; the engine keeps the request in its waiting queue and polls `handle.ready()` every
iteration, so its loop never waits on a compile. Which lane compiles it (in-process for
llguidance, small or cached guides; a killable worker process first for other xgrammar guides) is
compile_pool.py. Both libraries release the GIL while compiling.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Optional, Sequence

from ..request import GuidedDecodingParams, InvalidRequestError, UndeclaredKeys
from .backend import BACKENDS, CompiledGuide, GrammarBackend, canonical_backend
from .compile_pool import CompileLanes, timeout_message
from .limits import GuideLimits, check_guide
from .llguidance_backend import LlguidanceBackend
from .params import validate_guided
from .xgrammar_backend import XgrammarBackend

DEFAULT_CACHE_LIMIT_BYTES = 512 << 20
LLG_CACHE_ENTRIES = 256  # compiled llguidance guides kept (xgrammar keeps its own byte-limited cache)
AUTO_XGRAMMAR = ("ebnf_grammar", "structural_tag", "regex", "choice")  # `auto` keeps these on xgrammar
_WORKER_GRACE_S = 0.5  # how long after a worker job's deadline a handle gives up on its probe


# llguidance's Earley rows grow by ~4 items per optional property of one object and it fails past
# 2000 (measured: 480 properties pass, 600 -> "row has 2407 items; max is 2000"): wider objects go to xgrammar
LLG_MAX_OBJECT_PROPERTIES = 450


def widest_object(schema: Any) -> int:
    """The most `properties` any one object of a JSON schema lists (iterative: any depth)."""
    widest, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                widest = max(widest, len(props))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return widest


def auto_backend(params: GuidedDecodingParams) -> str:
    """`auto`: JSON (schema or any) -> llguidance (spec-true, fast compiles; bench/bench_jsonschema.py),
    unless one object lists more properties than llguidance's parser takes; xgrammar EBNF and
    structural tags -> xgrammar (its syntax); regex and choice -> xgrammar (both serve them;
    xgrammar keeps the forced-token drafts the speculative tests were tuned on)."""
    if params.guide_type in AUTO_XGRAMMAR:
        return "xgrammar"
    if params.guide_type == "json_schema" and not params.any_key_order:  # (any key order: llguidance only)
        try:
            if widest_object(json.loads(params.guide)) > LLG_MAX_OBJECT_PROPERTIES:
                return "xgrammar"
        except (ValueError, RecursionError):
            pass  # not JSON, or nested past the parser (with no depth limit): the backend's compile says so
    return "llguidance"


class CompileHandle:
    """A pending compile. `ready()` never blocks; `result()` returns the grammar or raises."""

    def __init__(self, future: Future, timeout_s: Optional[float]):
        self._future = future
        self.submitted = time.monotonic()
        self.deadline = None if timeout_s is None else self.submitted + timeout_s
        self.timeout_s = timeout_s

    def _deadline(self) -> Optional[float]:
        # a worker-process job's clock starts when the worker takes it and follows the worker's CPU
        # time (compile_pool.AbandonableFuture): its probe fails the future at the deadline (and
        # remembers the guide as refused), so the handle only gives up _WORKER_GRACE_S later.
        if not hasattr(self._future, "deadline"):
            return self.deadline
        return None if self._future.deadline is None else self._future.deadline + _WORKER_GRACE_S

    def timed_out(self) -> bool:
        deadline = self._deadline()
        return not self._future.done() and deadline is not None and time.monotonic() >= deadline

    def ready(self) -> bool:
        """True once `result()` will not block: compiled, failed, or past the timeout."""
        return self._future.done() or self.timed_out()

    def result(self, timeout: Optional[float] = None) -> CompiledGuide:
        """The compiled grammar; InvalidRequestError for a bad guide or a compile past its timeout.

        Blocks up to `timeout` seconds (None: until done or the compile timeout)."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            deadline = self._deadline()
            waits = [t - time.monotonic() for t in (end, deadline) if t is not None]
            wait = max(0.0, min(waits)) if waits else None
            if deadline is None and hasattr(self._future, "deadline"):  # queued for a worker: look again soon
                wait = 0.05 if wait is None else min(wait, 0.05)
            try:
                return self._future.result(timeout=wait)
            except FutureTimeout:
                if self.timed_out():
                    self._future.cancel()
                    raise InvalidRequestError(timeout_message(self.timeout_s)) from None
                if end is not None and time.monotonic() >= end:
                    raise

    def cancel(self) -> None:
        """Drop a compile nobody waits for (it still finishes if it already started)."""
        self._future.cancel()


class GrammarCompilerService:
    """The grammar backends for one model (xgrammar, llguidance), a compile cache and a thread pool.

    `default_backend` (EngineConfig.guided_backend) serves requests that name none."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, *, stop_token_ids: Optional[Sequence[int]] = None,
                 cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES, max_workers: int = 2,
                 timeout_s: Optional[float] = None, default_backend: str = "auto",
                 limits: Optional[GuideLimits] = None, undeclared_keys: str = "forbid"):
        self.vocab_size = vocab_size
        self.xgrammar = XgrammarBackend(hf_tokenizer, vocab_size, stop_token_ids, cache_limit_bytes)
        self.stop_token_ids: list[int] = list(self.xgrammar.stop_token_ids)
        self.llguidance = LlguidanceBackend(hf_tokenizer, vocab_size, self.stop_token_ids)
        # the registry a compile looks its backend up in, by name (params.BACKENDS)
        self.backends: dict[str, GrammarBackend] = {b.name: b for b in (self.xgrammar, self.llguidance)}
        assert sorted(self.backends) == sorted(BACKENDS), (sorted(self.backends), BACKENDS)
        self.default_backend = canonical_backend(default_backend, "guided_backend") or "auto"
        # JSON Schema objects silent on additionalProperties, for requests that say nothing
        self.undeclared_keys = UndeclaredKeys(undeclared_keys or "forbid")
        assert self.undeclared_keys != UndeclaredKeys.DEFAULT
        self.timeout_s = timeout_s
        self._cache: "OrderedDict[tuple, CompiledGuide]" = OrderedDict()  # llguidance guides, LRU
        self.limits = limits or GuideLimits()  # admission limits, checked at submit (guided/limits.py)
        # lanes: llguidance, small or cached guides in-process; other xgrammar guides proven first in
        # killable worker processes (compile_pool.py)
        self.lanes = CompileLanes(self._compile, self.xgrammar.tokenizer_info, workers=max_workers,
                                  route=self.backend_for)
        self._lock = threading.Lock()
        self._closed = False

    def backend_for(self, params: GuidedDecodingParams) -> str:
        """The backend that compiles `params`: the request's, else the server default; `auto` routes."""
        try:
            name = canonical_backend(params.backend) or self.default_backend
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        return auto_backend(params) if name == "auto" else name

    def submit(self, params: GuidedDecodingParams, timeout_s: Optional[float] = None) -> CompileHandle:
        """Validate now (InvalidRequestError at once for a malformed guide), compile in the pool."""
        params = self._with_defaults(validate_guided(params))
        size = check_guide(params, self.limits)  # InvalidRequestError naming the limit and its setting
        # resolved once (an unknown backend fails at once; `auto` reads the schema): the lanes,
        # the probe and the compile see the backend by name
        params = dataclasses.replace(params, backend=self.backend_for(params))
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is shut down")
            future = self.lanes.submit(params, size, timeout_s)
        return CompileHandle(future, timeout_s)

    def compile(self, params: GuidedDecodingParams) -> CompiledGuide:
        """Compile on the calling thread (cached); InvalidRequestError with a client-safe message."""
        return self._compile(self._with_defaults(validate_guided(params)))

    @property
    def token_bytes(self) -> list[bytes]:
        """Each token id's bytes (b"" for special tokens and padding ids)."""
        return self.xgrammar.table.bytes

    def _with_defaults(self, params: GuidedDecodingParams) -> GuidedDecodingParams:
        if params.undeclared_keys == UndeclaredKeys.DEFAULT:
            return dataclasses.replace(params, undeclared_keys=self.undeclared_keys)
        return params

    def _compile(self, params: GuidedDecodingParams) -> CompiledGuide:
        """The compile lanes' work (off the engine loop): compile, refuse a guide that cannot start."""
        backend = self.backends[self.backend_for(params)]
        if backend.caches_compiles:
            return _startable(backend.compile(params))
        key = params.cache_key(backend.name)  # the others' compiled guides are kept here, LRU
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        guide = _startable(backend.compile(params))
        with self._lock:
            self._cache[key] = guide
            while len(self._cache) > LLG_CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return guide

    def cache_size_bytes(self) -> int:
        return self.xgrammar.cache_size_bytes()

    @property
    def cache_limit_bytes(self) -> int:
        return self.xgrammar.compiler.cache_limit_bytes

    def clear_cache(self) -> None:
        self.xgrammar.clear_cache()
        with self._lock:
            self._cache.clear()

    def shutdown(self) -> None:
        """Stop taking compiles; pending ones are cancelled, running ones finish in the background."""
        with self._lock:
            self._closed = True
        self.lanes.shutdown()


def _startable(guide: CompiledGuide) -> CompiledGuide:
    """`guide`, or InvalidRequestError when its grammar allows no first token (no way to end)."""
    if not guide.can_start():
        raise InvalidRequestError("the guide accepts no output: its grammar allows no first token "
                                  "(a rule with no way to end, e.g. rules that only refer to each other)")
    return guide
