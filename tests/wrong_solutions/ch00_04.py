"""Wrong answers to the exercises of chapters 0 to 4."""

import math

import torch
import torch.nn.functional as F


def parameter_count_no_final_norm(config):
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads, head_dim = config.get("num_key_value_heads") or heads, config.get("head_dim") or hidden // heads
    layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * config[
        "intermediate_size"] + 2 * hidden + 2 * head_dim
    embeddings = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return config["num_hidden_layers"] * layer + embeddings


def parameter_count_head_dim_from_hidden(config):
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads, head_dim = config.get("num_key_value_heads") or heads, hidden // heads
    layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * config[
        "intermediate_size"] + 2 * hidden + 2 * head_dim
    embeddings = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return config["num_hidden_layers"] * layer + embeddings + hidden


def rms_norm_eps_outside(x, weight, eps):
    x32 = x.float()
    return weight * (x32 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)


def rms_norm_layer_norm(x, weight, eps):  # subtracts the mean: LayerNorm, not RMSNorm
    x32 = x.float()
    return weight * ((x32 - x32.mean(-1, keepdim=True)) * torch.rsqrt(x32.var(-1, keepdim=True, unbiased=False)
                                                                       + eps)).to(x.dtype)


def rms_norm_no_weight(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_interleaved(x, positions, theta):  # GPT-J's pairs (0, 1), (2, 3), ... instead of the two halves
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def rope_ignores_positions(x, positions, theta):
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(x.shape[0]).float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def top_p_drops_the_crossing_token(probs, top_p):
    sorted_probs, order = probs.sort(descending=True)
    drop = sorted_probs.cumsum(-1) > top_p
    drop[0] = False
    kept = torch.zeros_like(probs).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return kept / kept.sum()


def top_p_not_renormalised(probs, top_p):
    sorted_probs, order = probs.sort(descending=True)
    drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    return torch.zeros_like(probs).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))


def top_p_sorted_output(probs, top_p):
    sorted_probs, _ = probs.sort(descending=True)
    kept = sorted_probs.masked_fill(sorted_probs.cumsum(-1) - sorted_probs >= top_p, 0.0)
    return kept / kept.sum()


def _stop_hits(text, start, stop_strings):
    return [(text.find(s, start), len(s)) for s in stop_strings if text.find(s, start) >= 0]


def find_stop_no_look_back(text, searched, stop_strings, include_stop_str_in_output):  # only the new text
    hits = _stop_hits(text, searched, stop_strings)
    return None if not hits else min(hits)[0] + (min(hits)[1] if include_stop_str_in_output else 0)


def find_stop_looks_back_one_too_few(text, searched, stop_strings, include_stop_str_in_output):
    start = max(0, searched - max(len(s) for s in stop_strings) + 2)
    hits = _stop_hits(text, start, stop_strings)
    return None if not hits else min(hits)[0] + (min(hits)[1] if include_stop_str_in_output else 0)


def find_stop_first_listed(text, searched, stop_strings, include_stop_str_in_output):  # not the earliest
    start = max(0, searched - max(len(s) for s in stop_strings) + 1)
    for stop in stop_strings:
        position = text.find(stop, start)
        if position >= 0:
            return position + len(stop) if include_stop_str_in_output else position
    return None


def find_stop_ignores_include(text, searched, stop_strings, include_stop_str_in_output):
    hits = _stop_hits(text, max(0, searched - max(len(s) for s in stop_strings) + 1), stop_strings)
    return min(hits)[0] if hits else None


def find_stop_searches_everything(text, searched, stop_strings, include_stop_str_in_output):  # every time
    hits = [(text.find(s), len(s)) for s in stop_strings if s in text]
    return None if not hits else min(hits)[0] + (min(hits)[1] if include_stop_str_in_output else 0)


def find_stop_longest_at_a_tie(text, searched, stop_strings, include_stop_str_in_output):
    hits = [(p, -n) for p, n in _stop_hits(text, max(0, searched - max(len(s) for s in stop_strings) + 1),
                                          stop_strings)]
    return None if not hits else min(hits)[0] - (min(hits)[1] if include_stop_str_in_output else 0)


def settle_without_context(decode, token_ids, prefix_offset, read_offset):  # the new tokens decoded alone
    text = decode(token_ids[read_offset:])
    if text and not text.endswith("\ufffd"):
        return text, read_offset, len(token_ids)
    return "", prefix_offset, read_offset


def settle_partial_characters(decode, token_ids, prefix_offset, read_offset):  # U+FFFD goes out
    context, tail = decode(token_ids[prefix_offset:read_offset]), decode(token_ids[prefix_offset:])
    if len(tail) > len(context):
        return tail[len(context):], read_offset, len(token_ids)
    return "", prefix_offset, read_offset


def settle_from_the_start(decode, token_ids, prefix_offset, read_offset):  # right text, all decoded every time
    context, tail = decode(token_ids[:read_offset]), decode(token_ids)
    if len(tail) > len(context) and not tail.endswith("\ufffd"):
        return tail[len(context):], 0, len(token_ids)
    return "", 0, read_offset


def settle_read_offset_one_short(decode, token_ids, prefix_offset, read_offset):
    context, tail = decode(token_ids[prefix_offset:read_offset]), decode(token_ids[prefix_offset:])
    if len(tail) > len(context) and not tail.endswith("\ufffd"):
        return tail[len(context):], read_offset, len(token_ids) - 1
    return "", prefix_offset, read_offset


def _cache_attend(cache, layer, rows, num_cached, num_new, q, k, v, write_at=0, read=None, row_of=None):
    from minivllm.attention.base import causal_attention

    outputs, start = [], 0
    for i, (row, cached, new) in enumerate(zip(rows, num_cached, num_new)):
        row = i if row_of == "batch index" else row
        span = slice(start, start + new)
        cache.k[layer, row, cached + write_at:cached + write_at + new] = k[span]
        cache.v[layer, row, cached + write_at:cached + write_at + new] = v[span]
        end = cache.max_len if read == "whole row" else cached + new
        keys, values = (k[span], v[span]) if read == "new only" else (cache.k[layer, row, :end],
                                                                       cache.v[layer, row, :end])
        outputs.append(causal_attention(q[span], keys, values))
        start += new
    return torch.cat(outputs)


def cache_attend_writes_one_slot_late(cache, layer, rows, num_cached, num_new, q, k, v):
    return _cache_attend(cache, layer, rows, num_cached, num_new, q, k, v, write_at=1)


def cache_attend_reads_the_whole_row(cache, layer, rows, num_cached, num_new, q, k, v):  # stale slots read
    return _cache_attend(cache, layer, rows, num_cached, num_new, q, k, v, read="whole row")


def cache_attend_never_reads_the_cache(cache, layer, rows, num_cached, num_new, q, k, v):
    return _cache_attend(cache, layer, rows, num_cached, num_new, q, k, v, read="new only")


def cache_attend_row_by_batch_position(cache, layer, rows, num_cached, num_new, q, k, v):
    return _cache_attend(cache, layer, rows, num_cached, num_new, q, k, v, row_of="batch index")


def decode_attention_sdpa(q, k_cache, v_cache, length):
    group = q.shape[0] // k_cache.shape[1]
    k = k_cache[:length].transpose(0, 1).repeat_interleave(group, 0)
    v = v_cache[:length].transpose(0, 1).repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(q[:, None, :], k, v)[:, 0, :]


def decode_attention_whole_cache(q, k_cache, v_cache, length):  # stale slots read
    group = q.shape[0] // k_cache.shape[1]
    k, v = (c.transpose(0, 1).repeat_interleave(group, 0) for c in (k_cache, v_cache))
    scores = (k @ q[:, :, None])[:, :, 0] / math.sqrt(q.shape[-1])
    return (scores.softmax(-1)[:, None, :] @ v)[:, 0, :]


def decode_attention_heads_tiled(q, k_cache, v_cache, length):  # kv head j serves heads j, j + kv, ... (wrong map)
    group = q.shape[0] // k_cache.shape[1]
    k, v = (c[:length].transpose(0, 1).repeat(group, 1, 1) for c in (k_cache, v_cache))
    scores = (k @ q[:, :, None])[:, :, 0] / math.sqrt(q.shape[-1])
    return (scores.softmax(-1)[:, None, :] @ v)[:, 0, :]


def decode_attention_unscaled(q, k_cache, v_cache, length):
    group = q.shape[0] // k_cache.shape[1]
    k, v = (c[:length].transpose(0, 1).repeat_interleave(group, 0) for c in (k_cache, v_cache))
    return (((k @ q[:, :, None])[:, :, 0]).softmax(-1)[:, None, :] @ v)[:, 0, :]


def static_step_finished_keep_running(prompts, outputs, finished):
    rows = list(range(len(prompts)))
    return (rows, [outputs[i][-1:] if outputs[i] else list(prompts[i]) for i in rows],
            [len(prompts[i]) + len(outputs[i]) - 1 if outputs[i] else 0 for i in rows])


def static_step_skips_a_slot(prompts, outputs, finished):  # the sampled token's own slot counted as written
    rows = [i for i, done in enumerate(finished) if not done]
    return (rows, [outputs[i][-1:] if outputs[i] else list(prompts[i]) for i in rows],
            [len(prompts[i]) + len(outputs[i]) if outputs[i] else 0 for i in rows])


def static_step_rows_renumbered(prompts, outputs, finished):  # the running requests packed into rows 0, 1, ...
    running = [i for i, done in enumerate(finished) if not done]
    return (list(range(len(running))), [outputs[i][-1:] if outputs[i] else list(prompts[i]) for i in running],
            [len(prompts[i]) + len(outputs[i]) - 1 if outputs[i] else 0 for i in running])


def static_step_recomputes(prompts, outputs, finished):  # the whole sequence every step: no use of the cache
    rows = [i for i, done in enumerate(finished) if not done]
    return rows, [list(prompts[i]) + list(outputs[i]) for i in rows], [0 for _ in rows]


def best_fit_first_fit(allocations, size, capacity):
    start = 0
    for begin, end in allocations + [(capacity, capacity)]:
        if begin - start >= size:
            return start
        start = end
    return None


def best_fit_no_tail(allocations, size, capacity):
    gaps, start = [], 0
    for begin, end in allocations:
        if begin - start >= size:
            gaps.append((begin - start, start))
        start = end
    return min(gaps)[1] if gaps else None


def best_fit_ties_to_highest(allocations, size, capacity):
    gaps, start = [], 0
    for begin, end in allocations + [(capacity, capacity)]:
        if begin - start >= size:
            gaps.append((begin - start, -start))
        start = end
    return -min(gaps)[1] if gaps else None


WRONG = {
    "00.parameter_count": [parameter_count_no_final_norm, parameter_count_head_dim_from_hidden],
    "01.rms_norm": [rms_norm_eps_outside, rms_norm_layer_norm, rms_norm_no_weight],
    "01.apply_rope": [rope_interleaved, rope_ignores_positions],
    "01.top_p_filter": [top_p_drops_the_crossing_token, top_p_not_renormalised, top_p_sorted_output],
    "02.find_stop": [find_stop_no_look_back, find_stop_looks_back_one_too_few, find_stop_first_listed,
                     find_stop_ignores_include, find_stop_searches_everything, find_stop_longest_at_a_tie],
    "02.detokenize": [settle_without_context, settle_partial_characters, settle_from_the_start,
                      settle_read_offset_one_short],
    "03.cache_attend": [cache_attend_writes_one_slot_late, cache_attend_reads_the_whole_row,
                        cache_attend_never_reads_the_cache, cache_attend_row_by_batch_position],
    "03.decode_attention": [decode_attention_sdpa, decode_attention_whole_cache, decode_attention_heads_tiled,
                            decode_attention_unscaled],
    "04.static_step": [static_step_finished_keep_running, static_step_skips_a_slot, static_step_rows_renumbered,
                       static_step_recomputes],
    "04.best_fit": [best_fit_first_fit, best_fit_no_tail, best_fit_ties_to_highest],
}

RUN_THE_MODEL = {"02.detokenize", "02.find_stop", "03.cache_attend", "04.static_step"}
