"""Tool calls: the call format, the grammar that enforces it, and the parser of the output.

One format for every model (Hermes / Qwen style, what most tool-aware chat templates teach):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The guide is an xgrammar structural tag whose tags begin with `<tool_call>\\n{"name": "NAME",
"arguments": ` and hold the function's JSON Schema, so every call's arguments are valid:
`required` = one or more calls from the first token, a named function = exactly that call,
`auto` = free text until the trigger `<tool_call>` starts a call. `parallel_tool_calls: false`
stops after the first call.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from .schemas import NamedToolChoice, Tool, ToolChoiceMode

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it."""
    return f'{CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}\n{CALL_END}'


def tools_system_prompt(tools: list[Tool]) -> str:
    """The generic tool format, for chat templates without `tools` support."""
    sigs = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                 "parameters": t.function.parameters or _EMPTY_PARAMETERS}) for t in tools)
    return ("You may call one or more functions to answer. The functions are, one JSON object each "
            f"(their parameters are JSON Schemas):\n{sigs}\n"
            "To call a function, write its name and arguments as JSON inside tags, like this:\n"
            f'{CALL_BEGIN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{CALL_END}\n'
            "A function's result comes back inside <tool_response></tool_response>.")


def _tag(tool: Tool) -> dict[str, Any]:
    return {"type": "tag", "begin": f'{CALL_BEGIN}\n{{"name": {json.dumps(tool.function.name)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": tool.function.parameters or _EMPTY_PARAMETERS},
            "end": f"}}\n{CALL_END}"}


def tool_guide(tools: list[Tool], choice: ToolChoiceMode | NamedToolChoice, parallel: bool) -> Optional[dict]:
    """The structural tag that enforces `choice` (None for `none`: no guide)."""
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return {"type": "structural_tag", "format": _tag(tool)}
    tags = [_tag(t) for t in tools]
    if choice == ToolChoiceMode.REQUIRED:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": not parallel}
    elif choice == ToolChoiceMode.AUTO:
        fmt = {"type": "triggered_tags", "triggers": [CALL_BEGIN], "tags": tags, "at_least_one": False,
               "stop_after_first": not parallel}
    else:
        return None
    return {"type": "structural_tag", "format": fmt}


@dataclass
class ParsedCall:
    """One tool call found in the output."""

    name: str
    arguments: str  # a JSON string, as OpenAI sends it (the model's own text when the call was well formed)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallDelta:
    """A piece of one streamed call: the first carries its id and name, every one argument text;
    the SDK concatenates the argument pieces of an index."""

    index: int
    arguments: str
    call: Optional[ParsedCall] = None  # set on the call's first piece

    def to_openai(self) -> dict[str, Any]:
        if self.call is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.call.id, "type": "function",
                "function": {"name": self.call.name, "arguments": self.arguments}}


_CALL = re.compile(re.escape(CALL_BEGIN) + r"\s*(\{.*?\})\s*" + re.escape(CALL_END), re.DOTALL)
# a call's head, up to where its arguments begin (the format the tool guide enforces, any spacing)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def _parse_call(body: str) -> Optional[ParsedCall]:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return ParsedCall(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False))


@dataclass
class _OpenCall:
    """The call being streamed (index: len(calls) until it closes): its head is parsed, its
    arguments begin at `start` of the body."""

    call: ParsedCall
    start: int


class ToolCallParser:
    """Splits streamed output text into content and tool calls as it arrives.

    `feed(text)` returns (content delta, call pieces): a call's id and name go out as soon as its
    head is complete, then its arguments as they are written. Text that may be the start of
    `<tool_call>`, or the call's closing `}` and `</tool_call>`, is held back until it is known.
    `finish()` flushes what is left; a call cut short (max_tokens) keeps the arguments it has."""

    def __init__(self) -> None:
        self.buf = ""  # while in a call: from its CALL_BEGIN on
        self.in_call = False
        self.calls: list[ParsedCall] = []
        self.open: Optional[_OpenCall] = None
        self._after_call = False

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.buf += text
        content: list[str] = []
        pieces: list[CallDelta] = []
        while True:
            if not self.in_call:
                i = self.buf.find(CALL_BEGIN)
                if i < 0:
                    keep = _partial_suffix(self.buf, CALL_BEGIN)
                    content.append(self._content(self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content.append(self._content(self.buf[:i]))
                self.buf, self.in_call = self.buf[i:], True
            body = self.buf[len(CALL_BEGIN):]
            j = body.find(CALL_END)
            if self.open is None:
                m = _HEAD.match(body)
                if m and m.end() < len(body):  # the head and the arguments' first character
                    self.open = _OpenCall(ParsedCall(json.loads(m.group(1)), ""), m.end())
                    pieces.append(CallDelta(len(self.calls), "", self.open.call))
                elif j >= 0:  # not the guided format (only possible unguided): parse it whole
                    self._close_unstreamed(self.buf[:len(CALL_BEGIN) + j + len(CALL_END)], content, pieces)
                    continue
                else:
                    break
            if j < 0:
                self._send(pieces, _arguments(body[self.open.start:]))
                break
            self._send(pieces, _arguments(body[self.open.start:j]))
            self._close(len(CALL_BEGIN) + j + len(CALL_END))
        return "".join(content), pieces

    def _send(self, pieces: list[CallDelta], args: str) -> None:
        """Sends what `args` (the arguments known so far) adds to what was sent."""
        call, index = self.open.call, len(self.calls)
        new = args[len(call.arguments):] if args.startswith(call.arguments) else ""
        call.arguments += new
        if not new:
            return
        if pieces and pieces[-1].index == index:
            pieces[-1].arguments += new  # one piece per call per delta
        else:
            pieces.append(CallDelta(index, new))

    def _close(self, end: int) -> None:
        self.calls.append(self.open.call)
        self.buf, self.in_call, self.open, self._after_call = self.buf[end:], False, None, True

    def _close_unstreamed(self, block: str, content: list[str], pieces: list[CallDelta]) -> None:
        m = _CALL.fullmatch(block.strip())
        call = _parse_call(m.group(1)) if m else None
        self.buf, self.in_call = self.buf[len(block):], False
        if call is None:
            content.append(block)  # not a well-formed call: it stays text
            return
        pieces.append(CallDelta(len(self.calls), call.arguments, call))
        self.calls.append(call)
        self._after_call = True

    def _content(self, text: str) -> str:
        """Drops the whitespace that follows a call (the separators between calls)."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text

    def finish(self, pieces: Optional[list[CallDelta]] = None) -> tuple[str, list[CallDelta]]:
        """The text still held back, and `pieces` (the last feed's) with the last of the calls:
        an unfinished call whose head was sent keeps the arguments written (the client has them
        already); one cut inside its head (max_tokens) is dropped: neither a call nor content."""
        pieces = [] if pieces is None else pieces
        if self.open is not None:
            self._send(pieces, _arguments(self.buf[len(CALL_BEGIN) + self.open.start:], final=True))
            self._close(len(self.buf))
        elif self.in_call:
            self.buf = ""
        rest, self.buf, self.in_call = self.buf, "", False
        return self._content(rest), pieces


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _arguments(text: str, final: bool = False) -> str:
    """The arguments in `text` (what follows a call's head): without a partial `</tool_call>`, the
    whitespace before it, and a last `}` that closes the call object. While the call may go on,
    such a `}` is held back; at the output's end (`final`) it is dropped only when the arguments
    before it are whole JSON (else it is the arguments' own)."""
    text = text[:len(text) - _partial_suffix(text, CALL_END)].rstrip()
    if text.endswith("}") and (not final or _is_json(text[:-1])):
        return text[:-1].rstrip()
    return text


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_all(text: str) -> tuple[Optional[str], list[ParsedCall]]:
    """A whole output: (content or None, calls), the same calls a stream of it gives."""
    p = ToolCallParser()
    content, _ = p.feed(text)
    content += p.finish()[0]
    return (content if content.strip() or not p.calls else None), p.calls
