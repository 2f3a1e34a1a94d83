"""Request bodies bounded in size and in time, whatever their framing: what every web app of tensorfleet
lets a caller make it read (serve-model has no sign-in at all, the job service's sign-in page none yet)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from starlette.responses import PlainTextResponse

BODY_TIMEOUT_S = 30.0  # the longest a request body may take to arrive


class BodyLimit:
    """ASGI middleware: the request body is read here, bounded in size and in time whatever its framing, and
    handed to the app whole.

    A Content-Length over ``limit`` is refused (413) before anything is read; a chunked body (whose announced
    size would be no bound: ``Content-Length: 2`` with a chunked body of gigabytes) is refused (411); the bytes
    actually received are counted all the same (413 past ``limit``), and a body that has not arrived within
    ``timeout_s`` of the request's start is refused (408), so a slow sender holds a connection for a bounded
    time. At most ``limit`` bytes per request are held, whatever the app does with them.
    """

    def __init__(self, app: Callable, limit: int, timeout_s: float | None = None) -> None:
        self.app, self.limit = app, limit
        self.timeout_s = BODY_TIMEOUT_S if timeout_s is None else timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        lengths = {value for name, value in scope["headers"] if name == b"content-length"}
        if any(name == b"transfer-encoding" for name, _ in scope["headers"]):
            return await self._refuse(411, "send the body with a Content-Length: chunked bodies are not accepted",
                                      scope, receive, send)
        if len(lengths) > 1 or any(not value.isdigit() or int(value) > self.limit for value in lengths):
            return await self._refuse(413, f"request body over {self.limit} bytes", scope, receive, send)
        body = bytearray()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                return await self._refuse(408, f"the request body did not arrive within {self.timeout_s:g} s",
                                          scope, receive, send)
            if message["type"] != "http.request":  # the client went away: nobody to answer
                return None
            body += message.get("body", b"")
            if len(body) > self.limit:
                return await self._refuse(413, f"request body over {self.limit} bytes", scope, receive, send)
            if not message.get("more_body", False):
                break
        whole: dict[str, Any] | None = {"type": "http.request", "body": bytes(body), "more_body": False}

        async def replay() -> dict[str, Any]:
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # after the body: only a disconnect is left to hear of

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(status: int, text: str, scope: dict, receive: Callable, send: Callable) -> None:
        # Connection: close, so that the server reads no more of a body it refused.
        await PlainTextResponse(text, status, headers={"Connection": "close"})(scope, receive, send)
