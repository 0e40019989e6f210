"""Wrong answers to chapter 8b's exercises (the CPU backend's segments and its decode kernel in tensors)."""

import math

import torch


def kinds_prefill_first(query_start_loc, seq_lens):  # a one-token prompt called a fresh prefill
    kinds = []
    for i, seq_len in enumerate(seq_lens):
        query_len = query_start_loc[i + 1] - query_start_loc[i]
        kinds.append("fresh prefill" if query_len == seq_len else "decode" if query_len == 1 else "chunk over a cache")
    return kinds


def kinds_by_length_only(query_start_loc, seq_lens):  # every multi-token segment taken as fresh
    return ["decode" if b - a == 1 else "fresh prefill" for a, b in zip(query_start_loc, query_start_loc[1:])]


def _decode(q, k_cache, v_cache, block_tables, seq_lens, rows, heads):
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for s, n in enumerate(seq_lens.tolist()):
        keys, values = (rows(c, block_tables[s], n, block_size) for c in (k_cache, v_cache))
        keys, values = heads(keys, q.shape[1]), heads(values, q.shape[1])
        scores = torch.einsum("hd,nhd->hn", q[s], keys) / math.sqrt(q.shape[-1])
        out[s] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


def _table_rows(cache, table, n, block_size):
    return cache[table[:math.ceil(n / block_size)].long()].flatten(0, 1)[:n]


def _grouped(x, num_heads):
    return x.repeat_interleave(num_heads // x.shape[1], dim=1)


def decode_reads_the_whole_last_block(q, k_cache, v_cache, block_tables, seq_lens):  # padding leaks in
    return _decode(q, k_cache, v_cache, block_tables, seq_lens,
                   lambda c, t, n, b: c[t[:math.ceil(n / b)].long()].flatten(0, 1), _grouped)


def decode_ignores_the_block_table(q, k_cache, v_cache, block_tables, seq_lens):
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, lambda c, t, n, b: c.flatten(0, 1)[:n], _grouped)


def decode_heads_tiled(q, k_cache, v_cache, block_tables, seq_lens):  # query head h read kv head h % kv_heads
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, _table_rows,
                   lambda x, num_heads: x.repeat(1, num_heads // x.shape[1], 1))


WRONG = {
    "08b.segment_kinds": [kinds_prefill_first, kinds_by_length_only],
    "08b.paged_decode": [decode_reads_the_whole_last_block, decode_ignores_the_block_table, decode_heads_tiled],
}
