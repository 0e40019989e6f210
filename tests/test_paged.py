"""PagedAttention: the block pool's invariants, copy-on-write, and equivalence with transformers."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.attention.base import NoCacheAttention
from minivllm.core.block_pool import BlockPool, NoFreeBlocksError
from minivllm.config import ModelConfig
from minivllm.book.recompute import generate_recompute
from minivllm.model.loader import load_weights
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.book.static_paged import CopyOnWriteKVCacheManager, StaticPagedGenerator
from minivllm.sampling_params import SamplingParams
from tests.conftest import FAMILIES

# ------------------------------------------------------------------ the block pool, property-based

operations = st.lists(st.one_of(
    st.tuples(st.just("allocate"), st.integers(0, 6)),
    st.tuples(st.just("share"), st.integers(0, 50)),
    st.tuples(st.just("free"), st.integers(0, 50)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=operations)
def test_block_pool_never_hands_out_a_block_twice_nor_loses_one(num_blocks, ops):
    pool = BlockPool(num_blocks)
    owners: list[int] = []  # one entry per reference held, like sequences holding blocks
    for op, arg in ops:
        if op == "allocate":
            if arg > pool.num_free:
                free_before = pool.num_free
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(arg)
                assert pool.num_free == free_before  # all or nothing
                continue
            got = pool.allocate(arg)
            assert len(set(got)) == len(got) and not set(got) & set(owners)  # never handed out twice
            owners += got
        elif op == "share" and owners:
            block = owners[arg % len(owners)]
            pool.share([block])
            owners.append(block)
        elif op == "free" and owners:
            pool.free([owners.pop(arg % len(owners))])
        assert all(count >= 0 for count in pool.ref_counts)
        for block in range(num_blocks):
            assert pool.ref_counts[block] == owners.count(block)
            assert (block in pool.free_queue) == (block not in owners)
        assert pool.num_free + len(set(owners)) == num_blocks  # never lost
    pool.free(owners)
    assert pool.num_free == num_blocks and sorted(pool.free_queue) == list(range(num_blocks))


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6), block_size=st.sampled_from([1, 4, 16]),
       forks=st.lists(st.integers(0, 5), max_size=4), order=st.randoms(use_true_random=False))
def test_every_block_is_free_again_once_all_sequences_are_freed_in_any_order(lengths, block_size, forks, order):
    pool = BlockPool(64)
    manager = CopyOnWriteKVCacheManager(pool, block_size)
    live = []
    for seq, length in enumerate(lengths):
        try:
            manager.allocate(seq, 0, length)
        except NoFreeBlocksError:
            continue
        live.append(seq)
    for k, parent in enumerate(forks):
        if parent < len(live):
            child = ("fork", k)
            manager.fork(live[parent], child)
            live.append(child)
            try:  # the child writes one token past the parent's prompt: copy-on-write if that block is shared
                manager.allocate(child, lengths[live[parent]] if isinstance(live[parent], int) else 0, 1)
            except NoFreeBlocksError:
                pass
    order.shuffle(live)
    for seq in live:
        manager.free(seq)
    assert pool.num_free == 64 and all(c == 0 for c in pool.ref_counts)


def test_freed_blocks_are_reused_first_in_the_order_freed():
    """vLLM 0.33's free_blocks without prefix caching: freed blocks go to the front of the free queue (LIFO
    reuse), the first block of the list given first in line; a block still shared stays out."""
    pool = BlockPool(6)
    blocks = pool.allocate(4)  # 0 1 2 3; the queue holds 4 5
    pool.share([blocks[2]])
    pool.free(blocks[::-1])  # 3, 2 (still shared), 1, 0
    assert list(pool.free_queue) == [3, 1, 0, 4, 5]
    manager = KVCacheManager(pool, block_size=4)
    manager.allocate("seq", 0, 8)
    manager.free("seq")  # tail first: its last block is reused first
    assert list(pool.free_queue) == [1, 3, 0, 4, 5]


def test_double_free_and_sharing_a_free_block_are_refused():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([block])
    with pytest.raises(ValueError, match="is free"):
        pool.share([block])


def test_running_out_is_a_typed_error_that_changes_nothing():
    pool = BlockPool(4)
    manager = KVCacheManager(pool, block_size=4)
    manager.allocate("a", 0, 10)  # 3 blocks
    with pytest.raises(NoFreeBlocksError) as error:
        manager.allocate("b", 0, 8)
    assert (error.value.requested, error.value.free) == (2, 1)
    assert pool.num_free == 1 and "b" not in manager.block_tables


def test_copy_on_write_copies_only_the_shared_block_written_to():
    pool = BlockPool(10)
    manager = CopyOnWriteKVCacheManager(pool, block_size=4)
    manager.allocate("parent", 0, 6)  # blocks: full, half full
    manager.fork("parent", "child")
    full, partial = manager.block_tables["parent"]
    manager.allocate("child", 6, 1)  # the child writes into the shared, half-full block
    assert manager.block_tables["child"][0] == full
    assert manager.block_tables["child"][1] != partial
    assert manager.pending_copies == [(partial, manager.block_tables["child"][1])]
    assert pool.ref_counts[full] == 2 and pool.ref_counts[partial] == 1
    manager.allocate("parent", 6, 1)  # now the parent's block is its own again: written in place
    assert manager.block_tables["parent"][1] == partial and len(manager.pending_copies) == 1



def test_the_engines_manager_allocates_new_blocks_only_and_copy_on_write_lives_in_the_book():
    """Issue 27: no engine path forks or writes into a shared block, so the engine's manager has no copy-on-write;
    the book's static generator has it, in a subclass, and does its queued copies itself."""
    assert not any(hasattr(KVCacheManager, name) for name in ("fork", "pending_copies", "_written_shared_blocks"))
    manager = KVCacheManager(BlockPool(6), block_size=4)
    manager.allocate("a", 0, 6)
    manager.pool.share(manager.block_tables["a"])  # even a shared block is written in place: new blocks only
    assert manager.blocks_needed("a", 6, 3) == 1
    manager.allocate("a", 6, 3)
    assert manager.block_tables["a"][:2] == [0, 1] and len(manager.block_tables["a"]) == 3
    engine_sources = [Path(__file__).parents[1] / "minivllm" / folder for folder in ("core", "engine", "attention")]
    for path in (p for folder in engine_sources for p in folder.rglob("*.py")):
        text = path.read_text()
        assert "pending_copies" not in text and "copy_blocks" not in text, path

# ------------------------------------------------------------------ equivalence


def load(folder):
    return load_weights(folder, ModelConfig.from_hf(json.loads((folder / "config.json").read_text())),
                        torch.float32, torch.device("cpu"))


def mixed_prompts(seed, lengths):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batch_of_mixed_lengths_matches_transformers(checkpoints, family, block_size):
    folder, hf_model = checkpoints[family]
    model = load(folder)
    prompts = mixed_prompts(4, [1, 3, 16, 17, 33])
    generator = StaticPagedGenerator(model, num_blocks=200, block_size=block_size)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = generator.generate(prompts, params)
    for prompt, [completion] in zip(prompts, results):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                                         do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert completion.token_ids == expected
    assert generator.pool.num_free == 200


def test_parallel_sampling_shares_the_prompt_and_copies_on_write(checkpoints):
    folder, _ = checkpoints["qwen2-qkv-bias-gqa4"]
    model = load(folder)
    prompts = mixed_prompts(5, [18, 7, 32])  # partial, partial and exactly full last blocks
    generator = StaticPagedGenerator(model, num_blocks=100, block_size=16)
    params = SamplingParams(temperature=1.0, n=4, seed=3, max_tokens=12, ignore_eos=True)
    results = generator.generate(prompts, params)
    for prompt, completions in zip(prompts, results):
        assert len(completions) == 4 and len({tuple(c.token_ids) for c in completions}) > 1
        for completion in completions:  # each child's tokens were scored on its own keys and values
            sequence = prompt + completion.token_ids
            logprobs = model.compute_logits(model(*NoCacheAttention.for_sequences([sequence]))).log_softmax(-1)
            expected = [logprobs[len(prompt) - 1 + k, t].item() for k, t in enumerate(completion.token_ids)]
            assert max(abs(a - b) for a, b in zip(expected, completion.logprobs)) < 1e-4
    unshared = sum(4 * -(-(len(p) + 12) // 16) for p in prompts)
    assert generator.peak_blocks_used < unshared
    assert generator.pool.num_free == 100


def test_pool_exhaustion_gives_every_block_back(checkpoints):
    folder, _ = checkpoints["qwen3-gqa2-tied"]
    model = load(folder)
    generator = StaticPagedGenerator(model, num_blocks=6, block_size=4)
    with pytest.raises(NoFreeBlocksError):
        generator.generate(mixed_prompts(6, [8, 8]), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert generator.pool.num_free == 6


def test_bad_prompts_are_refused_before_any_work(checkpoints):
    folder, _ = checkpoints["qwen3-gqa2-tied"]
    generator = StaticPagedGenerator(load(folder), num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        generator.generate([[5], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[0\] has 256 tokens"):
        generator.generate([[5] * 256], SamplingParams())
    assert generator.pool.num_free == 8


# ------------------------------------------------------------------ the request mix on paged memory


def test_paged_timeline_keeps_waste_below_one_block_per_running_request():
    from minivllm.book.workloads import paged_timeline
    from minivllm.book.workloads import chat_workload, memory_shares

    requests = chat_workload(300, seed=1, max_model_len=2048)
    budget = 16_000
    for block_size in (1, 16, 64):
        snapshots = list(paged_timeline(requests, budget, block_size))
        for s in snapshots:
            assert s.token_states + s.internal + s.free == budget and s.reservation == 0
            assert 0 <= s.internal <= s.running * block_size
            assert s.running + s.waiting <= len(requests)
        shares = memory_shares(snapshots, budget)
        assert shares.internal * budget <= shares.mean_running * block_size
    assert memory_shares(paged_timeline(requests, budget, 16), budget).token_states >= 0.95


def test_paged_timeline_refuses_a_request_that_can_never_fit():
    from minivllm.book.workloads import paged_timeline
    from minivllm.book.workloads import WorkloadRequest

    with pytest.raises(ValueError, match=r"requests\[1\]"):
        list(paged_timeline([WorkloadRequest(10, 10), WorkloadRequest(100, 100)], budget=64, block_size=16))
