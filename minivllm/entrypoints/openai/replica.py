"""One data-parallel replica (chapter 12's plumbing, not taught): chapter 10's server (`build_app`) with its
prefix cache's KV events published, in a process of its own, started by the supervisor
(minivllm/entrypoints/openai/supervisor.py) as `python -m minivllm.entrypoints.openai.replica --rank R ...`.

Its extra routes:

    GET  /kv_events            the KV events as JSON lines (minivllm/distributed/kv_events.py), which the
                               engine's block pool records (LLM(kv_events_config={"enable_kv_cache_events":
                               True})): first a snapshot (AllBlocksCleared, then one BlockStored naming every
                               named block, each copy once), then every event as it happens. Only for the
                               operator key (`operator_key`; the supervisor makes one per cluster and hands it to
                               the front end), never for the client key: the events name every tenant's prompt
                               blocks (vLLM publishes them on a ZMQ socket, `KVEventsConfig.endpoint` in
                               vllm/config/kv_events.py, which no API route serves)
    POST /reset_prefix_cache   development mode only (`dev_mode`, or MINIVLLM_SERVER_DEV_MODE=1, as vLLM's
                               VLLM_SERVER_DEV_MODE): forget every cached block, in the engine loop's next turn;
                               409 while requests run. Without dev mode the route does not exist (404)

**A subscriber that does not read** cannot grow the replica's memory: each subscriber's backlog holds at most
`MAX_BACKLOG` lines. Past that the backlog is dropped, and the subscriber's next line starts a fresh snapshot,
which says everything the dropped lines said (the publisher keeps a mirror of the named blocks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import threading
import time
from collections import deque

from fastapi.responses import Response, StreamingResponse

from minivllm.distributed.kv_events import AllBlocksCleared, BlockStored, event_to_json
from minivllm.distributed.router import BlockIndex
from minivllm.entrypoints.openai.api_server import Limits, build_app
from minivllm.entrypoints.openai.protocol import APIError

MAX_BACKLOG = 4096  # lines per subscriber before it is resynchronised from a snapshot
DEV_MODE_VARIABLE = "MINIVLLM_SERVER_DEV_MODE"
OPERATOR_KEY_VARIABLE = "MINIVLLM_OPERATOR_KEY"  # how the supervisor hands a replica its operator key


def dev_mode_from_environment() -> bool:
    return os.environ.get(DEV_MODE_VARIABLE, "0") not in ("", "0")


class Subscriber:
    """One `/kv_events` stream's backlog: at most `MAX_BACKLOG` lines, or a mark that it must resync."""

    def __init__(self, snapshot_lines: list[str]):
        self.lines: deque[str] = deque(snapshot_lines)
        self.resync = False
        self.ready = asyncio.Event()
        self.ready.set()

    def offer(self, line: str) -> None:
        if self.resync:
            return  # the snapshot it will get covers this line too
        if len(self.lines) >= MAX_BACKLOG:
            self.lines.clear()
            self.resync = True
        else:
            self.lines.append(line)
        self.ready.set()


class KVEventPublisher:
    """Takes an engine's KV events (`engine.take_events`, which the pool records in the engine's worker thread and
    any thread may take) on the event loop, keeps a mirror of the named blocks for the snapshot a new (or
    resynchronised) subscriber gets, and fans events out as JSON lines to bounded backlogs."""

    def __init__(self, take_events, block_size: int):
        self.take_events, self.block_size = take_events, block_size
        self.mirror = BlockIndex(1)  # what the events said so far, copies counted, as the router keeps it
        self.subscribers: list[Subscriber] = []
        self.task: asyncio.Task | None = None
        self.resyncs = 0  # subscribers that fell behind by MAX_BACKLOG lines

    def drain(self) -> None:
        for event in self.take_events():
            self.mirror.apply(0, event)
            line = json.dumps(event_to_json(event)) + "\n"
            for subscriber in self.subscribers:
                subscriber.offer(line)

    async def run(self) -> None:
        while True:
            self.drain()
            await asyncio.sleep(0.005)

    def snapshot_lines(self) -> list[str]:
        lines = [json.dumps(event_to_json(AllBlocksCleared())) + "\n"]
        if self.mirror.blocks[0]:
            named = BlockStored(sorted(self.mirror.blocks[0].elements()), None, [], self.block_size)
            lines.append(json.dumps(event_to_json(named)) + "\n")
        return lines

    def subscribe(self) -> Subscriber:
        if self.task is None:
            self.task = asyncio.create_task(self.run())
        self.drain()
        subscriber = Subscriber(self.snapshot_lines())
        self.subscribers.append(subscriber)
        return subscriber

    async def lines(self, subscriber: Subscriber):
        """The subscriber's stream, forever; a fresh snapshot after it fell too far behind."""
        try:
            while True:
                await subscriber.ready.wait()
                subscriber.ready.clear()
                if subscriber.resync:
                    self.drain()
                    subscriber.resync, self.resyncs = False, self.resyncs + 1
                    subscriber.lines.extend(self.snapshot_lines())
                while subscriber.lines:
                    yield subscriber.lines.popleft()
        finally:
            self.subscribers.remove(subscriber)


def build_replica_app(llm, model_name: str | list[str] = "minivllm", api_key: str | None = None,
                      limits: Limits = Limits(), dev_mode: bool | None = None, model_path: str | None = None,
                      operator_key: str | None = None, enable_prompt_tokens_details: bool = False):
    """Chapter 10's app for `llm` (built with its KV events on), plus /kv_events (for `operator_key` only: a
    random one, `app.state.operator_key`, if none is given), and /reset_prefix_cache in development mode."""
    if not llm.engine.config.enable_kv_cache_events:
        raise ValueError("a replica publishes KV events: build its LLM with "
                         'kv_events_config={"enable_kv_cache_events": True}')
    operator_key = operator_key or secrets.token_urlsafe(32)
    if operator_key == api_key:
        raise ValueError("operator_key: the same as the client API key; /kv_events needs a key of its own")
    app = build_app(llm, model_name, api_key, limits, model_path, enable_prompt_tokens_details,
                    path_keys={"/kv_events": operator_key})
    app.state.operator_key = operator_key
    publisher = app.state.kv_events = KVEventPublisher(llm.engine.take_events, llm.engine.config.block_size)
    engine = app.state.serving.engine  # the AsyncLLM: its turns are the only code that touches the engine

    async def kv_events():
        return StreamingResponse(publisher.lines(publisher.subscribe()), media_type="application/x-ndjson")

    async def reset_prefix_cache():
        if not await engine.reset_prefix_cache():
            raise APIError(409, "requests are running: reset the prefix cache when the replica is idle")
        return Response(status_code=200)

    app.add_api_route("/kv_events", kv_events, methods=["GET"])
    if dev_mode_from_environment() if dev_mode is None else dev_mode:
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
    """One replica, until terminated; prints the line the supervisor waits for once its socket is bound."""
    parser = argparse.ArgumentParser(prog="minivllm replica")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-model-name", nargs="+", default=["minivllm"])
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--dev-mode", action="store_true", help="serve /reset_prefix_cache")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true")
    parser.add_argument("--llm-kwargs", default="{}", help="LLM(...) keyword arguments, as JSON")
    args = parser.parse_args(argv)
    watch_parent(args.parent)
    import torch
    import uvicorn

    from minivllm import LLM
    from minivllm.entrypoints.openai.health import exit_when_dead
    from minivllm.entrypoints.openai.launcher import bind, uvicorn_config
    from minivllm.model.loader import DEFAULT_MODEL

    if args.threads:
        torch.set_num_threads(args.threads)
    llm_kwargs = json.loads(args.llm_kwargs)
    llm = LLM(**llm_kwargs, kv_events_config={"enable_kv_cache_events": True})
    limits = Limits()
    model_path = llm_kwargs.get("model") or str(DEFAULT_MODEL)  # the model cards' root, as vLLM's
    app = build_replica_app(llm, args.served_model_name, os.environ.get("MINIVLLM_API_KEY") or None, limits,
                            dev_mode=args.dev_mode, model_path=model_path,
                            operator_key=os.environ.get(OPERATOR_KEY_VARIABLE) or None,
                            enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    sock = bind(args.host, 0)
    print(f"minivllm replica {args.rank} serving on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn_config(app, limits, log_level="warning"))
    server.config.timeout_graceful_shutdown = 1
    exit_when_dead(server, app.state.serving.engine, hard_exit_after=10)  # then the supervisor starts a fresh replica
    try:
        asyncio.run(server.serve(sockets=[sock]))
    except KeyboardInterrupt:
        pass
    return 1 if server.engine_death else 0


if __name__ == "__main__":
    sys.exit(replica_main())
