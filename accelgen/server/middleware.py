"""ASGI middleware that runs before any body parsing: authentication and the request body's size and arrival."""

from __future__ import annotations

import asyncio
import secrets

from fastapi.responses import JSONResponse

from accelgen.server.errors import error_response


class Guard:
    """ASGI middleware before any body parsing: the API key on every path but /health (the API, /metrics and
    the OpenAPI docs alike), then for POST the body: a Content-Length is required, so that an oversized body is
    refused before it is read, and the whole body must arrive within body_timeout_seconds, so that a client
    sending less than it announced cannot hold a connection (uvicorn times out idle connections, not slow bodies)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, body_timeout_seconds: float):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.body_timeout_seconds = body_timeout_seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        refusal = self.refusal(dict(scope["headers"]), scope["method"])
        if refusal is None and scope["method"] == "POST":
            body = await self.read_body(receive)
            if body is None:
                refusal = error_response(408, f"the request body did not arrive within {self.body_timeout_seconds:g} s")
                refusal.headers["connection"] = "close"
            else:
                receive = replay(body, receive)
        if refusal is not None:
            return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    async def read_body(self, receive) -> bytes | None:
        """The whole body, or None when it did not arrive in time (or the client left)."""
        chunks = []
        try:
            async with asyncio.timeout(self.body_timeout_seconds):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            return None

    def refusal(self, headers: dict[bytes, bytes], method: str) -> JSONResponse | None:
        if self.api_key is not None:
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            # the scheme is case-insensitive (RFC 7235); a key without it is refused
            if scheme.lower() != b"bearer" or not secrets.compare_digest(given.strip(), self.api_key.encode()):
                return error_response(401, "invalid or missing API key (header Authorization: Bearer <key>)",
                                      "authentication_error")
        if method == "POST":
            length = headers.get(b"content-length", b"")
            if not length.isdigit():
                return error_response(411, "a Content-Length header is required")
            if int(length) > self.max_body_bytes:
                return error_response(413, f"request body of {int(length)} bytes is over the limit of {self.max_body_bytes}")
        return None


def replay(body: bytes, receive):
    """An ASGI receive that gives the body already read, then passes on to the client's (disconnects)."""
    given = False

    async def receive_again():
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive_again
