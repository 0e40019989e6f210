"""The server speaks to the clients vLLM users run (issue 40): batched prompts answered with prompts x n choices
indexed as vLLM indexes them, vLLM's model naming and model cards, OpenAI's and vLLM's fields accepted at
their no-op values (and refused by name otherwise), `stop_reason`, per-chunk usage, case-insensitive Bearer,
VLLM_API_KEY, /version, /ping, and a log line naming the field of each 4xx. Plain HTTP and the `openai`
client, as lm-eval, LangChain, guidellm and `vllm bench serve` send them."""

import json
import logging
import os
import subprocess
import sys

import httpx
import pytest
from openai import OpenAI

from minivllm import LLM, SamplingParams, cli
from minivllm.book.texts import CORPUS
from minivllm.entrypoints.openai.launcher import BackgroundServer
from minivllm.model.loader import DEFAULT_MODEL
from tests.test_server import labels_sorted

TIMEOUT = 120


@pytest.fixture(scope="module")
def reference():
    return LLM(num_kv_blocks=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(LLM(num_kv_blocks=256, max_num_seqs=8), model_name=["tiny", "tiny-alias"],
                          model_path="/models/tiny") as running:
        yield running


def post(server, path, payload, headers=None):
    answer = httpx.post(server.url + path, json=payload, timeout=TIMEOUT, headers=headers)
    return answer.status_code, answer.json()


def stream(server, payload) -> list[dict]:
    """The JSON events of a streamed request, [DONE] checked and dropped."""
    with httpx.stream("POST", server.url + "/v1/completions", json={**payload, "stream": True},
                      timeout=TIMEOUT) as answer:
        lines = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


PROMPTS = ["ROMEO:", CORPUS[300:380], "KING RICHARD II:\nWhat"]


# ------------------------------------------------------------------ goal 2: batched prompts

def test_a_batch_of_prompts_is_prompts_times_n_choices_indexed_as_vllm(server, reference):
    params = dict(temperature=0.8, top_p=0.95, seed=11, max_tokens=12, n=2)
    expected = [o for o in reference.generate(PROMPTS, SamplingParams(**params), use_tqdm=False)]
    status, body = post(server, "/v1/completions", {"prompt": PROMPTS, **params})
    assert status == 200
    assert [c["index"] for c in body["choices"]] == list(range(len(PROMPTS) * 2))
    for i, output in enumerate(expected):  # prompt i's choice j at i * n + j
        assert [body["choices"][i * 2 + j]["text"] for j in range(2)] == [c.text for c in output.outputs]
    assert body["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in expected)
    assert body["usage"]["completion_tokens"] == sum(len(c.token_ids) for o in expected for c in o.outputs)
    ids = [o.prompt_token_ids for o in expected]  # the same batch as token lists: the same choices
    assert [c["text"] for c in post(server, "/v1/completions", {"prompt": ids, **params})[1]["choices"]] \
        == [c["text"] for c in body["choices"]]
    texts = {}  # streamed: the pieces of each index add up to the same texts
    for chunk in stream(server, {"prompt": PROMPTS, **params}):
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert [texts[i] for i in range(len(texts))] == [c["text"] for c in body["choices"]]


def test_the_openai_client_sends_a_list_as_langchain_does(server, reference):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    reply = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    expected = reference.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [c.text for c in reply.choices] == [o.outputs[0].text for o in expected]
    assert [c.index for c in reply.choices] == [0, 1]


@pytest.mark.parametrize("prompt, fragment", [
    ([], "empty"),
    (["ROMEO:", [1, 2]], "valid"),  # strings and token lists do not mix, as in vLLM
    (["ROMEO:", ""], "prompt 1:"),  # the second prompt is refused, and nothing of the first ran
    ([[1, 2], [3, 10**6]], "prompt 1:"),
    (["ROMEO:"] * 3000, "3000 prompts"),  # prompts x n x max_tokens over the per-request cap
])
def test_a_bad_batch_is_a_400_naming_the_prompt(server, prompt, fragment):
    status, body = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 16})
    assert status == 400 and body["error"]["param"] == "prompt" and fragment in body["error"]["message"], body
    assert not server.engine.snapshot["unfinished"] and not server.engine._queues


# ------------------------------------------------------------------ goal 3: model naming and cards

def test_model_cards_and_several_served_names(server):
    cards = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"]
    assert [c["id"] for c in cards] == ["tiny", "tiny-alias"]
    for card in cards:  # vLLM's ModelCard: `vllm bench serve` reads `root` when given no --model
        assert card["object"] == "model" and card["root"] == "/models/tiny" and card["parent"] is None
        assert card["max_model_len"] == 2048 and isinstance(card["created"], int) and card["created"] > 0
        assert card["permission"][0]["object"] == "model_permission" and card["permission"][0]["allow_sampling"]
    for model in ("tiny", "tiny-alias", "", None):  # any served name, or none, is the served model
        status, body = post(server, "/v1/completions", {"model": model, "prompt": "ROMEO:", "max_tokens": 2})
        assert status == 200 and body["model"] == "tiny"  # responses carry the first name, as vLLM's
    status, body = post(server, "/v1/completions", {"model": "/models/tiny", "prompt": "ROMEO:"})
    assert status == 404 and body["error"]["param"] == "model"


def test_serve_takes_the_model_positionally_and_names_it_after_it(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "serve", lambda args: seen.append(cli.served_names(args)) or 0)
    path = str(DEFAULT_MODEL)
    cli.main(["serve", path])
    cli.main(["serve", "--model", path])
    cli.main(["serve", path, "--served-model-name", "a", "b"])
    cli.main(["serve"])
    assert seen == [([path], path), ([path], path), (["a", "b"], path), (["minivllm"], path)]


# ------------------------------------------------------------------ goal 5: no-op fields

NOOP_COMMON = {"echo": False, "logit_bias": None, "response_format": {"type": "text"}, "store": False,
               "metadata": {"run": "eval-7"}, "request_id": "req-1", "priority": 0, "user": "u",
               "structured_outputs": None, "use_beam_search": False, "length_penalty": 1.0,
               "truncate_prompt_tokens": None, "allowed_token_ids": None, "bad_words": [], "prompt_logprobs": None,
               "return_token_ids": False, "kv_transfer_params": None, "vllm_xargs": None, "service_tier": "auto",
               "spaces_between_special_tokens": True, "stream_interval": 1, "session_id": "s"}


def test_no_op_fields_are_accepted_and_change_nothing(server):
    plain = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0})[1]
    status, body = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0,
                                                    "suffix": None, "best_of": 1, **NOOP_COMMON})
    assert status == 200 and body["choices"][0]["text"] == plain["choices"][0]["text"], body
    messages = [{"role": "user", "content": "Speak."}]
    plain = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0})[1]
    status, body = post(server, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 8, "temperature": 0, "tools": None, "tool_choice": "none",
        "parallel_tool_calls": True, "chat_template_kwargs": {}, "add_generation_prompt": True,
        "modalities": ["text"], "reasoning_effort": None, "continue_final_message": False, **NOOP_COMMON})
    assert status == 200 and body["choices"][0]["message"] == plain["choices"][0]["message"], body


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "echo", True), ("/v1/completions", "logit_bias", {"5": 100}),
    ("/v1/completions", "response_format", {"type": "json_object"}), ("/v1/completions", "priority", 3),
    ("/v1/completions", "use_beam_search", True), ("/v1/completions", "suffix", "end"),
    ("/v1/completions", "best_of", 4), ("/v1/completions", "store", 1), ("/v1/completions", "metadata", True),
    ("/v1/completions", "an\nunknown field", None),  # its log line stays one line
    ("/v1/completions", "prompt_logprobs", 2), ("/v1/completions", "bad_words", ["x"]),
    ("/v1/completions", "something_unknown", None),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "required"), ("/v1/chat/completions", "chat_template", "{{ x }}"),
    ("/v1/chat/completions", "chat_template_kwargs", {"enable_thinking": True}),
])
def test_a_field_asking_for_what_minivllm_lacks_is_a_400_naming_it(server, path, field, value, caplog):
    base = {"prompt": "ROMEO:"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    with caplog.at_level(logging.INFO, logger="minivllm.entrypoints.openai"):
        status, body = post(server, path, {**base, field: value})
    assert status == 400 and body["error"]["param"] == field and field in body["error"]["message"], body
    # goal 6: the server's log says why, naming the field, on one line
    lines = [r.getMessage() for r in caplog.records if f"-> 400 (field {field!r})" in r.getMessage()]
    assert lines and path in lines[0] and "\n" not in lines[0]


# ------------------------------------------------------------------ goal 6: stop_reason, usage per chunk, auth

def test_stop_reason_names_the_stop_string_or_token(server, reference):
    free = reference.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    word = free.text.split()[2]  # a word the greedy output reaches
    for include in (False, True):
        status, body = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 30, "temperature": 0,
                                                        "stop": ["@@@", word], "include_stop_str_in_output": include})
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == word, choice
        assert choice["text"].endswith(word) == include
    token = free.token_ids[4]
    body = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 30, "temperature": 0,
                                            "stop_token_ids": [token]})[1]
    assert body["choices"][0]["stop_reason"] == token and body["choices"][0]["finish_reason"] == "stop"
    body = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 3, "ignore_eos": True})[1]
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["stop_reason"] is None
    chunks = stream(server, {"prompt": "ROMEO:", "max_tokens": 30, "temperature": 0, "stop": [word]})
    last = [c for chunk in chunks for c in chunk["choices"]][-1]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == word


def test_continuous_usage_stats_put_usage_in_every_chunk(server):
    payload = {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    chunks = stream(server, {**payload, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *pieces, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 4 * 6
    seen = {}
    for chunk in pieces:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]  # this prompt's tokens, and this choice's tokens so far
        assert usage["completion_tokens"] >= seen.get(choice["index"], 0)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        seen[choice["index"]] = usage["completion_tokens"]
    assert seen == {i: 6 for i in range(4)}
    assert sum({c["choices"][0]["index"] // 2: c["usage"]["prompt_tokens"] for c in pieces}.values()) \
        == final["usage"]["prompt_tokens"]
    # as vLLM: continuous_usage_stats without include_usage adds nothing
    assert all("usage" not in c for c in stream(server, {**payload, "stream_options": {"continuous_usage_stats": True}}))


def test_bearer_in_any_case_version_and_ping():
    with BackgroundServer(LLM(num_kv_blocks=64), api_key="s3cret") as private:
        request = {"prompt": "ROMEO:", "max_tokens": 2}
        for header, status in [("Bearer s3cret", 200), ("bearer s3cret", 200), ("BEARER s3cret", 200),
                               ("Bearer wrong", 401), ("Basic s3cret", 401), ("Bearer", 401), ("s3cret", 401)]:
            answer = httpx.post(private.url + "/v1/completions", json=request, headers={"Authorization": header},
                                timeout=TIMEOUT)
            assert answer.status_code == status, header
        assert httpx.get(private.url + "/ping").status_code == 200  # a health check, open as /health
        assert httpx.post(private.url + "/ping").status_code == 200
        assert httpx.get(private.url + "/version").status_code == 401
        version = httpx.get(private.url + "/version", headers={"Authorization": "bearer s3cret"}).json()
        import minivllm
        assert version == {"version": minivllm.__version__}


def test_command_line_serve_model_positional_with_vllm_api_key(tmp_path):
    env = {**os.environ, "VLLM_API_KEY": "from-env"}
    env.pop("MINIVLLM_API_KEY", None)
    process = subprocess.Popen([sys.executable, "-m", "minivllm", "serve", str(DEFAULT_MODEL), "--port", "0",
                                "--disable-uvicorn-access-log"], stdout=subprocess.PIPE,
                               stderr=open(tmp_path / "err", "w"), text=True, env=env)
    try:
        line = process.stdout.readline()
        assert f"serving {str(DEFAULT_MODEL)!r} on http://" in line, (tmp_path / "err").read_text()
        url = line.split(" on ")[1].strip()
        key = {"Authorization": "Bearer from-env"}
        cards = httpx.get(url + "/models", headers=key, timeout=TIMEOUT).json()["data"]
        assert [(c["id"], c["root"]) for c in cards] == [(str(DEFAULT_MODEL), str(DEFAULT_MODEL))]
        assert httpx.get(url + "/models", timeout=TIMEOUT).status_code == 401
        answer = httpx.post(url + "/completions", headers=key, timeout=TIMEOUT,
                            json={"model": str(DEFAULT_MODEL), "prompt": "ROMEO:", "max_tokens": 2, "n": -1})
        assert answer.status_code == 400
    finally:
        process.terminate()
        process.wait(timeout=30)
    log = (tmp_path / "err").read_text()
    assert "POST /v1/completions -> 400 (field 'n')" in log, log


# ------------------------------------------------------------------ goal 4: vLLM's metrics

def scrape(url: str) -> dict:
    """/metrics as {name{labels}: value}, the labels in the order written here (model_name, engine, others)."""
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {labels_sorted(line.rsplit(" ", 1)[0]): float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_have_vllms_names_and_model_name_label(server):
    label = '{model_name="tiny",engine="0"}'  # the first served name, as vLLM's
    before = scrape(server.url)
    assert post(server, "/v1/completions", {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 5, "ignore_eos": True,
                                            "temperature": 0})[0] == 200
    after = scrape(server.url)
    grew = lambda name: after[name + label] - before.get(name + label, 0)  # noqa: E731
    assert grew("vllm:e2e_request_latency_seconds_count") == 2 and grew("vllm:request_params_n_count") == 2
    assert grew("vllm:generation_tokens_total") == 2 * 2 * 5 and grew("vllm:request_generation_tokens_sum") == 20
    for phase in ("queue", "prefill", "decode", "inference"):  # from the engine's own timestamps
        assert grew(f"vllm:request_{phase}_time_seconds_count") == 2
    success = 'vllm:request_success_total{model_name="tiny",engine="0",finished_reason="length"}'
    assert after[success] - before[success] == 2  # a prompt with its n choices is one request of minivllm's engine
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "request_time_per_output_token_seconds_count",
                 "request_prompt_tokens_count", "request_params_max_tokens_count", "prompt_tokens_cached_total"):
        assert f"vllm:{name}{label}" in after, name
    assert not any(k.startswith(("minivllm:", "vllm:spec_decode")) for k in after)  # no speculation here


def test_spec_decode_counters_as_vllm_bench_serve_reads_them():
    spec_llm = LLM(num_kv_blocks=256, speculative_config={"model": None, "num_speculative_tokens": 3})
    with BackgroundServer(spec_llm) as spec_server:
        for prompt in PROMPTS:
            assert post(spec_server, "/v1/completions", {"prompt": prompt, "max_tokens": 30, "temperature": 0})[0] == 200
        text = httpx.get(spec_server.url + "/metrics", timeout=TIMEOUT).text
    stats = spec_llm.stats()
    totals, per_position = {}, {}
    for line in text.splitlines():  # as vllm/benchmarks/serve.py fetch_spec_decode_metrics parses them
        if line.startswith("vllm:spec_decode"):
            name, value = line.split("{")[0], float(line.split()[-1])
            if 'position="' in line:
                per_position[int(line.split('position="')[1].split('"')[0])] = value
            elif name.endswith("_total"):
                totals[name] = value
    assert totals == {"vllm:spec_decode_num_drafts_total": stats["spec_decode_num_drafts"],
                      "vllm:spec_decode_num_draft_tokens_total": stats["spec_decode_num_draft_tokens"],
                      "vllm:spec_decode_num_accepted_tokens_total": stats["spec_decode_num_accepted_tokens"]}
    assert totals["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < sum(per_position.values()) == totals["vllm:spec_decode_num_accepted_tokens_total"]
    assert sorted(per_position) == [0, 1, 2]


def test_a_client_that_hangs_up_on_a_batch_frees_every_prompts_blocks(server):
    import socket
    import time

    body = json.dumps({"prompt": PROMPTS, "n": 2, "max_tokens": 1000, "ignore_eos": True, "stream": True}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    with socket.create_connection((server.host, server.port), timeout=TIMEOUT) as sock:
        sock.sendall(head % len(body) + body)
        received = b""
        while b"data: {" not in received:  # streaming has begun: every prompt is running
            received += sock.recv(65536)
        assert server.engine.snapshot["num_requests_running"] + server.engine.snapshot["num_requests_waiting"] > 0
    deadline = time.time() + 30  # 6 x 1,000 tokens would take far longer: they were aborted
    while (server.engine.snapshot["unfinished"] or server.engine._streams) and time.time() < deadline:
        time.sleep(0.05)
    engine = server.engine.engine
    assert not engine.has_unfinished_requests() and not engine.output_processor.parents
    assert engine.kv_manager.pool.num_free == engine.kv_manager.pool.num_blocks


def test_the_data_parallel_front_routes_a_batch_by_its_first_prompt(reference):
    """The front end hashes the blocks of what the replica will run first; a batch goes to one replica."""
    from minivllm.distributed.router import Router
    from minivllm.entrypoints.openai.front import RouterFront
    from minivllm.entrypoints.openai.guards import Limits

    router = Router(2, "prefix-aware", 16)
    front = RouterFront(["http://a", "http://b"], router, reference.tokenizer, Limits(), None)
    text = CORPUS[:400]
    alone = front.prompt_blocks(json.dumps({"prompt": text}).encode(), False, router)
    assert len(alone) >= 4 and alone == router.hash(reference.tokenizer(text).input_ids)
    batch = json.dumps({"prompt": [text, "ROMEO:"]}).encode()
    ids = json.dumps({"prompt": [reference.tokenizer(text).input_ids, [1, 2]]}).encode()
    assert front.prompt_blocks(batch, False, router) == alone == front.prompt_blocks(ids, False, router)
    assert front.prompt_blocks(json.dumps({"prompt": []}).encode(), False, router) == []
