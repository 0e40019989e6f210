"""Wrong answers to the exercises of chapters 11, 12 and the appendix."""

import numpy as np
import torch

from minivllm.core.kv_cache_utils import SEED_HASH, hash_block


class _VocabShard(torch.nn.Module):
    """What every wrong embedding below shares: rank's rows of the table, and its range."""

    def __init__(self, embedding, rank, world_size, all_reduce):
        super().__init__()
        part = embedding.num_embeddings // world_size
        self.start, self.end, self.all_reduce = rank * part, (rank + 1) * part, all_reduce
        self.weight = torch.nn.Parameter(embedding.weight.data[self.start:self.end].clone(), requires_grad=False)

    def local(self, input_ids):
        return (input_ids - self.start).clamp(0, self.end - self.start - 1)


class VocabEmbeddingNotZeroed(_VocabShard):  # clamped ids out of range look up a real row, and it is summed in
    def forward(self, input_ids):
        return self.all_reduce(self.weight[self.local(input_ids)])


class VocabEmbeddingNoOffset(_VocabShard):  # the shard's row 0 is id `start`, not id 0
    def forward(self, input_ids):
        mine = (input_ids >= self.start) & (input_ids < self.end)
        rows = self.weight[input_ids.clamp(0, self.end - self.start - 1)]
        return self.all_reduce(rows * mine.unsqueeze(-1))


class VocabEmbeddingNoAllReduce(_VocabShard):  # each rank has only its own ids' rows
    def forward(self, input_ids):
        mine = (input_ids >= self.start) & (input_ids < self.end)
        return self.weight[self.local(input_ids)] * mine.unsqueeze(-1)


class VocabEmbeddingRangeOffByOne(_VocabShard):  # the next range's first id counted here too
    def forward(self, input_ids):
        mine = (input_ids >= self.start) & (input_ids <= self.end)
        return self.all_reduce(self.weight[self.local(input_ids)] * mine.unsqueeze(-1))


class VocabEmbeddingWholeTable(torch.nn.Module):  # right rows, but every rank keeps the whole vocabulary
    def __init__(self, embedding, rank, world_size, all_reduce):
        super().__init__()
        self.embedding, self.rank, self.world_size = embedding, rank, world_size

    def forward(self, input_ids):
        return self.embedding(input_ids)


def shard_qkv_as_one(weight, num_heads, num_kv_heads, head_dim, rank, world_size):  # cuts through q, k and v
    return weight.chunk(world_size, dim=0)[rank]


def shard_qkv_kv_replicated(weight, num_heads, num_kv_heads, head_dim, rank, world_size):
    q, k, v = weight.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
    return torch.cat([q.chunk(world_size, 0)[rank], k, v])


def shard_qkv_interleaved_heads(weight, num_heads, num_kv_heads, head_dim, rank, world_size):
    q, k, v = weight.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
    parts = []
    for part, heads in ((q, num_heads), (k, num_kv_heads), (v, num_kv_heads)):
        parts.append(part.reshape(heads, head_dim, -1)[rank::world_size].reshape(-1, part.shape[-1]))
    return torch.cat(parts)


def _chain(token_ids, block_size, salt, count, every_block_salted=False):
    parent, hashes = SEED_HASH, []
    for index in range(count):
        extra = (salt,) if salt is not None and (index == 0 or every_block_salted) else ()
        parent = hash_block(parent, token_ids[index * block_size:(index + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


def cached_prefix_last_block_too(token_ids, block_size, cache_salt, held):  # the last-token rule forgotten
    count = 0
    for h in _chain(token_ids, block_size, cache_salt, len(token_ids) // block_size):
        if h not in held:
            break
        count += 1
    return count * block_size


def cached_prefix_counts_past_a_gap(token_ids, block_size, cache_salt, held):
    hashes = _chain(token_ids, block_size, cache_salt, (len(token_ids) - 1) // block_size)
    return sum(h in held for h in hashes) * block_size


def cached_prefix_salt_ignored(token_ids, block_size, cache_salt, held):
    count = 0
    for h in _chain(token_ids, block_size, None, (len(token_ids) - 1) // block_size):
        if h not in held:
            break
        count += 1
    return count * block_size


def choose_least_loaded(block_hashes, loads, index):
    return min(loads, key=lambda r: (loads[r], r))


def choose_ties_to_highest(block_hashes, loads, index):
    return max(loads, key=lambda r: (index.cached_prefix(r, block_hashes), -loads[r], r))


def choose_counts_blocks_not_prefix(block_hashes, loads, index):
    return min(loads, key=lambda r: (-sum(h in index.blocks[r] for h in block_hashes), loads[r], r))


def dequantize_interleaved_nibbles(block):
    d, m = np.frombuffer(block[:4], dtype=np.float16).astype(np.float32)
    nibbles = np.frombuffer(block[4:20], dtype=np.uint8)
    q = np.stack([nibbles & 0x0F, nibbles >> 4], axis=1).reshape(-1).astype(np.float32)
    return d * q + m


def dequantize_no_min(block):
    d, _ = np.frombuffer(block[:4], dtype=np.float16).astype(np.float32)
    nibbles = np.frombuffer(block[4:20], dtype=np.uint8)
    return d * np.concatenate([nibbles & 0x0F, nibbles >> 4]).astype(np.float32)


def dequantize_q4_0_style(block):  # centred at 8, as Q4_0 is
    d, m = np.frombuffer(block[:4], dtype=np.float16).astype(np.float32)
    nibbles = np.frombuffer(block[4:20], dtype=np.uint8)
    return d * (np.concatenate([nibbles & 0x0F, nibbles >> 4]).astype(np.float32) - 8) + m


def unpermute_permutes_again(weight, num_heads):
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def unpermute_identity(weight, num_heads):
    return weight.clone()


WRONG = {
    "11.vocab_parallel_embedding": [VocabEmbeddingNotZeroed, VocabEmbeddingNoOffset, VocabEmbeddingNoAllReduce,
                                    VocabEmbeddingRangeOffByOne, VocabEmbeddingWholeTable],
    "11.shard_qkv": [shard_qkv_as_one, shard_qkv_kv_replicated, shard_qkv_interleaved_heads],
    "12.cached_prefix_tokens": [cached_prefix_last_block_too, cached_prefix_counts_past_a_gap,
                                cached_prefix_salt_ignored],
    "12.choose": [choose_least_loaded, choose_ties_to_highest, choose_counts_blocks_not_prefix],
    "90.dequantize_q4_1": [dequantize_interleaved_nibbles, dequantize_no_min, dequantize_q4_0_style],
    "90.unpermute": [unpermute_permutes_again, unpermute_identity],
}
