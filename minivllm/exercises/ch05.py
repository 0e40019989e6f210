"""Chapter 5 exercises: the slot mapping and the block count run inside a real LLMEngine; the allocation with
copy-on-write inside the chapter's StaticPagedGenerator."""

import torch

from minivllm.exercises import CheckFailed, case_random, case_seed, close, exercise, expect
from minivllm.exercises.harness import expect_blocks_back, expect_transformers_tokens, paged_engine, step_engine


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


@exercise("05.allocate")
def _allocate():
    """The reader's allocate(manager, seq_id, start, count) replaces CopyOnWriteKVCacheManager.allocate in chapter 5's
    StaticPagedGenerator: n greedy samples of each prompt are forked, sharing the prompt's blocks."""
    from minivllm.book.mechanism_checks import divergence, greedy_reference, passage_prompts, tiny_model
    from minivllm.book.static_paged import CopyOnWriteKVCacheManager, StaticPagedGenerator
    from minivllm.core.block_pool import BlockPool, NoFreeBlocksError
    from minivllm.sampling_params import SamplingParams

    def manager_class(allocate):
        class ReaderManager(CopyOnWriteKVCacheManager):
            num_copies = 0

            def allocate(self, seq_id, start, count):
                before = len(self.pending_copies)
                allocate(self, seq_id, start, count)
                self.num_copies += len(self.pending_copies) - before
        return ReaderManager

    def run(allocate, lengths, n, block_size, num_blocks=64, max_tokens=8):
        model, tokenizer, _ = tiny_model()
        generator = StaticPagedGenerator(model, num_blocks, block_size, tokenizer)
        generator.manager = manager_class(allocate or CopyOnWriteKVCacheManager.allocate)(generator.pool, block_size)
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


@exercise("05.slot_mapping")
def _slot_mapping():
    """The reader's slot_mapping(block_table, start, count, block_size) computes the slots of every request's
    new tokens inside the model runner's BlockTables.batch, in a real LLMEngine whose free blocks were shuffled:
    the model writes each token's keys and values where the reader says, and reads them back through the block
    tables. Tokens are checked against transformers, slots against the runner's own."""
    from minivllm.book.mechanism_checks import passage_prompts
    from minivllm.config import EngineConfig
    from minivllm.engine.model_runner import BlockTables

    def reader_tables(slot_mapping, first_difference: list):
        class ReaderBlockTables(BlockTables):
            step = 0

            def batch(self, kv_cache, work, backend=None):
                input_ids, positions, metadata = super().batch(kv_cache, work, *([backend] if backend else []))
                self.step += 1
                size, theirs, slots = kv_cache.block_size, metadata.slot_mapping.tolist(), []
                for request_id, tokens, start in work:
                    row = self.rows[request_id]
                    table = self.table[row, :int(self.lengths[row])].tolist()
                    mine = [int(s) for s in slot_mapping(list(table), start, len(tokens), size)]
                    expect(len(mine) == len(tokens), f"step {self.step}, request {request_id}: {len(mine)} slots "
                                                     f"for {len(tokens)} new tokens")
                    want = theirs[len(slots):len(slots) + len(tokens)]
                    if mine != want and not first_difference:
                        first_difference.append(
                            f"step {self.step}, request {request_id}, positions {start}..{start + len(tokens) - 1}, "
                            f"block table {table}, block size {size}: your slots {mine}, the runner's {want}")
                    slots += mine
                metadata.slot_mapping = torch.tensor(slots, dtype=torch.long, device=metadata.slot_mapping.device)
                return input_ids, positions, metadata
        return ReaderBlockTables

    def case(lengths, max_tokens, budget, shuffle_seed, num_blocks=48):
        def test(slot_mapping):
            prompts, first_difference = passage_prompts(lengths), []
            config = EngineConfig(block_size=16, num_kv_blocks=num_blocks, max_num_seqs=4,
                                  max_num_batched_tokens=budget)
            engine = paged_engine(config, prompts, max_tokens, shuffle_seed)
            engine.model_runner.block_tables.__class__ = reader_tables(slot_mapping, first_difference)
            while engine.has_unfinished_requests():
                step_engine(engine)
            hint = f" (first wrong slots: {first_difference[0]})" if first_difference else ""
            expect_transformers_tokens(engine, prompts, max_tokens, hint)
            expect(not first_difference, f"the tokens are right, but {(first_difference or [''])[0]}")
            expect_blocks_back(engine)
        return test

    rng = case_random("05.slot_mapping")
    drawn = [rng.randrange(1, 70) for _ in range(rng.randrange(2, 5))]
    drawn_budget = rng.randrange(5, 40)
    return [
        ("prompts of 15, 16 and 17 tokens, decodes across the block edge", case([15, 16, 17], 6, 64, 1)),
        ("prefill chunks of 24 tokens that start and end inside blocks", case([40, 33, 9], 10, 24, 2)),
        ("one token per chunk: every position on its own", case([18], 3, 1, 3)),
        (f"random: prompts of {drawn} tokens, chunks of {drawn_budget}", case(drawn, 8, drawn_budget,
                                                                             rng.randrange(10**6))),
    ]


@exercise("05.blocks_needed")
def _blocks_needed():
    """The reader's blocks_needed(num_tokens_after, num_blocks_held, block_size) decides how many new blocks the
    engine's KV manager allocates for every request at every step, under a budget of blocks tight enough to
    preempt; an engine with its own manager runs side by side. Step for step, the same requests are scheduled
    and preempted; every count equals the manager's own; the tokens are transformers'; every block comes back."""
    from minivllm.book.mechanism_checks import passage_prompts
    from minivllm.config import EngineConfig
    from minivllm.core.block_pool import NoFreeBlocksError
    from minivllm.core.kv_cache_manager import KVCacheManager

    def reader_manager(blocks_needed, first_difference: list):
        class ReaderManager(KVCacheManager):
            def allocate(self, seq_id, start, count):
                held = len(self.block_tables.get(seq_id, []))
                mine = blocks_needed(start + count, held, self.block_size)
                expect(isinstance(mine, int) and not isinstance(mine, bool),
                       f"blocks_needed({start + count}, {held}, {self.block_size}) = {mine!r}: a whole number")
                theirs = KVCacheManager.blocks_needed(self, seq_id, start, count)
                if mine != theirs and not first_difference:
                    first_difference.append(f"request {seq_id} holds {held} blocks of {self.block_size} and writes "
                                            f"positions {start}..{start + count - 1}: blocks_needed({start + count}, "
                                            f"{held}, {self.block_size}) = {mine}, the manager's own count is {theirs}")
                if mine > self.pool.num_free:
                    raise NoFreeBlocksError(mine, self.pool.num_free)
                self.block_tables.setdefault(seq_id, []).extend(self.pool.allocate(max(mine, 0)))
        return ReaderManager

    def decisions(engine):
        out = engine.last_schedule
        return [(r.request_id, n) for r, n in out.scheduled], [r.request_id for r in out.preempted]

    def case(lengths, max_tokens, block_size, num_blocks, budget, preempts=True):
        def test(blocks_needed):
            prompts, first_difference = passage_prompts(lengths), []
            config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_num_seqs=4,
                                  max_num_batched_tokens=budget)
            reader = reader_manager(blocks_needed, first_difference)
            engine = paged_engine(config, prompts, max_tokens, manager_class=reader)
            reference = paged_engine(config, prompts, max_tokens)
            step = 0
            while reference.has_unfinished_requests() or engine.has_unfinished_requests():
                step += 1
                expect(step < 500, "no end after 500 steps")
                hint = f" (first wrong count: {first_difference[0]})" if first_difference else ""
                try:
                    step_engine(engine)
                except (CheckFailed, NotImplementedError):
                    raise
                except Exception as error:
                    raise CheckFailed(f"step {step}: the engine failed, {type(error).__name__}: {error}"
                                      f"{hint}") from None
                step_engine(reference)
                (mine, my_victims), (theirs, their_victims) = decisions(engine), decisions(reference)
                expect(my_victims == their_victims, f"step {step}: preempted {my_victims}, the engine's own manager "
                                                    f"leads to {their_victims}{hint}")
                expect(mine == theirs, f"step {step}: scheduled {mine}, with the engine's own manager {theirs}{hint}")
            expect_transformers_tokens(engine, prompts, max_tokens)
            expect(not first_difference, f"the steps are the engine's, but {(first_difference or [''])[0]}")
            expect_blocks_back(engine)
            expect(reference.scheduler.num_preemptions > 0 or not preempts,
                   f"{num_blocks} blocks and nothing preempted: the case proved less than it should")
        return test

    rng = case_random("05.blocks_needed")
    drawn = [rng.randrange(3, 60) for _ in range(rng.randrange(3, 6))]
    return [
        ("plenty of blocks: prompts of 15, 16, 17 and 32 tokens, decodes across block edges",
         case([15, 16, 17, 32], 8, 16, 64, 64, preempts=False)),
        ("18 blocks of 4 tokens: preemption, and readmission", case([22, 13, 16, 9], 12, 4, 18, 20)),
        ("6 blocks of 16 tokens: a prompt chunked to 20, preemption", case([47, 31, 16], 12, 16, 6, 20)),
        (f"random: prompts of {drawn} tokens in 20 blocks of 4", case(drawn, 10, 4, 20, rng.randrange(8, 40),
                                                                      preempts=False)),
    ]
