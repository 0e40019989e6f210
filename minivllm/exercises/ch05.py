"""Chapter 5 exercises."""

import torch

from minivllm.exercises import CheckFailed, case_seed, close, exercise, expect


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
            gen = torch.Generator().manual_seed(case_seed(seq_len))
            cache = torch.randn(num_blocks, block_size, 2, 8, generator=gen)
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


@exercise("05.allocate")
def _allocate():
    """The reader's allocate(manager, seq_id, start, count) replaces KVCacheManager.allocate in chapter 5's
    StaticPagedGenerator: n greedy samples of each prompt are forked, sharing the prompt's blocks."""
    from minivllm.book.mechanism_checks import divergence, greedy_reference, passage_prompts, tiny_model
    from minivllm.book.static_paged import StaticPagedGenerator
    from minivllm.core.block_pool import BlockPool, NoFreeBlocksError
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.sampling_params import SamplingParams

    def manager_class(allocate):
        class ReaderManager(KVCacheManager):
            num_copies = 0

            def allocate(self, seq_id, start, count):
                before = len(self.pending_copies)
                allocate(self, seq_id, start, count)
                self.num_copies += len(self.pending_copies) - before
        return ReaderManager

    def run(allocate, lengths, n, block_size, num_blocks=64, max_tokens=8):
        model, tokenizer, _ = tiny_model()
        generator = StaticPagedGenerator(model, num_blocks, block_size, tokenizer)
        generator.manager = manager_class(allocate or KVCacheManager.allocate)(generator.pool, block_size)
        prompts = passage_prompts(lengths)
        samples = generator.generate(prompts, SamplingParams(temperature=0, n=n, max_tokens=max_tokens, ignore_eos=True))
        return generator, prompts, samples

    def forked(lengths, n, block_size):
        def test(allocate):
            generator, prompts, samples = run(allocate, lengths, n, block_size)
            for i, (prompt, group) in enumerate(zip(prompts, samples)):
                want = greedy_reference(prompt, 8)
                for j, sample in enumerate(group):
                    where = divergence(list(sample.token_ids), want)
                    expect(where is None, f"prompt {i} ({len(prompt)} tokens), sample {j}: {where}")
            pool = generator.pool
            expect(pool.num_free == pool.num_blocks and not any(pool.ref_counts),
                   f"after generate, {pool.num_blocks - pool.num_free} blocks still held "
                   f"(reference counts {[(b, r) for b, r in enumerate(pool.ref_counts) if r]}): a block was leaked")
            want_copies = sum((n - 1) * (len(p) % block_size != 0) for p in prompts)
            expect(generator.manager.num_copies == want_copies,
                   f"{generator.manager.num_copies} copy-on-write copies, expected {want_copies}: each of the "
                   f"first n - 1 samples writing into a shared, partly filled last block copies it; "
                   f"a block-aligned prompt, or a block nobody else holds, is not copied")
            reference = run(None, lengths, n, block_size)[0]
            expect(generator.peak_blocks_used == reference.peak_blocks_used,
                   f"peak {generator.peak_blocks_used} blocks in use, expected {reference.peak_blocks_used}")
        return test

    def all_or_nothing(allocate):
        manager = manager_class(allocate)(BlockPool(3), 4)
        allocate(manager, "a", 0, 8)
        expect(manager.block_tables.get("a") is not None and len(manager.block_tables["a"]) == 2,
               f"8 tokens, block size 4: table {manager.block_tables.get('a')}, expected 2 blocks")
        table, free = list(manager.block_tables["a"]), manager.pool.num_free
        try:
            allocate(manager, "a", 8, 12)  # 3 more blocks, 1 free
        except NoFreeBlocksError:
            pass
        else:
            raise CheckFailed("positions 8..19 need 3 more blocks with 1 free: expected NoFreeBlocksError")
        expect(manager.block_tables["a"] == table and manager.pool.num_free == free,
               f"a refused allocation changed the table ({table} -> {manager.block_tables['a']}) "
               f"or the free count ({free} -> {manager.pool.num_free}): it must change nothing")

    return [
        ("refused when short, changing nothing", all_or_nothing),
        ("n = 3 samples, prompts with partial last blocks (block size 4)", forked([13, 22], 3, 4)),
        ("n = 2 samples, a block-aligned prompt among others (block size 8)", forked([16, 21, 9], 2, 8)),
        ("n = 4 samples, block size 16", forked([35], 4, 16)),
    ]
