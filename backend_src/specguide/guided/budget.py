"""JSON that closes within its budget: when the tokens left reach the shortest valid completion, follow it.

A `BudgetMatcher` wraps a JSON guide's matcher. It follows the accepted bytes with a scanner that
knows, at every point, which subschema each open container and the current value belong to, and
from that the shortest text that completes a valid document (`Scanner.completion`): the open
string, number or literal finished, each open object's missing required keys with their shortest
valid values (in the schema's key order, as the grammars generate them), each open array's
missing items, every container closed. Its tokens plus the stop token are the fewest this path needs.

With r tokens left (max_tokens minus those accepted, the stop token included), n needed and g the
most one free token can add (`Scanner.growth`: one more array item or optional key, in bytes):
while n + g + SLACK < r the grammar's mask stands, so after any token the answer can still close;
from then on the mask allows only the first token of the completion (its tokens are also the
forced tokens drafters propose), so the answer ends valid with finish reason "stop". Every
decision is a function of the matcher's own state, so draft positions get the same masks as plain
decoding: speculation stays lossless. Where anyOf / oneOf branches read the answer alike, the
completions of all of them are tried, shortest first (TRIES). Where the scanner cannot tell (a
format-constrained string half written, more readings than it follows) or the grammar refuses
every completion, it does nothing and the grammar's mask stands. A regex guide gets the same through `RegexScanner`: the states of
an NFA of the regex after the text so far, and the shortest text that completes the match.

Token after token of a free string (no const, enum, format, pattern or minLength) nothing of this
changes: such a state takes the completions and growth of the latest state the string only went on
from (Scanner.plain_end / extends), and where the string's schema says nothing of its text
(Scanner.free_text: no maxLength either) that state's grammar mask too (Matcher.mask_by_position:
the grammar's position is the same), rather than computing them again.

What this costs is bounded by the budget, never by what the guide asks for (issue 75): a
completion longer than the budget's bytes (`completion_cap`: tokens left x the longest token's
bytes) cannot fit, so no scanner builds it (TooLong); at most 2 x (budget + 2) tokens' worth of a
completion is tokenized and checked against the grammar.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..request import InvalidRequestError
from .backend import CompiledGuide, Encode, Matcher, fill_by_class
from .regex_completion import MAX_BYTES, TooLong, Unknown

SLACK = 8  # tokens kept in hand beyond what one free token may add to the completion
PLAIN_KEPT = 16  # plain-string states remembered (more than a step rolls back)
TRIES = 4  # completions (of anyOf / oneOf readings, shortest first) checked against the grammar per state
_LONGEST: dict[int, tuple[Sequence[bytes], int]] = {}  # id(vocabulary) -> (it, its longest token's bytes)


def longest_token(token_bytes: Sequence[bytes]) -> int:
    """The most bytes one token holds (once per vocabulary; at least 1)."""
    hit = _LONGEST.get(id(token_bytes))
    if hit is None or hit[0] is not token_bytes:
        hit = _LONGEST[id(token_bytes)] = (token_bytes, max((len(t) for t in token_bytes), default=1) or 1)
    return hit[1]


def completion_cap(budget: int, token_bytes: Sequence[bytes]) -> int:
    """The longest completion text worth building for a budget of `budget` tokens: anything longer
    cannot fit (at most MAX_BYTES; the scanners' `max_bytes`)."""
    return min(MAX_BYTES, max(1, budget) * longest_token(token_bytes))


class BudgetPlan:
    """What every BudgetMatcher of one request shares: the scanner (a JSON schema's or a regex's),
    token bytes, encode, stop id, and the tokens the budget forced (position -> token; NOTE:
    written by grammar callbacks, read when the request ends)."""

    def __init__(self, scanner: Any, token_bytes: Sequence[bytes], encode: Encode, stop_id: int, budget: int):
        self.scanner = scanner
        self.token_bytes, self.encode, self.stop_id, self.budget = token_bytes, encode, stop_id, budget
        self.longest = longest_token(token_bytes)
        self.forced: dict[int, int] = {}

    def tokens(self, text: str) -> list[int]:
        return self.encode(text) if text else []

    def closed(self, output_ids: Sequence[int]) -> bool:
        """Whether the budget forced the end of this answer (a forced position the output took)."""
        return any(i < len(output_ids) and output_ids[i] == t for i, t in list(self.forced.items()))


class BudgetMatcher(Matcher):
    """A JSON guide's matcher that ends the document within `budget` tokens (module docstring)."""

    def __init__(self, inner: Matcher, plan: BudgetPlan):
        self.inner, self.plan = inner, plan
        self.states: list[Any] = [plan.scanner.start()]  # the scanner's state after each accepted token (None: Unknown)
        self._texts: dict[int, Optional[list[str]]] = {}  # per state index: the completions' texts
        self._growths: dict[int, int] = {}  # per state index: Scanner.growth
        self._plans: dict[int, Optional[list[int]]] = {}  # per state index: its verified tokens + stop
        self._cut: set[int] = set()  # state indices whose plan is only the first left + 1 tokens
        self._plain: list[int] = []  # the latest state indices inside a plain string (Scanner.plain_end), ascending
        # (state index, the state, the grammar's mask words there) of a plain-string state: the mask of
        # every state that extends it (`_copy_mask`)
        self._mask: Optional[tuple[int, Any, np.ndarray]] = None
        self._linked: tuple = ()  # (j, state j, i, state i): the latest pair `_as_before` found to extend

    # -- the completion ---------------------------------------------------------------------

    def _candidates(self) -> Optional[list[str]]:
        """The completions' texts from the current state, shortest first (None: cannot tell)."""
        i = len(self.states) - 1
        if i not in self._texts and not self._as_before(i):
            st = self.states[-1]
            try:
                self._texts[i] = None if st is None else self.plan.scanner.completions(st)
            except Unknown:
                self._texts[i] = None
            plain_end = getattr(self.plan.scanner, "plain_end", None)  # (JSON scanners only)
            if self._texts[i] is not None and plain_end is not None and plain_end(st):
                self._mark_plain(i)
        return self._texts[i]

    def _as_before(self, i: int) -> bool:
        """State i only added characters to the plain string of the latest state before it whose
        completions are known (Scanner.extends): it takes that state's completions and growth (the
        same text: written, not computed again, token after token of a free string)."""
        j = self._plain[-1] if self._plain else -1  # (every index kept is below i: i's texts are not known)
        if j < 0 or self.states[i] is None or not self.plan.scanner.extends(self.states[j], self.states[i]):
            return False
        self._texts[i] = self._texts[j]
        if j in self._growths:
            self._growths[i] = self._growths[j]
        self._mark_plain(i)
        self._linked = (j, self.states[j], i, self.states[i])  # extends(states[j], states[i]), known
        return True

    def _mark_plain(self, i: int) -> None:
        self._plain.append(i)
        del self._plain[:-PLAIN_KEPT]

    def _text(self) -> Optional[str]:
        """The shortest completion's text from the current state (None: cannot tell)."""
        texts = self._candidates()
        return texts[0] if texts else None

    def _growth(self) -> int:
        """Scanner.growth of the current state, in bytes (>= the tokens it may add)."""
        i = len(self.states) - 1
        if i not in self._growths:
            try:
                self._growths[i] = self.plan.scanner.growth(self.states[-1]) if self.states[-1] else 0
            except Unknown:
                self._growths[i] = 0
        return self._growths[i]

    def _completion(self) -> Optional[list[int]]:
        """The verified completion tokens (stop token last) from the current state, or None. Where
        more than twice the budget, only its first 2 x (budget + 1) tokens (no stop): counted exactly as
        far as a refusal's message needs, never more than can be used."""
        i = len(self.states) - 1
        if i not in self._plans:
            out = None
            for text in (self._candidates() or [])[:TRIES]:  # the shortest the grammar takes
                most = 2 * (self.plan.budget + 1)
                chars = (most + 1) * self.plan.longest  # holds at least most + 1 tokens
                toks = self.plan.tokens(text[:chars])
                if len(text) <= chars:
                    toks.append(self.plan.stop_id)
                cut = len(toks) > most
                if cut:  # cannot fit: the tokens it may still force (a cut text's
                    toks = toks[:most]  # last tokens may differ from the whole text's: dropped)
                if self.inner.validate(toks) == len(toks):  # the grammar takes it, stop token included
                    out = toks
                    if cut:
                        self._cut.add(i)
                    break
            self._plans[i] = out
        return self._plans[i]

    def left(self) -> int:
        """Tokens left in the budget (the one about to be chosen included)."""
        return self.plan.budget - (len(self.states) - 1)

    def forcing(self) -> Optional[list[int]]:
        """The completion tokens when the budget takes over from here, else None."""
        st = self.states[-1]
        if st is None or self.inner.is_terminated():
            return None
        text = self._text()  # a token holds at least a byte: no tokenizing while the bytes fit
        if text is None:
            return None
        margin = SLACK + self._growth()
        if len(text.encode()) + 1 + margin < self.left():
            return None
        comp = self._completion()
        if comp is None or len(comp) + margin < self.left():
            return None
        return comp

    # -- Matcher ----------------------------------------------------------------------------

    def accept(self, token: int) -> bool:
        t = int(token)
        if not self.inner.accept(t):
            return False
        st = self.states[-1]
        if st is not None and t != self.plan.stop_id:
            try:
                st = self.plan.scanner.feed(st, self.plan.token_bytes[t])
            except Unknown:
                st = None
        self.states.append(st)
        return True

    def rollback(self, n: int) -> None:
        if n > 0:
            self.inner.rollback(n)
            for i in range(len(self.states) - n, len(self.states)):
                self._plans.pop(i, None)
                self._cut.discard(i)
                self._texts.pop(i, None)
                self._growths.pop(i, None)
            del self.states[len(self.states) - n:]
            while self._plain and self._plain[-1] >= len(self.states):
                self._plain.pop()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask.numpy().view(np.uint32)
        if not self._copy_mask(words, row):
            self.inner.fill(bitmask, row)
            self._keep_mask(words, row)
        self._restrict(words, row)

    def _copy_mask(self, words: np.ndarray, row: int) -> bool:
        """The grammar's mask of a plain-string state whose string only went on since a state whose
        mask is kept (inside free text, Scanner.free_text): the same words (the grammar's position is
        the same: `Matcher.mask_by_position`), copied rather than computed (`words`: the bitmask's
        uint32 view, [rows, words])."""
        if self._mask is None or not self.inner.mask_by_position:
            return False
        k, st, kept = self._mask
        i = len(self.states) - 1
        if k > i or self.states[k] is not st or not self._plain_here(i):
            return False
        lk = self._linked
        known = bool(lk) and lk[0] == k and lk[1] is st and lk[2] == i and lk[3] is self.states[i]
        if k < i and not known and not self.plan.scanner.extends(st, self.states[i]):
            return False
        words[row] = kept
        self._mask = (i, self.states[i], kept)  # the next state extends this one: a short check
        return True

    def _keep_mask(self, words: np.ndarray, row: int) -> None:
        """Keep the grammar's mask just filled where the state is inside a string of free text."""
        i = len(self.states) - 1
        if self.inner.mask_by_position and self._plain_here(i) and self.plan.scanner.free_text(self.states[i]):
            self._mask = (i, self.states[i], words[row].copy())

    def _plain_here(self, i: int) -> bool:
        """Whether the current state, i, is inside a plain string (its completions known)."""
        return self._candidates() is not None and bool(self._plain) and self._plain[-1] == i

    def _restrict(self, words: np.ndarray, row: int) -> None:
        comp = self.forcing()
        if comp is None:
            return
        t = comp[0]
        self.plan.forced[len(self.states) - 1] = t
        words[row] = 0  # bit t % 32 of word t // 32: token t allowed
        words[row, t >> 5] = np.uint32(1 << (t & 31))

    def forced_tokens(self, encode: Encode, k: int) -> list[int]:
        comp = self.forcing()
        if comp is not None:
            return comp[:k]
        return self.inner.forced_tokens(encode, k)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def reset(self) -> None:
        self.inner.reset()
        self.states = [self.plan.scanner.start()]
        self._plans.clear()
        self._cut.clear()
        self._plain.clear()
        self._mask = None
        self._linked = ()
        self._texts.clear()
        self._growths.clear()

    def violation(self) -> Optional[str]:
        return self.inner.violation()

    @classmethod
    def fill_many(cls, matchers: list["BudgetMatcher"], bitmask: torch.Tensor, rows: list[int],
                  num_threads: int | str = "auto") -> None:
        words = bitmask.numpy().view(np.uint32)  # NOTE: one view for every row (a view costs ~1.5 us)
        fresh = [(m, r) for m, r in zip(matchers, rows) if not m._copy_mask(words, r)]
        fill_by_class([m.inner for m, _ in fresh], bitmask, [r for _, r in fresh], num_threads)
        for m, r in fresh:
            m._keep_mask(words, r)
        for m, r in zip(matchers, rows):
            m._restrict(words, r)


def within_budget(guide: CompiledGuide, scanner: Any, budget: int, token_bytes: Sequence[bytes], encode: Encode,
                  stop_id: int) -> CompiledGuide:
    """`guide` whose matchers close the answer within `budget` tokens (stop token included);
    `scanner`: `Scanner(Schemas(schema, cap))` for JSON guides, `RegexScanner(pattern, cap)` for regex
    ones, `TagScanner(tag, token_bytes, encode, cap)` for structural tags (tool calls), cap =
    `completion_cap(budget, token_bytes)` (or a callable that makes one).
    InvalidRequestError when even the shortest valid answer's text does not fit; the guide unchanged
    where its shortest answer cannot be told or fits only without its stop token."""
    plan: Optional[BudgetPlan] = None
    try:
        plan = BudgetPlan(scanner() if callable(scanner) else scanner, token_bytes, encode, stop_id, budget)
        plan.scanner.completion(plan.scanner.start())  # TooLong here: no answer fits
    except TooLong as e:
        if e.limit < budget * longest_token(token_bytes):  # a cap below the budget's bytes proves nothing
            return guide
        raise InvalidRequestError(
            f"max_tokens {budget} cannot hold a valid answer: the shortest one this guide accepts takes "
            f"more than {budget} tokens ({e})") from None
    except Unknown:  # cannot tell from the start (free text first, ...): the matchers may later
        pass
    if plan is None:
        return guide
    make = guide.make_matcher
    wrapped = dataclasses.replace(guide, make_matcher=lambda: BudgetMatcher(make(), plan), budget=plan)
    probe = BudgetMatcher(guide.matcher(), plan)
    first = probe._completion()
    if first is None:  # cannot tell; or free text comes first (tool calls, `auto`): a call is finished once begun
        return wrapped if getattr(plan.scanner, "starts_in_free_text", False) else guide
    if 0 in probe._cut:  # not even the text fits, by far (checked as far as it matters)
        raise InvalidRequestError(
            f"max_tokens {budget} cannot hold a valid answer: the shortest one this guide accepts takes "
            f"more than {budget} tokens")
    if len(first) - 1 > budget:  # not even the text fits (the text without its stop token ends with "length")
        raise InvalidRequestError(
            f"max_tokens {budget} cannot hold a valid answer: the shortest one this guide accepts takes "
            f"{len(first) - 1} tokens")
    if len(first) > budget:  # the shortest text fits but not its stop token: no answer can end with "stop",
        return guide  # so the grammar alone decides (forcing would only replace the model's words)
    return wrapped
