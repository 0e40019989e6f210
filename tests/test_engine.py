"""The engine: continuous batching under pressure equals transformers; bad input; aborts; the LLM API."""

import json
import subprocess
import sys

import pytest
import torch

from minivllm.config import ModelConfig
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.loader import load_weights
from minivllm.sampling_params import SamplingParams
from tests.conftest import transformers_greedy


def load(folder):
    return load_weights(folder, ModelConfig.from_hf(json.loads((folder / "config.json").read_text())),
                        torch.float32, torch.device("cpu"))


def run(engine):
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def prompts_of(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["qwen3-gqa2-tied", "llama-biases-llama3-rope"])
def test_under_pressure_every_request_equals_transformers_alone(checkpoints, family):
    folder, hf_model = checkpoints[family]
    engine = LLMEngine(load(folder), None, EngineConfig(block_size=4, num_kv_blocks=40, max_num_seqs=5,
                                                        max_num_batched_tokens=24))
    prompts = prompts_of([5, 61, 17, 40, 1, 90, 33, 8, 24])
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=28, ignore_eos=True))
    mixed_steps = 0
    finished = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        sizes = [n for _, n in engine.last_schedule.scheduled]
        mixed_steps += 1 in sizes and any(n > 1 for n in sizes)
        finished.update({o.request_id: o for o in outputs if o.finished})
    assert engine.scheduler.num_preemptions > 0 and mixed_steps > 0
    for i, prompt in enumerate(prompts):
        assert finished[str(i)].outputs[0].token_ids == transformers_greedy(hf_model, prompt, 28), f"request {i}"
    assert engine.kv_manager.pool.num_free == 40
    assert sum(o.metrics.num_preemptions for o in finished.values()) == engine.scheduler.num_preemptions


def test_seeded_sampling_survives_preemption(checkpoints):
    folder, _ = checkpoints["qwen2-qkv-bias-gqa4"]
    model = load(folder)
    prompts = prompts_of([30, 45, 20, 50], seed=1)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=30, ignore_eos=True)

    def outputs(num_blocks):
        engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=num_blocks, max_num_batched_tokens=32))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        finished = run(engine)
        return [finished[str(i)].outputs[0].token_ids for i in range(len(prompts))], engine.scheduler.num_preemptions

    roomy, none = outputs(200)
    tight, some = outputs(30)
    assert none == 0 and some > 0 and roomy == tight


def test_latest_arrival_is_preempted_first(checkpoints):
    folder, _ = checkpoints["qwen3-gqa2-tied"]
    engine = LLMEngine(load(folder), None, EngineConfig(block_size=4, num_kv_blocks=12, max_num_batched_tokens=64))
    for i in range(3):
        engine.add_request(str(i), prompts_of([11], seed=i)[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    while not engine.last_schedule or not engine.last_schedule.preempted:
        engine.step()
    assert [r.request_id for r in engine.last_schedule.preempted] == ["2#0"]
    assert engine.scheduler.waiting[0].request_id == "2#0"  # back at the front of the queue
    run(engine)
    assert engine.kv_manager.pool.num_free == 12


def test_without_chunking_a_prompt_is_never_split(checkpoints):
    folder, _ = checkpoints["qwen3-gqa2-tied"]
    model = load(folder)
    with pytest.raises(ValueError, match="max_num_batched_tokens = 64"):
        LLMEngine(model, None, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64, enable_chunked_prefill=False))
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=128,
                                                 max_num_batched_tokens=128, enable_chunked_prefill=False))
    prompts = prompts_of([100, 90, 20])
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
        for request, n in engine.last_schedule.scheduled:
            assert n == 1 or n == request.num_computed_tokens == len(request.prompt_token_ids)


def test_bad_input_is_refused_at_submission_and_others_keep_going(checkpoints):
    folder, _ = checkpoints["qwen3-gqa2-tied"]
    engine = LLMEngine(load(folder), None, EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=100))
    engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()
    for request_id, ids, params, message in [
        ("a", [], SamplingParams(), "prompt is empty"),
        ("b", [5] * 100, SamplingParams(), "prompt of 100 tokens: must be shorter than max_model_len = 100"),
        ("c", [5, 256, -1], SamplingParams(), r"prompt_token_ids: \[256, -1\] outside the vocabulary \[0, 256\)"),
        ("good", [5], SamplingParams(), "request_id 'good' is already in use"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(request_id, ids, params)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request("d", [5], {"temperature": 0})
    assert set(engine.output_processor.parents) == {"good"}
    finished = run(engine)
    assert len(finished["good"].outputs[0].token_ids) == 10
    assert engine.kv_manager.pool.num_free == 64


def test_engine_config_is_checked(checkpoints):
    folder, _ = checkpoints["qwen3-gqa2-tied"]
    model = load(folder)
    with pytest.raises(ValueError, match="max_model_len = 1000"):
        LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=1000))
    with pytest.raises(ValueError, match="max_num_seqs = 0"):
        LLMEngine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=0))
    assert LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=10)).config.max_model_len == 40


def test_abort_frees_blocks_at_once(checkpoints):
    folder, _ = checkpoints["qwen3-gqa2-tied"]
    engine = LLMEngine(load(folder), None, EngineConfig(block_size=4, num_kv_blocks=64))
    engine.add_request("long", prompts_of([30])[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.add_request("queued", prompts_of([9])[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.step()
    held = 64 - engine.kv_manager.pool.num_free
    engine.abort_request("long")
    assert 64 - engine.kv_manager.pool.num_free < held
    finished = run(engine)
    assert engine.output("long").outputs[0].finish_reason == "abort"
    assert finished["queued"].outputs[0].finish_reason == "length"
    assert engine.kv_manager.pool.num_free == 64


def test_stream_yields_growing_partial_outputs(checkpoints):
    folder, _ = checkpoints["qwen3-gqa2-tied"]
    engine = LLMEngine(load(folder), None, EngineConfig(block_size=4, num_kv_blocks=64))
    engine.add_request("x", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    lengths = [len(o.outputs[0].token_ids) for o in engine.stream()]
    assert lengths == [1, 2, 3, 4, 5, 6]


# ------------------------------------------------------------------ the LLM API on the embedded model


@pytest.fixture(scope="module")
def llm():
    from minivllm import LLM

    return LLM(num_kv_blocks=256, enable_prefix_caching=False)


def test_prompt_forms_and_output_order(llm):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = llm.generate(["ROMEO:", {"prompt_token_ids": tokenizer("JULIET:").input_ids}, {"prompt": "KING:"}],
                           params, use_tqdm=False)
    assert [o.prompt for o in outputs] == ["ROMEO:", None, "KING:"]
    assert outputs[1].prompt_token_ids == tokenizer("JULIET:").input_ids
    alone = llm.generate("JULIET:", params, use_tqdm=False)[0]
    assert outputs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    for output in outputs:
        completion = output.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert output.finished and output.metrics.first_token_time >= output.metrics.arrival_time
        assert output.num_cached_tokens == 0


def test_bad_prompt_in_a_batch_stops_everything_before_work(llm):
    free = llm.stats()["kv_blocks_free"]
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt is empty"):
        llm.generate(["ROMEO:", "", "JULIET:"], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\]: expected a string"):
        llm.generate([42], use_tqdm=False)
    assert llm.stats()["kv_blocks_free"] == free and not llm.engine.has_unfinished_requests()


def test_parallel_sampling_and_stop_strings(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, stop="\n")
    first = llm.generate("ROMEO:\n", params, use_tqdm=False)[0]
    second = llm.generate("ROMEO:\n", params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1 and [c.index for c in first.outputs] == [0, 1, 2]
    for completion in first.outputs:
        assert "\n" not in completion.text
    stats = llm.stats()
    assert set(stats) >= {"kv_blocks_total", "kv_blocks_free", "num_preemptions", "prefix_cache_queries",
                          "prefix_cache_hits"}
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_command_line_generate():
    result = subprocess.run([sys.executable, "-m", "minivllm", "generate", "ROMEO:", "--max-tokens", "5"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:") and "finish_reason=length" in result.stderr
    bad = subprocess.run([sys.executable, "-m", "minivllm", "generate", "ROMEO:", "--max-tokens", "0"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "max_tokens" in bad.stderr


def test_a_checkpoint_without_tokenizer_serves_token_ids(checkpoints):
    from minivllm import LLM

    folder, hf_model = checkpoints["qwen2-qkv-bias-gqa4"]
    llm = LLM(str(folder), num_kv_blocks=64, block_size=8)
    assert llm.get_tokenizer() is None
    prompt = prompts_of([12], seed=9)[0]
    [out] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                     pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == expected and out.outputs[0].text == ""
    with pytest.raises(ValueError, match=r"prompts\[0\]: this checkpoint has no tokenizer"):
        llm.generate("ROMEO:", use_tqdm=False)


def test_stop_token_ids_and_running_to_max_model_len(checkpoints):
    folder, hf_model = checkpoints["qwen3-gqa2-tied"]
    engine = LLMEngine(load(folder), None, EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=40))
    prompt = prompts_of([10], seed=3)[0]
    with torch.no_grad():
        greedy = hf_model.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
    engine.add_request("open-ended", prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    engine.add_request("stopped", prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True,
                                                         stop_token_ids=[greedy[5]]))
    finished = run(engine)
    assert finished["open-ended"].outputs[0].token_ids == greedy  # 40 - 10 tokens: the context is full
    assert finished["open-ended"].outputs[0].finish_reason == "length"
    stopped = finished["stopped"].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == greedy[:greedy.index(greedy[5]) + 1]


# ------------------------------------------------------------------ vLLM's sampling knobs, seeds, all-or-nothing


def test_penalties_and_min_tokens_equal_transformers_generate(checkpoints):
    folder, hf_model = checkpoints["qwen3-gqa2-tied"]
    engine = LLMEngine(load(folder), None, EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16))
    prompts = prompts_of([7, 19])
    with torch.no_grad():  # the stop tokens: what greedy would say first, so that min_tokens must hold them off
        first = [int(hf_model(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    cases = {"repetition": (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.8),
                            dict(repetition_penalty=1.8, min_new_tokens=20, max_new_tokens=20)),
             "min_tokens": (SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=first),
                            dict(min_new_tokens=6, max_new_tokens=12, eos_token_id=first))}
    for name, (params, hf_kwargs) in cases.items():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{name}{i}", prompt, params)
    finished = run(engine)
    for name, (params, hf_kwargs) in cases.items():
        for i, prompt in enumerate(prompts):
            with torch.no_grad():
                out = hf_model.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **hf_kwargs)
            expected = out[0, len(prompt):].tolist()
            assert finished[f"{name}{i}"].outputs[0].token_ids == expected, f"{name}, prompt {i}"
    for i in range(2):  # without min_tokens each would stop at its first token
        assert len(finished[f"min_tokens{i}"].outputs[0].token_ids) >= 6
    assert engine.kv_manager.pool.num_free == 64


def test_the_largest_seed_works_for_every_sample(checkpoints):
    folder, _ = checkpoints["qwen3-gqa2-tied"]
    engine = LLMEngine(load(folder), None, EngineConfig(num_kv_blocks=64))
    params = SamplingParams(n=3, temperature=1.0, seed=2**63 - 1, max_tokens=8, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [5, 6, 7], params)
    finished = run(engine)
    seeds = [c.params.seed for c in engine.output_processor.parents["a"]]
    assert seeds == [2**63 - 1, 0, 1]  # seed + index, modulo 2**63: all valid, all different
    assert [c.token_ids for c in finished["a"].outputs] == [c.token_ids for c in finished["b"].outputs]


def test_generate_takes_back_every_request_when_an_add_fails(llm, monkeypatch):
    original, calls = llm.engine.add_request, []

    def fails_on_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("refused")
        return original(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", fails_on_the_third)
    with pytest.raises(RuntimeError, match="refused"):
        llm.generate(["ROMEO:", "JULIET:", "KING:"], SamplingParams(max_tokens=4), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests() and not llm.engine.output_processor.parents
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    [output] = llm.generate(["HAMLET:"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert output.request_id in {str(i) for i in range(100)} and len(output.outputs[0].token_ids) == 4
