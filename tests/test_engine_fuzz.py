"""A bounded, seeded fuzz of the engine: random configurations and workloads (preemption, chunked prefill,
prefix caching with shared prefixes and salts, block sizes 1 to 16, requests arriving and aborted at random
steps, both speculative methods). Every request that is not aborted must produce transformers' greedy tokens;
an aborted one a prefix of them; afterwards every block is free and nothing is left in the engine.

With chapter 13's KV tier behind the pool (a CPU tier small enough to evict, sometimes a file tier behind it,
with and without speculation), the workloads also bring earlier conversations back after the pool has lost
them; the same holds, the tiers never exceed their bytes, and across the fuzz blocks do come from the tiers."""

import functools
import math
import random
from dataclasses import replace

import pytest
import torch

from minivllm.attention.paged import PagedAttention
from minivllm.config import EngineConfig, kv_bytes_per_token
from minivllm.core.kv_events import BlockRemoved
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.engine import SpecDecodeEngine
from tests.test_engine import load

WORKLOADS = 60
TIER_WORKLOADS = 24
FILE_OVERHEAD = 512  # a block file's header and magic, at most, beside its keys and values


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


def flood(rng: random.Random, max_model_len: int, num_tokens: int):
    """Unsalted prompts of random tokens, at least `num_tokens` of them, arriving behind the others: they push
    earlier prompts' blocks out of the pool."""
    requests = []
    while sum(len(prompt) for _, prompt, *_ in requests) < num_tokens:
        prompt = [rng.randrange(3, 256) for _ in range(rng.randint(max_model_len // 2, max_model_len - 2))]
        requests.append((rng.randint(6, 12), prompt, rng.randint(1, 2), None, None))
    return requests


def returning_workload(rng: random.Random, max_model_len: int, earlier, reference):
    """Conversations of `earlier` that come back: a prompt followed by part of its answer and a new turn,
    mostly under the same salt, among new requests, some of them aborted."""
    requests = random_workload(rng, max_model_len)[:rng.randint(0, 3)]
    for _ in range(rng.randint(2, 6)):
        _, prompt, max_tokens, salt, _ = rng.choice(earlier)
        answer = reference(tuple(prompt), max_tokens)[:rng.randint(0, max_tokens)]
        turn = [rng.randrange(3, 256) for _ in range(rng.randint(0, 8))]
        prompt = (prompt + answer + turn)[:max_model_len - 2]
        salt = salt if rng.random() < 0.8 else rng.choice([None, "tenant-a", "tenant-b"])
        max_tokens = rng.randint(1, min(20, max_model_len - len(prompt)))
        requests.append((rng.randint(0, 6), prompt, max_tokens, salt, None))
    return requests


def random_config(rng: random.Random, seed: int):
    block_size = rng.choice([1, 2, 3, 4, 8, 16])
    max_model_len = rng.choice([64, 96, 128])
    one_request = math.ceil(max_model_len / block_size)
    num_blocks = rng.randint(one_request, 2 * one_request)  # tight: preemption is common
    return EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_num_seqs=rng.randint(1, 6),
                        max_num_batched_tokens=rng.choice([4, 8, 16, 32, 64, 128]), max_model_len=max_model_len,
                        enable_prefix_caching=rng.random() < 0.6, seed=seed)


def speculative_config(rng: random.Random, method: str | None, folder) -> dict | None:
    if method is None:
        return None
    options = {"method": method, "num_speculative_tokens": rng.randint(1, 4)}
    return options | ({"prompt_lookup_max": 3, "prompt_lookup_min": 1} if method == "ngram" else {"model": str(folder)})


def run_workload(engine, workload, each_step=lambda: None, tag: str = "") -> dict:
    """Requests added and aborted at their steps until all are done; the finished outputs by their index
    (request ids: `tag` and the index)."""
    finished, step, last = {}, 0, max(10, max(arrival for arrival, *_ in workload))
    while step <= last or engine.has_unfinished_requests():
        for i, (arrival, prompt, max_tokens, salt, abort) in enumerate(workload):
            if arrival == step:
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                engine.add_request(f"{tag}{i}", prompt, params, cache_salt=salt)
            if abort is not None and arrival + abort == step:
                engine.abort_request(f"{tag}{i}")
                finished[f"{tag}{i}"] = engine.output(f"{tag}{i}")
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        each_step()
        step += 1
        assert step < 5000, "the engine is stuck"
    return {str(i): finished[f"{tag}{i}"] for i in range(len(workload))}


def assert_outputs_and_blocks(engine, workload, finished, reference, context: str) -> None:
    """transformers' greedy tokens (an aborted request: a prefix of them); every block free, nothing running."""
    assert engine.kv_manager.pool.num_free == engine.config.num_kv_blocks and not engine.scheduler.running, context
    for i, (_, prompt, max_tokens, _, abort) in enumerate(workload):
        out, expected = finished[str(i)].outputs[0], reference(tuple(prompt), max_tokens)
        if out.finish_reason == "abort":
            assert abort is not None and out.token_ids == expected[:len(out.token_ids)], f"{context}, request {i}"
        else:
            assert (out.token_ids, out.finish_reason) == (expected, "length"), f"{context}, request {i}"


@pytest.mark.parametrize("seed", range(WORKLOADS))
def test_random_workload_equals_transformers_and_frees_every_block(target, seed):
    folder, model, reference = target
    rng = random.Random(seed)
    config = random_config(rng, seed)
    method = rng.choice([None, None, "ngram", "draft_model"])
    if method is None:
        engine = LLMEngine(model, None, config, PagedAttention)
    else:
        engine = SpecDecodeEngine(model, None, config, PagedAttention, speculative_config(rng, method, folder))
    workload = random_workload(rng, config.max_model_len)
    finished = run_workload(engine, workload)
    assert_outputs_and_blocks(engine, workload, finished, reference,
                              f"workload {seed}: block {config.block_size}, {config.num_kv_blocks} blocks, {method}")


def tiered_engine(rng: random.Random, model, config: EngineConfig, method, folder, root):
    """An offloading engine (chapter 13) over `config`, with speculation or without: a CPU tier of one to
    four requests' blocks, sometimes a file tier behind it, sometimes storing answers' blocks too."""
    one_request = math.ceil(config.max_model_len / config.block_size)
    c = model.config
    block_bytes = config.block_size * kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, 4)
    cpu_blocks = rng.randint(one_request, 4 * one_request)
    config = replace(config, enable_prefix_caching=True, enable_kv_cache_events=True,
                     kv_offloading_size=cpu_blocks * block_bytes / 2**30)
    file_blocks = rng.randint(2 * one_request, 6 * one_request) if rng.random() < 0.4 else 0
    files = {"root_dir": root, "size": file_blocks * (block_bytes + FILE_OVERHEAD) / 2**30} if file_blocks else None
    config = replace(config, kv_offloading_file_tier=files, model_name="qwen3-gqa2-tied",
                     kv_offload_prompt_only=rng.random() < 0.6)
    spec = speculative_config(rng, method, folder)
    if spec is None:
        engine = LLMEngine(model, None, config, PagedAttention)
    else:
        engine = SpecDecodeEngine(model, None, config, PagedAttention, speculative_config=spec)
    assert engine.kv_manager.store.cpu.capacity_blocks == cpu_blocks
    return engine, cpu_blocks * block_bytes


def test_random_workloads_with_a_kv_tier_equal_transformers_and_load_from_it(target, tmp_path):
    """The fuzz with chapter 13's tiers, in two rounds per engine: a random workload with a flood of new
    prompts behind it that overflows the pool, then conversations of the first round coming back. Per round,
    the checks above, the tiers within their bytes after every step (and the files on disk what the file tier
    counts), the manager's transfer queues empty; across the fuzz, blocks loaded from the CPU tier and from
    files, with and without speculation, and CPU tier evictions."""
    folder, model, reference = target
    loads, from_files, evictions, loading_workloads = {None: 0, "ngram": 0, "draft_model": 0}, 0, 0, 0
    for seed in range(1000, 1000 + TIER_WORKLOADS):
        rng = random.Random(seed)
        config = random_config(rng, seed)
        method = rng.choice([None, "ngram", "draft_model"])
        engine, cpu_bytes = tiered_engine(rng, model, config, method, folder, tmp_path / str(seed))
        first = random_workload(rng, config.max_model_len)
        rounds = [first + flood(rng, config.max_model_len, config.num_kv_blocks * config.block_size),
                  returning_workload(rng, config.max_model_len, first, reference)]
        events, tiers, manager = [], engine.kv_manager.store.tiers, engine.kv_manager

        def within_bounds():
            assert engine.kv_manager.store.cpu.used_bytes <= cpu_bytes and all(t.used_bytes <= t.capacity_bytes for t in tiers[1:])
            events.extend(engine.take_events())

        for round_, workload in enumerate(rounds):
            finished = run_workload(engine, workload, within_bounds, tag=f"{round_}-")
            context = (f"tier workload {seed}, round {round_}: block {config.block_size}, {config.num_kv_blocks} "
                       f"blocks, {method}, tiers {[t.medium for t in tiers]}, prompts only {manager.offload_prompt_only}")
            assert_outputs_and_blocks(engine, workload, finished, reference, context)
            assert not (manager.block_tables or manager.tier_hits or manager.num_offered or manager.loads
                        or manager.stores), context
            for file in tiers[1:]:
                assert sum(p.stat().st_size for p in file.folder.glob("*.kv")) == file.used_bytes, context
            for i, (_, prompt, *_) in enumerate(workload):
                cached = finished[str(i)].num_cached_tokens
                assert cached is None or (cached % config.block_size == 0 and cached < len(prompt)), context
        loads[method] += engine.model_runner.connector.blocks_loaded
        loading_workloads += engine.model_runner.connector.blocks_loaded > 0
        from_files += engine.kv_manager.store.hits.get("STORAGE", 0)
        evictions += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU")
    print(f"{loading_workloads} of {TIER_WORKLOADS} workloads loaded blocks from the tiers; blocks loaded, by "
          f"speculative method: {loads}; found in files {from_files}; CPU tier evictions {evictions}")
    assert loading_workloads >= TIER_WORKLOADS // 3 and all(loads.values()), (loading_workloads, loads)
    assert from_files > 0 and evictions > 0, (from_files, evictions)
