"""Running the FastAPI app with uvicorn (chapter 10's plumbing), as vLLM's `serve_http`
(`vllm/entrypoints/launcher.py`): in the foreground for `python -m minivllm serve`, or in a background thread
for the notebook, the tests and the benchmark (`BackgroundServer`).

uvicorn runs on its h11 protocol, with the bounds of `Limits` (minivllm/entrypoints/openai/api_server.py):
`h11_max_incomplete_event_size` bounds the request line and headers together, `timeout_keep_alive` closes
idle connections, `limit_concurrency` answers 503 past that many connections and requests in progress. uvicorn
has no deadline for a request's head: a client could hold a connection forever by sending a header byte now
and then. `HeadTimeoutH11Protocol` adds one.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from minivllm.entrypoints.openai.api_server import Limits, build_app


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's line and headers: `header_timeout` seconds
    from a new connection, or from the first byte of a request on a kept-alive one. A client that has sent
    part of a head and misses the deadline gets a 408; a new connection that sent nothing is just closed.
    Idle kept-alive connections stay uvicorn's business (`timeout_keep_alive`). A slowloris defence."""

    def __init__(self, *args, header_timeout: float = 10.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self._received = False

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        self._received = True
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm()  # part of a head: it has a deadline
        else:
            self._disarm()  # the head is complete: the body has a deadline of its own (Limits.body_timeout)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self._received:
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                                 b"content-length: 25\r\nconnection: close\r\n\r\nthe request head was slow")
        self.transport.close()


def uvicorn_config(app, limits: Limits, log_level: str = "warning", access_log: bool = False, **kwargs):
    protocol = functools.partial(HeadTimeoutH11Protocol, header_timeout=limits.header_timeout)
    return uvicorn.Config(app, http=protocol, log_level=log_level, access_log=access_log,
                          h11_max_incomplete_event_size=limits.max_head_bytes,
                          timeout_keep_alive=limits.keep_alive_timeout, limit_concurrency=limits.limit_concurrency,
                          timeout_graceful_shutdown=5, server_header=False, date_header=False, **kwargs)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free one), bound before uvicorn starts so that its port is known."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def run_server(llm, host: str = "127.0.0.1", port: int = 8000, model_name: str | list[str] = "minivllm",
               api_key: str | None = None, limits: Limits = Limits(), access_log: bool = True,
               model_path: str | None = None, enable_prompt_tokens_details: bool = False) -> None:
    """`python -m minivllm serve`: until interrupted, or until its engine is dead (as vLLM's watchdog)."""
    from minivllm.entrypoints.openai.health import exit_when_dead

    app = build_app(llm, model_name, api_key, limits, model_path, enable_prompt_tokens_details)
    sock = bind(host, port)
    names = ", ".join(map(repr, app.state.serving.model_names))
    print(f"minivllm serving {names} on http://{host}:{sock.getsockname()[1]}/v1", flush=True)
    server = uvicorn.Server(uvicorn_config(app, limits, log_level="info", access_log=access_log))
    exit_when_dead(server, app.state.serving.engine, hard_exit_after=10)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()


class ThreadedUvicorn:
    """uvicorn serving `app` on its own event loop in a daemon thread (the one place this is done: chapter
    10's `BackgroundServer` and chapter 12's `DataParallelServer` both use it). `loop` is that event loop."""

    def __init__(self, app, limits: Limits, host: str = "127.0.0.1", port: int = 0, name: str = "minivllm-server"):
        self._socket = bind(host, port)
        self.host, self.port = host, self._socket.getsockname()[1]
        self._server = uvicorn.Server(uvicorn_config(app, limits, log_level="error", log_config=None))
        self._server.config.timeout_graceful_shutdown = 1
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def _run(self) -> None:
        async def serve():
            self.loop = asyncio.get_running_loop()
            await self._server.serve(sockets=[self._socket])

        asyncio.run(serve())

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def running(self) -> bool:
        return self.loop is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"{self._thread.name} did not start (see the error above)")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        self._socket.close()


class BackgroundServer:
    """The server on its own event loop in a daemon thread, for notebooks, tests and the benchmark:

        with BackgroundServer(llm) as server:
            ... talk to server.url (or server.host, server.port) ...
    """

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 0, model_name: str | list[str] = "minivllm",
                 api_key: str | None = None, limits: Limits = Limits(), model_path: str | None = None,
                 enable_prompt_tokens_details: bool = False):
        self.app = build_app(llm, model_name, api_key, limits, model_path, enable_prompt_tokens_details)
        self.engine = self.app.state.serving.engine  # its AsyncLLM
        self._uvicorn = ThreadedUvicorn(self.app, limits, host, port)
        self.host, self.port = self._uvicorn.host, self._uvicorn.port

    @property
    def url(self) -> str:
        return self._uvicorn.url

    def start(self) -> "BackgroundServer":
        self._uvicorn.start()
        return self

    def stop(self) -> None:
        """Abort what runs (its streams end with an error event), then stop serving."""
        if self._uvicorn.running():
            asyncio.run_coroutine_threadsafe(self.engine.shutdown(), self._uvicorn.loop).result(timeout=60)
        self._uvicorn.stop()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
