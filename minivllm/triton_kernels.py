import math

import torch

from minivllm.triton_attention import TRITON_INTERPRETED  # first: on a machine without CUDA it sets TRITON_INTERPRET

import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(
    out_ptr, lse_ptr,  # per split: output [seqs, heads, splits, head_dim] and log2-sum-exp [seqs, heads, splits]
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works with exp2, one instruction on a GPU
    tokens_per_split,
    stride_q_token, stride_q_head,
    stride_cache_block, stride_cache_token, stride_cache_head,
    stride_table_seq,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    # GQA: the GROUP query heads that share this kv head are rows of one tile, so K and V are read once for all
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of each row's scores
    l = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)  # running sum of exp2(score - m) * v

    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    for tile_start in range(start, end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        # the block table turns a key's position into its physical block; a tile may span several blocks
        blocks = tl.load(block_tables_ptr + seq * stride_table_seq + keys // BLOCK_SIZE, mask=key_ok, other=0)
        rows = (blocks.to(tl.int64) * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_token
                + kv_head * stride_cache_head)
        kv_ok = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=kv_ok, other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)  # rescales what was summed under the old max
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    has_keys = l > 0  # a split that starts past the end of a short sequence saw no key at all
    l_safe = tl.where(has_keys, l, 1.0)
    out_rows = (seq * num_heads + heads) * num_splits + split
    tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :], (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None] & dim_ok[None, :])
    tl.store(lse_ptr + out_rows, tl.where(has_keys, m + tl.log2(l_safe), float("-inf")), mask=head_ok)


@triton.jit
def merge_splits_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, stride_out_token, stride_out_head,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    first = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    lse = tl.load(partial_lse_ptr + first + splits, mask=split_ok, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))  # split 0 always has keys, so the max is finite
    parts = tl.load(partial_out_ptr + (first + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(weights[:, None] * parts, 0) / tl.sum(weights, 0)
    tl.store(out_ptr + seq * stride_out_token + head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_ok)


DECODE_TILE = dict(block_n=64, num_warps=4, num_stages=2)  # not tuned yet: `make gpu-check` sweeps these
MIN_TOKENS_PER_SPLIT = 512  # a split shorter than a few tiles spends more on its prologue and merge than it saves


def check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    """ValueError naming the first argument that does not fit the paged layout, before any kernel runs."""
    if q.dim() != 3:
        raise ValueError(f"q has shape {tuple(q.shape)}: expected [num_tokens, num_heads, head_dim]")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}: expected both "
                         "[num_blocks, block_size, num_kv_heads, head_dim]")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides, with head_dim contiguous")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q is {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}: expected one dtype")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q has head_dim {q.shape[2]}, the cache {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's {k_cache.shape[2]} kv heads")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables is {block_tables.dtype} {tuple(block_tables.shape)}: expected int32 "
                         "[num_seqs, max_blocks]")
    if seq_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"seq_lens has shape {tuple(seq_lens.shape)}: expected ({block_tables.shape[0]},), "
                         "one length per row of block_tables")


def dot_precision(dtype: torch.dtype):
    """fp32 products exactly as the reference computes them; a GPU would otherwise round fp32 inputs to tf32."""
    return "ieee" if dtype == torch.float32 else None


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split-K: cut long contexts into parts that run in parallel when the batch alone cannot fill the GPU."""
    if device.type != "cuda":
        return 1
    programs_wanted = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(programs_wanted, num_seqs * num_kv_heads), max_seq_len // MIN_TOKENS_PER_SPLIT, 16))


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len: int, *,
                           num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None) -> torch.Tensor:
    """One new token per sequence (q: [num_seqs, num_heads, head_dim]) over its seq_lens[i] cached keys, read in
    place through the block tables. max_seq_len: seq_lens.max(), known on the host (reading it here would stall)."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens for {block_tables.shape[0]} sequences: decode is one each")
    block_n = block_n or DECODE_TILE["block_n"]
    num_splits = num_splits or choose_num_splits(num_seqs, num_kv_heads, max_seq_len, q.device)
    tokens_per_split = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n  # whole tiles
    group = num_heads // num_kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    partial_out = out if num_splits == 1 else q.new_empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32)
    partial_lse = q.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
    paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        partial_out, partial_lse, q, k_cache, v_cache, block_tables, seq_lens,
        math.log2(math.e) / math.sqrt(head_dim), tokens_per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot wants tiles of at least 16
        BLOCK_SIZE=block_size, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype),
        num_warps=num_warps or DECODE_TILE["num_warps"], num_stages=num_stages or DECODE_TILE["num_stages"],
    )
    if num_splits > 1:
        merge_splits_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_lse, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        )
    return out


@triton.jit
def paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_token, stride_cache_head,
    stride_table_seq,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    query_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - query_len  # tokens cached before this step: a prefix hit, earlier chunks

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # which of this sequence's new tokens
    row_ok = rows < query_len
    positions = context_len + rows  # query i sits at context_len + i and sees keys 0 .. context_len + i
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    # causality bounds the loop: no query of this tile sees past its last query's position. A tile past the
    # sequence's new tokens (the grid is sized for the longest one) has nothing to do.
    last_row = tl.minimum(q_tile * BLOCK_M + BLOCK_M, query_len)
    kv_end = tl.where(q_tile * BLOCK_M < query_len, context_len + last_row, 0)
    for tile_start in range(0, kv_end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        blocks = tl.load(block_tables_ptr + seq * stride_table_seq + keys // BLOCK_SIZE, mask=key_ok, other=0)
        kv_rows = (blocks.to(tl.int64) * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_token
                   + kv_head * stride_cache_head)
        kv_ok = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_rows[:, None] + dims[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_cache_ptr + kv_rows[:, None] + dims[None, :], mask=kv_ok, other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        # key 0 is in the first tile and every query sees it, so m is finite from the first tile on
        visible = key_ok[None, :] & (keys[None, :] <= positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    out = acc / tl.where(row_ok, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_out_token + head * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


PREFILL_TILE = dict(block_m=64, block_n=64, num_warps=4, num_stages=2)  # not tuned yet: `make gpu-check` sweeps these


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len: int, *,
                            block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None) -> torch.Tensor:
    """Sequence i's new tokens q[query_start_loc[i]:query_start_loc[i+1]] are the last ones of its seq_lens[i]
    keys (cached prefix + new tokens, all already in the cache); each attends causally. Any query lengths,
    decodes included. max_query_len: the longest, known on the host."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    if query_start_loc.shape != (block_tables.shape[0] + 1,):
        raise ValueError(f"query_start_loc has shape {tuple(query_start_loc.shape)}: expected "
                         f"({block_tables.shape[0] + 1},), num_seqs + 1 offsets")
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    # a short chunk (or a decode in a mixed batch) should not pay for a 64-row tile of empty queries
    block_m = block_m or min(PREFILL_TILE["block_m"], max(16, triton.next_power_of_2(max_query_len)))
    q = q.contiguous()
    out = torch.empty_like(q)
    paged_prefill_kernel[(num_seqs, triton.cdiv(max_query_len, block_m), num_heads)](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        math.log2(math.e) / math.sqrt(head_dim),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), GROUP=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n or PREFILL_TILE["block_n"],
        PRECISION=dot_precision(q.dtype),
        num_warps=num_warps or PREFILL_TILE["num_warps"], num_stages=num_stages or PREFILL_TILE["num_stages"],
    )
    return out
