"""A request's text, made where its events are read, not in the engine loop: incremental
detokenizing and stop strings over the engine's token events.

The engine's events carry token ids (and their per-token values); `TextStream` gives each event
its text. In the served engine it runs on the Triton stub's reader thread (process/engine_process.py:
only token ids cross the pipe), in the in-process `Engine` on its caller's side of the callback.
When the text holds a stop string, the stream cuts the text there, asks the engine to stop the
request (its slot is freed at the engine's next turn) and ends it at once: that event goes out as
the final one, finish_reason "stop", as if the engine had found the stop string itself. A guided
request's event waits for the engine's final one instead, whose guide notes it carries (what the
grammar left unchecked, whether the budget closed the document: known at the engine's end). Nothing
the engine made after the stop string reaches the client."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from .request import Request, RequestOutput, SamplingParams
from .tokenizer import IncrementalDetokenizer

Callback = Callable[[RequestOutput], None]


class TextStream:
    """One request's text: deltas that never split a UTF-8 character, with the text that could
    begin a stop string held back until it cannot (or is cut, or the request ends)."""

    def __init__(self, tokenizer, params: SamplingParams, stop: Callable[[], None], guided: bool = False):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = params.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # characters held back meanwhile
        self.include_stop = params.include_stop_str_in_output
        self.pending = ""  # decoded, held back: could be the start of a stop string
        self.wait_for_end = guided  # a stop string's event waits for the engine's final one (its guide notes)
        self.held: Optional[RequestOutput] = None  # that event, until then
        self.ended = False  # the client's final event is out: the engine's later events are not passed on
        self._stop = stop  # asks the engine to stop the request

    @staticmethod
    def wrap(tokenizer, request: Request, callback: Callback, stop: Callable[[], None]) -> Callback:
        """`callback` given the request's events with their text, up to its final one."""
        stream = TextStream(tokenizer, request.params, stop, guided=request.guided is not None)

        def on_output(out: RequestOutput) -> None:
            out = stream.take(out)
            if out is not None:
                callback(out)
        return on_output

    def take(self, out: RequestOutput) -> Optional[RequestOutput]:
        """The event with its text; None once the request has ended, or while a stop string's event
        waits for the engine's final one."""
        if self.ended:
            return None
        if self.held is not None:
            return self._stopped(out) if out.finished else None
        new = self.detok.add(out.token_ids) if out.token_ids else ""
        # the end: the rest of the text goes out, but on a cancel or an error without new tokens
        # (an error with tokens: the guide rejected one; the tokens before it are output)
        flush = out.finished and (out.finish_reason not in ("cancelled", "error") or bool(out.token_ids))
        if flush:
            new += self.detok.finish()
        if out.finished and not flush:
            text, hit, self.pending = "", False, ""  # held-back text is dropped
        else:
            text, hit = self._cut(self.pending + new, final=flush)
        out.text = text
        if hit and out.finished:
            out.finish_reason, out.error, out.error_code = "stop", None, None
        elif hit:
            self._stop()
            if self.wait_for_end:
                self.held = out
                return None
            self.ended = True
            out.finished, out.finish_reason, out.stage = True, "stop", "decode"
        return out

    def _cut(self, text: str, final: bool) -> tuple[str, bool]:
        """(the text to send, whether a stop string ends it); the rest stays pending."""
        if self.stops:
            hits = [(i, -len(s)) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
            if hits:
                start, neg = min(hits)  # the first stop string (the longer one where two start together)
                self.pending = ""
                return text[: start - neg if self.include_stop else start], True
            cut = len(text) if final else max(len(text) - self.hold, 0)
        else:
            cut = len(text)
        self.pending = text[cut:]
        return text[:cut], False

    def _stopped(self, final: RequestOutput) -> RequestOutput:
        """The held event, ended by the engine's final one (its tokens, if any, came after the stop string)."""
        return replace(self.held, finished=True, finish_reason="stop", error=None, error_code=None,
                       stage=final.stage, guide_notes=final.guide_notes)
