"""Issue 29's data-parallel items, with their reproducers as input (bounded, loopback only): a replica stopped
with SIGSTOP is marked down within a stated time, its in-flight requests end with a 503 and new ones go elsewhere,
and it is brought back when it answers; the front end's event follower survives any line; a KV-event subscriber
that never reads holds a bounded backlog and resyncs from a snapshot."""

import asyncio
import json
import signal
import threading
import time
from collections import Counter

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from minivllm.book.texts import CORPUS
from minivllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, event_from_json,
                                            event_to_json)
from minivllm.entrypoints.openai.api_server import Limits
from minivllm.entrypoints.openai.front import build_router_app
from minivllm.entrypoints.openai.launcher import ThreadedUvicorn
from minivllm.entrypoints.openai.replica import MAX_BACKLOG, KVEventPublisher

TIMEOUT = 120
DETECTED_WITHIN = 10.0  # seconds from SIGSTOP to "marked down", with the probe settings below


def h(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def line(event) -> str:
    return json.dumps(event_to_json(event))


# 14 kinds of line the old follower died on, or cleared its index for
MALFORMED = ["[1, 2]", "null", "42", '"stored"', "{", "{}", '{"type": "mystery"}', '{"type": "stored"}',
             '{"type": "stored", "block_hashes": [12], "parent_block_hash": null, "token_ids": [], "block_size": 4}',
             '{"type": "removed", "block_hashes": ["zz"]}', '{"type": "removed", "block_hashes": "abcd"}',
             '{"type": "stored", "block_hashes": [], "parent_block_hash": null, "token_ids": [1], "block_size": 0}',
             "[" * 100_000 + "]" * 100_000, '{"type": ["cleared"]}']


@pytest.mark.parametrize("text", MALFORMED, ids=range(len(MALFORMED)))
def test_event_from_json_refuses_every_malformed_line_with_a_value_error(text):
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        return  # not JSON: the follower skips it before event_from_json
    with pytest.raises(ValueError):
        event_from_json(body)


def test_the_event_follower_survives_any_line_and_resyncs():
    """A fake replica sends, on each new /kv_events stream, a snapshot, then the next malformed line. The
    follower skips each one, reopens the stream and starts again from the snapshot; it never dies and the
    replica stays routable; the index ends as the last, clean stream says."""
    connections = []
    fake = FastAPI()

    async def kv_events():
        k = len(connections)
        connections.append(k)

        async def lines():
            yield line(AllBlocksCleared()) + "\n" + line(BlockStored([h("a"), h("b")], None, [0] * 8, 4)) + "\n"
            if k < len(MALFORMED):
                yield MALFORMED[k] + "\n"
                yield line(BlockRemoved([h("a")])) + "\n"  # after a bad line: must come from the next snapshot
            else:
                yield line(BlockStored([h("c")], h("b"), [0] * 4, 4)) + "\n"
            while True:
                await asyncio.sleep(1)
                yield "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    fake.add_api_route("/kv_events", kv_events, methods=["GET"])
    fake.add_api_route("/health", lambda: Response(status_code=200), methods=["GET"])
    replica = ThreadedUvicorn(fake, Limits())
    replica.start()
    front_app = build_router_app([replica.url], "prefix-aware", block_size=4, probe_interval=0.05)
    front = ThreadedUvicorn(front_app, Limits())
    front.start()
    try:
        state = front_app.state.front
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (len(connections) <= len(MALFORMED) or not state.router.alive[0]
                                               or h("c") not in state.router.index.blocks[0]):
            time.sleep(0.05)
        assert state.skipped_lines == [len(MALFORMED)]
        assert state.router.alive == [True] and not any(task.done() for task in state.followers)
        assert set(state.router.index.blocks[0]) == {h("a"), h("b"), h("c")}
    finally:
        front.stop()
        replica.stop()


def test_a_kv_event_subscriber_that_never_reads_has_a_bounded_backlog_then_a_snapshot():
    """Issue 29 item 6: a /kv_events subscriber that never reads grew the replica's queue without bound. Now
    its backlog stops at MAX_BACKLOG lines; then it is dropped, and the next read starts with a snapshot of
    the blocks named at that moment."""
    async def scenario():
        from collections import deque

        events = deque()
        publisher = KVEventPublisher(lambda: [events.popleft() for _ in range(len(events))], block_size=4)
        subscriber = publisher.subscribe()
        for i in range(3 * MAX_BACKLOG):
            events.append(BlockStored([h(f"b{i}")], None, [0] * 4, 4))
            if i % 2:
                events.append(BlockRemoved([h(f"b{i - 1}")]))
            publisher.drain()
            assert len(subscriber.lines) <= MAX_BACKLOG
        stream = publisher.lines(subscriber)
        first, second = await anext(stream), await anext(stream)
        await stream.aclose()
        publisher.task.cancel()
        return subscriber, first, second, publisher

    subscriber, first, second, publisher = asyncio.run(scenario())
    assert publisher.resyncs == 1 and not publisher.subscribers
    assert event_from_json(json.loads(first)) == AllBlocksCleared()
    assert Counter(event_from_json(json.loads(second)).block_hashes) == publisher.mirror.blocks[0]
    assert len(publisher.mirror.blocks[0]) == 3 * MAX_BACKLOG // 2


@pytest.fixture(scope="module")
def stoppable():
    from minivllm.entrypoints.openai.dp_server import DataParallelServer

    server = DataParallelServer(2, "round-robin", llm_kwargs={"num_kv_blocks": 256, "max_num_seqs": 8}, threads=1,
                                probe_interval=0.25, probe_timeout=1.0, probe_failures=3)
    with server:
        yield server


def test_a_stopped_replica_is_marked_down_its_requests_fail_with_503_and_it_comes_back(stoppable):
    """Issue 29 item 2's reproducer: SIGSTOP one of two replicas, with round-robin. It is marked down within
    DETECTED_WITHIN seconds; its streaming and non-streaming requests in flight end with a 503; every request
    after that goes to the other one; /metrics answers; after SIGCONT it is back, and serves again."""
    server, victim = stoppable, stoppable.replicas.processes[1]
    long_body = {"prompt": CORPUS[:200], "max_tokens": 1500, "ignore_eos": True}
    results = {}

    def streaming():
        with httpx.stream("POST", server.url + "/v1/completions", json=long_body | {"stream": True},
                          timeout=TIMEOUT) as answer:
            results["stream replica"] = answer.headers["x-minivllm-replica"]
            results["stream"] = [text for text in answer.iter_lines() if text.startswith("data: ")]

    def plain():
        answer = httpx.post(server.url + "/v1/completions", json=long_body, timeout=TIMEOUT)
        results["plain"] = (answer.headers.get("x-minivllm-replica"), answer.status_code, answer.json())

    threads = [threading.Thread(target=streaming), threading.Thread(target=plain)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sum(server.front.router.in_flight) < 2:
        time.sleep(0.02)
    assert server.front.router.in_flight == [1, 1]  # one long request on each replica
    time.sleep(0.5)
    victim.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        while server.front.router.alive[1] and time.monotonic() - stopped < 30:
            time.sleep(0.05)
        detected = time.monotonic() - stopped
        print(f"marked down {detected:.1f} s after SIGSTOP")
        assert detected < DETECTED_WITHIN
        for thread in threads:
            thread.join(timeout=30)
        on_victim = "stream" if results["stream replica"] == "1" else "plain"
        if on_victim == "stream":
            assert '"code": 503' in results["stream"][-1] or '"code": 503' in results["stream"][-2]
        else:
            assert results["plain"][1] == 503 and results["plain"][2]["error"]["code"] == 503
        for i in range(4):
            answer = httpx.post(server.url + "/v1/completions", json={"prompt": f"While 1 sleeps, {i}", "max_tokens": 2},
                                timeout=TIMEOUT)
            assert answer.status_code == 200 and answer.headers["x-minivllm-replica"] == "0"
        started = time.monotonic()
        assert httpx.get(server.url + "/metrics", timeout=TIMEOUT).status_code == 200
        assert time.monotonic() - started < 5
    finally:
        victim.send_signal(signal.SIGCONT)
    while not server.front.router.alive[1] and time.monotonic() - stopped < 60:
        time.sleep(0.05)
    assert server.front.router.alive == [True, True]
    served = {httpx.post(server.url + "/v1/completions", json={"prompt": f"Awake {i}", "max_tokens": 2},
                         timeout=TIMEOUT).headers["x-minivllm-replica"] for i in range(4)}
    assert served == {"0", "1"}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (sum(server.front.router.in_flight) or usage(server) != [0.0, 0.0]):
        time.sleep(0.2)
    assert usage(server) == [0.0, 0.0]  # every block back, on the stopped replica too


def usage(server) -> list[float]:
    values = []
    for url in server.replicas.urls:
        text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
        values += [float(t.split()[-1]) for t in text.splitlines() if t.startswith("vllm:kv_cache_usage_perc{")]
    return values


def test_the_front_end_reads_a_gguf_files_tokenizer_without_its_weights():
    """The front end only hashes prompts: for a GGUF model it reads the tokenizer from the metadata, as the
    engine does, and never the tensors (SmolLM2-135M's file holds 94 MiB of weights, 540 MB once dequantized; the tokenizer alone takes about 200)."""
    import subprocess
    import sys

    from minivllm.book.real_model import smollm2_gguf

    script = ("import resource, sys\n"
              "from minivllm.entrypoints.openai.dp_server import front_tokenizer\n"
              "from minivllm.model.gguf_loader import gguf_tokenizer, read_gguf\n"
              "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
              "tokenizer = front_tokenizer(sys.argv[1])\n"
              "grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
              "text = 'ROMEO: what light through yonder window breaks?'\n"
              "same = tokenizer(text).input_ids == gguf_tokenizer(read_gguf(sys.argv[1]))(text).input_ids\n"
              "print(grown // 1024, same, bool(tokenizer.chat_template))\n")
    done = subprocess.run([sys.executable, "-c", script, str(smollm2_gguf())], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    grown_mib, same, has_template = done.stdout.split()
    assert same == "True" and has_template == "True"
    assert int(grown_mib) < 400, f"the front end's tokenizer grew the process by {grown_mib} MiB"
