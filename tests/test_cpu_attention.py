"""Chapter 8b's C++ decode kernel and the CPU backend around it, against chapter 5's reference and transformers."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from minivllm.attention.cpu_backend import CPUPagedAttention
from minivllm.attention.paged import PagedAttention, PagedKVCache
from minivllm.attention.selector import attention_backend_class
from minivllm.config import EngineConfig, ModelConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.kernels.cpu_attention import (load_cpu_attention, paged_decode_cpu,
                                           write_kv_cpu)
from minivllm.model.loader import load_weights
from minivllm.sampling_params import SamplingParams
from tests.conftest import kernel_missing, transformers_greedy

pytestmark = pytest.mark.skipif(kernel_missing(load_cpu_attention), reason="no C++ compiler here, or the kernels are off")


def paged_step(context_lens, query_lens, block_size, num_heads, num_kv_heads, head_dim, dtype=torch.float32, seed=0):
    """A cache whose blocks are scattered in random order (two never used), and one step's metadata arguments and
    q, k, v: sequence i has context_lens[i] cached tokens and brings query_lens[i] new ones."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    counts = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(counts) + 2
    cache = PagedKVCache(SimpleNamespace(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim), num_blocks,
                         block_size, dtype=dtype)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(n)] for n in counts]
    slots = [t[p // block_size] * block_size + p % block_size
             for t, s, n in zip(tables, seq_lens, query_lens) for p in range(s - n, s)]
    width = max(counts)
    args = (cache, torch.tensor(slots), torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
            torch.tensor(seq_lens), torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32))
    q, k, v = (torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype)
               for heads in (num_heads, num_kv_heads, num_kv_heads))
    return args, q, k, v


def attend(backend, args, q, k, v):
    cache = args[0]
    before = cache.kv.clone()
    out = backend(*args).attend(0, q, k, v)
    written = cache.kv.clone()
    cache.kv.copy_(before)  # the next backend starts from the same cache
    return out, written


@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 16), (8, 2, 64), (6, 3, 32), (8, 1, 128), (9, 3, 64)])
def test_decode_kernel_equals_the_reference(block_size, heads, kv_heads, head_dim):
    lengths = [1, 2, block_size, block_size + 1, 7 * block_size + 5, 333]
    args, q, k, v = paged_step([n - 1 for n in lengths], [1] * len(lengths), block_size, heads, kv_heads, head_dim,
                               seed=block_size)
    expected, _ = attend(PagedAttention, args, q, k, v)
    cache, _, _, seq_lens, tables = args
    PagedAttention(*args).write_kv(0, k, v)
    got = paged_decode_cpu(q, *cache.layer(0), tables, seq_lens)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fewer_sequences_than_threads_split_their_blocks_into_runs_and_merge_to_the_reference(threads, dtype):
    block_size, lengths = 4, [1, 3, 5, 9, 4 * 7 + 2, 333]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # 1 to 3 sequences on 2 to 4 threads: 1 to 4 runs each, some of them empty
    try:
        for batch in ([n] for n in lengths), [lengths[:2], lengths[2:4], lengths[4:]], [lengths[3:]]:
            for seqs in batch:
                args, q, k, v = paged_step([n - 1 for n in seqs], [1] * len(seqs), block_size, 6, 2, 32, dtype=dtype,
                                           seed=sum(seqs))
                expected, _ = attend(PagedAttention, args, q, k, v)
                cache, _, _, seq_lens, tables = args
                PagedAttention(*args).write_kv(0, k, v)
                got = paged_decode_cpu(q, *cache.layer(0), tables, seq_lens)
                tolerance = 2e-5 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    finally:
        torch.set_num_threads(before)


def test_write_kv_puts_each_row_in_its_slot_and_refuses_slots_outside_the_cache():
    args, q, k, v = paged_step([3, 10], [2, 1], 4, 4, 2, 16)
    cache, slots = args[0], args[1]
    expected = cache.kv.clone()
    PagedAttention(*args).write_kv(0, k, v)
    expected, cache.kv[:] = cache.kv.clone(), expected
    write_kv_cpu(cache, 0, k, v, slots)
    assert torch.equal(cache.kv, expected)
    k_cache, v_cache = cache.layer(0)
    for bad in (-1, k_cache.shape[0] * k_cache.shape[1]):
        with pytest.raises(RuntimeError, match=f"slot {bad} is outside the cache"):
            load_cpu_attention().write_kv(k_cache, v_cache, k, v, torch.tensor([0, 1, bad]))
    with pytest.raises(RuntimeError, match="int64"):
        load_cpu_attention().write_kv(k_cache, v_cache, k, v, slots.int())
    with pytest.raises(RuntimeError, match=r"\[tokens, kv_heads, head_dim\]"):
        load_cpu_attention().write_kv(k_cache, v_cache, k[:, :1], v[:, :1], slots)
    with pytest.raises(RuntimeError, match="dtype"):
        load_cpu_attention().write_kv(k_cache, v_cache, k.double(), v.double(), slots)
    assert torch.equal(cache.kv, expected)  # nothing written by a refused call


def test_decode_kernel_refuses_what_it_cannot_read():
    args, q, k, v = paged_step([4, 9], [1, 1], 4, 4, 2, 16)
    cache, _, _, seq_lens, tables = args
    k_cache, v_cache = cache.layer(0)
    with pytest.raises(RuntimeError, match="int32"):
        paged_decode_cpu(q, k_cache, v_cache, tables.long(), seq_lens)
    with pytest.raises(RuntimeError, match="float32"):
        paged_decode_cpu(q.double(), k_cache.double(), v_cache.double(), tables, seq_lens)


@pytest.mark.parametrize("context_lens, query_lens", [
    ([0, 0, 0], [5, 17, 1]),  # fresh prefills (one of a single token) only
    ([12, 40, 0, 7], [1, 1, 9, 1]),  # decodes mixed with a fresh prefill
    ([12, 33, 5, 0], [1, 6, 1, 4]),  # a chunk over a cached prefix, decodes, a fresh prefill
    ([30, 31, 100], [1, 1, 1]),  # decodes only
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kind_of_step_equals_the_reference_and_writes_the_same_cache(context_lens, query_lens, dtype):
    args, q, k, v = paged_step(context_lens, query_lens, 8, 8, 2, 32, dtype=dtype, seed=len(context_lens))
    expected, expected_cache = attend(PagedAttention, args, q, k, v)
    got, got_cache = attend(CPUPagedAttention, args, q, k, v)
    assert torch.equal(got_cache, expected_cache)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("family", ["qwen3-gqa2-tied", "qwen3-headdim-differs-untied", "qwen2-qkv-bias-gqa4",
                                    "llama-untied-gqa8", "llama-linear-rope-no-head-dim"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_engine_on_the_cpu_backend_equals_transformers_under_pressure(checkpoints, family, prefix_caching):
    """Chunked prefill, preemption, and (with prefix caching) shared prompt blocks, all through the CPU backend."""
    folder, hf_model = checkpoints[family]
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    model = load_weights(folder, config, torch.float32, torch.device("cpu"))
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=44, max_num_seqs=5,
                                                 max_num_batched_tokens=24, enable_prefix_caching=prefix_caching),
                       CPUPagedAttention)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 256, (20,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 41, 0, 15, 60, 9)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions > 0
    if prefix_caching:
        assert sum(o.num_cached_tokens for o in finished.values()) > 0
    for i, prompt in enumerate(prompts):
        assert finished[str(i)].outputs[0].token_ids == transformers_greedy(hf_model, prompt, 20), f"request {i}"
    assert engine.kv_manager.pool.num_free == 44


def test_the_selector_picks_the_kernel_on_a_cpu_and_names_what_is_wrong():
    assert attention_backend_class("auto", torch.device("cpu")) is CPUPagedAttention
    assert attention_backend_class("cpu", "cpu") is CPUPagedAttention
    assert attention_backend_class("torch", "cpu") is PagedAttention
    with pytest.raises(ValueError, match="'cpu' runs on a CPU"):
        attention_backend_class("cpu", torch.device("cuda"))
    with pytest.raises(ValueError, match="attention_backend = 'flash'.*'cpu'"):
        attention_backend_class("flash", "cpu")


def test_decode_kernel_never_reads_outside_the_cache():
    args, q, k, v = paged_step([4, 9], [1, 1], 4, 4, 2, 16)
    cache, _, _, seq_lens, tables = args
    with pytest.raises(RuntimeError, match="seq_lens"):
        paged_decode_cpu(q, *cache.layer(0), tables, seq_lens + 100)
    with pytest.raises(RuntimeError, match="block id"):
        paged_decode_cpu(q, *cache.layer(0), tables + 1000, seq_lens)
    k_cache, v_cache = cache.layer(0)
    with pytest.raises(RuntimeError, match="of one shape"):  # block ids valid for the keys, past the values
        paged_decode_cpu(q, k_cache, v_cache[:1].contiguous(), tables, seq_lens)
    with pytest.raises(RuntimeError, match="one table row and length a sequence"):
        paged_decode_cpu(q, k_cache, v_cache, tables[:1], seq_lens)  # two sequences, one row of the table
    with pytest.raises(RuntimeError, match="one table row and length a sequence"):
        paged_decode_cpu(q, k_cache, v_cache, tables, seq_lens[:1])
    with pytest.raises(RuntimeError, match="one table row and length a sequence"):
        paged_decode_cpu(q[0], k_cache, v_cache, tables, seq_lens)
