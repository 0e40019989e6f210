"""The data-parallel front end (chapter 12's plumbing, not taught): the FastAPI app clients talk to, in front of
replica processes (minivllm/entrypoints/openai/replica.py).

It reads each generation request's body, tokenizes it as the replicas do (prompt, or messages through the chat
template; `cache_salt`) and hashes its blocks, both in a worker thread, asks the `Router`
(minivllm/distributed/router.py) for a replica and proxies the request there with httpx: status, headers and
body pass through unchanged, streamed chunk by chunk, with an `x-minivllm-replica` header added. A replica's
refusal (any 4xx or 5xx) drops the blocks the router expected it to name.

Whom to trust, per replica:

- **the KV events**: one task follows the replica's `/kv_events` into the router's index. A line it cannot read
  (not JSON, not an event, an unknown type) is skipped and the stream reopened, which starts with a fresh
  snapshot; the follower never dies of a line, and never clears the index on a guess;
- **liveness**: a probe asks `/health` every `probe_interval` seconds, with a `probe_timeout`. After
  `probe_failures` failures in a row (a process stopped with SIGSTOP still accepts connections, but answers
  nothing; a replica whose engine is dead, or stalled in one step past its `stall_timeout`, answers 503) the
  replica is marked down: it gets no requests, its in-flight requests end at once with a 503 (an error event
  mid-stream) and may be retried, and its event stream is closed. When it answers again it is marked up (at the URL the supervisor gives a restarted one),
  and its event stream reopens with a snapshot. A replica is routed to while it is up and its event stream
  (opened with the replicas' operator key, never the client's) is open.

A client that hangs up closes the proxied connection, so the replica aborts the request. `/v1/models`,
`/tokenize`, `/detokenize` go to any live replica; `/health` (and `/ping`) is 200 while one is alive; `/metrics` is the
router's counters followed by every live replica's metrics with a `replica` label (asked in parallel, each
within `probe_timeout`).
"""

from __future__ import annotations

import asyncio
import json
import weakref
from contextlib import asynccontextmanager, contextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from minivllm import __version__
from minivllm.distributed.kv_events import AllBlocksCleared, event_from_json
from minivllm.distributed.router import Router, check_policy
from minivllm.entrypoints.chat import chat_token_ids
from minivllm.entrypoints.openai.guards import GuardMiddleware, Limits, error_response, read_body, until_disconnect
from minivllm.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest, error_body,
                                                  parse)

HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


class ReplicaDown(Exception):
    """The liveness probe marked the replica down while a request waited on it."""


class ProxyResponse(StreamingResponse):
    """A streamed pass-through of a replica's response; `cleanup` runs however the response ends (sent,
    client gone, replica gone), once."""

    def __init__(self, content, cleanup, **kwargs):
        super().__init__(content, **kwargs)
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.cleanup()


class RouterFront:
    """The front end's handlers: route, proxy, follow the replicas' KV events, probe their liveness."""

    def __init__(self, urls: list[str], router: Router, tokenizer, limits: Limits, api_key: str | None,
                 probe_interval: float = 0.5, probe_timeout: float = 2.0, probe_failures: int = 3,
                 read_timeout: float = 300.0, operator_key: str | None = None):
        self.urls, self.router, self.tokenizer, self.limits = urls, router, tokenizer, limits  # urls: shared with
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # the supervisor, which restarts
        self.operator_auth = {"Authorization": f"Bearer {operator_key}"} if operator_key else {}  # /kv_events
        self.probe_interval, self.probe_timeout, self.probe_failures = probe_interval, probe_timeout, probe_failures
        self.read_timeout = read_timeout
        size = len(urls)
        self.routed, self.predicted_hit_blocks = [0] * size, 0
        self.healthy, self.following = [True] * size, [False] * size
        self.waiting: list[set[asyncio.Task]] = [set() for _ in range(size)]  # tasks awaiting each replica
        self.stopped: weakref.WeakSet = weakref.WeakSet()  # tasks cancelled because their replica went down
        self.marked_down, self.skipped_lines = [0] * size, [0] * size
        self.events_applied, self.clears = [0] * size, [0] * size  # clears: AllBlocksCleared events seen
        self.client: httpx.AsyncClient | None = None
        self.followers: list[asyncio.Task] = []
        self.probes: list[asyncio.Task] = []

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(connect=10, read=self.read_timeout, write=30, pool=None)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self.followers = [asyncio.create_task(self.follow(r)) for r in range(len(self.urls))]
        self.probes = [asyncio.create_task(self.probe(r)) for r in range(len(self.urls))]

    async def stop(self) -> None:
        tasks = self.followers + self.probes
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.aclose()

    def set_router(self, router: Router) -> None:
        """Start over with another router (another policy, an empty index), keeping what is known of liveness."""
        router.alive = [h and f for h, f in zip(self.healthy, self.following)]
        self.router, self.routed, self.predicted_hit_blocks = router, [0] * len(self.urls), 0

    # ------------------------------------------------------------------ whom to trust
    def _update(self, replica: int) -> None:
        self.router.alive[replica] = self.healthy[replica] and self.following[replica]

    async def probe(self, replica: int) -> None:
        failures = 0
        while True:
            try:
                answer = await self.client.get(self.urls[replica] + "/health", timeout=self.probe_timeout)
                ok = answer.status_code == 200
            except httpx.TransportError:
                ok = False
            failures = 0 if ok else failures + 1
            if ok and not self.healthy[replica]:
                self.healthy[replica] = True
                self._update(replica)
            elif failures >= self.probe_failures and self.healthy[replica]:
                self.mark_down(replica)
            await asyncio.sleep(self.probe_interval)

    def mark_down(self, replica: int) -> None:
        """No more requests; the in-flight ones end with a 503; the event stream closes (and reopens with a
        snapshot once the probe sees the replica again)."""
        self.healthy[replica], self.following[replica] = False, False
        self.marked_down[replica] += 1
        self._update(replica)
        for task in self.waiting[replica]:
            self.stopped.add(task)
            task.cancel()
        self.followers[replica].cancel()
        self.followers[replica] = asyncio.create_task(self.follow(replica))

    async def follow(self, replica: int) -> None:
        """Apply the replica's KV events to the index, for as long as the replica is up."""
        while True:
            if self.healthy[replica]:
                try:
                    await self.follow_once(replica)
                except (httpx.TransportError, httpx.StreamError):
                    self.following[replica] = False
                    self._update(replica)
            await asyncio.sleep(self.probe_interval)

    async def follow_once(self, replica: int) -> None:
        """One `/kv_events` stream; returns at a line it cannot read, so that the next stream resyncs."""
        timeout = httpx.Timeout(connect=10, read=None, write=10, pool=None)
        url = self.urls[replica] + "/kv_events"
        async with self.client.stream("GET", url, headers=self.operator_auth, timeout=timeout) as answer:
            if answer.status_code != 200:
                self.following[replica] = False
                self._update(replica)
                return
            self.following[replica] = True
            self._update(replica)
            async for line in answer.aiter_lines():
                if not line:
                    continue
                try:
                    event = event_from_json(json.loads(line))
                except Exception:  # anything at all: skip it, and resync from a fresh snapshot
                    self.skipped_lines[replica] += 1
                    return
                self.router.index.apply(replica, event)
                self.events_applied[replica] += 1
                self.clears[replica] += isinstance(event, AllBlocksCleared)
        self.following[replica] = False  # the replica ended the stream
        self._update(replica)

    @contextmanager
    def awaiting(self, replica: int):
        """Around what a task awaits from a replica: if the probe marks the replica down meanwhile, the task is
        cancelled (the read, in the task that owns the connection, so that httpx closes it) and ReplicaDown
        raised in its place."""
        task = asyncio.current_task()
        self.waiting[replica].add(task)
        try:
            yield
        except asyncio.CancelledError:
            if task not in self.stopped:
                raise
            self.stopped.discard(task)
            task.uncancel()
            raise ReplicaDown() from None
        finally:
            self.waiting[replica].discard(task)

    # ------------------------------------------------------------------ routing and proxying
    def prompt_blocks(self, body: bytes, chat: bool, router: Router) -> list[bytes]:
        """The block hashes of the tokens the replica will see (off the event loop); [] if the body is not a
        valid request (the replica will say why) or there is no tokenizer for text."""
        try:
            request = parse(ChatCompletionRequest if chat else CompletionRequest, body)
        except APIError:
            return []
        if chat:
            if self.tokenizer is None or not self.tokenizer.chat_template:
                return []
            try:  # as the replica renders it, under the same time limit; a failure is the replica's to report
                token_ids = chat_token_ids(self.tokenizer, [{"role": m.role, "content": m.text()}
                                                            for m in request.messages])
            except ValueError:
                return []
        else:  # a batch goes to one replica: route it by its first prompt
            first = request.prompts()[0] if request.prompts() else []
            if isinstance(first, str):
                token_ids = None if self.tokenizer is None else self.tokenizer(
                    first, add_special_tokens=request.add_special_tokens).input_ids
            else:
                token_ids = list(first)
        return router.hash(token_ids, request.cache_salt)

    async def generate(self, raw: Request, chat: bool):
        body = await read_body(raw, self.limits)
        hashes = await asyncio.to_thread(self.prompt_blocks, body, chat, self.router)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return await until_disconnect(raw, self.forward(raw, path, body, hashes))

    async def forward(self, raw: Request, path: str, body: bytes, hashes=None, replica=None):
        """Send the request to a replica (the router's choice, or `replica`) and relay its answer."""
        headers = {k: v for k, v in raw.headers.items() if k.lower() in ("authorization", "content-type")}
        routed = replica is None
        for _ in range(len(self.urls)):
            router = self.router
            try:
                chosen, hit, pending = router.route_blocks(hashes or []) if routed else (replica, 0, [])
            except LookupError:
                break
            if not routed:
                router.in_flight[chosen] += 1
            self.routed[chosen] += routed
            self.predicted_hit_blocks += hit
            request = self.client.build_request(raw.method, self.urls[chosen] + path, content=body, headers=headers)
            try:
                with self.awaiting(chosen):
                    upstream = await self.client.send(request, stream=True)
            except BaseException as error:
                router.finished(chosen)
                router.refused(chosen, pending)
                if isinstance(error, httpx.ConnectError) and routed:  # it never saw the request: try another
                    self.mark_down(chosen)
                    continue
                if isinstance(error, (ReplicaDown, httpx.TransportError)):
                    return error_response(503, f"replica {chosen} stopped answering ({type(error).__name__}); "
                                               "retry: it gets no more requests until it answers again")
                raise  # cancelled: the client hung up
            if upstream.status_code >= 400:
                router.refused(chosen, pending)
            return self.relay(chosen, upstream, router)
        return error_response(503, "no replica is alive to serve this request")

    def relay(self, replica: int, upstream: httpx.Response, router: Router) -> ProxyResponse:
        done = False

        async def cleanup():
            nonlocal done
            if not done:
                done = True
                await upstream.aclose()
                router.finished(replica)

        async def chunks():
            pieces = upstream.aiter_raw()
            while True:
                try:
                    with self.awaiting(replica):
                        chunk = await anext(pieces)
                except StopAsyncIteration:
                    return
                except (ReplicaDown, httpx.TransportError) as error:  # stopped or died mid-answer
                    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                        message = f"replica {replica} failed mid-stream: {type(error).__name__}; retry"
                        yield f"data: {json.dumps(error_body(503, message))}\n\n".encode()
                    return
                yield chunk

        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["x-minivllm-replica"] = str(replica)
        return ProxyResponse(chunks(), cleanup, status_code=upstream.status_code, headers=headers)

    async def any_replica(self, raw: Request):
        body = await read_body(raw, self.limits) if raw.method == "POST" else b""
        live = [r for r, alive in enumerate(self.router.alive) if alive]
        if not live:
            return error_response(503, "no replica is alive")
        replica = min(live, key=lambda r: (self.router.in_flight[r], r))
        return await self.forward(raw, raw.url.path, body, replica=replica)

    # ------------------------------------------------------------------ metrics and the dev-mode reset
    async def replica_metrics(self, replica: int) -> list[str]:
        if not self.router.alive[replica]:
            return []
        try:
            answer = await self.client.get(self.urls[replica] + "/metrics", headers=self.auth,
                                           timeout=self.probe_timeout)
        except httpx.TransportError:
            return []
        return [with_label(line, replica) for line in answer.text.splitlines() if line and not line.startswith("#")]

    async def metrics(self, raw: Request):
        router, lines = self.router, []
        gauges = [("replica_up", "1 while the replica answers its probe and its KV-event stream is open",
                   "gauge", [int(a) for a in router.alive]),
                  ("replica_marked_down_total", "times the probe marked the replica down", "counter", self.marked_down),
                  ("requests_routed_total", "requests routed to the replica", "counter", self.routed),
                  ("requests_in_flight", "requests proxied and not finished", "gauge", router.in_flight),
                  ("index_blocks", "block hashes the replica's KV events say it holds", "gauge",
                   [len(b) for b in router.index.blocks]),
                  ("index_pending_blocks", "block hashes routed there, not confirmed by a KV event yet", "gauge",
                   [len(p) for p in router.index.pending]),
                  ("kv_event_lines_skipped_total", "unreadable KV-event lines (each followed by a resync)", "counter",
                   self.skipped_lines)]
        for name, documentation, kind, values in gauges:
            lines += [f"# HELP minivllm_router:{name} {documentation}", f"# TYPE minivllm_router:{name} {kind}"]
            lines += [f'minivllm_router:{name}{{replica="{r}"}} {v}' for r, v in enumerate(values)]
        for replica_lines in await asyncio.gather(*(self.replica_metrics(r) for r in range(len(self.urls)))):
            lines += replica_lines
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    async def reset_prefix_cache(self, raw: Request):
        live = [r for r, alive in enumerate(self.router.alive) if alive]
        answers = await asyncio.gather(*(self.client.post(self.urls[r] + "/reset_prefix_cache", headers=self.auth)
                                         for r in live))
        statuses = [answer.status_code for answer in answers]
        if any(s != 200 for s in statuses):
            return error_response(409, f"some replicas refused (status codes {statuses}): retry when idle")
        return Response(status_code=200)


def with_label(line: str, replica: int) -> str:
    """`name{a="b"} 1` -> `name{replica="0",a="b"} 1`; `name 1` -> `name{replica="0"} 1`."""
    name, _, rest = line.partition(" ")
    if "{" in name or name.endswith("}"):
        head, _, labels = line.partition("{")
        return f'{head}{{replica="{replica}",{labels}'
    return f'{name}{{replica="{replica}"}} {rest}'


def build_router_app(urls: list[str], policy: str = "prefix-aware", tokenizer=None, block_size: int = 16,
                     api_key: str | None = None, limits: Limits = Limits(), dev_mode: bool = False,
                     **front_options) -> FastAPI:
    """The front end for replicas at `urls`; `app.state.front` is its RouterFront. `front_options`: the probe's
    and the proxy's timeouts, the replicas' operator key (RouterFront's keyword arguments)."""
    check_policy(policy)
    front = RouterFront(urls, Router(len(urls), policy, block_size), tokenizer, limits, api_key, **front_options)

    @asynccontextmanager
    async def lifespan(app):
        await front.start()
        yield
        await front.stop()

    app = FastAPI(title="minivllm router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.front = front

    async def completions(raw: Request):
        return await front.generate(raw, chat=False)

    async def chat(raw: Request):
        return await front.generate(raw, chat=True)

    async def health():
        return Response(status_code=200 if any(front.router.alive) else 503)

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    for path, methods in [("/v1/models", ["GET", "HEAD"]), ("/tokenize", ["POST"]), ("/detokenize", ["POST"])]:
        app.add_api_route(path, front.any_replica, methods=methods)
    app.add_api_route("/health", health, methods=["GET", "HEAD"])
    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's (SageMaker's) health check
    app.add_api_route("/version", lambda: {"version": __version__}, methods=["GET"])
    app.add_api_route("/metrics", front.metrics, methods=["GET", "HEAD"])
    if dev_mode:
        app.add_api_route("/reset_prefix_cache", front.reset_prefix_cache, methods=["POST"])

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return error_response(error.status, error.message, error.param)

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        return error_response(500, f"{type(error).__name__}: {error}")

    app.add_middleware(GuardMiddleware, router=app.router, limits=limits, api_key=api_key)
    return app
