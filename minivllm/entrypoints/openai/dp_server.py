"""Data parallelism behind one OpenAI-compatible endpoint (chapter 12's plumbing, not taught):
`python -m minivllm serve --data-parallel-size N --router {round-robin,least-loaded,prefix-aware}`.

Each replica is chapter 10's one-replica server (`build_app`) in a process of its own, on a port of its own,
with two more routes:

    GET  /kv_events            its prefix cache's KV events as JSON lines (minivllm/distributed/kv_events.py):
                               first a snapshot (AllBlocksCleared, then one BlockStored of every named block),
                               then every event as it happens
    POST /reset_prefix_cache   forget every cached block (409 while requests run), as vLLM's dev-mode route

The front end is a FastAPI app that the clients talk to. It reads each generation request's body, tokenizes
it as the replicas do (prompt, or messages through the chat template; `cache_salt`), asks the `Router`
(minivllm/distributed/router.py) for a replica and proxies the request there with httpx: the replica's status,
headers and body pass through unchanged, streamed chunk by chunk, with an `x-minivllm-replica` header added.
One task per replica follows its `/kv_events` and feeds the router's index; when that stream breaks, the
replica counts as dead (no more requests) until it answers again. A client that hangs up closes the proxied
connection, so the replica aborts the request, as with one replica. A replica that cannot be reached is marked
dead and the request goes to another; when none is left, a 503. `/v1/models`, `/tokenize`, `/detokenize` go to
any live replica; `/health` is 200 while one is alive; `/metrics` is the router's counters followed by every
replica's metrics with a `replica` label.

Replica processes watch their parent and exit when it has gone, so that a killed front end leaves no orphans.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from minivllm.distributed.kv_events import (AllBlocksCleared, BlockStored, event_from_json, event_to_json,
                                            publish_kv_events)
from minivllm.distributed.router import POLICIES, Router
from minivllm.entrypoints.openai.api_server import (GuardMiddleware, Limits, build_app, error_response, read_body,
                                                    until_disconnect)
from minivllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse

MAX_REPLICAS = 64
READY = re.compile(r"^minivllm replica (\d+) serving on (http://\S+)$")


# ---------------------------------------------------------------------------------------------- a replica
class KVEventPublisher:
    """Drains an engine's KV-event deque (filled by the engine's worker thread) on the event loop, keeps a
    mirror of the named blocks for the snapshot a new subscriber gets, and fans events out as JSON lines."""

    def __init__(self, events, block_size: int):
        self.events, self.block_size = events, block_size
        self.mirror: set[bytes] = set()
        self.subscribers: list[asyncio.Queue] = []
        self.task: asyncio.Task | None = None
        self.published = 0

    def drain(self) -> None:
        while self.events:
            event = self.events.popleft()
            if isinstance(event, BlockStored):
                self.mirror.update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.mirror.clear()
            else:
                self.mirror.difference_update(event.block_hashes)
            line = json.dumps(event_to_json(event)) + "\n"
            self.published += 1
            for queue in self.subscribers:
                queue.put_nowait(line)

    async def run(self) -> None:
        while True:
            self.drain()
            await asyncio.sleep(0.005)

    def subscribe(self) -> asyncio.Queue:
        if self.task is None:
            self.task = asyncio.create_task(self.run())
        self.drain()
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(json.dumps(event_to_json(AllBlocksCleared())) + "\n")
        if self.mirror:
            snapshot = BlockStored(sorted(self.mirror), None, [], self.block_size)
            queue.put_nowait(json.dumps(event_to_json(snapshot)) + "\n")
        self.subscribers.append(queue)
        return queue


def build_replica_app(llm, model_name: str = "minivllm", api_key: str | None = None, limits: Limits = Limits()):
    """Chapter 10's app for `llm`, plus /kv_events and /reset_prefix_cache."""
    events = publish_kv_events(llm.engine)
    app = build_app(llm, model_name, api_key, limits)
    publisher = app.state.kv_events = KVEventPublisher(events, llm.engine.config.block_size)
    serving = app.state.serving

    async def kv_events():
        queue = publisher.subscribe()

        async def lines():
            try:
                while True:
                    yield await queue.get()
            finally:
                publisher.subscribers.remove(queue)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def reset_prefix_cache():
        engine = serving.engine
        if engine.snapshot["unfinished"] or engine._inbox or llm.engine.has_unfinished_requests():
            raise APIError(409, "requests are running: reset the prefix cache when the replica is idle")
        llm.engine.kv_manager.reset_prefix_cache()
        return Response(status_code=200)

    app.add_api_route("/kv_events", kv_events, methods=["GET"])
    app.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    return app


def watch_parent(parent: int) -> None:
    """Exit this process when its parent has gone (a front end killed with SIGKILL cannot stop us)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="minivllm-parent-watch").start()


def replica_main(argv=None) -> int:
    """`python -m minivllm.entrypoints.openai.dp_server --rank R ...`: one replica, until terminated."""
    parser = argparse.ArgumentParser(prog="minivllm replica")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-model-name", default="minivllm")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--llm-kwargs", default="{}", help="LLM(...) keyword arguments, as JSON")
    args = parser.parse_args(argv)
    watch_parent(args.parent)
    import torch
    import uvicorn

    from minivllm import LLM
    from minivllm.entrypoints.openai.launcher import bind, uvicorn_config

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(**json.loads(args.llm_kwargs))
    limits = Limits()
    app = build_replica_app(llm, args.served_model_name, os.environ.get("MINIVLLM_API_KEY") or None, limits)
    sock = bind(args.host, 0)
    print(f"minivllm replica {args.rank} serving on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn_config(app, limits, log_level="warning"))
    server.config.timeout_graceful_shutdown = 1
    try:
        asyncio.run(server.serve(sockets=[sock]))
    except KeyboardInterrupt:
        pass
    return 0


class Replicas:
    """N replica processes: started together, each announcing its URL; stopped together, also on failure."""

    def __init__(self, size: int, llm_kwargs: dict | None = None, model_name: str = "minivllm",
                 api_key: str | None = None, threads: int | None = None, startup_timeout: float = 300):
        check_data_parallel_size(size)
        threads = threads or max(1, (os.cpu_count() or 1) // size)
        env = {**os.environ, "TQDM_DISABLE": "1"}
        if api_key:
            env["MINIVLLM_API_KEY"] = api_key
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = [""] * size
        try:
            for rank in range(size):
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", "minivllm.entrypoints.openai.dp_server", "--rank", str(rank),
                     "--parent", str(os.getpid()), "--served-model-name", model_name, "--threads", str(threads),
                     "--llm-kwargs", json.dumps(llm_kwargs or {})],
                    stdout=subprocess.PIPE, stderr=None, text=True, env=env))
            deadline = time.monotonic() + startup_timeout
            for rank, process in enumerate(self.processes):
                self.urls[rank] = self._announced(rank, process, deadline)
            for url in self.urls:
                self._wait_healthy(url, deadline)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _announced(rank: int, process: subprocess.Popen, deadline: float) -> str:
        """The URL the replica prints once its socket is bound; its later output is drained in a thread."""
        import queue

        lines: queue.Queue = queue.Queue()

        def read():
            for line in process.stdout:
                lines.put(line)
            lines.put(None)  # it closed its stdout: it exited

        threading.Thread(target=read, daemon=True, name=f"minivllm-replica-{rank}-stdout").start()
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"replica {rank} did not announce its port in time") from None
            if line is None:
                raise RuntimeError(f"replica {rank} did not start (exit code {process.wait()}; see its error above)")
            match = READY.match(line.strip())
            if match:
                return match.group(2)

    @staticmethod
    def _wait_healthy(url: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the replica at {url} did not become healthy")

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout:
                process.stdout.close()


def check_data_parallel_size(size) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_REPLICAS:
        raise ValueError(f"--data-parallel-size {size!r}: must be an integer from 1 to {MAX_REPLICAS}")


# ---------------------------------------------------------------------------------------------- the front end
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


HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


class RouterFront:
    """The front end's handlers: route, proxy, follow the replicas' KV events."""

    def __init__(self, urls: list[str], policy: str, tokenizer, block_size: int, limits: Limits,
                 api_key: str | None):
        self.urls, self.tokenizer, self.limits = urls, tokenizer, limits
        self.router = Router(len(urls), policy, block_size)
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.routed = [0] * len(urls)
        self.predicted_hit_blocks = 0
        self.client: httpx.AsyncClient | None = None
        self.followers: list[asyncio.Task] = []
        self.events_applied = [0] * len(urls)
        self.clears = [0] * len(urls)  # AllBlocksCleared events seen, per replica

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10), limits=limits)
        self.followers = [asyncio.create_task(self.follow(r)) for r in range(len(self.urls))]

    async def stop(self) -> None:
        for task in self.followers:
            task.cancel()
        await asyncio.gather(*self.followers, return_exceptions=True)
        await self.client.aclose()

    async def follow(self, replica: int) -> None:
        """Apply the replica's KV events to the index; the stream breaking means the replica is gone."""
        while True:
            try:
                async with self.client.stream("GET", self.urls[replica] + "/kv_events", headers=self.auth) as answer:
                    if answer.status_code == 200:
                        self.router.alive[replica] = True
                        async for line in answer.aiter_lines():
                            if line:
                                event = event_from_json(json.loads(line))
                                self.router.index.apply(replica, event)
                                self.events_applied[replica] += 1
                                self.clears[replica] += isinstance(event, AllBlocksCleared)
            except (httpx.TransportError, ValueError, KeyError):
                pass
            self.router.alive[replica] = False
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ routing
    def prompt_tokens(self, body: bytes, chat: bool) -> tuple[list[int] | None, str | None]:
        """The token ids the replica will see, and the salt; (None, None) if the body is not a valid request
        (the replica will say why)."""
        try:
            request = parse(ChatCompletionRequest if chat else CompletionRequest, body)
        except APIError:
            return None, None
        if chat:
            if self.tokenizer is None or not self.tokenizer.chat_template:
                return None, request.cache_salt
            plain = [{"role": m.role, "content": m.text()} for m in request.messages]
            text = self.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False).input_ids, request.cache_salt
        if isinstance(request.prompt, str):
            return (None if self.tokenizer is None else self.tokenizer(request.prompt).input_ids), request.cache_salt
        return list(request.prompt), request.cache_salt

    async def generate(self, raw: Request, chat: bool):
        body = await read_body(raw, self.limits)
        token_ids, salt = await asyncio.to_thread(self.prompt_tokens, body, chat)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return await until_disconnect(raw, self.forward(raw, path, body, token_ids, salt))

    async def forward(self, raw: Request, path: str, body: bytes, token_ids=None, salt=None, replica=None):
        """Send the request to a replica (the router's choice, or `replica`) and relay its answer."""
        headers = {k: v for k, v in raw.headers.items() if k.lower() in ("authorization", "content-type")}
        for _ in range(len(self.urls)):
            routed = replica is None
            try:
                if routed:
                    chosen, hit = self.router.route(token_ids, salt)
                    self.predicted_hit_blocks += hit
                else:
                    chosen = replica
                    self.router.in_flight[chosen] += 1
            except LookupError:
                break
            self.routed[chosen] += routed
            request = self.client.build_request(raw.method, self.urls[chosen] + path, content=body, headers=headers)
            try:
                upstream = await self.client.send(request, stream=True)
            except httpx.ConnectError:  # it never saw the request: try another
                self.router.finished(chosen)
                self.router.alive[chosen] = False
                if not routed:
                    break
                continue
            except BaseException as error:  # cancelled (the client hung up), or the replica failed
                self.router.finished(chosen)
                if isinstance(error, httpx.TransportError):
                    self.router.alive[chosen] = False
                    return error_response(503, f"replica {chosen} failed: {type(error).__name__}: {error}")
                raise
            return self.relay(chosen, upstream)
        return error_response(503, "no replica is alive to serve this request")

    def relay(self, replica: int, upstream: httpx.Response) -> ProxyResponse:
        done = False

        async def cleanup():
            nonlocal done
            if not done:
                done = True
                await upstream.aclose()
                self.router.finished(replica)

        async def chunks():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.TransportError as error:  # the replica died mid-answer
                self.router.alive[replica] = False
                if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    message = f"replica {replica} failed mid-stream: {type(error).__name__}"
                    yield f"data: {json.dumps(error_response_body(503, message))}\n\n".encode()

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

    async def metrics(self, raw: Request):
        lines = ["# HELP minivllm_router:replica_up 1 while the replica's KV-event stream is open",
                 "# TYPE minivllm_router:replica_up gauge"]
        lines += [f'minivllm_router:replica_up{{replica="{r}"}} {int(a)}' for r, a in enumerate(self.router.alive)]
        lines += ["# TYPE minivllm_router:requests_routed_total counter"]
        lines += [f'minivllm_router:requests_routed_total{{replica="{r}"}} {n}' for r, n in enumerate(self.routed)]
        lines += ["# TYPE minivllm_router:requests_in_flight gauge"]
        lines += [f'minivllm_router:requests_in_flight{{replica="{r}"}} {n}'
                  for r, n in enumerate(self.router.in_flight)]
        lines += ["# TYPE minivllm_router:index_blocks gauge"]
        lines += [f'minivllm_router:index_blocks{{replica="{r}"}} {len(b)}' for r, b in enumerate(self.router.index.blocks)]
        for replica, url in enumerate(self.urls):
            if not self.router.alive[replica]:
                continue
            try:
                text = (await self.client.get(url + "/metrics", headers=self.auth, timeout=10)).text
            except httpx.TransportError:
                continue
            lines += [with_label(line, replica) for line in text.splitlines() if line and not line.startswith("#")]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    async def reset_prefix_cache(self, raw: Request):
        statuses = []
        for replica, url in enumerate(self.urls):
            if self.router.alive[replica]:
                answer = await self.client.post(url + "/reset_prefix_cache", headers=self.auth)
                statuses.append(answer.status_code)
        if any(s != 200 for s in statuses):
            return error_response(409, f"some replicas refused (status codes {statuses}): retry when idle")
        return Response(status_code=200)


def error_response_body(status: int, message: str) -> dict:
    from minivllm.entrypoints.openai.protocol import error_body

    return error_body(status, message)


def with_label(line: str, replica: int) -> str:
    """`name{a="b"} 1` -> `name{replica="0",a="b"} 1`; `name 1` -> `name{replica="0"} 1`."""
    name, _, rest = line.partition(" ")
    if "{" in name or name.endswith("}"):
        head, _, labels = line.partition("{")
        return f'{head}{{replica="{replica}",{labels}'
    return f'{name}{{replica="{replica}"}} {rest}'


def front_tokenizer(model):
    """The replicas' tokenizer, without loading the weights where the checkpoint is a folder."""
    from minivllm.model.loader import TOKENIZER_FILES, load_model, resolve_model_path

    if model is None or not str(model).endswith(".gguf"):
        folder = resolve_model_path(model)
        if not any((folder / name).exists() for name in TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    return load_model(model)[1]


def build_router_app(urls: list[str], policy: str = "prefix-aware", tokenizer=None, block_size: int = 16,
                     api_key: str | None = None, limits: Limits = Limits()) -> FastAPI:
    """The front end for replicas at `urls`; `app.state.front` is its RouterFront."""
    if policy not in POLICIES:
        raise ValueError(f"--router {policy!r}: choose one of {', '.join(sorted(POLICIES))}")
    front = RouterFront(urls, policy, tokenizer, block_size, limits, api_key)

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
    app.add_api_route("/metrics", front.metrics, methods=["GET", "HEAD"])
    app.add_api_route("/reset_prefix_cache", front.reset_prefix_cache, methods=["POST"])

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return error_response(error.status, error.message, error.param)

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        return error_response(500, f"{type(error).__name__}: {error}")

    app.add_middleware(GuardMiddleware, router=app.router, limits=limits, api_key=api_key)
    return app


class DataParallelServer:
    """N replica processes and the front end (in a background thread of this process), for the notebook and
    the tests:

        with DataParallelServer(2, "prefix-aware", llm_kwargs={"num_kv_blocks": 256}) as server:
            ... talk to server.url ...
    """

    def __init__(self, size: int, policy: str = "prefix-aware", llm_kwargs: dict | None = None, model=None,
                 model_name: str = "minivllm", api_key: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 threads: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"--router {policy!r}: choose one of {', '.join(sorted(POLICIES))}")
        check_data_parallel_size(size)
        llm_kwargs = dict(llm_kwargs or {}) | ({"model": model} if model is not None else {})
        self.host, self.port, self.policy = host, port, policy
        self.size, self.llm_kwargs, self.model_name, self.api_key = size, llm_kwargs, model_name, api_key
        self.threads = threads
        self.replicas: Replicas | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "DataParallelServer":
        import uvicorn

        from minivllm.entrypoints.openai.launcher import bind, uvicorn_config

        tokenizer = front_tokenizer(self.llm_kwargs.get("model"))
        self.replicas = Replicas(self.size, self.llm_kwargs, self.model_name, self.api_key, self.threads)
        try:
            limits = Limits()
            self.app = build_router_app(self.replicas.urls, self.policy, tokenizer,
                                        self.llm_kwargs.get("block_size", 16), self.api_key, limits)
            self.front: RouterFront = self.app.state.front
            self._socket = bind(self.host, self.port)
            self.port = self._socket.getsockname()[1]
            self._server = uvicorn.Server(uvicorn_config(self.app, limits, log_level="error", log_config=None))
            self._server.config.timeout_graceful_shutdown = 1
            self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[self._socket])),
                                            daemon=True, name="minivllm-router")
            self._thread.start()
            while not self._server.started:
                if not self._thread.is_alive():
                    raise RuntimeError("the router did not start (see the error above)")
                time.sleep(0.01)
        except BaseException:
            self.replicas.stop()
            raise
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def use_policy(self, policy: str, timeout: float = 30) -> None:
        """Start over, idle, with another routing policy and every replica's prefix cache empty (between two
        measurements): the replicas reset their caches, and once their AllBlocksCleared events have reached the
        index, a new Router takes over."""
        if policy not in POLICIES:
            raise ValueError(f"--router {policy!r}: choose one of {', '.join(sorted(POLICIES))}")
        front = self.front
        seen = list(front.clears)
        answer = httpx.post(self.url + "/reset_prefix_cache", timeout=timeout,
                            headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})
        if answer.status_code != 200:
            raise RuntimeError(f"reset_prefix_cache: {answer.status_code} {answer.text}")
        deadline = time.monotonic() + timeout
        live = [r for r, alive in enumerate(front.router.alive) if alive]
        while any(front.clears[r] <= seen[r] for r in live) and time.monotonic() < deadline:
            time.sleep(0.005)
        router = Router(self.size, policy, self.llm_kwargs.get("block_size", 16))
        router.alive = front.router.alive
        front.router, front.routed, front.predicted_hit_blocks = router, [0] * self.size, 0

    def stop(self) -> None:
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
            self._socket.close()
            self._thread = None
        if self.replicas is not None:
            self.replicas.stop()

    def __enter__(self) -> "DataParallelServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_dp_server(size: int, policy: str, llm_kwargs: dict, host: str = "127.0.0.1", port: int = 8000,
                  model_name: str = "minivllm", api_key: str | None = None) -> None:
    """`python -m minivllm serve --data-parallel-size N`: until interrupted."""
    import uvicorn

    from minivllm.entrypoints.openai.launcher import bind, uvicorn_config

    if policy not in POLICIES:
        raise ValueError(f"--router {policy!r}: choose one of {', '.join(sorted(POLICIES))}")
    check_data_parallel_size(size)
    tokenizer = front_tokenizer(llm_kwargs.get("model"))
    replicas = Replicas(size, llm_kwargs, model_name, api_key)
    try:
        limits = Limits()
        app = build_router_app(replicas.urls, policy, tokenizer, llm_kwargs.get("block_size", 16), api_key, limits)
        sock = bind(host, port)
        print(f"minivllm serving {model_name!r} on http://{host}:{sock.getsockname()[1]}/v1 with {size} replicas "
              f"({', '.join(replicas.urls)}), router {policy}", flush=True)
        server = uvicorn.Server(uvicorn_config(app, limits, log_level="info", access_log=True))
        try:
            asyncio.run(server.serve(sockets=[sock]))
        finally:
            sock.close()
    finally:
        replicas.stop()


if __name__ == "__main__":
    sys.exit(replica_main())
