"""Grammar compilation: one xgrammar GrammarCompiler per model, a cache, and compile lanes.

`submit(params)` checks the guide's size limits (limits.py) and returns at once with a
CompileHandle; the engine keeps the request in its waiting queue and polls `handle.ready()` every
iteration, so its loop never waits on a compile. Which lane compiles it (in-process for small or
cached guides, a killable worker process first for the rest) is compile_pool.py.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Optional, Sequence

import xgrammar as xgr

from ..request import GuidedDecodingParams, InvalidRequestError
from .compile_pool import CompileScheduler, timeout_message
from .limits import GuideLimits, check_guide
from .params import choice_to_ebnf, looks_like_lark, normalize_structural_tag, validate_guided

DEFAULT_CACHE_LIMIT_BYTES = 512 << 20
ANY_JSON_SCHEMA = '{"type": ["object", "array"]}'  # guide type `json`, compact

# "[02:15:01] /project/cpp/grammar_parser.cc:820: " and "Check failed: (...) is false: "
_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false: ")


def xgrammar_message(err: BaseException) -> str:
    """xgrammar's error text without its C++ source location and CHECK boilerplate."""
    text = str(err).strip()
    text = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", text))
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def build_tokenizer_info(hf_tokenizer: Any, vocab_size: int, stop_token_ids: Optional[Sequence[int]] = None,
                         exclude_special_tokens: bool = True) -> xgr.TokenizerInfo:
    """TokenizerInfo sized to the model's logits (`vocab_size`), stop tokens = EOS by default.

    Ids at or past the tokenizer's vocabulary (logit padding) have an empty encoding, which
    xgrammar treats as special tokens: never allowed by a mask. With `exclude_special_tokens`
    the tokenizer's own special tokens (e.g. `<|im_start|>`) get the same treatment, so a guided
    output never contains text that the detokenizer (skip_special_tokens) would drop.
    """
    if stop_token_ids is None:
        if hf_tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; pass stop_token_ids")
        stop_token_ids = [hf_tokenizer.eos_token_id]
    stop = [int(t) for t in stop_token_ids]
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
    if not exclude_special_tokens:
        return info
    encoded = [""] * vocab_size
    for token, idx in hf_tokenizer.get_vocab().items():
        if idx < vocab_size:
            encoded[idx] = token
    special = set(hf_tokenizer.all_special_ids)
    special |= {i for i, tok in getattr(hf_tokenizer, "added_tokens_decoder", {}).items() if tok.special}
    for idx in special:
        if 0 <= idx < vocab_size:
            encoded[idx] = ""
    return xgr.TokenizerInfo(encoded, info.vocab_type, vocab_size=vocab_size, stop_token_ids=stop,
                             add_prefix_space=info.add_prefix_space)


class CompileHandle:
    """A pending compile. `ready()` never blocks; `result()` returns the grammar or raises."""

    def __init__(self, future: Future, timeout_s: Optional[float]):
        self._future = future
        self.submitted = time.monotonic()
        self.deadline = None if timeout_s is None else self.submitted + timeout_s
        self.timeout_s = timeout_s

    def _deadline(self) -> Optional[float]:
        # a worker-process job's clock starts when the worker takes it (compile_pool.AbandonableFuture)
        return getattr(self._future, "deadline", self.deadline)

    def timed_out(self) -> bool:
        deadline = self._deadline()
        return not self._future.done() and deadline is not None and time.monotonic() >= deadline

    def ready(self) -> bool:
        """True once `result()` will not block: compiled, failed, or past the timeout."""
        return self._future.done() or self.timed_out()

    def result(self, timeout: Optional[float] = None) -> xgr.CompiledGrammar:
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
    """One xgrammar GrammarCompiler for one model, with its cache and a compile thread pool."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, *, stop_token_ids: Optional[Sequence[int]] = None,
                 cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES, max_workers: int = 2,
                 compile_threads: Optional[int] = None, timeout_s: Optional[float] = None,
                 json_any_whitespace: bool = False, exclude_special_tokens: bool = True,
                 limits: Optional[GuideLimits] = None):
        self.vocab_size = vocab_size
        self.tokenizer_info = build_tokenizer_info(hf_tokenizer, vocab_size, stop_token_ids, exclude_special_tokens)
        self.stop_token_ids: list[int] = list(self.tokenizer_info.stop_token_ids)
        threads = compile_threads or max(1, (os.cpu_count() or 2) // 2)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads, cache_enabled=True,
                                            cache_limit_bytes=cache_limit_bytes)
        self.timeout_s = timeout_s
        self.json_any_whitespace = json_any_whitespace  # False: compact JSON, no runaway whitespace
        self.limits = limits or GuideLimits()  # admission limits, checked at submit (guided/limits.py)
        # lanes: small/cached in-process, the rest proven in killable worker processes (compile_pool.py)
        self.scheduler = CompileScheduler(self._compile, self.tokenizer_info, workers=max_workers,
                                          any_whitespace=json_any_whitespace)
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_model_dir(cls, model_dir: Path | str, vocab_size: Optional[int] = None, **kwargs: Any) -> "GrammarCompilerService":
        """Tokenizer from an HF folder; `vocab_size` defaults to the config's (the logits' width)."""
        from transformers import AutoConfig, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        if vocab_size is None:
            vocab_size = AutoConfig.from_pretrained(str(model_dir)).vocab_size
        return cls(tok, vocab_size, **kwargs)

    def submit(self, params: GuidedDecodingParams, timeout_s: Optional[float] = None) -> CompileHandle:
        """Validate now (InvalidRequestError at once for a malformed guide), compile in the pool."""
        params = validate_guided(params)
        size = check_guide(params, self.limits)  # InvalidRequestError naming the limit and its setting
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is shut down")
            future = self.scheduler.submit(params, size, timeout_s)
        return CompileHandle(future, timeout_s)

    def compile(self, params: GuidedDecodingParams) -> xgr.CompiledGrammar:
        """Compile on the calling thread (cached); InvalidRequestError with xgrammar's message."""
        return self._compile(validate_guided(params))

    def _compile(self, params: GuidedDecodingParams) -> xgr.CompiledGrammar:
        gtype, guide = params.guide_type, params.guide  # already validated
        try:
            if gtype == "json":  # an object or an array, like xgrammar's builtin JSON grammar
                if self.json_any_whitespace:
                    return self.compiler.compile_builtin_json_grammar()
                return self.compiler.compile_json_schema(ANY_JSON_SCHEMA, any_whitespace=False)
            if gtype == "json_schema":
                return self.compiler.compile_json_schema(guide, any_whitespace=self.json_any_whitespace)
            if gtype == "regex":
                return self.compiler.compile_regex(guide)
            if gtype == "ebnf_grammar":
                if looks_like_lark(guide):
                    return self.compiler.compile_lark(guide)
                return self.compiler.compile_grammar(guide)
            if gtype == "structural_tag":
                tag = normalize_structural_tag(json.loads(guide))
                return self.compiler.compile_structural_tag(json.dumps(tag))
            if gtype == "choice":
                return self.compiler.compile_grammar(choice_to_ebnf(json.loads(guide)))
        except InvalidRequestError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"invalid {gtype} guide: {xgrammar_message(e)}") from None
        raise InvalidRequestError(f"unknown guide type {gtype!r}")  # unreachable after validate_guided

    def cache_size_bytes(self) -> int:
        return self.compiler.get_cache_size_bytes()

    @property
    def cache_limit_bytes(self) -> int:
        return self.compiler.cache_limit_bytes

    def clear_cache(self) -> None:
        self.compiler.clear_cache()

    def shutdown(self, wait: bool = False) -> None:
        """Stop taking compiles; pending ones are cancelled, running ones finish in the background."""
        with self._lock:
            self._closed = True
        self.scheduler.shutdown()
