"""Wrong answers to chapter 5's exercises."""

import math

from minivllm.core.block_pool import NoFreeBlocksError


def slot_mapping_block_index_as_offset(block_table, start, count, block_size):
    return [block_table[p // block_size] * block_size + p // block_size for p in range(start, start + count)]


def slot_mapping_off_by_one(block_table, start, count, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start + 1, start + count + 1)]


def slot_mapping_logical_block(block_table, start, count, block_size):  # the block's index, not its id
    return list(range(start, start + count))


def slot_mapping_contiguous(block_table, start, count, block_size):  # the table read only once
    return [block_table[start // block_size] * block_size + start % block_size + i for i in range(count)]


def gather_untrimmed(k_cache, block_table, seq_len):
    return k_cache[block_table].reshape(-1, *k_cache.shape[2:])


def gather_sorted_blocks(k_cache, block_table, seq_len):
    blocks = sorted(block_table[: math.ceil(seq_len / k_cache.shape[1])].tolist())
    return k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:seq_len]


def blocks_needed_floor(num_tokens_after, num_blocks_held, block_size):
    return max(0, num_tokens_after // block_size - num_blocks_held)


def blocks_needed_ignores_held(num_tokens_after, num_blocks_held, block_size):
    return math.ceil(num_tokens_after / block_size)


def blocks_needed_opens_a_block_when_full(num_tokens_after, num_blocks_held, block_size):
    return max(0, num_tokens_after // block_size + 1 - num_blocks_held)


def blocks_needed_without_the_new_token(num_tokens_after, num_blocks_held, block_size):  # the cached ones only
    return max(0, math.ceil((num_tokens_after - 1) / block_size) - num_blocks_held)


def allocate_partial_on_refusal(manager, seq_id, start, count):  # grows the table before finding out it is short
    table = manager.block_tables.setdefault(seq_id, [])
    for index in manager._written_shared_blocks(seq_id, start, count):
        [copy] = manager.pool.allocate(1)
        manager.pending_copies.append((table[index], copy))
        manager.pool.free([table[index]])
        table[index] = copy
    for _ in range(max(0, math.ceil((start + count) / manager.block_size) - len(table))):
        if manager.pool.num_free == 0:
            raise NoFreeBlocksError(1, 0)
        table += manager.pool.allocate(1)


def allocate_no_copy_on_write(manager, seq_id, start, count):  # samples write into a block they share
    needed = max(0, math.ceil((start + count) / manager.block_size) - len(manager.block_tables.get(seq_id, [])))
    if needed > manager.pool.num_free:
        raise NoFreeBlocksError(needed, manager.pool.num_free)
    manager.block_tables.setdefault(seq_id, []).extend(manager.pool.allocate(needed))


def allocate_keeps_shared_reference(manager, seq_id, start, count):  # the copied block's old owner count leaks
    needed = manager.blocks_needed(seq_id, start, count)
    if needed > manager.pool.num_free:
        raise NoFreeBlocksError(needed, manager.pool.num_free)
    table = manager.block_tables.setdefault(seq_id, [])
    for index in manager._written_shared_blocks(seq_id, start, count):
        [copy] = manager.pool.allocate(1)
        manager.pending_copies.append((table[index], copy))
        table[index] = copy
    table += manager.pool.allocate(max(0, math.ceil((start + count) / manager.block_size) - len(table)))


WRONG = {
    "05.slot_mapping": [slot_mapping_block_index_as_offset, slot_mapping_off_by_one, slot_mapping_logical_block,
                        slot_mapping_contiguous],
    "05.gather_kv": [gather_untrimmed, gather_sorted_blocks],
    "05.blocks_needed": [blocks_needed_floor, blocks_needed_ignores_held, blocks_needed_opens_a_block_when_full,
                         blocks_needed_without_the_new_token],
    "05.allocate": [allocate_partial_on_refusal, allocate_no_copy_on_write, allocate_keeps_shared_reference],
}

RUN_THE_MODEL = {"05.slot_mapping", "05.blocks_needed"}
