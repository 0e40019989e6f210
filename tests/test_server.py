"""The OpenAI-compatible server (chapter 10): the same tokens as LLM.generate, streamed or not, alone or under
load; the official client understands it; bad input is a 400 naming the field and the server keeps serving;
a client that hangs up, streaming or not, gets its request aborted and its blocks freed; hostile requests
(issue 19) are refused with a 4xx, harm no other request, and never stick the engine."""

import asyncio
import http.client
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from openai import AuthenticationError, BadRequestError, NotFoundError, OpenAI

from minivllm import LLM, SamplingParams
from minivllm.book.texts import CORPUS
from minivllm.engine.llm_engine import EngineStepError
from minivllm.entrypoints.openai.api_server import Limits
from minivllm.entrypoints.openai.launcher import BackgroundServer
from minivllm.entrypoints.openai_server import sendable_text
from minivllm.model.loader import DEFAULT_MODEL
from minivllm.sampling_checks import MAX_N
from minivllm.tools.loadgen import RequestTiming, percentile, run_load, summarize

TIMEOUT = 120  # seconds: generous, for a loaded 2-core machine; nothing here is a timed benchmark


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def reference():
    """A second engine on the same model, for expected outputs: the served one belongs to the server's thread."""
    return LLM(num_kv_blocks=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def server(llm):
    # cached_tokens asked for, as vLLM's --enable-prompt-tokens-details (test_serving_health.py: off by default)
    with BackgroundServer(llm, limits=Limits(header_timeout=3.0), enable_prompt_tokens_details=True) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def wait_idle(server, llm, seconds: float = 60) -> None:
    """Until the server's engine holds no request (aborts take effect at the next turn)."""
    deadline = time.time() + seconds
    while time.time() < deadline and (server.engine.snapshot["unfinished"] or server.engine._queues
                                      or llm.engine.output_processor.parents):
        time.sleep(0.02)


def assert_all_free(server, llm) -> None:
    wait_idle(server, llm)
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    assert not llm.engine.output_processor.parents  # released, not leaked
    assert not server.engine._streams and not server.engine.engine.output_processor.parents


def post(server, path, payload, raw: bytes | None = None, headers: dict | None = None):
    data = raw if raw is not None else json.dumps(payload).encode()
    answer = httpx.post(server.url + path, content=data, timeout=TIMEOUT,
                        headers={"Content-Type": "application/json", **(headers or {})})
    return answer.status_code, answer.json()


def get(server, path, headers: dict | None = None):
    answer = httpx.get(server.url + path, timeout=TIMEOUT, headers=headers)
    return answer.status_code, answer.content


def raw_exchange(server, request: bytes, read: int = 65536) -> bytes:
    with socket.create_connection((server.host, server.port), timeout=TIMEOUT) as sock:
        sock.sendall(request)
        return sock.recv(read)


def raw_status(server, request: bytes) -> int:
    return int(raw_exchange(server, request, 64).split()[1])


def raw_post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (path.encode(), len(body), extra)) + body


PROMPTS = [CORPUS[:120], "ROMEO:", CORPUS[900:1000], "KING RICHARD II:\nWhat"]
CASES = [dict(temperature=0, max_tokens=40),
         dict(temperature=0.9, top_p=0.9, seed=7, max_tokens=30),
         dict(temperature=0, max_tokens=60, stop=["\n\n", "lord"]),
         dict(temperature=1.0, top_k=20, seed=3, max_tokens=25, stop=["KING"])]


# ------------------------------------------------------------------ the same tokens as LLM.generate

@pytest.mark.parametrize("case", range(len(CASES)))
def test_completions_equal_llm_generate_streamed_or_not(reference, client, case):
    options = CASES[case]
    openai_fields = {k: v for k, v in options.items() if k != "top_k"}
    extra = {"extra_body": {"top_k": options["top_k"]}} if "top_k" in options else {}  # as vLLM's docs pass it
    for prompt in PROMPTS:
        [expected] = reference.generate(prompt, SamplingParams(**options), use_tqdm=False)
        expected = expected.outputs[0]
        whole = client.completions.create(model="minivllm", prompt=prompt, **openai_fields, **extra)
        assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == expected.finish_reason
        assert whole.usage.completion_tokens == len(expected.token_ids)
        chunks = list(client.completions.create(model="minivllm", prompt=prompt, stream=True, **openai_fields, **extra))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text  # stop strings never leak
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason


def test_stream_with_several_choices_and_usage(reference, client):
    options = dict(temperature=1.0, seed=11, max_tokens=20, n=3)
    [expected] = reference.generate("ROMEO:", SamplingParams(**options), use_tqdm=False)
    chunks = list(client.completions.create(model="minivllm", prompt="ROMEO:", stream=True,
                                            stream_options={"include_usage": True}, **options))
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in expected.outputs]
    assert chunks[-1].usage.completion_tokens == sum(len(c.token_ids) for c in expected.outputs)
    finishes = [choice.index for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert sorted(finishes) == [0, 1, 2]  # each choice says it finished exactly once


def test_chat_completions(reference, client):
    messages = [{"role": "system", "content": "Answer in verse."}, {"role": "user", "content": "Who art thou?"}]
    tokenizer = reference.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    [expected] = reference.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24),
                                    use_tqdm=False)
    reply = client.chat.completions.create(model="minivllm", messages=messages, temperature=0, max_tokens=24)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == tokenizer.decode(expected.outputs[0].token_ids, skip_special_tokens=True)
    chunks = list(client.chat.completions.create(model="minivllm", messages=messages, temperature=0, max_tokens=24,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    parts = [{"role": "user", "content": [{"type": "text", "text": "Who art "}, {"type": "text", "text": "thou?"}]}]
    again = client.chat.completions.create(model="minivllm", messages=[messages[0], *parts], temperature=0,
                                           max_completion_tokens=24)
    assert again.choices[0].message.content == reply.choices[0].message.content  # text parts join


def test_concurrent_streams_equal_each_request_alone(reference, server):
    prompts = [CORPUS[i * 150:i * 150 + 100 + 10 * i] for i in range(12)]
    expected = [o.outputs[0].text for o in reference.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                                                       ignore_eos=True), use_tqdm=False)]
    timings, seconds = asyncio.run(run_load(server.url, prompts, float("inf"), 24))
    assert [t.text for t in timings] == expected
    assert all(t.num_tokens == 24 and len(t.arrivals) >= 1 for t in timings)
    summary = summarize(timings, seconds)
    assert summary["ttft_p50_ms"] <= summary["ttft_p99_ms"] and summary["output_tokens_per_s"] > 0


def test_logprobs_are_the_models_own(server, client, reference):
    from transformers import AutoModelForCausalLM

    prompt, k = CORPUS[:80], 3
    reply = client.completions.create(model="minivllm", prompt=prompt, max_tokens=6, temperature=0, logprobs=k)
    got = reply.choices[0].logprobs
    tokenizer = server.engine.tokenizer
    prompt_ids = tokenizer(prompt).input_ids
    [same] = reference.generate(prompt, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    completion_ids = same.outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + completion_ids])).logits[0, len(prompt_ids) - 1:-1]
    expected = logits.log_softmax(-1)
    assert len(got.token_logprobs) == len(got.tokens) == len(got.top_logprobs) == 6
    for position, (token, logprob, top) in enumerate(zip(got.tokens, got.token_logprobs, got.top_logprobs)):
        values, ids = expected[position].topk(k)
        assert logprob == pytest.approx(values[0].item(), abs=1e-3)  # greedy: the sampled token is the top one
        assert list(top) == [tokenizer.decode([i]) for i in ids.tolist()]
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-3)
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(6)]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="minivllm", prompt=prompt, max_tokens=6, temperature=0, logprobs=k, stream=True) if c.choices]
    assert [lp for piece in streamed for lp in piece.token_logprobs] == pytest.approx(got.token_logprobs, abs=1e-5)
    chat = client.chat.completions.create(model="minivllm", messages=[{"role": "user", "content": "Speak."}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)  # greedy
    plain = client.completions.create(model="minivllm", prompt=prompt, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None  # only when asked


def test_tokenize_detokenize_and_models(server, reference):
    status, body = post(server, "/tokenize", {"prompt": "ROMEO:", "return_token_strs": True})
    assert status == 200 and body["tokens"] == reference.tokenizer("ROMEO:").input_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    assert "".join(body["token_strs"]) == "ROMEO:"
    status, detok = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and detok["prompt"] == "ROMEO:"
    status, chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    text = reference.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                   add_generation_prompt=True)
    assert status == 200 and chat["tokens"] == reference.tokenizer(text, add_special_tokens=False).input_ids
    assert post(server, "/detokenize", {"tokens": [1, 10**6]})[1]["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {})[0] == 400
    status, models = get(server, "/v1/models")
    assert status == 200 and json.loads(models)["data"][0]["id"] == "minivllm"


# ------------------------------------------------------------------ bad input: 400 naming the field

@pytest.mark.parametrize("payload, param", [
    ({"prompt": "ROMEO:", "temperature": -1}, "temperature"),
    ({"prompt": "ROMEO:", "temperature": "hot"}, "temperature"),
    ({"prompt": "ROMEO:", "top_p": 0}, "top_p"),
    ({"prompt": "ROMEO:", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "ROMEO:", "max_tokens": True}, "max_tokens"),
    ({"prompt": "ROMEO:", "n": "2"}, "n"),
    ({"prompt": "ROMEO:", "stop": [""]}, "stop"),
    ({"prompt": "ROMEO:", "echo": True}, "echo"),  # an OpenAI field minivllm does not implement
    ({"prompt": "ROMEO:", "logprobs": 21}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 99999]}, "prompt"),
    ({"prompt": "word " * 3000}, "prompt"),
    ({"prompt": 7}, "prompt"),
    ({"prompt": "ROMEO:", "stop": 5}, "stop"),
    ({"prompt": "ROMEO:", "stop_token_ids": 3}, "stop_token_ids"),
    ({"prompt": "ROMEO:", "seed": 2**64}, "seed"),
    ({"prompt": "ROMEO:", "stream": True, "stream_options": True}, "stream_options"),
    ({"prompt": "ROMEO:", "stream": "x"}, "stream"),
    ({"prompt": "ROMEO:", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"prompt": "ROMEO:", "stop": ["x"] * 33}, "stop"),
    ({"prompt": "ROMEO:", "n": MAX_N + 1}, "n"),
])
def test_bad_completion_requests_are_400_naming_the_field(server, payload, param):
    status, body = post(server, "/v1/completions", payload)
    assert status == 400 and body["error"]["param"] == param, body
    assert body["error"]["message"] and body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
    status, body = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3  # the server keeps serving


def test_protocol_errors(server, client):
    assert post(server, "/v1/nothing", {})[0] == 404
    assert post(server, "/v1/completions", None, raw=b"{not json")[0] == 400
    assert post(server, "/v1/completions", None, raw=b'{"prompt": "\xff\xfe"}')[0] == 400
    assert raw_status(server, b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Length: abc\r\n\r\n") == 400
    assert raw_status(server, b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Length: -1\r\n\r\n") == 400
    assert post(server, "/v1/chat/completions", {"messages": "hello"})[1]["error"]["param"] == "messages"
    assert post(server, "/v1/chat/completions", {"messages": []})[1]["error"]["param"] == "messages"
    assert post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
                )[1]["error"]["param"] == "top_logprobs"
    assert get(server, "/v1/completions")[0] == 405
    assert post(server, "/v1/completions", None, raw=b"x" * (Limits().max_body_bytes + 1))[0] == 413
    with pytest.raises(NotFoundError):
        client.completions.create(model="gpt-4", prompt="ROMEO:")
    with pytest.raises(BadRequestError, match="temperature"):
        client.completions.create(model="minivllm", prompt="ROMEO:", temperature=-2)


def test_head_and_options(server):
    assert httpx.head(server.url + "/health").status_code == 200
    assert httpx.head(server.url + "/v1/models").status_code == 200
    options = httpx.options(server.url + "/v1/completions")
    assert options.status_code == 204 and set(options.headers["allow"].split(", ")) == {"OPTIONS", "POST"}
    assert httpx.options(server.url + "/nowhere").status_code == 404
    preflight = httpx.options(server.url + "/v1/completions", headers={
        "Origin": "http://example.org", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"


def test_keep_alive_serves_several_requests_on_one_connection(server):
    connection = http.client.HTTPConnection(server.host, server.port, timeout=TIMEOUT)
    try:
        ports = []
        for max_tokens in (2, 3, 4):
            connection.request("POST", "/v1/completions", json.dumps({"prompt": "ROMEO:", "max_tokens": max_tokens}),
                               {"Content-Type": "application/json"})
            answer = connection.getresponse()
            assert answer.status == 200 and json.loads(answer.read())["usage"]["completion_tokens"] == max_tokens
            ports.append(connection.sock.getsockname()[1])
        assert len(set(ports)) == 1  # one connection, three requests
    finally:
        connection.close()


def test_a_chunked_request_body(server, reference):
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunks + b"0\r\n\r\n")
    with socket.create_connection((server.host, server.port), timeout=TIMEOUT) as sock:
        sock.sendall(request)
        response = b""
        while data := sock.recv(65536):
            response += data
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    [expected] = reference.generate("ROMEO:", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert json.loads(payload)["choices"][0]["text"] == expected.outputs[0].text
    too_big = b"x" * (Limits().max_body_bytes + 10)  # no Content-Length to trust: the bytes are counted
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
               + b"%x\r\n%s\r\n0\r\n\r\n" % (len(too_big), too_big))
    assert _send_then_status(server, request) == 413


def test_cache_salt_isolation_and_cached_tokens_over_http(server, client):
    prompt = "A prompt of this test alone. " + CORPUS[1500:2300]  # its first block is new: nothing is cached
    tokens = len(server.engine.tokenizer(prompt).input_ids)
    full_blocks = (tokens - 1) // 16 * 16  # the last token is always computed

    def cached(salt):
        extra = {"extra_body": {"cache_salt": salt}} if salt else {}
        reply = client.completions.create(model="minivllm", prompt=prompt, max_tokens=1, **extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == full_blocks  # the same tenant shares
    assert cached("tenant-b") == 0  # another tenant, the same prompt: nothing shared
    assert cached(None) == 0  # nor with requests that have no salt
    assert cached(None) == full_blocks
    chunks = list(client.completions.create(model="minivllm", prompt=prompt, max_tokens=1, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"cache_salt": "tenant-b"}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full_blocks
    assert post(server, "/v1/completions", {"prompt": prompt, "cache_salt": ""})[1]["error"]["param"] == "cache_salt"


# ------------------------------------------------------------------ hang-ups, failures, stopping

def test_a_client_that_hangs_up_is_aborted_and_its_blocks_freed(llm, server):
    body = json.dumps({"prompt": CORPUS[:300], "max_tokens": 1500, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(raw_post("/v1/completions", body))
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        sock.recv(4096)
    assert_all_free(server, llm)


def test_a_non_streaming_client_that_hangs_up_is_aborted(llm, server):
    """Issue 19, item 6: n = 4 with max_tokens = 1500 kept running 16 s after the client left."""
    body = json.dumps({"prompt": CORPUS[:300], "n": 4, "max_tokens": 1500, "ignore_eos": True}).encode()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(raw_post("/v1/completions", body))
        deadline = time.time() + TIMEOUT
        while not server.engine.snapshot["num_requests_running"] and time.time() < deadline:
            time.sleep(0.01)
        assert server.engine.snapshot["num_requests_running"] == 4  # running when the client leaves
    left = time.time()
    assert_all_free(server, llm)
    assert time.time() - left < 30  # at the next step boundary, in fact; 1,500 tokens would take far longer


def test_metrics_and_health(server):
    before = _metrics(server)
    for _ in range(3):
        assert post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4})[0] == 200
    after = _metrics(server)
    label = '{model_name="minivllm",engine="0"}'  # vLLM's names and labels
    assert after['vllm:request_success_total{model_name="minivllm",engine="0",finished_reason="length"}'] \
        == before['vllm:request_success_total{model_name="minivllm",engine="0",finished_reason="length"}'] + 3
    count = "vllm:time_to_first_token_seconds_count" + label
    assert after[count] == before[count] + 3
    assert after["vllm:generation_tokens_total" + label] == before["vllm:generation_tokens_total" + label] + 12
    buckets = [v for k, v in after.items() if k.startswith("vllm:time_to_first_token_seconds_bucket{")]
    assert buckets == sorted(buckets) and buckets[-1] == after[count]
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_time_per_output_token_seconds_count"):
        assert f"vllm:{name}{label}" in after
    assert get(server, "/health")[0] == 200
    assert json.loads(get(server, "/v1/models")[1])["data"][0]["id"] == "minivllm"


def _metrics(server, headers=None) -> dict:
    status, body = get(server, "/metrics", headers)
    assert status == 200
    return {labels_sorted(line.rsplit(" ", 1)[0]): float(line.rsplit(" ", 1)[1])
            for line in body.decode().splitlines() if line and not line.startswith("#")}


def labels_sorted(key: str) -> str:
    """`name{b="1",a="2"}` -> `name{model_name=...,engine=...,the others}`: one spelling whatever the client's order."""
    if "{" not in key:
        return key
    name, labels = key[:-1].split("{")
    pairs = sorted(labels.split(","), key=lambda p: (not p.startswith("model_name="), not p.startswith("engine="), p))
    return f"{name}{{{','.join(pairs)}}}"


def test_metrics_come_from_the_engine_loops_snapshot(server, monkeypatch):
    """/metrics never reads the scheduler: what it shows is the dict the loop published after its last turn."""
    monkeypatch.setattr(server.engine, "snapshot", {**server.engine.snapshot, "num_requests_waiting": 12345})
    assert _metrics(server)['vllm:num_requests_waiting{model_name="minivllm",engine="0"}'] == 12345


def test_sendable_text_holds_back_partial_characters_and_stop_prefixes():
    assert sendable_text("caf\ufffd", False, []) == "caf"
    assert sendable_text("caf\ufffd", True, []) == "caf\ufffd"
    assert sendable_text("my good lo", False, ["lord"]) == "my good"  # "lo" might become "lord"
    assert sendable_text("ab", False, ["long stop"]) == ""
    assert sendable_text("my good lo", True, ["lord"]) == "my good lo"


def test_load_statistics():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0 and percentile(values, 90) == pytest.approx(4.6)
    assert percentile([7.0], 99) == 7.0
    timing = RequestTiming(sent=10.0, arrivals=[10.5, 10.7, 11.5], num_tokens=5, text="x")
    assert timing.ttft == 0.5 and timing.e2e == 1.5 and timing.tpot == pytest.approx(0.25)
    assert timing.itls == pytest.approx([0.2, 0.8])
    assert RequestTiming(0.0, [1.0], 1, "x").tpot is None


def test_command_line_serve():
    process = subprocess.Popen([sys.executable, "-m", "minivllm", "serve", "--port", "0", "--api-key", "k3y",
                                "--disable-uvicorn-access-log"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        line = process.stdout.readline()
        assert "serving 'minivllm' on http://127.0.0.1:" in line, process.stderr.read() if not line else line
        url = line.split(" on ")[1].strip()
        reply = OpenAI(base_url=url, api_key="k3y", timeout=TIMEOUT).completions.create(
            model="minivllm", prompt="ROMEO:", max_tokens=5)
        assert reply.usage.completion_tokens == 5
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=url, api_key="wrong", max_retries=0).completions.create(model="minivllm", prompt="x")
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_an_engine_failure_is_a_500_and_the_server_keeps_serving(llm, server, monkeypatch):
    real_step, calls = llm.engine.step, []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    monkeypatch.setattr(llm.engine, "step", failing_once)
    status, body = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 5})
    assert status == 500 and "simulated kernel failure" in body["error"]["message"]
    status, body = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 5})
    assert status == 200 and body["usage"]["completion_tokens"] == 5
    assert_all_free(server, llm)


def test_a_failed_step_fails_only_its_own_requests(llm, reference, server, monkeypatch):
    """EngineStepError maps the requests the failed step aborted to their errors: those fail, with a
    500 or an error event in their stream, and the other requests go on to the right output."""
    real_step, victims = llm.engine.step, []

    def step():
        parents = llm.engine.output_processor.parents
        marked = [rid for rid, seqs in parents.items() if seqs[0].prompt == "FAIL ME" and seqs[0].output_token_ids]
        if marked:
            victims.extend(marked)
            for request_id in marked:  # as the engine does with the requests of a failed step
                llm.engine.abort_request(request_id)
            raise EngineStepError({rid: RuntimeError("simulated failure of one request") for rid in marked}, [])
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)
    prompts = [CORPUS[i * 200:i * 200 + 120] for i in range(3)]
    params = dict(temperature=0, max_tokens=60, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference.generate(prompts, SamplingParams(**params), use_tqdm=False)]

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
            async def stream(prompt):
                text, errors = "", []
                async with http.stream("POST", "/v1/completions", json={"prompt": prompt, "stream": True, **params}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            errors += [event["error"]["message"]] if "error" in event else []
                            text += "".join(c["text"] for c in event.get("choices", []))
                return text, errors

            streams = [asyncio.create_task(stream(p)) for p in prompts]
            await asyncio.sleep(0.3)
            victim_whole = asyncio.create_task(http.post("/v1/completions", json={"prompt": "FAIL ME", "max_tokens": 50}))
            victim_stream = asyncio.create_task(stream("FAIL ME"))
            return await asyncio.gather(*streams), await victim_whole, await victim_stream

    streamed, whole, (victim_text, victim_errors) = asyncio.run(scenario())
    assert [text for text, _ in streamed] == expected and not any(errors for _, errors in streamed)
    assert whole.status_code == 500 and "simulated failure" in whole.json()["error"]["message"]
    assert victim_errors and "simulated failure" in victim_errors[0]
    assert len(victims) >= 2
    monkeypatch.undo()
    assert_all_free(server, llm)


def test_a_request_the_engine_cannot_add_fails_alone(llm, server, monkeypatch):
    real_add, calls = llm.engine.add_request, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated add_request failure")
        return real_add(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", failing_once)
    status, body = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 5})
    assert status == 500 and "simulated add_request failure" in body["error"]["message"]
    assert post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 5})[0] == 200


def test_a_server_with_speculative_decoding():
    spec_llm = LLM(num_kv_blocks=256, speculative_config={"model": None, "num_speculative_tokens": 3})
    plain = LLM(num_kv_blocks=256)
    options = dict(temperature=0, max_tokens=40, stop=["\n\n"])
    with BackgroundServer(spec_llm) as spec_server:
        client = OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        for prompt in PROMPTS:
            [expected] = plain.generate(prompt, SamplingParams(**options), use_tqdm=False)
            chunks = list(client.completions.create(model="minivllm", prompt=prompt, stream=True, **options))
            assert "".join(c.choices[0].text for c in chunks) == expected.outputs[0].text
        assert spec_llm.stats()["spec_decode_num_accepted_tokens"] > 0
        with pytest.raises(BadRequestError, match="logprobs"):
            client.completions.create(model="minivllm", prompt="ROMEO:", logprobs=2)
        body = json.dumps({"prompt": CORPUS[:300], "max_tokens": 1000, "ignore_eos": True, "stream": True}).encode()
        with socket.create_connection((spec_server.host, spec_server.port)) as sock:  # hang up mid-stream
            sock.sendall(raw_post("/v1/completions", body))
            sock.recv(4096)
        deadline = time.time() + 30
        while spec_server.engine.snapshot["unfinished"] and time.time() < deadline:
            time.sleep(0.05)
    engine = spec_llm.engine
    assert not engine.has_unfinished_requests() and engine.kv_manager.pool.num_free == engine.kv_cache.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.output_processor.parents


def test_stopping_the_server_aborts_what_runs():
    local = LLM(num_kv_blocks=128)
    server = BackgroundServer(local).start()
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 1500, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(raw_post("/v1/completions", body))
        sock.recv(4096)
        server.stop()
    assert not local.engine.has_unfinished_requests() and not local.engine.output_processor.parents
    assert local.stats()["kv_blocks_free"] == 128


# ------------------------------------------------------------------ hostile input (issues 13 and 19)

def test_fifty_slow_clients_dribbling_headers_do_not_stop_a_normal_request(server):
    slow, stop = [], threading.Event()
    for _ in range(50):
        sock = socket.create_connection((server.host, server.port), timeout=TIMEOUT)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
        slow.append(sock)

    def dribble():
        while not stop.is_set():
            for sock in slow:
                try:
                    sock.send(b"X")
                except OSError:
                    pass
            time.sleep(0.2)

    dribbler = threading.Thread(target=dribble, daemon=True)
    dribbler.start()
    try:
        started = time.time()
        assert post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4})[0] == 200
        assert get(server, "/health")[0] == 200
        assert time.time() - started < 30  # served while 50 heads are still arriving (well under a second, in fact)
        time.sleep(Limits(header_timeout=3.0).header_timeout + 1)  # the head deadline passes
        answers = []
        for sock in slow:
            sock.settimeout(10)
            try:
                answers.append(sock.recv(64))
            except OSError:
                answers.append(b"")
        assert all(a.startswith(b"HTTP/1.1 408") or a == b"" for a in answers)  # cut off, not kept forever
        assert sum(a.startswith(b"HTTP/1.1 408") for a in answers) >= 45
    finally:
        stop.set()
        dribbler.join()
        for sock in slow:
            sock.close()


def test_a_slow_body_and_too_many_connections_get_a_4xx_and_a_503():
    limits = Limits(body_timeout=1.0, header_timeout=2.0, limit_concurrency=4)
    with BackgroundServer(LLM(num_kv_blocks=16), limits=limits) as small:
        with socket.create_connection((small.host, small.port), timeout=TIMEOUT) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
            assert sock.recv(64).startswith(b"HTTP/1.1 408")  # the rest of the body never came
        with socket.create_connection((small.host, small.port), timeout=TIMEOUT) as sock:
            assert sock.recv(64) == b""  # a connection that sends nothing is closed after header_timeout
        idle = [socket.create_connection((small.host, small.port), timeout=TIMEOUT) for _ in range(4)]
        try:
            time.sleep(0.2)
            assert httpx.get(small.url + "/health", timeout=TIMEOUT).status_code == 503  # over limit_concurrency
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.2)
        assert httpx.get(small.url + "/health", timeout=TIMEOUT).status_code == 200


FIELDS = {  # every request field, with values of a wrong type or out of range
    "prompt": [None, 7, 1.5, True, {}, [], [[]], [[1], ["a"]], [[-1]], [["a"]], [-1], [2**40], [1, "a"], [True]],
    "max_tokens": [0, -1, 2**31, 2**64, 1.5, "1", True, [], {}],
    "n": [0, -1, MAX_N + 1, 2**63, 1.5, "1", True, "x", [1]],
    "temperature": [-1, -1e-9, "0", True, [], {}, "nan"],
    "top_p": [0, -0.5, 1.01, 2**64, "1", False, []],
    "top_k": [-2, 2**31, 2**70, 1.5, "5", True],
    "min_p": [-0.1, 1.1, "0", True, [0.1]],
    "seed": [-1, 2**63, 2**64, 0.5, "1", True, [1]],
    "stop": [5, [""], [1], ["x"] * 33, ["y" * 1025], {"a": "b"}, True, [None]],
    "stop_token_ids": [3, [-1], [2**31], ["1"], [1.5], [True], list(range(1025))],
    "ignore_eos": ["yes", 1, 0, [], {}],
    "include_stop_str_in_output": ["no", 1],
    "skip_special_tokens": [1, "true"],
    "stream": ["x", [1], {}, 1],
    "stream_options": [True, "x", [1], {"include_usage": "yes"}, {"include_usage": 1}, {"unknown": True}],
    "cache_salt": ["", 5, [1, 2], {"a": 1}, True, "s" * 1025],
    "logprobs": [-1, 21, 2**64, 1.5, "2", True],
    "model": [5, ["minivllm"], "gpt-4"],  # "" is the served model, as in vLLM
    "user": [5, {}],
    "echo": [True],
    "presence_penalty": [3, -2.5, "0.5", True, [0.5]],
    "frequency_penalty": [2.5, "1", False],
    "repetition_penalty": [0, -1, "1", True],
    "min_tokens": [-1, 1.5, "1", 2**31, 5],  # 5: more than max_tokens
}
CHAT_FIELDS = {
    "messages": [None, "hello", [], [{}], [{"role": "user"}], [{"role": "wizard", "content": "x"}],
                 [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image", "url": "x"}]}],
                 [{"role": "user", "content": "x", "extra": 1}]],
    "max_completion_tokens": [0, -1, "5", True],
    "logprobs": [1, "true", []],
    "top_logprobs": [-1, 21, "3", True],
}


def test_fuzz_of_wrong_types_and_ranges_for_every_field(llm, server):
    """4xx, never 5xx; the server stays healthy and every KV block is free afterwards."""
    rng = random.Random(0)
    bodies = []
    for field, values in FIELDS.items():
        bodies += [("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 1, field: value}) for value in values]
    for field, values in {**{k: v for k, v in FIELDS.items() if k not in ("prompt", "logprobs")}, **CHAT_FIELDS}.items():
        bodies += [("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                             field: value}) for value in values]
    pool = [v for values in FIELDS.values() for v in values]
    for _ in range(60):  # one wrong field, and two more with any value from the pool
        first, *others = rng.sample(sorted(FIELDS), 3)
        body = {"prompt": "ROMEO:", "max_tokens": 1, **{f: rng.choice(pool) for f in others}}
        bodies.append(("/v1/completions", body | {first: rng.choice(FIELDS[first])}))
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        for path, body in bodies:
            answer = http.post(path, json=body)
            assert 400 <= answer.status_code < 500, (path, body, answer.status_code, answer.text)
            assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}).status_code == 200
    assert_all_free(server, llm)


def current_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_rss_stays_flat_over_a_few_hundred_requests(llm, server):
    def run(count):
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            for i in range(count):
                body = {"prompt": CORPUS[i % 50 * 20:i % 50 * 20 + 60], "max_tokens": 2, "logprobs": i % 3,
                        "stream": i % 2 == 0}
                assert http.post("/v1/completions", json=body).status_code == 200
                if i % 10 == 0:
                    http.post("/v1/completions", json={"prompt": "x", "n": "many"})

    run(40)  # warm up: caches, allocator pools, lazy imports
    before = current_rss()
    run(240)
    growth = current_rss() - before
    print(f"RSS growth {growth / 2**20:.1f} MiB")
    assert growth < 48 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 240 requests"
    assert_all_free(server, llm)


def test_issue19_item1_unbounded_n_is_refused_and_health_answers_within_a_second(llm, server):
    for n in (9223372036854775808, 200000):
        status, body = post(server, "/v1/completions", {"prompt": "x", "n": n})
        assert status == 400 and body["error"]["param"] == "n"
    stop, latencies = threading.Event(), []

    def hostile():  # the largest accepted n (hung up after 2 s), huge prompts to tokenize, refused requests
        with httpx.Client(base_url=server.url, timeout=2) as http:
            while not stop.is_set():
                for body in ({"prompt": "x", "n": MAX_N, "max_tokens": 1}, {"prompt": "word " * 150_000},
                             {"prompt": "x", "n": 9223372036854775808}, {"prompt": "x", "temperature": 2**64}):
                    if stop.is_set():
                        break
                    try:
                        http.post("/v1/completions", json=body)
                    except httpx.TimeoutException:
                        pass  # the client hangs up; the server aborts the request

    attackers = [threading.Thread(target=hostile, daemon=True) for _ in range(3)]
    for attacker in attackers:
        attacker.start()
    try:
        time.sleep(1.0)
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            for _ in range(15):
                started = time.perf_counter()
                assert http.get("/health").status_code == 200
                latencies.append(time.perf_counter() - started)
                time.sleep(0.2)
    finally:
        stop.set()
        for attacker in attackers:
            attacker.join(timeout=TIMEOUT)
    print(f"/health: up to {max(latencies) * 1000:.0f} ms")
    assert max(latencies) < 1.0, f"/health took up to {max(latencies):.2f} s"
    assert_all_free(server, llm)


def test_issue19_item2_a_huge_temperature_fails_no_one(llm, reference, server):
    """temperature = 2**64 (an integer) used to raise OverflowError inside the step and fail every stream."""
    prompts = [CORPUS[i * 300:i * 300 + 100] for i in range(3)]
    params = dict(temperature=0, max_tokens=150, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference.generate(prompts, SamplingParams(**params), use_tqdm=False)]

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
            counts = [0, 0, 0]

            async def stream(i):
                text = ""
                async with http.stream("POST", "/v1/completions", json={"prompt": prompts[i], "stream": True, **params}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            assert "error" not in event
                            text += "".join(c["text"] for c in event["choices"])
                            counts[i] += 1
                return text

            streams = [asyncio.create_task(stream(i)) for i in range(3)]
            while min(counts) < 100 and not all(s.done() for s in streams):
                await asyncio.sleep(0.01)
            hostile = await http.post("/v1/completions", json={"prompt": "ROMEO:", "temperature": 2**64,
                                                               "max_tokens": 20})
            return await asyncio.gather(*streams), hostile

    texts, hostile = asyncio.run(scenario())
    assert hostile.status_code in (200, 400), hostile.text  # a finite number: accepted, sampled almost uniformly
    assert texts == expected  # the three streams, 100 events in, finish with the right text
    status, body = post(server, "/v1/completions", {"prompt": "HELLO", "max_tokens": 5, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 5  # the next request works
    assert_all_free(server, llm)


@pytest.mark.parametrize("salt", [[1, 2], {"a": 1}, 5, True])
def test_issue19_item4_an_unchecked_salt_is_refused(llm, server, salt):
    status, body = post(server, "/v1/completions", {"prompt": "ROMEO:", "cache_salt": salt})
    assert status == 400 and body["error"]["param"] == "cache_salt"
    status, body = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 3, "cache_salt": "fine"})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert_all_free(server, llm)


def _send_then_status(server, data: bytes) -> int:
    """Send a (possibly huge) request, tolerating a server that answers and closes before it is all sent."""
    with socket.create_connection((server.host, server.port), timeout=TIMEOUT) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass
        answer = sock.recv(64)
    return int(answer.split()[1])


@pytest.mark.parametrize("what", ["lone surrogate (escaped)", "lone surrogate (raw bytes)", "nested 100,000 deep",
                                  "an integer of 5,000 digits", "a float of 5,000 digits", "non-ASCII Content-Length",
                                  "a 1 MB header line", "20,000 headers of 1 KB", "500 small headers"])
def test_issue19_item5_is_a_4xx_never_a_500(llm, server, what):
    bodies = {"lone surrogate (escaped)": b'{"prompt": "\\ud800"}',
              "lone surrogate (raw bytes)": b'{"prompt": "\xed\xa0\x80"}',
              "nested 100,000 deep": b'{"prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
              "an integer of 5,000 digits": b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}",
              "a float of 5,000 digits": b'{"prompt": "x", "temperature": 0.' + b"9" * 5000 + b"}"}
    if what in bodies:
        status = _send_then_status(server, raw_post("/v1/completions", bodies[what]))
    elif what == "non-ASCII Content-Length":
        status = _send_then_status(server, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: ١٢\r\n\r\n{}"
                                   .encode())
    elif what == "a 1 MB header line":
        status = _send_then_status(server, b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 2**20 + b"\r\n\r\n")
    elif what == "20,000 headers of 1 KB":
        status = _send_then_status(server, b"GET /health HTTP/1.1\r\nHost: t\r\n" +
                                   b"".join(b"X-%d: %s\r\n" % (i, b"v" * 1000) for i in range(20_000)) + b"\r\n")
    else:
        status = _send_then_status(server, b"GET /health HTTP/1.1\r\nHost: t\r\n" +
                                   b"".join(b"X-%d: v\r\n" % i for i in range(500)) + b"\r\n")
    if what == "a float of 5,000 digits":  # a long decimal is a float like any other: served, never a 500
        assert status == 200
    else:
        assert 400 <= status < 500 and status not in (404, 405)
    assert get(server, "/health")[0] == 200
    assert post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 2})[0] == 200
    assert_all_free(server, llm)


def test_issue19_item7_the_metrics_oracle_and_what_closes_it():
    """After a victim's prompt, prefix_cache_hits moves by more for a right guess than for a wrong one. A salt
    per tenant makes both moves equal (nothing is shared); the API key keeps /metrics from strangers."""
    key = {"Authorization": "Bearer operator"}
    secret = "The vault code is 0451. " + CORPUS[1000:1600]  # a wrong guess differs within the first block
    wrong = "The vault code is 9999. " + CORPUS[1000:1600]
    with BackgroundServer(LLM(num_kv_blocks=256), api_key="operator") as private:
        assert httpx.get(private.url + "/metrics").status_code == 401
        assert httpx.post(private.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        assert httpx.post(private.url + "/tokenize", json={"prompt": "x"}).status_code == 401
        assert httpx.get(private.url + "/health").status_code == 200  # probes need no key

        def hits():
            text = httpx.get(private.url + "/metrics", headers=key).text
            return float(re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M).group(1))

        def gain(prompt, salt):
            before = hits()
            answer = httpx.post(private.url + "/v1/completions", headers=key, timeout=TIMEOUT,
                                json={"prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt else {})})
            assert answer.status_code == 200
            return hits() - before

        gain(secret, None)  # the victim, without a salt
        right, miss = gain(secret, None), gain(wrong, None)
        assert right > miss  # the oracle: the counter tells a right guess from a wrong one
        assert miss == 0 and right >= 128
        gain(secret + " again", "victim")  # the victim, with a salt of its own
        right, miss = gain(secret + " again", "attacker"), gain(wrong + " again", "attacker")
        assert right == miss == 0  # nothing of the victim's is visible to another tenant
