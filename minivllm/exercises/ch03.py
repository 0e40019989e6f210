"""Chapter 3 exercises."""

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from minivllm.exercises import CheckFailed, case_random, case_seed, close, exercise, expect

_BY_HAND = "the exercise asks for attention by hand: scores, softmax and the weighted sum, not a library's attention"


class _NoAttentionFunctions(TorchFunctionMode):
    """Refuses torch's attention functions, however they were imported (F.scaled_dot_product_attention, the
    module behind nn.MultiheadAttention)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (F.scaled_dot_product_attention, F.multi_head_attention_forward):
            raise CheckFailed(f"{func.__name__} was called: {_BY_HAND}")
        return func(*args, **(kwargs or {}))


class _NoAttentionKernels(TorchDispatchMode):
    """Refuses every fused attention operator at the dispatcher (torch.ops.aten.*scaled_dot_product*)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func):
            raise CheckFailed(f"{func} was called: {_BY_HAND}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def by_hand():
    """Inside, a call of a library attention function or kernel fails the check."""
    with _NoAttentionFunctions(), _NoAttentionKernels():
        yield


@exercise("03.kv_cache_bytes")
def _kv_cache_bytes():
    def case(hf_config, num_tokens, dtype_bytes, want):
        def test(kv_cache_bytes):
            got = kv_cache_bytes(dict(hf_config), num_tokens, dtype_bytes)
            expect(got == want, f"{num_tokens} tokens, {dtype_bytes}-byte dtype: {got!r}, expected {want:,}")
        return test

    llama3_8b = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    qwen3_06b = dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128)
    opt_like = dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=40)
    return [
        ("Llama-3-8B, one token in bf16 (head_dim from hidden_size)", case(llama3_8b, 1, 2, 131_072)),
        ("Llama-3-8B, 2,048 tokens in fp32", case(llama3_8b, 2048, 4, 2048 * 262_144)),
        ("Qwen3-0.6B: head_dim is given and differs from hidden / heads", case(qwen3_06b, 10, 2, 10 * 114_688)),
        ("no num_key_value_heads means multi-head attention", case(opt_like, 1, 2, 819_200)),
        ("a missing head_dim with num_key_value_heads given", case(dict(llama3_8b, hidden_size=2048), 3, 2, 3 * 65_536)),
    ]


@exercise("03.decode_attention")
def _decode_attention():
    from minivllm.attention.base import causal_attention

    def case(num_heads, num_kv_heads, head_dim, max_len, length, seed):
        def test(decode_attention):
            gen = torch.Generator().manual_seed(case_seed(seed))
            q = torch.randn(num_heads, head_dim, generator=gen)
            k_cache = torch.randn(max_len, num_kv_heads, head_dim, generator=gen)
            v_cache = torch.randn(max_len, num_kv_heads, head_dim, generator=gen)
            k_cache[length:] = 1e4  # slots past `length` are stale: reading them is a bug
            v_cache[length:] = 1e4
            expected = causal_attention(q[None], k_cache[:length], v_cache[:length])[0]
            with by_hand():
                got = decode_attention(q, k_cache, v_cache, length)
            close(got, expected, f"{num_heads} heads over {num_kv_heads} kv heads, {length} of {max_len} slots",
                  atol=1e-4, rtol=1e-4)
        return test

    rng = case_random("03.decode_attention")
    kv_heads, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 3])
    max_len = rng.randrange(8, 64)
    return [
        ("multi-head, one cached token", case(4, 4, 8, 6, 1, 0)),
        ("multi-head, a full row", case(4, 4, 16, 12, 12, 1)),
        ("grouped-query: 8 heads over 2 kv heads", case(8, 2, 16, 32, 20, 2)),
        ("multi-query: 6 heads over 1 kv head", case(6, 1, 32, 40, 33, 3)),
        (f"random: {kv_heads * group} heads over {kv_heads} kv heads",
         case(kv_heads * group, kv_heads, rng.choice([8, 16, 32]), max_len, rng.randrange(1, max_len + 1),
              rng.randrange(1000))),
    ]
