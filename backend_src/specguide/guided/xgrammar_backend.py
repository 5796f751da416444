"""The xgrammar backend: GrammarCompiler (with its own cache) and GrammarMatcher behind the interface.

JSON Schema defaults are spec-true as far as xgrammar goes: `strict_mode=False` (additional
properties allowed unless `false`, arrays without `items` hold anything), keys in schema order
(fixed, as in llguidance), whitespace allowed but bounded (`max_whitespace_cnt`), so compact and `json.dumps`
spacing both match. Keywords xgrammar would ignore (schema.xgrammar_unenforced) are checked with
jsonschema when their value closes (value_check.py).
"""
from __future__ import annotations

import functools
import os
import time
from typing import Any, Optional, Sequence

import torch
import xgrammar as xgr

from ..request import GuidedDecodingParams
from .backend import CompiledGuide, Encode, GrammarBackend, Matcher
from .schema import json_schema_of, xgrammar_unenforced
from .value_check import ValueChecker, ValueCheckedMatcher, checked_validator
from .value_scan import TokenTable
from .xgrammar_compile import compile_guide, xgrammar_message  # noqa: F401 (xgrammar_message: re-exported)


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


class XgrammarMatcher(Matcher):
    """xgr.GrammarMatcher (rollback is unlimited in xgrammar 0.2.8)."""

    mask_by_position = True

    _batches: dict[int, xgr.BatchGrammarMatcher] = {}

    def __init__(self, compiled: xgr.CompiledGrammar):
        self.compiled = compiled
        self.m = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        return not self.m.is_terminated() and self.m.accept_token(int(token))

    def rollback(self, n: int) -> None:
        if n > 0:
            self.m.rollback(n)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def forced_tokens(self, encode: Encode, k: int) -> list[int]:
        if k <= 0 or self.m.is_terminated():
            return []
        # NOTE: trailing whitespace stays undrafted: the model writes it fused to the next word
        # (`": "` + ` true`), so a lone-space token would be rejected and end the drafts
        try:
            text = self.m.find_jump_forward_string().rstrip()
        except UnicodeDecodeError:
            # NOTE: inside a multi-byte character (a byte-level token ended mid-character) xgrammar
            # hands back bytes that are no UTF-8 text: nothing whole to draft (drafts are optional)
            return []
        if not text:
            return []
        fork, out = self.m.fork(), []
        for t in encode(text)[:k]:
            if not fork.accept_token(int(t)):
                break
            out.append(int(t))
        return out

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def is_completed(self) -> bool:
        return self.m.is_completed()

    def reset(self) -> None:
        self.m.reset()

    @classmethod
    def fill_many(cls, matchers: list["XgrammarMatcher"], bitmask: torch.Tensor, rows: list[int],
                  num_threads: int | str = "auto") -> None:
        """One batched, multi-threaded xgrammar call."""
        key = 0 if num_threads == "auto" else int(num_threads)
        batch = cls._batches.get(key)
        if batch is None:
            batch = cls._batches[key] = xgr.BatchGrammarMatcher(num_threads)
        batch.batch_fill_next_token_bitmask([m.m for m in matchers], bitmask, rows)


class XgrammarBackend(GrammarBackend):
    """One xgrammar GrammarCompiler for one model's tokenizer."""

    name = "xgrammar"
    caches_compiles = True  # xgrammar's GrammarCompiler keeps a byte-limited cache

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Optional[Sequence[int]] = None,
                 cache_limit_bytes: int = 512 << 20, compile_threads: Optional[int] = None,
                 exclude_special_tokens: bool = True):
        self.vocab_size = vocab_size
        self.hf_tokenizer = hf_tokenizer
        self.tokenizer_info = build_tokenizer_info(hf_tokenizer, vocab_size, stop_token_ids, exclude_special_tokens)
        self.stop_token_ids: list[int] = list(self.tokenizer_info.stop_token_ids)
        threads = compile_threads or max(1, (os.cpu_count() or 2) // 2)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads, cache_enabled=True,
                                            cache_limit_bytes=cache_limit_bytes)

    def compile(self, params: GuidedDecodingParams) -> CompiledGuide:
        t0 = time.perf_counter()
        schema, unenforced, blind, make = json_schema_of(params), [], [], None
        if schema is not None:
            unenforced = xgrammar_unenforced(schema)
            if unenforced:  # what xgrammar ignores is checked with jsonschema when its value closes
                validator, blind = checked_validator(schema, params, frozenset())  # refusals before the compile
                checker = ValueChecker(schema, validator, unenforced, self.table, frozenset(self.stop_token_ids))
                make = lambda: ValueCheckedMatcher(XgrammarMatcher(grammar), checker)  # noqa: E731
        grammar = self._compile(params, schema)
        return CompiledGuide(self.name, self.vocab_size, grammar, make or (lambda: XgrammarMatcher(grammar)),
                             compile_s=time.perf_counter() - t0, unenforced=tuple(blind), checked=tuple(unenforced),
                             schema=schema)

    @functools.cached_property
    def table(self) -> TokenTable:
        vocab = list(self.tokenizer_info.decoded_vocab)
        return TokenTable(vocab + [b""] * (self.vocab_size - len(vocab)))

    def _compile(self, params: GuidedDecodingParams, schema: Any) -> xgr.CompiledGrammar:
        return compile_guide(self.compiler, params, schema)

    def cache_size_bytes(self) -> int:
        return self.compiler.get_cache_size_bytes()

    def clear_cache(self) -> None:
        self.compiler.clear_cache()
