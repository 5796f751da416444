"""A text/event-stream answer written straight to ASGI, and cancelled when its client goes away."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator

from starlette.responses import Response


class EventStream(Response):
    """Sends each string of `events` as it comes, then ends the body. A client that disconnects
    cancels the task that sends (so the iterator's Triton call is reset and its slot freed).

    NOTE: Starlette's StreamingResponse does the same under ASGI 2.3 (uvicorn's) with an anyio task
    group per answer: a cancel scope, a second task and a repr of the task when it cancels, about an
    eighth of the server's CPU per streamed request (bench/bench_openai.py). Here the listener is
    one plain task."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None]):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})  # no content-length: the body is chunked

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        sender = asyncio.current_task()
        gone = done = False

        async def listen() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass  # a request body's remaining messages (already read: none)
            if not done:
                gone = True
                sender.cancel()

        listener = asyncio.ensure_future(listen())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            done = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise  # the server's own cancellation (shutdown)
            getattr(sender, "uncancel", lambda: 0)()  # Python >= 3.11: this task is not being cancelled
        finally:
            listener.cancel()
            await self.events.aclose()
