"""The grammar backend interface: all the compile service, the GuidedDecoder and the capturable
decoder ask of a grammar library (the shape of vLLM v1's StructuredOutputBackend / Grammar).

A backend compiles a guide into a `CompiledGuide`; a guide makes `Matcher`s, one per sequence.
Bitmask rows are int32 words [ceil(V/32)], bit j of word w = token 32*w + j allowed (xgrammar's
layout, which llguidance shares), so one buffer serves both backends: `allocate_token_bitmask`
makes it. A matcher class fills many rows in one batched call (`Matcher.fill_many`); wrappers
(value checks, token budgets, reasoning) hand their inner matchers to `fill_by_class`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ..request import GuidedDecodingParams
from .params import BACKEND_NAMES, BACKENDS, MAX_JSON_WHITESPACE, canonical_backend  # noqa: F401  (named here too)

Encode = Callable[[str], list[int]]
BITMASK_DTYPE = torch.int32


def bitmask_shape(rows: int, vocab_size: int) -> tuple[int, int]:
    """[rows, ceil(V/32)]: one int32 word per 32 token ids."""
    return rows, (vocab_size + 31) // 32


def allocate_token_bitmask(rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """A CPU bitmask of `rows` rows, every token allowed."""
    return torch.full(bitmask_shape(rows, vocab_size), -1, dtype=BITMASK_DTYPE, pin_memory=pin_memory)


class Matcher(ABC):
    """One sequence's grammar state. A rejected token leaves the state unchanged."""

    # whether `fill` depends on the grammar's position alone: a grammar backend's own matcher, whose
    # mask inside a free string is the same after any whole characters (budget.py copies it there);
    # not a wrapper that reads what the answer wrote (value checks)
    mask_by_position = False

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Feed one token; False (state unchanged) when rejected or already terminated."""

    def validate(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, would be accepted; the state is not changed."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        self.rollback(n)
        return n

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""

    @abstractmethod
    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next-token mask into bitmask[row] (CPU int32 [rows, ceil(V/32)])."""

    @classmethod
    def fill_many(cls, matchers: Sequence["Matcher"], bitmask: torch.Tensor, rows: Sequence[int],
                  num_threads: int | str = "auto") -> None:
        """bitmask[rows[i]] from matchers[i], all of this class: one batched call where the library
        has one (the backends override this); one by one otherwise."""
        for m, r in zip(matchers, rows):
            m.fill(bitmask, r)

    @abstractmethod
    def forced_tokens(self, encode: Encode, k: int) -> list[int]:
        """Up to k tokens the grammar forces next (jump-forward), each accepted in order from the
        current state; the state is not changed."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar ended and a stop token was accepted."""

    @abstractmethod
    def is_completed(self) -> bool:
        """The accepted text is a complete match (the stop token may still be to come)."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start state."""

    def violation(self) -> Optional[str]:
        """Why the value so far cannot end here (a value-checked guide, value_check.py); None otherwise."""
        return None


def fill_by_class(matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int],
                  num_threads: int | str = "auto") -> None:
    """bitmask[rows[i]] from matchers[i], one batched `fill_many` call per matcher class (wrappers
    pass their inner matchers here, then adjust their own rows)."""
    groups: dict[type, tuple[list[Matcher], list[int]]] = {}
    for m, r in zip(matchers, rows):
        ms, idx = groups.setdefault(type(m), ([], []))
        ms.append(m)
        idx.append(r)
    for cls, (ms, idx) in groups.items():
        cls.fill_many(ms, bitmask, idx, num_threads)


@dataclass
class CompiledGuide:
    """A compiled guide: the library's grammar and how to start a matcher for it."""

    backend: str  # "xgrammar" | "llguidance"
    vocab_size: int  # the logits width it was compiled for
    grammar: Any  # xgr.CompiledGrammar | the template llg.LLMatcher
    make_matcher: Callable[[], Matcher]
    compile_s: float = 0.0
    unenforced: tuple[str, ...] = ()  # best effort: "keyword at /json/pointer" not enforced
    checked: tuple[str, ...] = ()  # "keyword at /json/pointer" checked when its value closes (value_check.py)
    budget: Any = None  # budget.BudgetPlan: the document closes within max_tokens (set per request)
    schema: Any = None  # json / json_schema guides: the schema compiled (schema.json_schema_of), for the budget

    def matcher(self) -> Matcher:
        return self.make_matcher()

    def can_start(self) -> bool:
        """Whether a fresh matcher allows some token or is already done. A grammar with no way to
        end (rules that only refer to each other) allows none: its first mask is empty. (A grammar
        that starts and only later cannot end is not found here.)"""
        m = self.matcher()
        bitmask = allocate_token_bitmask(1, self.vocab_size)
        m.fill(bitmask, 0)
        done = m.is_terminated()  # (where the library found the grammar broken: InvalidRequestError)
        return done or bool(bitmask.any())


class GrammarBackend(ABC):
    """Compiles guides for one tokenizer (its matchers fill many masks at once)."""

    name: str
    caches_compiles: bool = False  # the library keeps its own cache of compiled guides

    @abstractmethod
    def compile(self, params: GuidedDecodingParams) -> CompiledGuide:
        """Compile a validated guide; InvalidRequestError with a client-safe message."""

    def cache_size_bytes(self) -> int:
        return 0

    def clear_cache(self) -> None:
        pass
