"""Reasoning models (the model's `reasoning_markers`, e.g. `<think>,</think>`): the text up to the
end marker goes in `reasoning_content`, the rest in `content`.

The same rule as the engine's guide gating (`specguide.guided.reasoning`, vLLM's default): the output
is reasoning until the end marker, unless the prompt already closed the block (a template with
thinking off ends the prompt with `<think>\\n\\n</think>\\n\\n`).
"""
from __future__ import annotations

from typing import Optional

from ..config import ReasoningMarkers
from .tools import _partial_suffix


class ReasoningSplitter:
    """Splits streamed text into (reasoning, content) deltas; text that may begin the end marker is held back."""

    def __init__(self, markers: ReasoningMarkers, prompt: str):
        self.m = markers
        closed = prompt.rfind(markers.end) > prompt.rfind(markers.start) >= 0
        self.reasoning = not closed
        self.buf = ""
        self.started = False  # a leading start marker in the output is not reasoning text
        self.lead = False

    def feed(self, text: str) -> tuple[str, str]:
        if not self.reasoning:
            if self.lead:  # the whitespace after the end marker is neither
                text = text.lstrip()
                self.lead = not text
            return "", text
        self.buf += text
        if not self.started:
            stripped = self.buf.lstrip()
            if self.m.start.startswith(stripped):  # may still become the start marker
                return "", ""
            if stripped.startswith(self.m.start):
                self.buf = stripped[len(self.m.start):]
            self.started = True
        i = self.buf.find(self.m.end)
        if i >= 0:
            thought, rest = self.buf[:i], self.buf[i + len(self.m.end):]
            self.buf, self.reasoning, self.lead = "", False, True
            return thought, self.feed(rest)[1]
        keep = _partial_suffix(self.buf, self.m.end)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out, ""

    def finish(self) -> str:
        """Reasoning text still held back (an output that never closed its block)."""
        rest, self.buf = self.buf, ""
        return rest if self.reasoning else ""


def split_all(markers: Optional[ReasoningMarkers], prompt: str, text: str) -> tuple[Optional[str], str]:
    """A whole output: (reasoning or None, content)."""
    if markers is None:
        return None, text
    s = ReasoningSplitter(markers, prompt)
    thought, content = s.feed(text)
    thought += s.finish()
    return (thought or None), content
