"""Prompt-lookup (n-gram) drafting: model-free, proposes what followed the latest earlier
occurrence of the sequence's current suffix."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine.scheduler import Sequence


@dataclass
class NgramDrafter:
    max_ngram: int = 4  # longest suffix tried first, down to min_ngram
    min_ngram: int = 1

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `tokens` (prompt + output), [] when no suffix recurs."""
        return self.match(tokens, k)[0]

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the latest earlier occurrence of the longest recurring
        suffix, that suffix's length); ([], 0) when none recurs."""
        if k <= 0:
            return [], 0
        n = len(tokens)
        # the history as int32 bytes: bytes.rfind scans it in C (a Python scan of a few hundred
        # tokens per size took ~0.1 ms a draft); a hit must start on a token (a multiple of 4)
        buf = array("i", tokens).tobytes()
        for size in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            suffix = buf[4 * (n - size):]
            hi = 4 * (n - 1)  # the latest earlier occurrence whose continuation exists ends by token n - 1
            while (pos := buf.rfind(suffix, 0, hi)) >= 0:
                if pos % 4 == 0:
                    start = pos // 4
                    return tokens[start + size: start + size + k], size
                hi = pos + len(suffix) - 1  # misaligned: look further back
        return [], 0

    def chain(self, tokens: list[int], forced: list[int], k: int, trust: int = 1) -> tuple[list[int], list[int]]:
        """Model-free drafts after `tokens`: the grammar-forced tokens `forced`, then the continuation
        of tokens + forced when its recurring suffix has at least `trust` tokens. Returns (those up
        to k drafts, the continuation whatever its suffix's length)."""
        cont, size = self.match(tokens + forced, k - len(forced))
        return forced + (cont if size >= trust else []), cont


@dataclass
class SuffixIndex:
    """One sequence's n-grams of length `n`, indexed as it grows: `continuation(seq, k)` answers what
    `NgramDrafter.match` would for a suffix of length n (how many tokens followed its latest earlier
    occurrence, up to k) with a dict lookup per step instead of a scan of the history."""

    n: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its latest occurrence
    upto: int = 0  # the n-grams ending before this position are indexed

    def continuation(self, seq: "Sequence", k: int) -> int:
        """Up to k: the tokens that followed the latest earlier occurrence of the sequence's last n
        tokens, 0 when they have not occurred before."""
        total, g = seq.num_tokens, self.n
        if total <= g:
            return 0
        lo = max(self.upto, g - 1)
        if lo < total - 1:  # index the n-grams ending at lo .. total-2 (the one ending at total-1 is the suffix)
            w = seq.tokens(lo - g + 1, total - 1)
            for e in range(lo, total - 1):
                self.ends[tuple(w[e - lo: e - lo + g])] = e
            self.upto = total - 1
        end = self.ends.get(tuple(seq.tokens(total - g, total)))
        return 0 if end is None else min(k, total - 1 - end)

