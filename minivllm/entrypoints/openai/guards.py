"""The HTTP server's bounds and connection handling (chapter 10's plumbing, not taught), shared by the one-replica
server (minivllm/entrypoints/openai/api_server.py) and the data-parallel front end
(minivllm/entrypoints/openai/front.py): `Limits` (the table in api_server's docstring), the outermost guard
(header count, API key, OPTIONS), reading a body within its bounds, and cancelling a handler whose client hung up.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from minivllm.entrypoints.openai.protocol import APIError, error_body

logger = logging.getLogger("minivllm.entrypoints.openai")


def log_refusal(request, status: int, message: str, param: str | None) -> None:
    """One log line per 4xx, naming the field (vLLM logs what it refuses too): an operator sees why clients
    fail without asking them."""
    if 400 <= status < 500:  # one line, whatever the client put in the path or a value
        one_line = lambda text: text.encode("unicode_escape").decode("ascii")  # noqa: E731
        logger.info("%s %s -> %d%s: %s", request.method, one_line(request.url.path), status,
                    f" (field {param!r})" if param else "", one_line(message))


def bearer_matches(header: bytes, api_key: str) -> bool:
    """`Authorization: Bearer KEY`, the scheme in any case (RFC 9110; vLLM's authenticate.py lowers it)."""
    scheme, _, token = header.partition(b" ")
    return secrets.compare_digest(token, api_key.encode()) and scheme.lower() == b"bearer"


@dataclass(frozen=True)
class Limits:
    """The server's bounds (the table in the module docstring)."""

    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0
    max_head_bytes: int = 64 << 10
    max_headers: int = 100
    header_timeout: float = 10.0
    keep_alive_timeout: int = 5
    limit_concurrency: int = 1000
    max_tokens_per_request: int = 32768  # n x max_tokens, over all of a request's choices
    client_share: float = 0.5  # of max_num_seqs and max_num_batched_tokens, per client (AsyncLLM, chapter 10)
    stall_timeout: float = 300.0  # a step running longer: the engine cannot serve (/health 503, health.py)


def error_response(status: int, message: str, param: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def head_bytes(scope) -> int:
    """The request line and headers as sent, in bytes (give or take the method and the version)."""
    target = len(scope.get("raw_path") or scope["path"].encode()) + len(scope.get("query_string") or b"") + 1
    return len(scope["method"]) + target + 11 + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


class GuardMiddleware:
    """Plain ASGI, outermost: the header count, the API key, and OPTIONS for routes that have no handler
    for it. Runs before any body is read."""

    OPEN_PATHS = ("/health", "/ping")

    def __init__(self, app, router, limits: Limits, api_key: str | None, path_keys: dict[str, str] | None = None):
        self.app, self.router, self.limits, self.api_key = app, router, limits, api_key
        self.path_keys = path_keys or {}  # a path here needs its own key (and not api_key), even without api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        if len(headers) > self.limits.max_headers:
            response = error_response(431, f"{len(headers)} headers: the limit is {self.limits.max_headers}")
            return await response(scope, receive, send)
        head = head_bytes(scope)  # h11 bounds only a head that arrives in pieces; one read may bring more
        if head > self.limits.max_head_bytes:
            response = error_response(431, f"a request head of {head} bytes: the limit is {self.limits.max_head_bytes}")
            return await response(scope, receive, send)
        preflight = scope["method"] == "OPTIONS" and any(name == b"access-control-request-method"
                                                         for name, _ in headers)
        key = self.path_keys.get(scope["path"], self.api_key)
        if key is not None and not preflight and scope["path"] not in self.OPEN_PATHS:
            if not bearer_matches(dict(headers).get(b"authorization", b""), key):
                what = "operator key" if scope["path"] in self.path_keys else "API key"
                response = error_response(401, f"missing or wrong {what}: send Authorization: Bearer <key>",
                                          headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        if scope["method"] == "OPTIONS" and not preflight:
            return await self.options(scope, receive, send)
        return await self.app(scope, receive, send)

    async def options(self, scope, receive, send):
        methods = set()
        for route in self.router.routes:
            match, _ = route.matches({**scope, "method": "GET"})
            if match != Match.NONE:
                methods |= getattr(route, "methods", None) or set()
        if not methods:
            response = error_response(404, f"no route {scope['path']}")
        else:
            response = Response(status_code=204, headers={"Allow": ", ".join(sorted(methods | {"OPTIONS"}))})
        await response(scope, receive, send)


async def read_body(raw: Request, limits: Limits) -> bytes:
    """The whole body, at most `max_body_bytes` (with or without Content-Length), within `body_timeout`."""
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise APIError(413, f"a body of {declared} bytes: the limit is {limits.max_body_bytes}")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout):
            async for chunk in raw.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise APIError(413, f"a body of more than {limits.max_body_bytes} bytes: that is the limit")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the body did not arrive within {limits.body_timeout:g} s") from None
    except ClientDisconnect:
        raise APIError(400, "the client closed the connection before the end of its body") from None
    return b"".join(chunks)


async def wait_for_disconnect(raw: Request) -> None:
    """Returns when the client closes the connection (call it once the body has been read)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(raw: Request, work):
    """Run a handler, cancelled if the client hangs up first, as vLLM's `with_cancellation`. Cancelling it
    closes the request's output generator, whose `finally` aborts the request in the engine."""
    handler = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(raw))
    try:
        await asyncio.wait([handler, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():
            handler.cancel()
        await asyncio.gather(handler, watcher, return_exceptions=True)
    if handler.cancelled():
        return Response(status_code=499)  # nobody reads it: the client has gone
    return handler.result()
