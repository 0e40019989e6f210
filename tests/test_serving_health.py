"""Issue 41, items 4 and 6, each test built from the red team's reproducer (bounded, loopback only).

Item 4, health means "can serve": after a tensor-parallel worker died, `/health` said 200 while every request
failed; a data-parallel front end kept routing to such a replica; a killed replica was never restarted.
Item 6: `usage.prompt_tokens_details.cached_tokens` was always sent (vLLM sends it only with
--enable-prompt-tokens-details), an oracle for other tenants' prompts; a replica's `/kv_events` (every tenant's
prompt blocks) answered the client key."""

import asyncio
import json
import logging
import os
import signal
import time
import types

import httpx
import pytest

from minivllm import LLM
from minivllm.book.texts import CORPUS
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.openai.api_server import Limits
from minivllm.entrypoints.openai.health import engine_problem, exit_when_dead
from minivllm.entrypoints.openai.launcher import BackgroundServer, ThreadedUvicorn
from minivllm.entrypoints.openai.replica import build_replica_app

TIMEOUT = 120


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


# ------------------------------------------------------------------ item 6: the cached-token oracle
@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=128, max_num_seqs=4, kv_events_config={"enable_kv_cache_events": True})


def test_cached_tokens_only_when_the_operator_asks(llm):
    """The reproducer: the same prompt twice. By default neither answer says how much of it was cached (null, as
    vLLM), streamed or not; with enable_prompt_tokens_details the second says every full block."""
    prompt = "Issue 41's guessed prompt. " + CORPUS[200:900]
    body = {"prompt": prompt, "max_tokens": 1}
    with BackgroundServer(llm) as server:
        first = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT).json()["usage"]
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT).json()["usage"]
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/completions", json=stream, timeout=TIMEOUT) as answer:
            events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
    assert first["prompt_tokens"] > 32 and first["prompt_tokens_details"] is None
    assert again["prompt_tokens_details"] is None and events[-1]["usage"]["prompt_tokens_details"] is None
    assert llm.stats()["prefix_cache_hits"] > 0  # the cache did serve it: only the answer is silent
    with BackgroundServer(llm, enable_prompt_tokens_details=True) as server:
        shown = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT).json()["usage"]
    assert shown["prompt_tokens_details"] == {"cached_tokens": (first["prompt_tokens"] - 1) // 16 * 16}


def test_kv_events_answer_the_operator_key_only(llm):
    """The reproducer: GET /kv_events with the client key streamed every tenant's blocks. Now the client key,
    no key and a wrong key get a 401; the operator key gets the stream (a snapshot first); without a client key
    the route still needs the operator key; an operator key equal to the client key is refused."""
    app = build_replica_app(llm, api_key="client-key", operator_key="operator-key")
    server = ThreadedUvicorn(app, Limits())
    server.start()
    try:
        def status(key):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            with httpx.stream("GET", server.url + "/kv_events", headers=headers, timeout=TIMEOUT) as answer:
                if answer.status_code != 200:
                    answer.read()
                    assert "operator key" in answer.json()["error"]["message"]
                    return answer.status_code, None
                return answer.status_code, next(answer.iter_lines())

        assert status("client-key") == (401, None)
        assert status(None) == (401, None) and status("wrong") == (401, None)
        code, first = status("operator-key")
        assert code == 200 and json.loads(first)["type"] == "cleared"
        headers = {"Authorization": "Bearer client-key"}
        assert httpx.get(server.url + "/v1/models", headers=headers, timeout=TIMEOUT).status_code == 200
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer operator-key"},
                         timeout=TIMEOUT).status_code == 401  # and the operator key is no client key
    finally:
        server.stop()
    open_app = build_replica_app(llm)  # no client key: /kv_events still needs the (random) operator key
    assert len(open_app.state.operator_key) >= 32
    with pytest.raises(ValueError, match="operator_key"):
        build_replica_app(llm, api_key="same", operator_key="same")


# ------------------------------------------------------------------ item 4: health means "can serve"
def test_health_fails_once_a_tensor_parallel_worker_died(monkeypatch):
    """The reproducer: a server on a TP = 2 engine, its worker killed. /health (and /ping) said 200 while every
    request failed; now they say 503 naming the rank, a request gets a 503 at once, and the watchdog (vLLM's
    terminate_if_errored) asks the server to exit."""
    monkeypatch.setattr(LLMEngine, "timeout_s", 10.0)
    tp = LLM(device="cpu", num_kv_blocks=32, tensor_parallel_size=2)
    try:
        with BackgroundServer(tp) as server:
            assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
            body = {"prompt": "ROMEO:", "max_tokens": 2}
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT).status_code == 200
            [worker] = tp.engine.workers.processes
            os.kill(worker.pid, signal.SIGKILL)
            assert wait_for(lambda: not worker.is_alive(), 10)
            health = httpx.get(server.url + "/health", timeout=TIMEOUT)
            assert health.status_code == 503 and "rank 1 died" in health.json()["error"]["message"]
            assert httpx.get(server.url + "/ping", timeout=TIMEOUT).status_code == 503
            started = time.monotonic()
            answer = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
            assert answer.status_code == 503 and "rank 1 died" in answer.json()["error"]["message"]
            assert time.monotonic() - started < 5
            assert "rank 1 died" in engine_problem(server.engine)
            uvicorn_server = types.SimpleNamespace(should_exit=False)
            exit_when_dead(uvicorn_server, server.engine, interval=0.05)
            assert wait_for(lambda: uvicorn_server.should_exit, 5) and "rank 1" in uvicorn_server.engine_death
    finally:
        tp.shutdown()


def replica_children(pid: int) -> list[int]:
    """The processes a replica forked (its tensor-parallel worker), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        if ppid == pid and b"minivllm.entrypoints.openai.replica" in cmdline:
            found.append(int(entry))
    return found


def test_the_front_end_restarts_a_dead_replica_a_bounded_number_of_times(caplog):
    """The reproducer: a data-parallel replica on a TP = 2 engine whose worker is killed, then the replica
    itself killed. First the replica sees its engine dead and exits (code 1); the supervisor restarts it, logged,
    and the front end routes to it at its new URL. Killed again, past max_restarts = 1, it is left down, logged,
    and the front end answers a clean 503."""
    from minivllm.entrypoints.openai.dp_server import DataParallelServer

    caplog.set_level(logging.WARNING, logger="minivllm.entrypoints.openai")
    server = DataParallelServer(1, "round-robin", llm_kwargs={"num_kv_blocks": 32, "tensor_parallel_size": 2},
                                threads=1, max_restarts=1, probe_interval=0.1, probe_timeout=2.0, probe_failures=2)
    with server:
        body = {"prompt": "ROMEO:", "max_tokens": 2}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT).status_code == 200
        first, old_url = server.replicas.processes[0], server.replicas.urls[0]
        [worker] = replica_children(first.pid)
        os.kill(worker, signal.SIGKILL)
        assert wait_for(lambda: first.poll() is not None, 30), "the replica did not exit with its engine dead"
        assert first.returncode == 1
        assert wait_for(lambda: server.replicas.urls[0] != old_url and server.front.router.alive[0], 240)
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert answer.status_code == 200 and answer.headers["x-minivllm-replica"] == "0"
        assert "replica 0 exited (code 1): restart 1 of at most 1" in caplog.text
        assert "replica 0 restarted on " + server.replicas.urls[0] in caplog.text
        second = server.replicas.processes[0]
        second.send_signal(signal.SIGKILL)
        assert wait_for(lambda: "not restarting it again" in caplog.text, 30)
        assert wait_for(lambda: not server.front.router.alive[0], 30)
        assert server.replicas.processes[0] is second and server.replicas.restarts[0] > 1
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 503
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == 503
    assert all(p.poll() is not None for p in server.replicas.processes)


def test_serve_takes_vllms_flag(monkeypatch):
    """`python -m minivllm serve --enable-prompt-tokens-details`, as vLLM's; without it, off."""
    import minivllm
    from minivllm import cli
    from minivllm.entrypoints.openai import launcher

    seen = []
    monkeypatch.setattr(minivllm, "LLM", lambda **kwargs: object())
    monkeypatch.setattr(launcher, "run_server", lambda llm, *args, **kwargs: seen.append(
        kwargs["enable_prompt_tokens_details"]))
    assert cli.main(["serve"]) == 0 and cli.main(["serve", "--enable-prompt-tokens-details"]) == 0
    assert seen == [False, True]


def test_the_front_end_stops_routing_to_a_replica_whose_health_fails():
    """A replica that still answers, but whose /health says 503 (its engine is dead), gets no requests once the
    probe has seen it fail; the other replica gets them all; when its /health is 200 again it is routed to again.
    Two fake replicas, no model."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    from minivllm.distributed.kv_events import AllBlocksCleared, event_to_json
    from minivllm.entrypoints.openai.front import build_router_app

    health = {0: 200, 1: 200}

    def fake(rank):
        app = FastAPI()

        async def kv_events():
            async def lines():
                yield json.dumps(event_to_json(AllBlocksCleared())) + "\n"
                while True:
                    await asyncio.sleep(1)
                    yield "\n"
            return StreamingResponse(lines(), media_type="application/x-ndjson")

        app.add_api_route("/kv_events", kv_events, methods=["GET"])
        app.add_api_route("/health", lambda: Response(status_code=health[rank]), methods=["GET"])
        app.add_api_route("/v1/completions", lambda: JSONResponse({"served_by": rank}), methods=["POST"])
        server = ThreadedUvicorn(app, Limits())
        server.start()
        return server

    replicas = [fake(0), fake(1)]
    front_app = build_router_app([r.url for r in replicas], "round-robin", probe_interval=0.05, probe_failures=2)
    front = ThreadedUvicorn(front_app, Limits())
    front.start()
    state = front_app.state.front
    try:
        def served(count=4):
            return [httpx.post(front.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1},
                               timeout=TIMEOUT).json()["served_by"] for _ in range(count)]

        assert wait_for(lambda: state.router.alive == [True, True], 10)
        assert sorted(set(served())) == [0, 1]
        health[1] = 503
        assert wait_for(lambda: state.router.alive == [True, False], 5)
        assert served() == [0, 0, 0, 0]
        health[1] = 200
        assert wait_for(lambda: state.router.alive == [True, True], 5)
        assert sorted(set(served())) == [0, 1]
    finally:
        front.stop()
        for replica in replicas:
            replica.stop()
