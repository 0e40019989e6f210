"""Chapter 8 exercises: the pieces of the kernels' algorithm, in plain PyTorch (no triton needed)."""

import math

import torch

from minivllm.exercises import close, exercise, expect


def _attention(q, k, v):
    """softmax(q . k / sqrt(d)) . v for one query vector q [d] over keys k, values v [n, d]."""
    weights = torch.softmax(k.double() @ q.double() / math.sqrt(q.shape[-1]), dim=0)
    return weights @ v.double()


@exercise("08.online_softmax")
def _online_softmax():
    def case(num_keys, tile, head_dim=16, scale=1.0, seed=0):
        def test(online_attention):
            gen = torch.Generator().manual_seed(seed)
            q = torch.randn(head_dim, generator=gen, dtype=torch.float64) * scale
            k = torch.randn(num_keys, head_dim, generator=gen, dtype=torch.float64) * scale
            v = torch.randn(num_keys, head_dim, generator=gen, dtype=torch.float64)
            got = online_attention(q, k, v, tile)
            close(got, _attention(q, k, v), f"{num_keys} keys in tiles of {tile}", atol=1e-9, rtol=1e-9)
        return test

    return [
        ("keys a whole number of tiles", case(64, 16)),
        ("a last tile that is only partly filled", case(37, 16)),
        ("fewer keys than one tile", case(5, 16)),
        ("one key", case(1, 8)),
        ("scores large enough to overflow exp() without the running max", case(50, 8, scale=40.0)),
    ]


def _partials(num_keys, split, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(head_dim, generator=gen, dtype=torch.float64) * 3
    k = torch.randn(num_keys, head_dim, generator=gen, dtype=torch.float64) * 3
    v = torch.randn(num_keys, head_dim, generator=gen, dtype=torch.float64)

    def part(keys, values):
        if len(keys) == 0:  # an empty split: nothing seen, by convention output 0 and log-sum-exp -inf
            return torch.zeros(head_dim, dtype=torch.float64), torch.tensor(-math.inf, dtype=torch.float64)
        scores = keys @ q / math.sqrt(head_dim)
        return torch.softmax(scores, 0) @ values, torch.logsumexp(scores, 0)

    full_out, full_lse = part(k, v)
    return part(k[:split], v[:split]), part(k[split:], v[split:]), (full_out, full_lse)


@exercise("08.merge_partials")
def _merge_partials():
    def case(num_keys, split, head_dim=8, seed=0):
        def test(merge_partials):
            (o1, lse1), (o2, lse2), (want_out, want_lse) = _partials(num_keys, split, head_dim, seed)
            got = merge_partials(o1, lse1, o2, lse2)
            expect(isinstance(got, tuple) and len(got) == 2, "return a pair (output, log-sum-exp)")
            close(got[0], want_out, f"merged output of {split} + {num_keys - split} keys", atol=1e-9, rtol=1e-9)
            close(got[1], want_lse, f"merged log-sum-exp of {split} + {num_keys - split} keys", atol=1e-9,
                  rtol=1e-9)
        return test

    return [
        ("two halves", case(40, 20)),
        ("a short first part and a long second one", case(40, 3, seed=1)),
        ("one key in each part", case(2, 1, seed=2)),
        ("an empty second part (a split past the end of a short sequence)", case(12, 12, seed=3)),
        ("an empty first part", case(12, 0, seed=4)),
    ]


@exercise("08.prefill_key_range")
def _prefill_key_range():
    def key_range(seq_len, query_len, tile, block_m):
        first = tile * block_m
        if first >= query_len:
            return 0
        return seq_len - query_len + min(first + block_m, query_len)

    def case(seq_len, query_len, tile, block_m):
        def test(prefill_key_range):
            want = key_range(seq_len, query_len, tile, block_m)
            got = prefill_key_range(seq_len, query_len, tile, block_m)
            expect(got == want, f"prefill_key_range(seq_len={seq_len}, query_len={query_len}, tile={tile}, "
                                f"block_m={block_m}) = {got}, expected {want}")
        return test

    return [
        ("a fresh prompt, first tile", case(100, 100, 0, 16)),
        ("a fresh prompt, last (partial) tile", case(100, 100, 6, 16)),
        ("a chunk over a cached prefix", case(530, 30, 1, 16)),
        ("a decode: one query after 40 cached tokens", case(41, 1, 0, 16)),
        ("the last, partly filled tile of a long chunk", case(1000, 500, 31, 16)),
    ]
