"""Chapter 12: replicas behind a prefix-aware router. The KV events mirror the engine's prefix cache; the index
and the policies decide as specified (longest cached prefix, ties by load, then in turn); through the router a
conversation's next turn goes back to the replica that served the last one, `cached_tokens` is reported streamed
and not, errors pass through, a hang-up aborts on the replica, a dead replica is avoided and, when none is left,
a clean 503; no replica process outlives its front end."""

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest

from minivllm import LLM, SamplingParams
from minivllm.book.texts import CORPUS
from minivllm.core.kv_cache_utils import block_hashes
from minivllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, event_from_json, event_to_json
from minivllm.distributed.router import BlockIndex, Router

TIMEOUT = 120


def h(name: str) -> bytes:
    return name.encode().ljust(32, b".")


# ---------------------------------------------------------------------------------------------- the index
def test_the_index_follows_stored_removed_and_cleared_events():
    index = BlockIndex(2)
    index.apply(0, BlockStored([h("a"), h("b"), h("c")], None, list(range(12)), 4))
    index.apply(1, BlockStored([h("a")], None, list(range(4)), 4))
    assert index.cached_prefix(0, [h("a"), h("b"), h("c"), h("d")]) == 3
    assert index.cached_prefix(1, [h("a"), h("b")]) == 1
    index.apply(0, BlockRemoved([h("b")]))
    assert index.cached_prefix(0, [h("a"), h("b"), h("c")]) == 1  # the engine's lookup stops at a gap too
    index.apply(0, AllBlocksCleared())
    assert index.cached_prefix(0, [h("a")]) == 0 and index.cached_prefix(1, [h("a")]) == 1
    with pytest.raises(TypeError):
        index.apply(0, "not an event")


def test_the_index_counts_copies_of_a_block():
    """Issue 27: the pool names every duplicate block, and each copy is stored and removed on its own. Removing one
    copy of a hash must not drop the hash while another copy is still named on that replica."""
    index = BlockIndex(2)
    index.apply(0, BlockStored([h("a"), h("b")], None, list(range(8)), 4))
    index.apply(0, BlockStored([h("a")], None, list(range(4)), 4))  # a second copy of a
    index.apply(1, BlockStored([h("a")], None, list(range(4)), 4))
    index.apply(0, BlockRemoved([h("a")]))
    assert index.cached_prefix(0, [h("a"), h("b")]) == 2  # the other copy still serves it
    index.apply(0, BlockRemoved([h("a")]))
    assert index.cached_prefix(0, [h("a"), h("b")]) == 0 and index.cached_prefix(1, [h("a")]) == 1
    index.apply(0, BlockRemoved([h("a")]))  # one removal too many (say, after a resync): nothing goes negative
    index.apply(0, BlockStored([h("a")], None, list(range(4)), 4))
    assert index.blocks[0][h("a")] == 1


def test_events_survive_the_wire():
    for event in [BlockStored([h("a"), h("b")], h("p"), [1, 2, 3, 4, 5, 6, 7, 8], 4), BlockStored([h("a")], None, [1], 1),
                  BlockRemoved([h("x")]), BlockRemoved([h("y")], "CPU"), AllBlocksCleared()]:
        assert event_from_json(json.loads(json.dumps(event_to_json(event)))) == event
    with pytest.raises(ValueError, match="medium"):
        event_from_json({"type": "removed", "block_hashes": [h("x").hex()], "medium": 7})


# ---------------------------------------------------------------------------------------------- the policies
def router_with(policy: str, held: dict[int, int], tokens: list[int], replicas: int = 3) -> Router:
    """A router whose index says replica r holds the first held[r] blocks of `tokens` (blocks of 4)."""
    router = Router(replicas, policy, block_size=4)
    chain = block_hashes(tokens, 4)
    for replica, count in held.items():
        router.index.apply(replica, BlockStored(chain[:count], None, tokens[:4 * count], 4))
    return router


TOKENS = list(range(100, 124))  # 6 blocks of 4


def test_prefix_aware_picks_the_longest_cached_prefix():
    router = router_with("prefix-aware", {0: 2, 1: 5, 2: 3}, TOKENS)
    router.in_flight = [0, 4, 0]  # within the load bound, load does not outweigh a longer prefix
    assert router.route(TOKENS) == (1, 5)
    assert router.in_flight == [0, 5, 0]
    router.finished(1)
    assert router.in_flight == [0, 4, 0]


def test_prefix_aware_follows_the_cache_only_within_its_load_bound():
    """Issue 27 item 7: one hot prefix must not pin one replica. Past `load_bound` requests in flight beyond
    the least loaded replica, the holder of the longest prefix is passed over for the best of the others."""
    for bound, in_flight, expected in [(4, [0, 5, 0], 2), (4, [1, 5, 1], 1), (2, [0, 3, 1], 2), (0, [1, 1, 0], 2),
                                       (None, [0, 90, 0], 1)]:
        router = router_with("prefix-aware", {0: 2, 1: 5, 2: 3}, TOKENS)
        router.policy.load_bound, router.in_flight = bound, list(in_flight)
        assert router.route(TOKENS)[0] == expected, (bound, in_flight)


def test_a_request_s_blocks_stay_pending_until_confirmed_refused_or_timed_out():
    """Issue 29 item 3 / issue 27 item 7: the router records a routed request's new blocks as pending; a refusal
    or the timeout drops them, a BlockStored makes them facts that neither can drop."""
    router = Router(2, "prefix-aware", block_size=4, pending_timeout=0.2)
    chain = block_hashes(TOKENS, 4)
    replica, hit, pending = router.route_blocks(chain)
    assert (hit, pending) == (0, chain) and router.index.cached_prefix(replica, chain) == 6
    router.refused(replica, pending)  # the replica answered 400: it holds none of them
    assert router.index.cached_prefix(replica, chain) == 0 and not router.index.pending[replica]
    router.finished(replica)
    replica, _, pending = router.route_blocks(chain)
    router.index.apply(replica, BlockStored(chain[:3], None, TOKENS[:12], 4))  # the first 3 confirmed
    router.refused(replica, pending)
    assert router.index.cached_prefix(replica, chain) == 3
    router.finished(replica)
    replica, _, pending = router.route_blocks(chain)  # routed home; blocks 4 to 6 pending again
    assert pending == chain[3:] and router.index.cached_prefix(replica, chain) == 6
    time.sleep(0.25)
    router.finished(replica)
    router.route_blocks([])  # any routing decision first drops the guesses whose time is up
    assert router.index.cached_prefix(replica, chain) == 3 and not router.index.pending[replica]


def test_refused_prompts_do_not_grow_the_index():
    """Issue 29 item 3's reproducer, made small: 30 refused prompts of 20,000 tokens leave nothing behind."""
    router = Router(2, "prefix-aware", block_size=16)
    for i in range(30):
        replica, _, pending = router.route_blocks(router.hash([i] * 20_000))
        router.refused(replica, pending)
        router.finished(replica)
    assert [len(b) for b in router.index.blocks] == [0, 0] and not any(router.index.pending)


def test_prefix_aware_breaks_ties_by_load_then_in_turn():
    router = router_with("prefix-aware", {0: 4, 1: 4, 2: 1}, TOKENS)
    router.in_flight = [3, 1, 0]
    assert router.route(TOKENS)[0] == 1  # 0 and 1 tie on the prefix; 1 has fewer in flight
    fresh = Router(2, "prefix-aware", block_size=4)
    picks = []
    for i in range(4):
        picks.append(fresh.route([7000 + 100 * i + t for t in range(8)])[0])
        fresh.in_flight = [0, 0]
    assert picks == [0, 1, 0, 1]  # nothing cached anywhere, nothing in flight: in turn


def test_a_salt_changes_the_match():
    router = router_with("prefix-aware", {0: 6}, TOKENS, replicas=2)
    router.in_flight = [1, 0]
    assert router.route(TOKENS, cache_salt="tenant-b") == (1, 0)  # salted hashes are other blocks


def test_round_robin_and_least_loaded():
    rr = Router(3, "round-robin")
    assert [rr.route(TOKENS)[0] for _ in range(4)] == [0, 1, 2, 0]
    ll = router_with("least-loaded", {0: 6}, TOKENS)
    ll.in_flight = [0, 2, 1]
    assert ll.route(TOKENS)[0] == 0
    ll.in_flight = [5, 2, 1]
    assert ll.route(TOKENS)[0] == 2  # blind to the cache


def test_dead_replicas_get_nothing():
    router = router_with("prefix-aware", {0: 6}, TOKENS, replicas=2)
    router.alive[0] = False
    assert router.route(TOKENS) == (1, 0)
    router.alive[1] = False
    with pytest.raises(LookupError):
        router.route(TOKENS)
    with pytest.raises(ValueError, match="router policy"):
        Router(2, "random")


# ---------------------------------------------------------------------------------------------- the events
def test_kv_events_mirror_the_prefix_cache_under_eviction():
    llm = LLM(num_kv_blocks=24, block_size=4, max_num_seqs=2, kv_events_config={"enable_kv_cache_events": True})
    index = BlockIndex(1)
    ids = llm.get_tokenizer()(CORPUS[:2000]).input_ids
    prompts = [{"prompt_token_ids": ids[i * 13:i * 13 + 30]} for i in range(5)] + [{"prompt_token_ids": ids[:30],
                                                                                   "cache_salt": "s"}]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    events = llm.engine.take_events()
    kinds = {type(e).__name__ for e in events}
    assert all(e.medium == "GPU" for e in events)
    assert {"BlockStored", "BlockRemoved"} <= kinds
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert all(len(e.token_ids) == 4 * len(e.block_hashes) for e in stored)
    assert any(e.parent_block_hash is not None for e in stored)
    for event in events:
        index.apply(0, event)
    pool = llm.engine.kv_manager.pool
    assert index.blocks[0] == Counter({block_hash: len(pool.cached.copies(block_hash)) for block_hash in pool.cached})
    llm.engine.kv_manager.reset_prefix_cache()  # outside a step: recorded at once
    llm.generate({"prompt_token_ids": ids[:9]}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    events = llm.engine.take_events()
    assert events[0] == AllBlocksCleared() and isinstance(events[1], BlockStored)
    with pytest.raises(ValueError, match="prefix cache"):
        LLM(num_kv_blocks=8, enable_prefix_caching=False, kv_events_config={"enable_kv_cache_events": True})
    with pytest.raises(ValueError, match="kv_events_config"):
        LLM(num_kv_blocks=8, kv_events_config={"enable_kv_cache_events": "yes"})
    quiet = LLM(num_kv_blocks=8)  # off unless asked for: nothing is recorded
    quiet.generate("ROMEO:", SamplingParams(max_tokens=2), use_tqdm=False)
    assert quiet.engine.take_events() == [] and not quiet.engine.kv_manager.pool.kv_events


def test_a_removed_copy_leaves_the_other_copy_findable():
    """Issue 27 case C through the events: two identical block-aligned prompts. The second finds the first's
    blocks but recomputes the last one (a fully cached prompt still needs one token's logits), so that block
    exists twice, both copies named. Evicting one copy sends a BlockRemoved for a hash the replica still serves
    from the other; the index keeps it, and the engine does hit it."""
    llm = LLM(num_kv_blocks=12, block_size=4, max_num_seqs=2, kv_events_config={"enable_kv_cache_events": True})
    index = BlockIndex(1)
    ids = llm.get_tokenizer()(CORPUS[:2000]).input_ids
    twin, greedy = ids[:16], SamplingParams(temperature=0, max_tokens=1)
    llm.generate([{"prompt_token_ids": twin}] * 2, greedy, use_tqdm=False)  # 5 named blocks: the last one twice
    # 8 blocks: the 7 that hold no name, then the least recently freed named one, the first copy of the last block
    llm.generate({"prompt_token_ids": ids[300:332]}, greedy, use_tqdm=False)
    events = llm.engine.take_events()
    for event in events:
        index.apply(0, event)
    chain = block_hashes(twin, 4)
    removed = {bh for e in events if isinstance(e, BlockRemoved) for bh in e.block_hashes}
    still_named = [bh for bh in chain if bh in removed and bh in llm.engine.kv_manager.pool.cached]
    assert still_named, "the workload was meant to evict one copy of a twin block"
    assert all(index.blocks[0][bh] == 1 for bh in still_named)
    assert index.cached_prefix(0, chain) == sum(1 for _ in itertools.takewhile(
        lambda bh: bh in llm.engine.kv_manager.pool.cached, chain))
    [out] = llm.generate({"prompt_token_ids": twin + [5]}, greedy, use_tqdm=False)
    assert out.num_cached_tokens == 4 * index.cached_prefix(0, chain) > 0


def test_bad_command_lines_are_refused():
    from minivllm.cli import main

    for argv in (["serve", "--data-parallel-size", "0"], ["serve", "--data-parallel-size", "two"],
                 ["serve", "--data-parallel-size", "2", "--router", "random"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2


def test_no_replica_reachable_is_a_clean_503():
    from fastapi.testclient import TestClient

    from minivllm.entrypoints.openai.front import build_router_app

    with socket.socket() as probe:  # a port that was free a moment ago: nobody listens there
        probe.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{probe.getsockname()[1]}"
    app = build_router_app([nowhere, nowhere], "round-robin")
    with TestClient(app) as client:
        answer = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert answer.status_code == 503
        assert answer.json()["error"]["type"] == "ServiceUnavailable"
        assert app.state.front.router.alive == [False, False]
        assert client.get("/health").status_code == 503


# ---------------------------------------------------------------------------------------------- two replicas
@pytest.fixture(scope="module")
def cluster():
    from minivllm.entrypoints.openai.dp_server import DataParallelServer

    # cached_tokens asked for (vLLM's --enable-prompt-tokens-details); no restarts: the last test kills the replicas
    server = DataParallelServer(2, "prefix-aware", llm_kwargs={"num_kv_blocks": 256, "max_num_seqs": 8}, threads=1,
                                enable_prompt_tokens_details=True, max_restarts=0)
    with server:
        yield server
    assert all(p.poll() is not None for p in server.replicas.processes)  # no orphans


def chat(server, messages, **extra):
    answer = httpx.post(server.url + "/v1/chat/completions", timeout=TIMEOUT,
                        json={"messages": messages, "max_tokens": 6, "temperature": 0, **extra})
    assert answer.status_code == 200, answer.text
    return int(answer.headers["x-minivllm-replica"]), answer.json()


def metric(server, name: str, replica: int) -> float:
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    for line in text.splitlines():
        if line.startswith((f'{name}{{replica="{replica}"}}', f'{name}{{replica="{replica}",')):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} for replica {replica} in /metrics")


def test_a_conversation_returns_to_its_replica(cluster):
    tenants = {}
    for tenant in ("Globe", "Rose"):
        system = f"You are the prompter of the {tenant} Theatre. Answer in verse.\n" * 5
        conversation = [{"role": "system", "content": system}, {"role": "user", "content": "Who speaks first?"}]
        replica, body = chat(cluster, conversation)
        tenants[tenant] = replica
        seen_by_router = cluster.front.prompt_blocks(json.dumps({"messages": conversation}).encode(), True,
                                                     cluster.front.router)
        assert len(seen_by_router) == body["usage"]["prompt_tokens"] // 16  # the tokens the replica computes
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for turn in range(2):
            conversation += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                             {"role": "user", "content": f"And then, in turn {turn}?"}]
            again, body = chat(cluster, conversation)
            assert again == replica  # where its prefix is
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 16 * 8 and cached % 16 == 0
    assert tenants["Globe"] != tenants["Rose"]  # nothing in common: the second tenant goes to the idle replica


def test_cached_tokens_pass_through_streamed_and_not(cluster):
    prompt = CORPUS[1000:1600]
    plain = httpx.post(cluster.url + "/v1/completions", timeout=TIMEOUT,
                       json={"prompt": prompt, "max_tokens": 5, "temperature": 0}).json()
    body = {"prompt": prompt + " more", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=TIMEOUT) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
    usage = events[-1]["usage"]
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    want = 16 * min(plain["usage"]["prompt_tokens"] // 16, (usage["prompt_tokens"] - 1) // 16)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= want - 16 > 0
    again = httpx.post(cluster.url + "/v1/completions", timeout=TIMEOUT,
                       json={"prompt": prompt, "max_tokens": 5, "temperature": 0}).json()
    assert again["choices"][0]["text"] == plain["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * ((plain["usage"]["prompt_tokens"] - 1) // 16)


def test_a_refused_request_leaves_nothing_in_the_index(cluster):
    """Issue 29 item 3 through the front end: a prompt the replica refuses (longer than max_model_len) was
    hashed off the event loop, and its blocks, pending on the replica, go with the refusal."""
    before = [metric(cluster, "minivllm_router:index_blocks", r) for r in range(2)]
    for i in range(3):
        answer = httpx.post(cluster.url + "/v1/completions", timeout=TIMEOUT,
                            json={"prompt": [7 + i] * 4000, "max_tokens": 2})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
    assert [metric(cluster, "minivllm_router:index_blocks", r) for r in range(2)] == before
    assert [metric(cluster, "minivllm_router:index_pending_blocks", r) for r in range(2)] == [0, 0]
    assert httpx.post(cluster.url + "/reset_prefix_cache", timeout=TIMEOUT).status_code == 404  # not dev mode
    assert httpx.post(cluster.replicas.urls[0] + "/reset_prefix_cache", timeout=TIMEOUT).status_code == 404


def test_errors_pass_through(cluster):
    answer = httpx.post(cluster.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=TIMEOUT)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_tokens"
    answer = httpx.post(cluster.url + "/v1/completions", json={"prompt": "x", "bogus": 1}, timeout=TIMEOUT)
    assert answer.status_code == 400 and "bogus" in answer.json()["error"]["message"]
    assert httpx.get(cluster.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"] == "minivllm"
    assert httpx.get(cluster.url + "/nowhere", timeout=TIMEOUT).status_code == 404


@pytest.mark.parametrize("stream", [True, False])
def test_a_hang_up_aborts_on_the_replica(cluster, stream):
    body = {"prompt": CORPUS[:200], "max_tokens": 1500, "ignore_eos": True, "stream": stream}
    start = time.monotonic()
    if stream:
        with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=TIMEOUT) as answer:
            replica = int(answer.headers["x-minivllm-replica"])
            lines = answer.iter_lines()
            for _ in range(6):
                next(lines)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(cluster.url + "/v1/completions", json=body, timeout=httpx.Timeout(TIMEOUT, read=1.0))
    deadline = time.monotonic() + 30
    running = [1.0, 1.0]
    while time.monotonic() < deadline and (sum(running) or sum(cluster.front.router.in_flight)):
        running = [metric(cluster, "vllm:num_requests_running", r) for r in range(2)]
        time.sleep(0.1)
    assert running == [0.0, 0.0] and cluster.front.router.in_flight == [0, 0]
    assert time.monotonic() - start < 20  # 1,500 tokens would take longer: it was aborted, not finished
    assert all(metric(cluster, "vllm:kv_cache_usage_perc", r) == 0 for r in range(2))


def test_vllm_clients_see_the_front_as_one_vllm_server(cluster):
    """Issue 40 through the data-parallel front: model cards with the model's root (what `vllm bench serve`
    reads without --model), /ping and /version, and a batch of prompts answered by one replica."""
    import minivllm
    from minivllm.model.loader import DEFAULT_MODEL

    cards = httpx.get(cluster.url + "/v1/models", timeout=TIMEOUT).json()["data"]
    assert [(card["id"], card["root"]) for card in cards] == [("minivllm", str(DEFAULT_MODEL))]
    assert httpx.get(cluster.url + "/ping", timeout=TIMEOUT).status_code == 200
    assert httpx.post(cluster.url + "/ping", timeout=TIMEOUT).status_code == 200
    assert httpx.get(cluster.url + "/version", timeout=TIMEOUT).json() == {"version": minivllm.__version__}
    answer = httpx.post(cluster.url + "/v1/completions", timeout=TIMEOUT,
                        json={"prompt": [CORPUS[:200], "ROMEO:"], "n": 2, "max_tokens": 3, "ignore_eos": True})
    assert answer.status_code == 200 and [c["index"] for c in answer.json()["choices"]] == [0, 1, 2, 3]


def test_a_dead_replica_is_avoided_then_a_clean_503(cluster):
    """Last in the file: it kills the cluster's replicas."""
    victim = cluster.replicas.processes[1]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    for i in range(3):  # every request is served, by the survivor
        answer = httpx.post(cluster.url + "/v1/completions", timeout=TIMEOUT,
                            json={"prompt": f"After the crash, {i}:", "max_tokens": 2})
        assert answer.status_code == 200 and answer.headers["x-minivllm-replica"] == "0"
    assert cluster.front.router.alive == [True, False]
    assert httpx.get(cluster.url + "/health", timeout=TIMEOUT).status_code == 200
    cluster.replicas.processes[0].send_signal(signal.SIGKILL)
    cluster.replicas.processes[0].wait(timeout=30)
    answer = httpx.post(cluster.url + "/v1/completions", json={"prompt": "Anyone?", "max_tokens": 2}, timeout=TIMEOUT)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == 503
    assert httpx.get(cluster.url + "/health", timeout=TIMEOUT).status_code == 503


def test_the_api_key_guards_the_front_end_and_reaches_the_replicas():
    from minivllm.entrypoints.openai.dp_server import DataParallelServer

    with DataParallelServer(1, "least-loaded", llm_kwargs={"num_kv_blocks": 32}, api_key="k3y", threads=1) as server:
        body = {"prompt": "ROMEO:", "max_tokens": 2}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT).status_code == 401
        assert httpx.get(server.url + "/metrics", timeout=TIMEOUT).status_code == 401
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
        key = {"Authorization": "Bearer k3y"}
        assert httpx.post(server.url + "/v1/completions", json=body, headers=key, timeout=TIMEOUT).status_code == 200
        assert httpx.post(server.replicas.urls[0] + "/v1/completions", json=body, timeout=TIMEOUT).status_code == 401
        assert server.front.router.alive == [True]  # its event stream, with the operator key, is open
        for client_key in ({}, key):  # /kv_events names every tenant's blocks: never for a client (issue 41)
            with httpx.stream("GET", server.replicas.urls[0] + "/kv_events", headers=client_key,
                              timeout=TIMEOUT) as answer:
                assert answer.status_code == 401


def test_replicas_exit_when_their_front_end_is_killed():
    code = ("from minivllm.entrypoints.openai.supervisor import Replicas\n"
            "r = Replicas(1, {'num_kv_blocks': 16}, threads=1)\n"
            "print(r.processes[0].pid, flush=True)\n"
            "import time; time.sleep(600)\n")
    front = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(front.stdout.readline())
        front.kill()  # SIGKILL: no cleanup runs in the front end
        front.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.1)
        assert not alive(pid)
    finally:
        if front.poll() is None:
            front.kill()
        front.stdout.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_kv_events_compose_with_tensor_parallelism():
    """With tensor parallelism the driver's pool records the events, and replaying them gives what it holds."""
    llm = LLM(device="cpu", num_kv_blocks=32, block_size=4, tensor_parallel_size=2,
              kv_events_config={"enable_kv_cache_events": True})
    try:
        ids = llm.get_tokenizer()(CORPUS[:400]).input_ids
        llm.generate([{"prompt_token_ids": ids[:18]}, {"prompt_token_ids": ids[40:70]}],
                     SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        index = BlockIndex(1)
        for event in llm.engine.take_events():
            index.apply(0, event)
        pool = llm.engine.kv_manager.pool
        assert index.blocks[0] == Counter({h: len(pool.cached.copies(h)) for h in pool.cached}) and index.blocks[0]
    finally:
        llm.shutdown()
