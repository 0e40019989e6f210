"""A bounded, seeded fuzz of the engine: random configurations and workloads (preemption, chunked prefill,
prefix caching with shared prefixes and salts, block sizes 1 to 16, requests arriving and aborted at random
steps, both speculative methods). Every request that is not aborted must produce transformers' greedy tokens;
an aborted one a prefix of them; afterwards every block is free and nothing is left in the engine."""

import functools
import math
import random

import pytest
import torch

from minivllm.attention.paged import PagedAttention
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.engine import SpecDecodeEngine
from tests.test_engine import load

WORKLOADS = 60


@pytest.fixture(scope="module")
def target(checkpoints):
    folder, hf_model = checkpoints["qwen3-gqa2-tied"]

    @functools.cache
    def reference(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                    do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    return folder, load(folder), reference


def random_workload(rng: random.Random, max_model_len: int):
    """(arrival step, prompt, max_tokens, salt, abort step or None) per request; some share prefixes, some repeat."""
    shared = [rng.randrange(3, 256) for _ in range(rng.randint(8, 60))]
    phrase = [rng.randrange(3, 256) for _ in range(rng.randint(2, 6))]
    requests = []
    for _ in range(rng.randint(2, 8)):
        kind = rng.random()
        if kind < 0.5:
            prompt = shared[:rng.randint(1, len(shared))] + [rng.randrange(3, 256) for _ in range(rng.randint(0, 10))]
        elif kind < 0.7:
            prompt = phrase * rng.randint(1, 6)
        else:
            prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 50))]
        prompt = prompt[:max_model_len - 2]
        max_tokens = rng.randint(1, min(30, max_model_len - len(prompt)))
        salt = rng.choice([None, None, "tenant-a", "tenant-b"])
        abort = rng.randint(0, 20) if rng.random() < 0.2 else None
        requests.append((rng.randint(0, 6), prompt, max_tokens, salt, abort))
    return requests


@pytest.mark.parametrize("seed", range(WORKLOADS))
def test_random_workload_equals_transformers_and_frees_every_block(target, seed):
    folder, model, reference = target
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 4, 8, 16])
    max_model_len = rng.choice([64, 96, 128])
    one_request = math.ceil(max_model_len / block_size)
    num_blocks = rng.randint(one_request, 2 * one_request)  # tight: preemption is common
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_num_seqs=rng.randint(1, 6),
                          max_num_batched_tokens=rng.choice([4, 8, 16, 32, 64, 128]), max_model_len=max_model_len,
                          enable_prefix_caching=rng.random() < 0.6, seed=seed)
    method = rng.choice([None, None, "ngram", "draft_model"])
    if method is None:
        engine = LLMEngine(model, None, config, PagedAttention)
    else:
        options = {"method": method, "num_speculative_tokens": rng.randint(1, 4)}
        options |= {"prompt_lookup_max": 3, "prompt_lookup_min": 1} if method == "ngram" else {"model": str(folder)}
        engine = SpecDecodeEngine(model, None, config, PagedAttention, options)
    workload = random_workload(rng, max_model_len)
    finished, step = {}, 0
    while step <= 10 or engine.has_unfinished_requests():
        for i, (arrival, prompt, max_tokens, salt, abort) in enumerate(workload):
            if arrival == step:
                engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                  ignore_eos=True), cache_salt=salt)
            if abort is not None and arrival + abort == step:
                engine.abort_request(str(i))
                finished[str(i)] = engine.output(str(i))
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
        assert step < 5000, "the engine is stuck"
    assert engine.kv_manager.pool.num_free == num_blocks and not engine.scheduler.running
    for i, (_, prompt, max_tokens, _, abort) in enumerate(workload):
        out, expected = finished[str(i)].outputs[0], reference(tuple(prompt), max_tokens)
        context = f"workload {seed}, request {i}: block {block_size}, {num_blocks} blocks, {method}"
        if out.finish_reason == "abort":
            assert abort is not None and out.token_ids == expected[:len(out.token_ids)], context
        else:
            assert (out.token_ids, out.finish_reason) == (expected, "length"), context
