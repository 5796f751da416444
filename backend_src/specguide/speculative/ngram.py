"""Prompt-lookup (n-gram) drafting: model-free, proposes what followed the latest earlier
occurrence of the sequence's current suffix."""
from __future__ import annotations

from dataclasses import dataclass


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
        for size in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            suffix = tokens[n - size:]
            # latest earlier occurrence whose continuation exists
            for start in range(n - size - 1, -1, -1):
                if tokens[start: start + size] == suffix:
                    return tokens[start + size: start + size + k], size
        return [], 0

    def chain(self, tokens: list[int], forced: list[int], k: int, trust: int = 1) -> tuple[list[int], list[int]]:
        """Model-free drafts after `tokens`: the grammar-forced tokens `forced`, then the continuation
        of tokens + forced when its recurring suffix has at least `trust` tokens. Returns (those up
        to k drafts, the continuation whatever its suffix's length)."""
        cont, size = self.match(tokens + forced, k - len(forced))
        return forced + (cont if size >= trust else []), cont
