"""Reasoning models: a guide applies only after the reasoning block's end marker (`</think>`), the way
vLLM's reasoning parsers and TensorRT-LLM gate structured output.

`ReasoningMatcher` wraps a guide's matcher. Before the end marker it allows every token but the guide's
stop tokens (the guided answer must still come) and the tokens that would complete the marker and go on
past it (the guide starts on a token boundary); from the end marker on, the wrapped matcher decides. The
marker is found on the tokens' bytes, so every tokenization of `</think>` ends the block (`</` `think`
`>`, ` </` ..., or one special token). Each accepted token keeps its marker progress, so a rollback
across the boundary (a draft window that holds the marker, then is partly rejected) is exact, and the
matcher is a function of its accepted tokens (invariant 3).

Where the prompt already closed the block (`<think>\\n\\n</think>\\n\\n` at its end: a template with
thinking off), the guide applies from the first token; otherwise, whether the prompt opened the block
(`...<think>\\n`) or the model will, the output up to the end marker is reasoning (vLLM's default).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch

from ..config import ReasoningMarkers
from .backend import CompiledGuide, Encode, Matcher, fill_by_class

DONE = -1  # marker progress once the end marker went by
BANNED = -2  # a token that completes the marker before its own end


class EndMarker:
    """The end marker over one vocabulary's token bytes: progress after a token, and the mask of the
    tokens allowed at each progress (built once per engine)."""

    def __init__(self, marker: bytes, vocab: Sequence[bytes], stop_ids: Iterable[int], vocab_size: int):
        assert marker, "empty end marker"
        self.marker, self.vocab = marker, vocab
        self.stop_ids, self.vocab_size = frozenset(int(t) for t in stop_ids), vocab_size
        m, words = len(marker), (vocab_size + 31) // 32
        allowed = np.ones((m, words * 32), dtype=bool)  # [progress, V (padded)]
        allowed[:, vocab_size:] = False
        for t in (t for t, b in enumerate(vocab[:vocab_size]) if marker[-1] in b):  # only these can complete it
            for p in range(m):
                allowed[p, t] = self.step(p, t) != BANNED
        allowed[:, [t for t in self.stop_ids if 0 <= t < vocab_size]] = False
        packed = np.packbits(allowed, axis=1, bitorder="little")  # bit j of word w = token 32w + j
        self.rows = packed.view(np.int32).copy()  # [m, words] int32 (numpy: no torch dispatch in callbacks)

    def allows(self, token: int) -> bool:
        """Not a stop token and inside the vocabulary (what the mask rows say besides BANNED)."""
        return 0 <= token < self.vocab_size and token not in self.stop_ids

    def step(self, p: int, token: int) -> int:
        """Progress after `token` from progress p: DONE, BANNED, or the longest marker prefix the text ends with."""
        s = self.marker[:p] + self.vocab[token]
        i = s.find(self.marker)
        if i >= 0:
            return DONE if i + len(self.marker) == len(s) else BANNED
        return self.progress(s)

    def progress(self, text: bytes) -> int:
        """The longest proper prefix of the marker that `text` ends with."""
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if text.endswith(self.marker[:k]):
                return k
        return 0


class ReasoningMatcher(Matcher):
    """Wraps a guide's matcher: free text (no stop token) until the end marker, then the guide."""

    def __init__(self, inner: Matcher, end: EndMarker, progress: int = 0):
        self.inner, self.end, self.start = inner, end, progress
        self.think: list[int] = []  # marker progress after each reasoning token (DONE last once ended)
        self.fed = 0  # tokens fed to `inner` (all after the marker)

    @property
    def ended(self) -> bool:
        return bool(self.think) and self.think[-1] == DONE

    def _progress(self) -> int:
        return self.think[-1] if self.think else self.start

    def accept(self, token: int) -> bool:
        if self.ended:
            ok = self.inner.accept(token)
            self.fed += ok
            return ok
        t = int(token)
        p = self.end.step(self._progress(), t) if self.end.allows(t) else BANNED
        if p == BANNED:
            return False  # a stop token, or the marker completed mid-token
        self.think.append(p)
        return True

    def rollback(self, n: int) -> None:
        k = min(n, self.fed)  # guided tokens first, then reasoning ones
        if k > 0:
            self.inner.rollback(k)
            self.fed -= k
        if n > k:
            del self.think[len(self.think) - (n - k):]

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.ended:
            self.inner.fill(bitmask, row)
        else:
            bitmask.numpy()[row] = self.end.rows[self._progress()]

    def forced_tokens(self, encode: Encode, k: int) -> list[int]:
        return self.inner.forced_tokens(encode, k) if self.ended else []  # nothing is forced in free text

    def is_terminated(self) -> bool:
        return self.ended and self.inner.is_terminated()

    def is_completed(self) -> bool:
        return self.ended and self.inner.is_completed()

    def violation(self) -> Optional[str]:
        return self.inner.violation() if self.ended else None

    def reset(self) -> None:
        self.inner.reset()
        self.think.clear()
        self.fed = 0

    @classmethod
    def fill_many(cls, matchers: list["ReasoningMatcher"], bitmask: torch.Tensor, rows: list[int],
                  num_threads: int | str = "auto") -> None:
        """Rows past the marker: one batched call per inner backend; reasoning rows: copies."""
        host = bitmask.numpy()
        for m, r in zip(matchers, rows):
            if not m.ended:
                host[r] = m.end.rows[m._progress()]
        ended = [(m.inner, r) for m, r in zip(matchers, rows) if m.ended]
        fill_by_class([m for m, _ in ended], bitmask, [r for _, r in ended], num_threads)


class Reasoning:
    """An engine's reasoning setting: wraps each guided request's compiled guide for its prompt."""

    def __init__(self, markers: ReasoningMarkers, vocab: Sequence[bytes], stop_ids: Iterable[int], vocab_size: int):
        self.markers, self.vocab = markers, vocab
        self.end = EndMarker(markers.end.encode(), vocab, stop_ids, vocab_size)

    @classmethod
    def for_tokenizer(cls, markers: ReasoningMarkers, hf_tokenizer: Any, stop_ids: Iterable[int],
                      vocab_size: int) -> "Reasoning":
        """Token bytes from xgrammar's decoded vocabulary (special tokens as their text)."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        return cls(markers, list(info.decoded_vocab), stop_ids, vocab_size)

    def initial(self, prompt_ids: Sequence[int]) -> Optional[int]:
        """None when the prompt closed the block (guide from the start), else the marker progress
        the prompt's end leaves."""
        tail = b"".join(self.vocab[t] for t in prompt_ids[-64:])
        if tail.rstrip().endswith(self.end.marker):
            return None
        return self.end.progress(tail)

    def wrap(self, guide: CompiledGuide, prompt_ids: Sequence[int]) -> CompiledGuide:
        """The guide for one request: its matchers wait for the end marker (unless the prompt closed the block)."""
        start = self.initial(prompt_ids)
        if start is None:
            return guide
        make = guide.make_matcher
        return dataclasses.replace(guide, make_matcher=lambda: ReasoningMatcher(make(), self.end, start))
