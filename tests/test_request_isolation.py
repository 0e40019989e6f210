"""Issue 41 item 1: a request is checked against the model before it is admitted, and a failure while a step is
computed fails only the requests it belongs to. The reproducer: `min_tokens: 1` with `stop_token_ids: [99999]`
(past the embedded model's 2,048-token vocabulary) raised inside the sampler, failed every request of the step
with a 500 naming the others' ids, and reset the prefix cache. Offline (LLM.generate, LLMEngine) and over HTTP
(loopback only)."""

import json
import threading

import httpx
import pytest

from minivllm import LLM, SamplingParams
from minivllm.book.texts import CORPUS
from minivllm.engine import checks
from minivllm.engine.llm_engine import EngineStepError
from minivllm.entrypoints.openai.launcher import BackgroundServer

TIMEOUT = 120
BAD = {"min_tokens": 1, "stop_token_ids": [99999]}


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256, max_num_seqs=8, max_model_len=256)


def all_blocks_back(llm) -> bool:
    stats = llm.stats()
    return stats["kv_blocks_free"] == stats["kv_blocks_total"] and not llm.engine.output_processor.parents


def test_token_ids_and_lengths_are_checked_against_the_model_before_any_work(llm):
    """Each field past this model's vocabulary or limits is a ValueError naming it, raised by LLM.generate
    before any request is added: no step runs (the prefix cache was never queried), every block is free."""
    vocab, prompt = llm.engine.model.config.vocab_size, llm.tokenizer("ROMEO:").input_ids
    room = llm.engine.config.max_model_len - len(prompt)
    queries = llm.stats()["prefix_cache_queries"]
    cases = [(SamplingParams(**BAD), "stop_token_ids", "99999"),
             (SamplingParams(stop_token_ids=[5, vocab]), "stop_token_ids", str(vocab)),
             (SamplingParams(min_tokens=room + 1, max_tokens=None), "min_tokens", str(room))]
    for params, field, value in cases:
        with pytest.raises(ValueError) as refused:
            llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt}],
                         [SamplingParams(max_tokens=2), params], use_tqdm=False)
        message = str(refused.value)
        assert message.startswith("prompts[1]: ") and f"SamplingParams.{field}" in message and value in message
    with pytest.raises(ValueError, match=r"prompt_token_ids: \[%d\] outside the vocabulary" % vocab):
        llm.generate({"prompt_token_ids": prompt + [vocab]}, use_tqdm=False)
    assert llm.stats()["prefix_cache_queries"] == queries and all_blocks_back(llm)
    # the largest stop id and min_tokens the model allows are served
    (output,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=3, min_tokens=3, stop_token_ids=[vocab - 1]), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3 and all_blocks_back(llm)


def test_a_request_that_breaks_the_sampler_fails_alone_and_the_cache_stays(llm):
    """A request that got past the checks (its stop ids changed after admission, as a checking bug would
    let through) breaks the batched sampler in a step it shares with a greedy request. Only it fails (both of
    its n = 2 samples), with an error that names no other request; the greedy request keeps that step's token
    and ends with the tokens it gets alone; the prefix cache keeps every block (a rerun hits them)."""
    engine, prompt = llm.engine, llm.tokenizer(CORPUS[:120]).input_ids
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (alone,) = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)
    engine.kv_manager.reset_prefix_cache()
    engine.add_request("good", prompt, greedy)
    engine.step()  # good's prefill; then bad's prefill shares a step with good's decode
    engine.add_request("bad", llm.tokenizer("JULIET:").input_ids, SamplingParams(n=2, seed=3, max_tokens=8, **{
        "min_tokens": 2}))
    for child in engine.output_processor.parents["bad"]:
        child.params.stop_token_ids.append(99999)
    cached = len(engine.kv_manager.pool.cached)
    with pytest.raises(EngineStepError) as failed:
        engine.step()
    error = failed.value
    assert list(error.errors) == ["bad"] and isinstance(error.errors["bad"], IndexError)
    assert [o.request_id for o in error.outputs] == ["good"] and len(error.outputs[0].outputs[0].token_ids) == 2
    assert "good" not in str(error) and "good" not in str(error.errors["bad"])
    assert [c.finish_reason for c in engine.output("bad").outputs] == ["abort", "abort"]
    assert len(engine.kv_manager.pool.cached) >= cached > 0  # nothing forgotten
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.output("good").outputs[0].token_ids == alone.outputs[0].token_ids
    engine.release("good"), engine.release("bad")
    hits = llm.stats()["prefix_cache_hits"]
    (again,) = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)
    assert again.num_cached_tokens > 0 and llm.stats()["prefix_cache_hits"] > hits
    assert all_blocks_back(llm)


def test_a_forward_pass_failure_fails_its_batch_with_one_error_per_request(llm, monkeypatch):
    """A forward pass that raises fails every request it carried (no telling which one broke it), each
    with its own error, which names no other; the engine serves the next request."""
    engine, prompt = llm.engine, llm.tokenizer("ROMEO:").input_ids
    for name in ("a", "b"):
        engine.add_request(name, prompt, SamplingParams(max_tokens=4))
    monkeypatch.setattr(engine.model_runner, "forward", lambda work: (_ for _ in ()).throw(MemoryError("no room")))
    with pytest.raises(EngineStepError) as failed:
        engine.step()
    monkeypatch.undo()
    assert sorted(failed.value.errors) == ["a", "b"] and failed.value.outputs == []
    assert all(str(e) == "no room" for e in failed.value.errors.values()) and "'a'" not in str(failed.value)
    engine.release("a"), engine.release("b")
    assert all_blocks_back(llm)
    assert len(llm.generate("ROMEO:", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 3


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(llm) as running:
        yield running


def complete(server, payload):
    answer = httpx.post(server.url + "/v1/completions", json=payload, timeout=TIMEOUT)
    return answer.status_code, answer.json()


def test_over_http_the_reproducer_is_a_400_naming_the_field_and_others_are_served(llm, server):
    """The reproducer, sent while two greedy requests run: a 400 naming stop_token_ids; so are a prompt token
    and a logit_bias key past the vocabulary. The running requests answer 200 with the tokens they get alone."""
    prompt = llm.tokenizer(CORPUS[:80]).input_ids
    greedy = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    results = []
    runners = [threading.Thread(target=lambda: results.append(complete(server, greedy))) for _ in range(2)]
    for runner in runners:
        runner.start()
    status, body = complete(server, {"prompt": "ROMEO:", "max_tokens": 4, **BAD})
    assert status == 400 and body["error"]["param"] == "stop_token_ids" and "99999" in body["error"]["message"]
    status, body = complete(server, {"prompt": [5, 99999], "max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "prompt" and "99999" in body["error"]["message"]
    status, body = complete(server, {"prompt": "ROMEO:", "max_tokens": 4, "logit_bias": {"99999": 5}})
    assert status == 400 and body["error"]["param"] == "logit_bias"
    for runner in runners:
        runner.join(TIMEOUT)
    (alone,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24,
                                                                           ignore_eos=True), use_tqdm=False)
    assert [(s, b["choices"][0]["text"]) for s, b in results] == [(200, alone.outputs[0].text)] * 2


def test_over_http_a_sampler_failure_is_one_500_that_names_no_other_request(llm, server, monkeypatch):
    """With the model check switched off (as a checking bug would), the reproducer reaches the sampler in a
    step shared with a streaming greedy request. The bad request alone gets a 500 whose message names no
    request id; the stream ends with every token and no error; the prefix cache was not reset."""
    monkeypatch.setattr(checks, "check_params_against_model", lambda *args: None)
    shared_steps = []
    sample_each = llm.engine.model_runner.sample_each
    monkeypatch.setattr(llm.engine.model_runner, "sample_each",
                        lambda scheduled, *rest: shared_steps.append(len(scheduled)) or sample_each(scheduled, *rest))
    prompt = llm.tokenizer(CORPUS[200:300]).input_ids
    greedy = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    lines, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", json=greedy, timeout=TIMEOUT) as answer:
            for line in filter(None, answer.iter_lines()):
                lines.append(line)
                started.set()

    runner = threading.Thread(target=stream)
    runner.start()
    assert started.wait(TIMEOUT)
    cached = len(llm.engine.kv_manager.pool.cached)
    status, body = complete(server, {"prompt": "JULIET:", "max_tokens": 4, "temperature": 0.7, **BAD})
    runner.join(TIMEOUT)
    assert status == 500 and "IndexError" in body["error"]["message"] and "this request" in body["error"]["message"]
    assert "cmpl-" not in body["error"]["message"] and shared_steps and max(shared_steps) >= 2
    events = [line for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    (alone,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40,
                                                                           ignore_eos=True), use_tqdm=False)

    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events if json.loads(e[6:])["choices"])
    assert text == alone.outputs[0].text
    assert len(llm.engine.kv_manager.pool.cached) >= cached > 0


def test_through_the_data_parallel_front_end_the_reproducer_is_a_400_and_others_are_served():
    """The reproducer through the data-parallel front end (one replica process behind it): a 400 naming
    stop_token_ids, while a greedy request sent at the same time is answered in full."""
    from minivllm.entrypoints.openai.dp_server import DataParallelServer

    with DataParallelServer(1, "prefix-aware", llm_kwargs={"num_kv_blocks": 128, "max_num_seqs": 4},
                            threads=1) as cluster:
        results = []
        greedy = {"prompt": CORPUS[:200], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        runner = threading.Thread(target=lambda: results.append(complete(cluster, greedy)))
        runner.start()
        status, body = complete(cluster, {"prompt": "ROMEO:", "max_tokens": 4, **BAD})
        runner.join(TIMEOUT)
        assert status == 400 and body["error"]["param"] == "stop_token_ids" and "99999" in body["error"]["message"]
        assert results[0][0] == 200 and results[0][1]["usage"]["completion_tokens"] == 24
        assert httpx.get(cluster.url + "/health", timeout=TIMEOUT).status_code == 200
