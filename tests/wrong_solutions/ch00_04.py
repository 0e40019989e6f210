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


def intensity_weights_only(tokens, d_in, d_out, bytes_per_element):
    return 2 * tokens * d_in * d_out / (bytes_per_element * d_in * d_out)


def intensity_no_factor_two(tokens, d_in, d_out, bytes_per_element):
    return tokens * d_in * d_out / (bytes_per_element * (d_in * d_out + tokens * d_in + tokens * d_out))


def ttft_tpot_divides_by_tokens(arrival, token_times):
    ttft = token_times[0] - arrival
    return ttft, ((token_times[-1] - token_times[0]) / len(token_times)) if len(token_times) > 1 else None


def ttft_tpot_from_arrival(arrival, token_times):
    ttft = token_times[0] - arrival
    return ttft, ((token_times[-1] - arrival) / len(token_times)) if len(token_times) > 1 else None


def kv_bytes_keys_only(hf_config, num_tokens, dtype_bytes):
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    return hf_config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes * num_tokens


def kv_bytes_all_heads(hf_config, num_tokens, dtype_bytes):  # GQA ignored
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    return 2 * hf_config["num_hidden_layers"] * heads * head_dim * dtype_bytes * num_tokens


def kv_bytes_head_dim_from_hidden(hf_config, num_tokens, dtype_bytes):
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config["hidden_size"] // heads
    return 2 * hf_config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes * num_tokens


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


def slot_states_internal_from_stored(running, budget):
    return dict(token_states=sum(s for _, s, _ in running), reservation=sum(f - s for _, s, f in running),
                internal=sum(r - s for r, s, _ in running), free=budget - sum(r for r, _, _ in running))


def slot_states_free_after_tokens(running, budget):
    return dict(token_states=sum(s for _, s, _ in running), reservation=sum(f - s for _, s, f in running),
                internal=sum(r - f for r, _, f in running), free=budget - sum(s for _, s, _ in running))


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
    "02.linear_intensity": [intensity_weights_only, intensity_no_factor_two],
    "02.ttft_tpot": [ttft_tpot_divides_by_tokens, ttft_tpot_from_arrival],
    "03.kv_cache_bytes": [kv_bytes_keys_only, kv_bytes_all_heads, kv_bytes_head_dim_from_hidden],
    "03.decode_attention": [decode_attention_sdpa, decode_attention_whole_cache, decode_attention_heads_tiled,
                            decode_attention_unscaled],
    "04.slot_states": [slot_states_internal_from_stored, slot_states_free_after_tokens],
    "04.best_fit": [best_fit_first_fit, best_fit_no_tail, best_fit_ties_to_highest],
}
