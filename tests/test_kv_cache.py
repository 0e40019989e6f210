"""The contiguous KV cache: cached generation equals recomputation and transformers; its size is the formula."""

import json

import pytest
import torch

from minivllm.attention.base import NoCacheAttention
from minivllm.config import ModelConfig
from minivllm.book.recompute import generate_recompute
from minivllm.book.contiguous_cache import ContiguousCacheAttention, ContiguousKVCache, generate_cached
from minivllm.config import kv_bytes_per_token
from minivllm.model.loader import load_weights
from minivllm.sampling_params import SamplingParams
from tests.conftest import FAMILIES


def load(folder):
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    return load_weights(folder, config, torch.float32, torch.device("cpu"))


def random_tokens(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_greedy_equals_recompute_and_transformers(checkpoints, family):
    folder, hf_model = checkpoints[family]
    model = load(folder)
    prompt = random_tokens(12, seed=3)
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                     pad_token_id=0)[0, len(prompt):].tolist()
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    cached = generate_cached(model, prompt, params)
    assert cached.token_ids == expected
    assert cached.token_ids == generate_recompute(model, prompt, params).token_ids
    assert cached.finish_reason == "length"


@pytest.mark.parametrize("family", ["qwen3-gqa2-tied", "llama-untied-gqa8"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.3, top_k=20, min_p=0.05, seed=11, max_tokens=40, stop_token_ids=[7, 8, 9]),
], ids=["top_p", "top_k-min_p-stop_ids"])
def test_cached_seeded_sampling_equals_recompute(checkpoints, family, params):
    model = load(checkpoints[family][0])
    prompt = random_tokens(9, seed=4)
    cached, recomputed = generate_cached(model, prompt, params), generate_recompute(model, prompt, params)
    assert cached.token_ids == recomputed.token_ids
    assert cached.finish_reason == recomputed.finish_reason


@pytest.mark.parametrize("family", ["qwen3-headdim-differs-untied", "qwen2-qkv-bias-gqa4"])
def test_mixed_prefill_and_decode_batch_equals_no_cache(checkpoints, family):
    """One step where sequences bring different numbers of new tokens over different cached prefixes."""
    model = load(checkpoints[family][0])
    sequences = [random_tokens(n, seed=n) for n in (1, 20, 7, 33)]
    already = [0, 19, 3, 30]  # tokens of each sequence put in the cache by an earlier step
    cache = ContiguousKVCache.for_model(model, max_seqs=6, max_len=40)
    rows = [5, 0, 2, 3]
    prefilled = [(r, s[:c], c) for r, s, c in zip(rows, sequences, already) if c]
    model(*ContiguousCacheAttention.for_step(cache, [r for r, _, _ in prefilled], [t for _, t, _ in prefilled],
                                             [0] * len(prefilled)))
    step = ContiguousCacheAttention.for_step(cache, rows, [s[c:] for s, c in zip(sequences, already)], already)
    got = model.compute_logits(model(*step))
    full = model.compute_logits(model(*NoCacheAttention.for_sequences(sequences)))
    starts = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)
    expected = torch.cat([full[start + c:start + len(s)] for start, s, c in zip(starts.tolist(), sequences, already)])
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_per_token_formula_equals_measured_size(checkpoints, family, dtype):
    config = load(checkpoints[family][0]).config
    cache = ContiguousKVCache(config.num_layers, 3, 50, config.num_kv_heads, config.head_dim, dtype)
    formula = kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, dtype.itemsize)
    assert cache.bytes_per_token == formula
    assert cache.nbytes == formula * 3 * 50


def test_cache_refuses_bad_sizes_and_overflow():
    with pytest.raises(ValueError, match="max_len"):
        ContiguousKVCache(2, 1, 0, 2, 8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ContiguousKVCache(2, 1, 4, 2.0, 8)
    cache = ContiguousKVCache(2, 2, 8, 2, 8)
    with pytest.raises(ValueError, match="exceed max_len"):
        ContiguousCacheAttention(cache, [0], [6], [3])
    with pytest.raises(ValueError, match="rows"):
        ContiguousCacheAttention(cache, [1, 1], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="rows"):
        ContiguousCacheAttention(cache, [2], [0], [1])
    with pytest.raises(ValueError, match="lengths"):
        ContiguousCacheAttention(cache, [0, 1], [0], [1, 1])
    with pytest.raises(ValueError, match="num_new"):
        ContiguousCacheAttention(cache, [0], [0], [0])


def test_generate_cached_refuses_bad_requests(checkpoints):
    model = load(checkpoints["qwen3-gqa2-tied"][0])
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate_cached(model, [], SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams.n"):
        generate_cached(model, [5], SamplingParams(n=2))
    with pytest.raises(ValueError, match="no room"):
        generate_cached(model, [5] * model.config.max_model_len, SamplingParams())


def test_the_context_limit_ends_generation_with_length(checkpoints):
    model = load(checkpoints["qwen3-gqa2-tied"][0])
    prompt = random_tokens(model.config.max_model_len - 3, seed=6)
    done = generate_cached(model, prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(done.token_ids) == 3 and done.finish_reason == "length"
