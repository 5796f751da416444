"""Where in a structural tag's output the accepted bytes are (`TagScanner`), and the shortest text
that ends a valid output from there: the token budget's view (budget.py) of tool calls.

The formats understood are xgrammar's, with JSON-schema contents (what the OpenAI server's tool
guides and most clients send): one `tag` (a named function: exactly one call), `tags_with_separator`
(`required`: calls separated by `separator`, nothing else) and `triggered_tags` (`auto`: free text,
where a trigger starts a call). Anything else raises Unknown and the guide keeps no budget.

  between calls   the output may end once the format's calls are in (else: the cheapest call);
                  one token may begin a whole call, so `growth` is that call's length
  in a call head  the rest of the cheapest head that fits, its shortest arguments and end
  in arguments    the JSON scanner's completion, then the tag's end
  in free text    Unknown: the budget never ends free text early (the answer keeps "length"),
                  it only finishes a call once one has begun; right after a call, as between
                  calls: the output ends there when another call could not fit

Free text is matched against the triggers by one automaton (Aho-Corasick over the triggers'
bytes), so a byte costs the same whatever the triggers' lengths; the tags' shortest calls share
one `Work` and one byte cap (`max_bytes`).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional, Sequence

from .json_scanner import Scanner, State
from .regex_completion import MAX_BYTES, TooLong, Unknown
from .schema_completion import WORK_PER_BYTE, Schemas, Work


class TagMode(Enum):
    ONE = "tag"
    SEPARATED = "tags_with_separator"
    TRIGGERED = "triggered_tags"


class Phase(Enum):
    BETWEEN = 0  # outside a call, where only calls (and the separator) may come; buf: the head so far
    TEXT = 1  # free text (triggered); buf: its end that may begin a trigger
    ARGS = 2  # inside call `tag`'s JSON arguments
    END = 3  # inside call `tag`'s end; buf: the end so far


@dataclass(frozen=True)
class TagState:
    phase: Phase
    calls: int = 0  # calls complete
    buf: bytes = b""
    tag: int = -1
    json: Optional[State] = None
    fresh: bool = False  # TEXT: a call has just ended, no text since
    node: int = 0  # TEXT: the trigger automaton's node (the text's end that may begin a trigger)


@dataclass(frozen=True)
class _Tag:
    begin: bytes
    end: bytes
    scanner: Scanner
    shortest: bytes  # begin + shortest arguments + end
    extra: int  # the most one more arguments element adds (bytes)


class TagScanner:
    """Follows a structural tag's output bytes: TagState -> TagState, raising Unknown where it
    cannot. `token_bytes`: the vocabulary, to tell whether one token can reach past a call's end;
    `encode`: the tokenizer's, to count the tokens of a whole new call."""

    def __init__(self, structural_tag: Any, token_bytes: Sequence[bytes], encode: Callable[[str], list[int]],
                 max_bytes: int = MAX_BYTES):
        fmt = structural_tag.get("format") if isinstance(structural_tag, dict) else None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        try:
            self.mode = TagMode(kind)
        except ValueError:
            raise Unknown(f"structural tag format {kind!r}") from None
        specs = [fmt] if self.mode == TagMode.ONE else fmt.get("tags")
        if not isinstance(specs, list) or not specs:
            raise Unknown("no tags")
        self.max_bytes, work = max_bytes, Work(WORK_PER_BYTE * max_bytes)  # one cost for all the tags
        try:
            self.tags = [_tag(s, max_bytes, work) for s in specs]
        except TooLong as e:  # another tag may be short: the budget cannot tell
            raise Unknown(f"a tag's shortest call: {e}") from None
        self.sep = str(fmt.get("separator", "")).encode() if self.mode == TagMode.SEPARATED else b""
        self.triggers = [str(t).encode() for t in fmt.get("triggers", [])] if self.mode == TagMode.TRIGGERED else []
        self._ac = _Triggers(self.triggers)
        self.at_least_one = self.mode == TagMode.ONE or bool(fmt.get("at_least_one", False))
        self.one_call = self.mode == TagMode.ONE or bool(fmt.get("stop_after_first", False))
        if self.mode == TagMode.TRIGGERED and (self.at_least_one or not self.triggers
                                               or not all(any(t.begin.startswith(g) for g in self.triggers)
                                                          for t in self.tags)):
            raise Unknown("triggered tags: at_least_one, or a begin that no trigger starts")
        self.token_bytes = token_bytes
        # what one token may begin where the output could end: a whole call, in tokens (+2: its
        # rest may split into more tokens than the whole), and one more arguments element (bytes)
        self._new_call = max(len(encode((self.sep + t.shortest).decode())) + 2 + t.extra for t in self.tags)
        # the first bytes that may follow a call (None: any, free text follows)
        self._next = None if self.mode == TagMode.TRIGGERED else {(self.sep + t.begin)[:1] for t in self.tags}
        self._reach: dict[tuple[int, int], bool] = {}

    @property
    def starts_in_free_text(self) -> bool:
        """The output begins as free text (no completion to tell yet): budget.within_budget wraps anyway."""
        return self.mode == TagMode.TRIGGERED

    def start(self) -> TagState:
        return TagState(Phase.TEXT if self.mode == TagMode.TRIGGERED else Phase.BETWEEN)

    def feed(self, st: TagState, data: bytes) -> TagState:
        for c in data:
            st = self._byte(st, c)
        return st

    def _heads(self, st: TagState) -> list[tuple[int, bytes]]:
        """(tag, the head text still to write) for every call head that the bytes so far begin."""
        pre = self.sep if st.calls and self.mode == TagMode.SEPARATED else b""
        return [(i, (pre + t.begin)[len(st.buf):]) for i, t in enumerate(self.tags)
                if (pre + t.begin).startswith(st.buf)]

    def _byte(self, st: TagState, c: int) -> TagState:
        b = bytes([c])
        if st.phase == Phase.TEXT:
            if st.calls and self.one_call:
                raise Unknown("text after the one call")
            node = self._ac.step(st.node, c)
            hit = self._ac.hit[node]
            if hit >= 0:
                return self._head(TagState(Phase.BETWEEN, st.calls, self.triggers[hit]))
            return TagState(Phase.TEXT, st.calls, node=node)
        if st.phase == Phase.BETWEEN:
            if st.calls and self.one_call:
                raise Unknown("bytes after the one call")
            return self._head(TagState(Phase.BETWEEN, st.calls, st.buf + b))
        tag = self.tags[st.tag]
        if st.phase == Phase.ARGS:
            if not st.json.done:
                return TagState(Phase.ARGS, st.calls, b"", st.tag, tag.scanner.feed(st.json, b))
            st = TagState(Phase.END, st.calls, b"", st.tag)
        buf = st.buf + b
        if not tag.end.startswith(buf):
            raise Unknown("not the tag's end")
        if buf != tag.end:
            return TagState(Phase.END, st.calls, buf, st.tag)
        return TagState(Phase.TEXT if self.mode == TagMode.TRIGGERED else Phase.BETWEEN, st.calls + 1,
                        fresh=self.mode == TagMode.TRIGGERED)

    def _head(self, st: TagState) -> TagState:
        heads = self._heads(st)
        if not heads:
            raise Unknown("no call head begins so")
        for i, rest in heads:
            if not rest:  # a whole head: the arguments begin
                return TagState(Phase.ARGS, st.calls, b"", i, self.tags[i].scanner.start())
        return st

    # -- the shortest completion -------------------------------------------------------------

    def _may_end(self, st: TagState) -> bool:
        return st.phase == Phase.BETWEEN and not st.buf and (st.calls > 0 or not self.at_least_one)

    def completion(self, st: TagState) -> str:
        """The shortest text that ends a valid output from `st`."""
        if st.phase == Phase.TEXT:
            if st.fresh:
                return ""
            raise Unknown("free text")
        if self._may_end(st):
            return ""
        if st.phase == Phase.BETWEEN:
            return min((rest + self.tags[i].shortest[len(self.tags[i].begin):] for i, rest in self._heads(st)),
                       key=len).decode()
        tag = self.tags[st.tag]
        if st.phase == Phase.ARGS:
            return tag.scanner.completion(st.json) + tag.end.decode()
        return tag.end[len(st.buf):].decode()

    def completions(self, st: TagState) -> list[str]:
        """The completions the budget checks, shortest first: here the one."""
        return [self.completion(st)]

    def growth(self, st: TagState) -> int:
        """The most one more token adds to the completion's tokens (bytes bound them where they are
        not counted): where the output may end, a whole new call; in a head, the dearest call it
        may still become; in a call, one more arguments element, or (where one token reaches past
        the call's end) a new call after it."""
        if st.phase == Phase.TEXT or self._may_end(st):
            return 0 if self.one_call or not (st.phase == Phase.BETWEEN or st.fresh) else self._new_call
        if st.phase == Phase.BETWEEN:
            heads = self._heads(st)  # the dearest call the head may still become, and its first element
            ends = [len(rest) + len(self.tags[i].shortest) - len(self.tags[i].begin) for i, rest in heads]
            return max(ends) - min(ends) + max(self.tags[i].extra for i, _ in heads)
        tag = self.tags[st.tag]
        inner = 0
        if st.phase == Phase.ARGS:
            inner = tag.extra if not st.json.stack and st.json.lex is None and not st.json.done \
                else tag.scanner.growth(st.json)
        if self.one_call or not self._reaches(st):
            return inner
        return max(inner, self._new_call)

    def _reaches(self, st: TagState) -> bool:
        """Whether one token from `st` (inside a call) can close it and go on past its end (into the
        next call, or free text): a token holding the rest of the end and a byte that may follow
        (ARGS: the whole end). Where none can, the budget decides at the call's end."""
        key = (st.tag, -1 if st.phase == Phase.ARGS else len(st.buf))
        if key not in self._reach:
            end = self.tags[st.tag].end
            rest, nxt = (end if st.phase == Phase.ARGS else end[len(st.buf):]), self._next
            if st.phase == Phase.ARGS:
                hit = (lambda t: rest in t[:-1]) if nxt is None else (lambda t: any(rest + b in t for b in nxt))
            else:
                hit = (lambda t: len(t) > len(rest) and t.startswith(rest)) if nxt is None else \
                    (lambda t: any(t.startswith(rest + b) for b in nxt))
            self._reach[key] = any(hit(t) for t in _holding(self.token_bytes, end[-1:]))
        return self._reach[key]


_HOLDING: dict[tuple[int, bytes], tuple[Sequence[bytes], list[bytes]]] = {}


def _holding(token_bytes: Sequence[bytes], b: bytes) -> list[bytes]:
    """The tokens that hold byte `b` (a call's end's last byte: any token reaching past the end holds
    it), once per vocabulary (NOTE: kept with the vocabulary itself, so a new list at an old id misses)."""
    hit = _HOLDING.get((id(token_bytes), b))
    if hit is None or hit[0] is not token_bytes:
        hit = (token_bytes, [t for t in token_bytes if b in t])
        _HOLDING[(id(token_bytes), b)] = hit
    return hit[1]


class _Triggers:
    """Aho-Corasick over the triggers' bytes: node 0 is the empty text; a node is the longest end
    of the text that begins a trigger; `hit[node]`: the first trigger (in list order) the text
    then ends with, else -1. Built in the triggers' total length; `step` memoized per (node, byte)."""

    def __init__(self, triggers: list[bytes]):
        self._steps: dict[tuple[int, int], int] = {}
        self.children: list[dict[int, int]] = [{}]
        self.hit, self.fail, depth = [-1], [0], [0]
        ends: list[list[int]] = [[]]
        for i, trig in enumerate(triggers):
            node = 0
            for c in trig:
                nxt = self.children[node].get(c)
                if nxt is None:
                    nxt = self.children[node][c] = len(self.children)
                    self.children.append({})
                    self.hit.append(-1)
                    self.fail.append(0)
                    depth.append(depth[node] + 1)
                    ends.append([])
                node = nxt
            ends[node].append(i)
        order, k = [0], 0
        while k < len(order):  # breadth first: a node's failure link is shallower, so set before it
            node = order[k]
            k += 1
            for c, child in self.children[node].items():
                self.fail[child] = 0 if node == 0 else self.step(self.fail[node], c)
                order.append(child)
        for node in order:
            own = min(ends[node], default=-1)
            inherited = self.hit[self.fail[node]] if node else -1
            self.hit[node] = min((h for h in (own, inherited) if h >= 0), default=-1)

    def step(self, node: int, c: int) -> int:
        """The node after byte `c`."""
        out = self._steps.get((node, c))
        if out is None:  # each (node, byte) once: a byte costs O(1) after the first time
            start = node
            while node and c not in self.children[node]:
                node = self.fail[node]
            out = self._steps[(start, c)] = self.children[node].get(c, 0)
        return out


def _tag(spec: Any, max_bytes: int, work: Work) -> _Tag:
    content = spec.get("content") if isinstance(spec, dict) else None
    if not isinstance(content, dict) or content.get("type") != "json_schema" \
            or not isinstance(spec.get("begin"), str) or not isinstance(spec.get("end"), str) or not spec["end"]:
        raise Unknown("a tag that is not begin + JSON schema + end")
    schemas = Schemas(content.get("json_schema", {}), max_bytes, work)
    root = schemas.resolve(schemas.root)
    begin, end = spec["begin"].encode(), spec["end"].encode()
    return _Tag(begin, end, Scanner(schemas), begin + schemas.shortest(root).encode() + end,
                schemas.extra(root, "object" if isinstance(root, dict) and root.get("type") != "array" else "array"))
