"""Wrong answers to chapter 8's exercises (the Triton tile update's run in a subprocess: see the test)."""

import math

import torch


def online_plain_softmax(q, k, v, tile):
    return torch.softmax(k @ q / math.sqrt(q.shape[0]), 0) @ v


def online_tiles_put_back_together(q, k, v, tile):
    keys = torch.cat([k[i:i + tile] for i in range(0, len(k), tile)])
    values = torch.cat([v[i:i + tile] for i in range(0, len(v), tile)])
    return torch.softmax(keys @ q / math.sqrt(q.shape[0]), 0) @ values


def online_no_rescale(q, k, v, tile):
    m, l, acc = -math.inf, 0.0, torch.zeros_like(v[0])
    for start in range(0, len(k), tile):
        scores = k[start:start + tile] @ q / math.sqrt(q.shape[0])
        m = max(m, scores.max().item())
        p = torch.exp(scores - m)
        l, acc = l + p.sum(), acc + p @ v[start:start + tile]
    return acc / l


def online_no_running_max(q, k, v, tile):
    l, acc = 0.0, torch.zeros_like(v[0])
    for start in range(0, len(k), tile):
        p = torch.exp(k[start:start + tile] @ q / math.sqrt(q.shape[0]))
        l, acc = l + p.sum(), acc + p @ v[start:start + tile]
    return acc / l


def online_drops_partial_tile(q, k, v, tile):
    m, l, acc = -math.inf, 0.0, torch.zeros_like(v[0])
    for start in range(0, len(k) - tile + 1, tile):
        scores = k[start:start + tile] @ q / math.sqrt(q.shape[0])
        m_new = max(m, scores.max().item())
        p, alpha = torch.exp(scores - m_new), math.exp(m - m_new)
        l, acc, m = l * alpha + p.sum(), acc * alpha + p @ v[start:start + tile], m_new
    return acc / l if l else acc


def merge_average(o1, lse1, o2, lse2):
    return (o1 + o2) / 2, torch.logaddexp(lse1, lse2)


def merge_by_max(o1, lse1, o2, lse2):
    return (o1 if lse1 >= lse2 else o2), torch.maximum(lse1, lse2)


def merge_nan_on_empty(o1, lse1, o2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = torch.exp(lse1 - lse), torch.exp(lse2 - lse)
    return (w1 * o1 + w2 * o2) / (w1 + w2) * 1.0, lse1 + torch.log1p(torch.exp(lse2 - lse1))


def key_range_off_by_one(seq_len, query_len, tile, block_m):
    return seq_len - query_len + min((tile + 1) * block_m, query_len) - 1


def key_range_ignores_cached_prefix(seq_len, query_len, tile, block_m):
    return min((tile + 1) * block_m, query_len)


def key_range_no_clamp(seq_len, query_len, tile, block_m):
    return seq_len - query_len + (tile + 1) * block_m


WRONG = {
    "08.online_softmax": [online_plain_softmax, online_tiles_put_back_together, online_no_rescale,
                          online_no_running_max, online_drops_partial_tile],
    "08.merge_partials": [merge_average, merge_by_max, merge_nan_on_empty],
    "08.prefill_key_range": [key_range_off_by_one, key_range_ignores_cached_prefix, key_range_no_clamp],
}

TILE_UPDATE_WRONG = {  # sources: each defines tile_update(m, l, acc, scores, v) with tl = triton.language
    "no rescale of the sums": """
def tile_update(m, l, acc, scores, v):
    m_new = tl.maximum(m, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    return m_new, l + tl.sum(p, 1), acc + tl.dot(p, v)
""",
    "the running max never moves": """
def tile_update(m, l, acc, scores, v):
    p = tl.exp2(scores - tl.max(scores, 1)[:, None])
    return m, l + tl.sum(p, 1), acc + tl.dot(p, v)
""",
    "natural exp on log2-scaled scores": """
def tile_update(m, l, acc, scores, v):
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v)
""",
}
