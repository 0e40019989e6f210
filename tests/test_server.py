"""The OpenAI-compatible server (chapter 10): the same tokens as LLM.generate, streamed or not, alone or under
load; the official client understands it; bad input is a 400 naming the field and the server keeps serving;
a client that hangs up gets its request aborted and its blocks freed."""

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from minivllm import LLM, SamplingParams
from minivllm.tools.loadgen import RequestTiming, percentile, run_load, summarize
from minivllm.entrypoints.openai_server import BackgroundServer, sendable_text
from minivllm.book.texts import CORPUS


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(llm) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server, path, payload, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(payload).encode()
    request = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


PROMPTS = [CORPUS[:120], "ROMEO:", CORPUS[900:1000], "KING RICHARD II:\nWhat"]
CASES = [dict(temperature=0, max_tokens=40),
         dict(temperature=0.9, top_p=0.9, seed=7, max_tokens=30),
         dict(temperature=0, max_tokens=60, stop=["\n\n", "lord"]),
         dict(temperature=1.0, top_k=20, seed=3, max_tokens=25, stop=["KING"])]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_completions_equal_llm_generate_streamed_or_not(llm, client, case):
    options = CASES[case]
    openai_fields = {k: v for k, v in options.items() if k != "top_k"}
    extra = {"extra_body": {"top_k": options["top_k"]}} if "top_k" in options else {}  # as vLLM's docs pass it
    for prompt in PROMPTS:
        [expected] = llm.generate(prompt, SamplingParams(**options), use_tqdm=False)
        expected = expected.outputs[0]
        whole = client.completions.create(model="minivllm", prompt=prompt, **openai_fields, **extra)
        assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == expected.finish_reason
        assert whole.usage.completion_tokens == len(expected.token_ids)
        chunks = list(client.completions.create(model="minivllm", prompt=prompt, stream=True, **openai_fields, **extra))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text  # stop strings never leak
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason


def test_stream_with_several_choices_and_usage(llm, client):
    options = dict(temperature=1.0, seed=11, max_tokens=20, n=3)
    [expected] = llm.generate("ROMEO:", SamplingParams(**options), use_tqdm=False)
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


def test_chat_completions(llm, client):
    messages = [{"role": "system", "content": "Answer in verse."}, {"role": "user", "content": "Who art thou?"}]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer(text, add_special_tokens=False).input_ids
    [expected] = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    reply = client.chat.completions.create(model="minivllm", messages=messages, temperature=0, max_tokens=24)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == llm.tokenizer.decode(expected.outputs[0].token_ids,
                                                                     skip_special_tokens=True)
    chunks = list(client.chat.completions.create(model="minivllm", messages=messages, temperature=0, max_tokens=24,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content


def test_concurrent_streams_equal_each_request_alone(llm, server):
    prompts = [CORPUS[i * 150:i * 150 + 100 + 10 * i] for i in range(12)]
    expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                                                 ignore_eos=True), use_tqdm=False)]
    timings, seconds = asyncio.run(run_load(server.host, server.port, prompts, float("inf"), 24))
    assert [t.text for t in timings] == expected
    assert all(t.num_tokens == 24 and len(t.arrivals) >= 1 for t in timings)
    summary = summarize(timings, seconds)
    assert summary["ttft_p50_ms"] <= summary["ttft_p99_ms"] and summary["output_tokens_per_s"] > 0


@pytest.mark.parametrize("payload, param", [
    ({"prompt": "ROMEO:", "temperature": -1}, "temperature"),
    ({"prompt": "ROMEO:", "temperature": "hot"}, "temperature"),
    ({"prompt": "ROMEO:", "top_p": 0}, "top_p"),
    ({"prompt": "ROMEO:", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "ROMEO:", "max_tokens": True}, "max_tokens"),
    ({"prompt": "ROMEO:", "n": "2"}, "n"),
    ({"prompt": "ROMEO:", "stop": [""]}, "stop"),
    ({"prompt": "ROMEO:", "logprobs": 2}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 99999]}, "prompt"),
    ({"prompt": "word " * 3000}, "prompt"),
    ({"prompt": 7}, "prompt"),
    ({"prompt": "ROMEO:", "stop": 5}, "stop"),
    ({"prompt": "ROMEO:", "stop_token_ids": 3}, "stop_token_ids"),
    ({"prompt": "ROMEO:", "seed": 2**64}, "seed"),
    ({"prompt": "ROMEO:", "stream": True, "stream_options": True}, "stream_options"),
])
def test_bad_completion_requests_are_400_naming_the_field(server, payload, param):
    status, body = post(server, "/v1/completions", payload)
    assert status == 400 and body["error"]["param"] == param, body
    assert body["error"]["message"]
    status, body = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3  # the server keeps serving


def raw_status(server, request: bytes) -> int:
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(request)
        return int(sock.recv(64).split()[1])


def test_protocol_errors(server, client):
    assert post(server, "/v1/nothing", {})[0] == 404
    assert post(server, "/v1/completions", None, raw=b"{not json")[0] == 400
    assert post(server, "/v1/completions", None, raw=b'{"prompt": "\xff\xfe"}')[0] == 400
    assert raw_status(server, b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n") == 400
    assert raw_status(server, b"POST /v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n") == 400
    assert post(server, "/v1/chat/completions", {"messages": "hello"})[1]["error"]["param"] == "messages"
    assert get(server, "/v1/completions")[0] == 405
    with pytest.raises(NotFoundError):
        client.completions.create(model="gpt-4", prompt="ROMEO:")
    with pytest.raises(BadRequestError, match="temperature"):
        client.completions.create(model="minivllm", prompt="ROMEO:", temperature=-2)


def get(server, path):
    try:
        with urllib.request.urlopen(server.url + path, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_a_client_that_hangs_up_is_aborted_and_its_blocks_freed(llm, server):
    free = llm.stats()["kv_blocks_free"]
    body = json.dumps({"prompt": CORPUS[:300], "max_tokens": 1500, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        sock.recv(4096)
    deadline = time.time() + 30
    while (llm.engine.has_unfinished_requests() or llm.stats()["kv_blocks_free"] != free) and time.time() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished_requests() and llm.stats()["kv_blocks_free"] == free
    assert not llm.engine.output_processor.parents  # released, not leaked


def test_metrics_and_health(server):
    before = _metrics(server)
    for _ in range(3):
        assert post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4})[0] == 200
    after = _metrics(server)
    assert after["minivllm:request_success_total"] == before["minivllm:request_success_total"] + 3
    assert after["minivllm:time_to_first_token_seconds_count"] == before["minivllm:time_to_first_token_seconds_count"] + 3
    assert after["minivllm:generation_tokens_total"] == before["minivllm:generation_tokens_total"] + 12
    buckets = [v for k, v in after.items() if k.startswith("minivllm:time_to_first_token_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == after["minivllm:time_to_first_token_seconds_count"]
    assert get(server, "/health")[0] == 200
    assert json.loads(get(server, "/v1/models")[1])["data"][0]["id"] == "minivllm"


def _metrics(server) -> dict:
    status, body = get(server, "/metrics")
    assert status == 200
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in body.decode().splitlines() if line and not line.startswith("#")}


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
    process = subprocess.Popen([sys.executable, "-m", "minivllm", "serve", "--port", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert "serving 'minivllm' on http://127.0.0.1:" in line, process.stderr.read() if not line else line
        url = line.split(" on ")[1].strip()
        reply = OpenAI(base_url=url, api_key="unused").completions.create(model="minivllm", prompt="ROMEO:",
                                                                           max_tokens=5)
        assert reply.usage.completion_tokens == 5
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
    assert not llm.engine.has_unfinished_requests() and llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


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
        client = OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0)
        for prompt in PROMPTS:
            [expected] = plain.generate(prompt, SamplingParams(**options), use_tqdm=False)
            chunks = list(client.completions.create(model="minivllm", prompt=prompt, stream=True, **options))
            assert "".join(c.choices[0].text for c in chunks) == expected.outputs[0].text
        assert spec_llm.stats()["spec_decode_num_accepted_tokens"] > 0
        body = json.dumps({"prompt": CORPUS[:300], "max_tokens": 1000, "ignore_eos": True, "stream": True}).encode()
        with socket.create_connection((spec_server.host, spec_server.port)) as sock:  # hang up mid-stream
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            sock.recv(4096)
        deadline = time.time() + 30
        while spec_llm.engine.has_unfinished_requests() and time.time() < deadline:
            time.sleep(0.05)
    engine = spec_llm.engine
    assert not engine.has_unfinished_requests() and engine.kv_manager.pool.num_free == engine.kv_cache.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.output_processor.parents


def test_stopping_the_server_aborts_what_runs():
    local = LLM(num_kv_blocks=128)
    server = BackgroundServer(local).start()
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 1500, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        sock.recv(4096)
        server.stop()
    assert not local.engine.has_unfinished_requests() and not local.engine.output_processor.parents
    assert local.stats()["kv_blocks_free"] == 128
