"""Chapter 5 exercises."""

import torch

from minivllm.exercises import close, exercise, expect


@exercise("05.slot_mapping")
def _slot_mapping():
    def case(table, start, count, block_size):
        def test(slot_mapping):
            want = [table[p // block_size] * block_size + p % block_size for p in range(start, start + count)]
            got = list(slot_mapping(list(table), start, count, block_size))
            expect(got == want, f"slot_mapping({table}, {start}, {count}, {block_size}) = {got}, expected {want}")
        return test

    return [
        ("a prefill from position 0", case([7, 2, 9], 0, 10, 4)),
        ("one decode token at a block boundary", case([3, 0, 5], 8, 1, 4)),
        ("a chunk in the middle", case([11, 4, 6, 1], 5, 9, 4)),
        ("block size 16", case([40, 3], 14, 4, 16)),
        ("block size 1", case([5, 1, 4, 2], 1, 3, 1)),
    ]


@exercise("05.gather_kv")
def _gather_kv():
    def case(num_blocks, block_size, table, seq_len):
        def test(gather_kv):
            cache = torch.randn(num_blocks, block_size, 2, 8, generator=torch.Generator().manual_seed(seq_len))
            want = torch.cat([cache[b] for b in table])[:seq_len]
            close(gather_kv(cache, torch.tensor(table), seq_len), want, f"table {table}, seq_len {seq_len}", atol=0)
        return test

    return [
        ("one full block", case(4, 4, [2], 4)),
        ("scattered blocks, last one partial", case(10, 4, [7, 1, 3], 10)),
        ("a table longer than the sequence", case(10, 8, [5, 0, 9], 9)),
        ("a single token", case(3, 16, [1], 1)),
    ]


@exercise("05.blocks_needed")
def _blocks_needed():
    def case(after, held, block_size, want):
        def test(blocks_needed):
            got = blocks_needed(after, held, block_size)
            expect(got == want, f"blocks_needed({after}, {held}, {block_size}) = {got}, expected {want}")
        return test

    return [
        ("an empty sequence's prompt", case(33, 0, 16, 3)),
        ("a decode inside the last block", case(20, 2, 16, 0)),
        ("a decode that opens a block", case(33, 2, 16, 1)),
        ("exactly full", case(32, 1, 16, 1)),
        ("already more than enough", case(5, 3, 4, 0)),
    ]
