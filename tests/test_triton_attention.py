"""Chapter 8's Triton kernels against chapter 5's PyTorch reference, and the engine on both backends.

On a machine without a CUDA GPU the kernels run in triton's interpreter (slow: shapes here are small, with a
few long cases); `make gpu-check` runs this same file compiled on a GPU.
"""

import copy
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from minivllm.kernels.interpreter import triton_available, use_interpreter_without_gpu

# the interpreter is switched on explicitly, before triton is imported (importing minivllm changes nothing)
INTERPRETED = not torch.cuda.is_available() and use_interpreter_without_gpu()
triton = pytest.importorskip("triton")

from minivllm.attention.selector import attention_backend_class  # noqa: E402

from minivllm.core.block_pool import BlockPool  # noqa: E402
from minivllm.config import ModelConfig  # noqa: E402
from minivllm.model.loader import load_weights  # noqa: E402
from minivllm.attention.paged import PagedAttention, PagedKVCache
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.engine.model_runner import prepare_paged_batch  # noqa: E402
from minivllm.attention.triton_backend import TritonPagedAttention  # noqa: E402
from minivllm.attention.cpu_backend import CPUPagedAttention  # noqa: E402
from minivllm.kernels.paged_attention import paged_decode_attention, paged_prefill_attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # the interpreter has no bf16


def paged_batch(context_lens, query_lens, block_size, num_heads, num_kv_heads, head_dim, dtype=torch.float32,
                seed=0):
    """A random cache with blocks scattered in a random order, and one step's metadata and q, k, v: sequence i
    has context_lens[i] cached tokens and brings query_lens[i] new ones."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # a few never used: a kernel that reads past its table reads garbage
    cache = PagedKVCache(SimpleNamespace(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim),
                         num_blocks, block_size, dtype=dtype, device=DEVICE)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for seq_len, query_len, count in zip(seq_lens, query_lens, blocks_per_seq):
        table = [free.pop() for _ in range(count)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - query_len, seq_len)]
    width = max(blocks_per_seq)

    def tensor(values, dtype=torch.long):
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    metadata_args = (cache, tensor(slots), tensor([0] + torch.tensor(query_lens).cumsum(0).tolist()),
                     tensor(seq_lens), tensor([t + [0] * (width - len(t)) for t in tables], torch.int32))
    num_tokens = sum(query_lens)
    q, k, v = (torch.randn(num_tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)
               for heads in (num_heads, num_kv_heads, num_kv_heads))
    return metadata_args, q, k, v


def assert_matches_reference(metadata_args, q, k, v, attention):
    """`attention(k_cache, v_cache, block_tables, seq_lens, query_start_loc)` once this step's k and v are in the
    cache, against the reference run in fp32 on an fp32 copy of the cache."""
    cache, slots, query_start_loc, seq_lens, block_tables = metadata_args
    fp32_cache = copy.copy(cache)
    fp32_cache.kv = cache.kv.float()
    expected = PagedAttention(fp32_cache, *metadata_args[1:]).attend(0, q.float(), k.float(), v.float())
    k_cache, v_cache = cache.layer(0)
    k_cache.view(-1, *k.shape[1:])[slots] = k
    v_cache.view(-1, *v.shape[1:])[slots] = v
    got = attention(k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    assert got.shape == q.shape and got.dtype == q.dtype
    error = (got.float() - expected).abs().max().item()
    assert error < TOLERANCE[q.dtype], f"max abs error {error:.2e}"


def edge_lengths(block_size):
    """Contexts that break sloppy kernels: 1 token, one short of a block, exactly one, one over, several."""
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]


# ------------------------------------------------------------------ decode: one new token per sequence


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_kernel_matches_reference(block_size, group, head_dim):
    lengths = edge_lengths(block_size)
    args, q, k, v = paged_batch([n - 1 for n in lengths], [1] * len(lengths), block_size, 2 * group, 2, head_dim,
                                seed=block_size + group)
    assert_matches_reference(args, q, k, v, lambda kc, vc, tables, seq_lens, _: paged_decode_attention(
        q, kc, vc, tables, seq_lens, max(lengths)))


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("block_n", [16, 64])
def test_decode_split_k_over_long_contexts(num_splits, block_n):
    """Splits that end mid-block, splits past the end of a short sequence, tiles smaller and larger than a block."""
    lengths = [1, 33, 700, 2049]
    args, q, k, v = paged_batch([n - 1 for n in lengths], [1] * len(lengths), 32, 8, 2, 64, seed=num_splits)
    assert_matches_reference(args, q, k, v, lambda kc, vc, tables, seq_lens, _: paged_decode_attention(
        q, kc, vc, tables, seq_lens, max(lengths), num_splits=num_splits, block_n=block_n))


def test_decode_in_half_precision():
    lengths = edge_lengths(16)
    args, q, k, v = paged_batch([n - 1 for n in lengths], [1] * len(lengths), 16, 8, 2, 128, dtype=HALF)
    assert_matches_reference(args, q, k, v, lambda kc, vc, tables, seq_lens, _: paged_decode_attention(
        q, kc, vc, tables, seq_lens, max(lengths), num_splits=2))


# ------------------------------------------------------------------ prefill: new tokens over a cached prefix


def prefill_mix(block_size):
    """(cached context, new tokens) per sequence: fresh prompts at block edges, chunks over a cached prefix
    that ends mid-block and on a boundary, and a decode mixed into the batch."""
    b = block_size
    return [(0, 1), (0, b - 1), (0, b + 1), (b - 1, 2), (b, 1), (b + 1, b + 3), (2 * b, 21)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_kernel_matches_reference(block_size, group, head_dim):
    context_lens, query_lens = zip(*prefill_mix(block_size))
    args, q, k, v = paged_batch(context_lens, query_lens, block_size, group, 1, head_dim, seed=block_size * group)
    assert_matches_reference(args, q, k, v, lambda kc, vc, tables, seq_lens, starts: paged_prefill_attention(
        q, kc, vc, tables, seq_lens, starts, max(query_lens), block_m=16, block_n=16))


@pytest.mark.parametrize("block_m, block_n", [(16, 64), (32, 16), (64, 32)])
def test_prefill_long_prompt_and_long_chunk(block_m, block_n):
    context_lens, query_lens = [0, 450], [300, 77]
    args, q, k, v = paged_batch(context_lens, query_lens, 16, 2, 1, 64, seed=block_m)
    assert_matches_reference(args, q, k, v, lambda kc, vc, tables, seq_lens, starts: paged_prefill_attention(
        q, kc, vc, tables, seq_lens, starts, max(query_lens), block_m=block_m, block_n=block_n))


def test_prefill_in_half_precision():
    context_lens, query_lens = zip(*prefill_mix(16))
    args, q, k, v = paged_batch(context_lens, query_lens, 16, 4, 2, 128, dtype=HALF)
    assert_matches_reference(args, q, k, v, lambda kc, vc, tables, seq_lens, starts: paged_prefill_attention(
        q, kc, vc, tables, seq_lens, starts, max(query_lens)))


# ------------------------------------------------------------------ the backend


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 1, 9]], ids=["decode", "mixed"])
def test_backend_writes_the_cache_and_matches_reference(query_lens):
    args, q, k, v = paged_batch([0, 17, 30], query_lens, 16, 4, 2, 64)
    reference_cache = copy.copy(args[0])
    reference_cache.kv = args[0].kv.clone()
    expected = PagedAttention(reference_cache, *args[1:]).attend(0, q, k, v)
    got = TritonPagedAttention(*args).attend(0, q, k, v)
    assert (got - expected).abs().max().item() < TOLERANCE[torch.float32]
    assert torch.equal(args[0].kv, reference_cache.kv)


def test_backend_refuses_inconsistent_metadata_before_any_work():
    (cache, slots, starts, seq_lens, tables), q, k, v = paged_batch([0, 3], [4, 1], 8, 2, 1, 64)
    before = cache.kv.clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        TritonPagedAttention(cache, slots[:-1], starts, seq_lens, tables)
    with pytest.raises(ValueError, match="seq_lens"):
        TritonPagedAttention(cache, slots, starts, seq_lens[:1], tables)
    with pytest.raises(ValueError, match="block_tables"):
        TritonPagedAttention(cache, slots, starts, seq_lens, tables.long())
    metadata = TritonPagedAttention(cache, slots, starts, seq_lens, tables)
    with pytest.raises(ValueError, match="head_dim"):
        metadata.attend(0, q[..., :32], k, v)
    with pytest.raises(ValueError, match="k is"):
        metadata.attend(0, q, k[:, :, :32], v)
    with pytest.raises(ValueError, match="q is"):
        metadata.attend(0, q.double(), k.double(), v.double())
    assert torch.equal(cache.kv, before)


def test_backend_choice():
    assert attention_backend_class("torch", torch.device("cpu")) is PagedAttention
    assert attention_backend_class("triton", DEVICE) is TritonPagedAttention
    if DEVICE.type == "cuda":  # compiled kernels cannot read CPU tensors
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            attention_backend_class("triton", torch.device("cpu"))
    expected_auto = TritonPagedAttention if DEVICE.type == "cuda" else CPUPagedAttention
    assert attention_backend_class("auto", DEVICE) is expected_auto
    with pytest.raises(ValueError, match="attention_backend"):
        attention_backend_class("flash", DEVICE)
    assert triton_available() and INTERPRETED == (DEVICE.type == "cpu")


def test_triton_on_a_cpu_device_of_a_cuda_machine_is_refused(monkeypatch):
    """Where CUDA is, triton compiles for the GPU unless TRITON_INTERPRET=1: CPU tensors would reach a GPU kernel
    (on an H200, 2026-12-04, the selector handed the backend out and test_backend_choice failed)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        attention_backend_class("triton", torch.device("cpu"))


def test_without_triton_the_package_imports_and_falls_back_to_the_reference():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import minivllm.attention.selector as t, torch\n"
            "print(t.triton_available(), t.attention_backend_class('auto', torch.device('cpu')).__name__)\n"
            "try:\n    t.attention_backend_class('triton', torch.device('cpu'))\n"
            "except ImportError as e:\n    print('ImportError', 'pip install triton' in str(e))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "CPUPagedAttention", "ImportError", "True"]


# ------------------------------------------------------------------ the whole engine, greedy, on both backends


def greedy_paged(model, prompts, max_tokens, backend, block_size=4, chunk=6):
    """Greedy tokens of each prompt, with prompts prefilled `chunk` tokens per step (so later chunks attend over a
    cached prefix) while sequences already past their prompt decode in the same batch."""
    num_blocks = sum(math.ceil((len(p) + max_tokens) / block_size) for p in prompts)
    cache = PagedKVCache.for_model(model, num_blocks, block_size)
    manager = KVCacheManager(BlockPool(num_blocks), block_size)
    outputs = [[] for _ in prompts]
    prefilled = [0] * len(prompts)
    while any(len(out) < max_tokens for out in outputs):
        work = []
        for i, prompt in enumerate(prompts):
            if prefilled[i] < len(prompt):
                start, tokens = prefilled[i], prompt[prefilled[i]:prefilled[i] + chunk]
                prefilled[i] += len(tokens)
            elif len(outputs[i]) < max_tokens:
                start, tokens = len(prompt) + len(outputs[i]) - 1, outputs[i][-1:]
            else:
                continue
            manager.allocate(i, start, len(tokens))
            work.append((i, tokens, start))
        input_ids, positions, metadata = prepare_paged_batch(cache, manager, work, backend)
        with torch.no_grad():
            logits = model.compute_logits(model(input_ids, positions, metadata)[metadata.query_start_loc[1:] - 1])
        for (i, tokens, start), row in zip(work, logits):
            if start + len(tokens) >= len(prompts[i]):  # the prompt is all in: this row predicts a new token
                outputs[i].append(int(row.argmax()))
    return outputs


@pytest.mark.parametrize("family", ["qwen3-gqa2-tied", "qwen2-qkv-bias-gqa4", "llama-untied-gqa8"])
def test_engine_greedy_outputs_identical_on_both_backends(checkpoints, family):
    folder, _ = checkpoints[family]
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    model = load_weights(folder, config, torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 4, 13, 17)]
    reference = greedy_paged(model, prompts, 10, PagedAttention)
    assert greedy_paged(model, prompts, 10, TritonPagedAttention) == reference
    assert all(len(out) == 10 for out in reference)


# ------------------------------------------------------------------ make gpu-check, as far as a CPU can take it


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpu_check_refuses_clearly_without_cuda(capsys):
    from minivllm.tools import gpu_check

    assert gpu_check.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_engine_runs_on_chapter_8s_triton_backend(checkpoints):
    from minivllm import LLM
    from minivllm.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(11)
    folder, _ = checkpoints["qwen3-gqa2-tied"]
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=gen).tolist()} for n in (9, 21, 4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for backend in ["torch", "triton"]:
        llm = LLM(str(folder), num_kv_blocks=32, block_size=8, max_num_batched_tokens=16, attention_backend=backend)
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.model_runner.backend is TritonPagedAttention
    assert outputs["triton"] == outputs["torch"]
