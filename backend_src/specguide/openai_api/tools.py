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
    arguments: str  # a JSON string, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self, index: Optional[int] = None) -> dict[str, Any]:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


_CALL = re.compile(re.escape(CALL_BEGIN) + r"\s*(\{.*?\})\s*" + re.escape(CALL_END), re.DOTALL)


def _parse_call(body: str) -> Optional[ParsedCall]:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return ParsedCall(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False))


class ToolCallParser:
    """Splits streamed output text into content and tool calls as it arrives.

    `feed(text)` returns (content delta, calls completed by it); text that may be the start of
    `<tool_call>` is held back until it is known. `finish()` flushes what is left."""

    def __init__(self) -> None:
        self.buf = ""
        self.in_call = False
        self.calls: list[ParsedCall] = []
        self._after_call = False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buf += text
        content, done = [], []
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
            j = self.buf.find(CALL_END)
            if j < 0:
                break
            block, self.buf, self.in_call = self.buf[:j + len(CALL_END)], self.buf[j + len(CALL_END):], False
            m = _CALL.fullmatch(block.strip())
            call = _parse_call(m.group(1)) if m else None
            if call is None:
                content.append(block)  # not a well-formed call (only possible unguided): keep it as text
            else:
                done.append(call)
                self._after_call = True
        self.calls.extend(done)
        return "".join(content), done

    def _content(self, text: str) -> str:
        """Drops the whitespace that follows a call (the separators between calls)."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text

    def finish(self) -> str:
        """The text still held back (an unfinished call stays text)."""
        rest, self.buf, self.in_call = self.buf, "", False
        return self._content(rest)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_all(text: str) -> tuple[Optional[str], list[ParsedCall]]:
    """A whole output: (content or None, calls)."""
    p = ToolCallParser()
    content, _ = p.feed(text)
    content += p.finish()
    return (content if content.strip() or not p.calls else None), p.calls
