"""Chapter 8's exercise kernel: the paged decode kernel without split-K, its online-softmax update of one tile
left to a function passed in (`TILE_UPDATE`). Import it only after
`minivllm.kernels.interpreter.use_interpreter_without_gpu()`: the exercise runs it in Triton's interpreter,
where the function it calls may be plain Python."""

import math

import torch
import triton
import triton.language as tl


@triton.jit
def decode_kernel_with_tile_update(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale_log2,
    stride_q_token, stride_q_head, stride_cache_block, stride_cache_token, stride_cache_head, stride_table_seq,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE_UPDATE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
                mask=head_ok[:, None], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for tile_start in range(0, seq_len, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_ok = keys < seq_len
        blocks = tl.load(block_tables_ptr + seq * stride_table_seq + keys // BLOCK_SIZE, mask=key_ok, other=0)
        rows = (blocks.to(tl.int64) * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_token
                + kv_head * stride_cache_head)
        k = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m, l, acc = TILE_UPDATE(m, l, acc, scores, v)  # the reader's online-softmax step
    out = acc / tl.where(head_ok, l, 1.0)[:, None]
    tl.store(out_ptr + (seq * num_heads + heads)[:, None] * HEAD_DIM + dims[None, :], out, mask=head_ok[:, None])


def decode_with_tile_update(tile_update, q, k_cache, v_cache, block_tables, seq_lens, block_n: int = 16):
    """Decode attention (q: [num_seqs, num_heads, head_dim], float32) through the kernel above, calling
    `tile_update(m, l, acc, scores, v) -> (m, l, acc)` once per tile of `block_n` keys."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    decode_kernel_with_tile_update[(num_seqs, num_kv_heads)](
        out, q, k_cache, v_cache, block_tables, seq_lens, math.log2(math.e) / math.sqrt(head_dim),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        BLOCK_N=block_n, TILE_UPDATE=tile_update,
    )
    return out
