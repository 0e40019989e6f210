"""Issue 41, item 5 (goal 3) and the rest of item 4, each test built from the red team's reproducer (bounded,
loopback only).

Fairness: two requests within every limit (n = 64, 512 tokens each) made an 8-token request from another client
wait 22 s, because the seat share was per request, not per client. Now AsyncLLM holds a client (the `user`
field) to `client_share` of the seats and of the token budget, clients taking turns.

A hung engine: `/health` said 200 while a step never returned. Now a step running past `stall_timeout` is a 503,
the watchdog stops the server, and the data-parallel front end stops routing to such a replica."""

import asyncio
import threading
import time
import types

import httpx
import pytest

from minivllm import LLM, SamplingParams
from minivllm.book.texts import CORPUS
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai import health
from minivllm.entrypoints.openai.api_server import Limits
from minivllm.entrypoints.openai.launcher import BackgroundServer, ThreadedUvicorn

TIMEOUT = 120


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=512)


# ------------------------------------------------------------------ fairness across clients
def requests_in(engine: AsyncLLM) -> int:
    """The requests an AsyncLLM holds, in the engine or in front of it (read from another thread: may retry)."""
    for _ in range(100):
        try:
            return len(list(engine._admitted)) + sum(len(queue) for queue in list(engine._queues.values()))
        except RuntimeError:  # changed while we read
            time.sleep(0.001)
    return -1


def flood_then_probe(server, flood_user: str | None = "flood", probe_user: str | None = "probe") -> dict:
    """The reproducer, small: client `flood` sends two requests of n = 8 x 64 tokens; once they run, client
    `probe` sends one of 8 tokens. Returns when each answer came, in seconds from the start."""
    done, start = {}, time.monotonic()

    def post(label, body):
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert answer.status_code == 200, answer.text
        done[label] = time.monotonic() - start

    flood = {"n": 8, "max_tokens": 64, "ignore_eos": True, "temperature": 1.0, "seed": 0}
    threads = [threading.Thread(target=post, args=(f"flood {i}", {**flood, "prompt": CORPUS[i * 99:i * 99 + 80]}
                                                   | ({"user": flood_user} if flood_user else {})))
               for i in range(2)]
    for thread in threads:
        thread.start()
    running = lambda: server.engine.snapshot["num_requests_running"] > 0  # noqa: E731
    assert wait_for(lambda: running() and requests_in(server.engine) == 2, 60)  # both flood requests arrived
    probe = {"prompt": "ROMEO:", "max_tokens": 8, "ignore_eos": True}
    post("probe", probe | ({"user": probe_user} if probe_user else {}))
    for thread in threads:
        thread.join(TIMEOUT)
    return done


def test_a_flood_from_one_user_does_not_hold_the_engine(llm):
    """With the default share, the 8-token request finishes before either flood request; with client_share = 1
    (a client may take every seat: the red team's case) it waits for one of them. The flood's second request
    waited in front of the engine: at most its share (4 of 8 seats) was ever the flood's."""
    with BackgroundServer(llm) as server:
        seen = []
        admit = server.engine._admit

        def watched_admit(aborted):  # the flood's seats in the engine after every admission
            adds = admit(aborted)
            seen.append(sum(s for c, s, _ in server.engine._admitted.values() if c == "user:flood"))
            return adds

        server.engine._admit = watched_admit
        fair = flood_then_probe(server)
        assert not server.engine._queues and not server.engine._admitted
    assert fair["probe"] < min(fair["flood 0"], fair["flood 1"]), fair
    assert max(seen) == 4  # chapter 6 caps a request at 4 seats; the share caps the client at 4
    with BackgroundServer(llm, limits=Limits(client_share=1.0)) as server:
        unfair = flood_then_probe(server)
    assert unfair["probe"] > min(unfair["flood 0"], unfair["flood 1"]), unfair


def test_requests_without_a_user_are_scheduled_as_before(llm):
    """A request that names no client is a client of its own: two big anonymous requests take every seat, as
    they did before the share (and as a benchmark that sends no `user` expects)."""
    with BackgroundServer(llm) as server:
        anonymous = flood_then_probe(server, flood_user=None, probe_user=None)
    assert anonymous["probe"] > min(anonymous["flood 0"], anonymous["flood 1"]), anonymous


def test_a_client_is_held_to_its_share_of_the_token_budget_and_outputs_do_not_change(llm):
    """Three prompts of about 360 tokens from one client with max_num_batched_tokens = 512 (a share of 256): one
    prompt at a time is in the engine unprefilled; every answer is the one LLM.generate gives."""
    prompts = [(CORPUS * 3)[i * 400:i * 400 + 1000] for i in range(3)]
    token_ids = [llm.get_tokenizer()(p).input_ids for p in prompts]
    assert all(256 < len(ids) < 512 for ids in token_ids)
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]

    async def run():
        fair, queued = AsyncLLM(llm), []
        admit = fair._admit

        def watched_admit(aborted):
            adds = admit(aborted)
            queued.append(sum(1 for c, _, t in fair._admitted.values() if c == "tenant" and t))
            return adds

        fair._admit = watched_admit

        async def one(ids):
            async for output in fair.generate(ids, params, client="tenant"):
                pass
            return output.outputs[0].text

        texts = await asyncio.gather(*(one(ids) for ids in token_ids))
        return texts, queued, fair

    texts, queued, fair = asyncio.run(run())
    assert texts == expected
    assert max(queued) == 1 and not fair._admitted and not fair._queues


def test_a_held_request_whose_caller_left_never_reaches_the_engine(llm):
    """A client's second request waits behind its first; its caller hangs up while it waits: the engine never
    sees it, and nothing is left held or counted."""
    added = []

    async def run():
        fair = AsyncLLM(llm, client_share=0.5)
        original = fair.engine.add_request

        def add_request(request_id, *args):
            added.append(request_id)
            return original(request_id, *args)

        fair.engine.add_request = add_request
        try:
            big = SamplingParams(n=4, max_tokens=300, ignore_eos=True, seed=1)
            first = fair.generate(llm.get_tokenizer()("ROMEO:").input_ids, big, client="c")
            await anext(first)
            second = fair.generate(llm.get_tokenizer()("JULIET:").input_ids, big, client="c")
            waiting = asyncio.ensure_future(anext(second))
            while not fair._queues:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)  # a few turns
            assert not waiting.done() and len(added) == 1 and sum(map(len, fair._queues.values())) == 1
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await second.aclose()
            async for _ in first:
                pass
            while fair.snapshot["unfinished"] or fair._queues:
                await asyncio.sleep(0.01)
            return fair
        finally:
            del fair.engine.add_request

    fair = asyncio.run(run())
    assert len(added) == 1 and not fair._queues and not fair._admitted


def test_bad_fairness_options_and_user_fields_are_refused(llm):
    for share in (0, -0.5, 1.5, True, "half", float("nan")):
        with pytest.raises(ValueError, match="client_share"):
            AsyncLLM(llm, client_share=share)
    for seconds in (0, -1, float("inf"), None):
        with pytest.raises(ValueError, match="stall_timeout"):
            AsyncLLM(llm, stall_timeout=seconds)
    with BackgroundServer(llm) as server:
        for user in ("u" * 257, 5, ["a"]):
            answer = httpx.post(server.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 1,
                                                                       "user": user}, timeout=TIMEOUT)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "user", answer.text
        for user in ("", "u" * 256):  # "" names no client, as if it were left out
            answer = httpx.post(server.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "user": user}, timeout=TIMEOUT)
            assert answer.status_code == 200, answer.text


# ------------------------------------------------------------------ a stalled engine
class Stall:
    """Make `engine.step` block on an event (at most `limit` seconds), from the next step on."""

    def __init__(self, engine, limit: float = 60):
        self.engine, self.limit, self.release, self.entered = engine, limit, threading.Event(), threading.Event()
        original = engine.step

        def step():
            self.entered.set()
            self.release.wait(self.limit)
            return original()

        engine.step = step

    def undo(self):
        self.release.set()
        del self.engine.step


def test_a_stalled_step_makes_health_fail_and_the_watchdog_stop_the_server(monkeypatch, llm):
    """The reproducer: a step that does not return. /health said 200; now, past stall_timeout, it and /ping say
    503 naming the stall, a new request gets a 503 at once, and the watchdog stops the server, ending the process
    if it does not stop (os._exit, stubbed here). When the step returns, /health is 200 again and the stalled
    request is answered."""
    exits = []
    monkeypatch.setattr(health.os, "_exit", exits.append)
    with BackgroundServer(llm, limits=Limits(stall_timeout=0.5)) as server:
        stall = Stall(llm.engine)
        try:
            answers = []
            body = {"prompt": "ROMEO:", "max_tokens": 3}
            sender = threading.Thread(target=lambda: answers.append(httpx.post(
                server.url + "/v1/completions", json=body, timeout=TIMEOUT)))
            sender.start()
            assert stall.entered.wait(30)
            assert wait_for(lambda: httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 503, 10)
            answer = httpx.get(server.url + "/ping", timeout=TIMEOUT)
            assert answer.status_code == 503 and "stalled" in answer.json()["error"]["message"]
            started = time.monotonic()
            refused = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
            assert refused.status_code == 503 and "stall_timeout 0.5 s" in refused.json()["error"]["message"]
            assert time.monotonic() - started < 5
            uvicorn_server = types.SimpleNamespace(should_exit=False)
            health.exit_when_dead(uvicorn_server, server.engine, interval=0.05, hard_exit_after=0.1)
            assert wait_for(lambda: exits == [1], 5) and uvicorn_server.should_exit
            assert "stalled" in uvicorn_server.engine_death
        finally:
            stall.undo()
        sender.join(TIMEOUT)
        assert answers and answers[0].status_code == 200
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200


def test_the_front_end_stops_routing_to_a_stalled_replica():
    """Two real replicas (in this process) behind the data-parallel front end; replica 1's step blocks. Its
    /health turns 503 past stall_timeout, the front end marks it down: the request waiting on it ends with a 503
    at once, and the next requests go to replica 0. When the step returns, replica 1 is routed to again."""
    from minivllm.entrypoints.openai.front import build_router_app
    from minivllm.entrypoints.openai.replica import build_replica_app

    llms = [LLM(num_kv_blocks=64, max_num_seqs=4, kv_events_config={"enable_kv_cache_events": True})
            for _ in range(2)]
    limits = Limits(stall_timeout=0.5)
    replicas = [ThreadedUvicorn(build_replica_app(llm, operator_key="operator-key", limits=limits), limits)
                for llm in llms]
    for replica in replicas:
        replica.start()
    front_app = build_router_app([r.url for r in replicas], "round-robin", tokenizer=llms[0].get_tokenizer(),
                                 probe_interval=0.05, probe_timeout=2.0, probe_failures=2,
                                 operator_key="operator-key")
    front = ThreadedUvicorn(front_app, Limits())
    front.start()
    state, stall = front_app.state.front, None
    body = {"prompt": "ROMEO:", "max_tokens": 2}
    try:
        def send():
            answer = httpx.post(front.url + "/v1/completions", json=body, timeout=TIMEOUT)
            return answer.status_code, answer.headers.get("x-minivllm-replica")

        assert wait_for(lambda: state.router.alive == [True, True], 30)
        assert sorted(send()[1] for _ in range(2)) == ["0", "1"]
        stall = Stall(llms[1].engine)
        answers = []
        senders = [threading.Thread(target=lambda: answers.append(send())) for _ in range(2)]  # one per replica
        for sender in senders:
            sender.start()
        assert stall.entered.wait(30)
        assert wait_for(lambda: state.router.alive == [True, False], 10)
        for sender in senders:
            sender.join(TIMEOUT)
        assert sorted(answers) == [(200, "0"), (503, None)] or sorted(answers) == [(200, "0"), (503, "1")]
        assert [send() for _ in range(3)] == [(200, "0")] * 3
        stall.undo()
        stall = None
        assert wait_for(lambda: state.router.alive == [True, True], 30)
        assert "1" in {send()[1] for _ in range(4)}
    finally:
        if stall is not None:
            stall.undo()
        front.stop()
        for replica in replicas:
            replica.stop()
