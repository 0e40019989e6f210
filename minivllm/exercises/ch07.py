"""Chapter 7 exercises."""

from minivllm.exercises import case_random, exercise, expect, forbidden_calls


@exercise("07.shared_blocks")
def _shared_blocks():
    def reference(a, b, size):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return min(same // size, (len(b) - 1) // size, len(a) // size) * size

    def case(a, b, size, what):
        def test(shared_blocks):
            got, want = shared_blocks(list(a), list(b), size), reference(a, b, size)
            expect(got == want, f"{what}: shared_blocks(len {len(a)}, len {len(b)}, {size}) = {got}, expected {want}")
        return test

    rng = case_random("07.shared_blocks")
    base = [rng.randrange(1000) for _ in range(100)]
    return [
        ("nothing in common", case(base, [7] + base[1:], 16, "differs at token 0")),
        ("differs inside block 3", case(base, base[:50] + [1] + base[51:], 16, "differs at token 50")),
        ("b extends a", case(base[:64], base, 16, "a's 4 full blocks")),
        ("identical, block-aligned: the last block is recomputed", case(base[:64], base[:64], 16, "64 tokens")),
        ("identical, not aligned", case(base[:70], base[:70], 16, "70 tokens")),
        ("a's partial block is not cached", case(base[:40], base, 16, "a has 2 full blocks")),
        ("block size 1", case(base, base[:30] + [5], 1, "differs at token 30")),
    ]


def _chain_reference(token_ids, block_size, salt):
    """The chain written out once more, apart from the package's: block k's hash covers its parent's hash,
    its tokens, and (block 0 only) the salt; a partial last block has none."""
    from minivllm.core.kv_cache_utils import SEED_HASH, hash_block

    full = [token_ids[start:start + block_size] for start in range(0, len(token_ids), block_size)]
    full = [block for block in full if len(block) == block_size]
    chain = [SEED_HASH]
    for k, block in enumerate(full):
        chain.append(hash_block(chain[-1], block, () if k or salt is None else (salt,)))
    return chain[1:]


def _package_chains():
    """The package's own chain functions, which the reader's chain may not call."""
    from minivllm.core import kv_cache_manager, kv_cache_utils

    found = [getattr(kv_cache_utils, name, None) for name in ("block_hashes", "extend_hash_chain")]
    found += [getattr(cls, "block_hashes", None) for cls in vars(kv_cache_manager).values() if isinstance(cls, type)]
    return [f for f in found if callable(f) and hasattr(f, "__code__")]


@exercise("07.chain")
def _chain():
    def case(tokens, size, salt, what):
        def test(chain):
            with forbidden_calls(_package_chains(), "write the chain from hash_block yourself"):
                got = list(chain(list(tokens), size, salt))
            want = _chain_reference(tokens, size, salt)
            expect(len(got) == len(want), f"{what}: {len(got)} hashes, expected {len(want)} (one per full block)")
            wrong = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
            expect(wrong is None, f"{what}: block {wrong}'s hash differs (salt {salt!r})")
        return test

    rng = case_random("07.chain")
    drawn = [([rng.randrange(50_000) for _ in range(rng.randrange(0, 80))], rng.choice([1, 2, 4, 16]),
              rng.choice([None, "tenant-a", ""])) for _ in range(6)]
    ids = list(range(1000, 1064))
    return [
        ("no tokens, no blocks", case([], 16, None, "empty")),
        ("fewer tokens than a block", case(ids[:10], 16, None, "10 tokens, block size 16")),
        ("exactly one block", case(ids[:16], 16, None, "16 tokens, block size 16")),
        ("three full blocks and a partial one", case(ids[:55], 16, None, "55 tokens")),
        ("block size 4: every hash depends on the blocks before it", case(ids[:17], 4, None, "17 tokens")),
        ("a salt enters the first block", case(ids[:48], 16, "tenant-a", "48 tokens, salted")),
        ("an empty salt is still a salt", case(ids[:8], 4, "", "8 tokens, salt ''")),
        ("the same block twice hashes differently in place", case(ids[:4] * 3, 4, None, "a repeated block")),
        *[(f"random case {i}", case(*args, f"random case {i}")) for i, args in enumerate(drawn)],
    ]


@exercise("07.computed_blocks")
def _computed_blocks():
    """The reader's get_computed_blocks(manager, request) -> (blocks, num_tokens) replaces the prefix cache's
    lookup in a real LLMEngine with prefix caching on; tokens and cached counts are checked."""
    from minivllm.book.mechanism_checks import divergence, greedy_reference, passage_prompts, run_engine, tiny_model
    from minivllm.config import EngineConfig
    from minivllm.core.block_pool import BlockPool
    from minivllm.core.kv_cache_manager import KVCacheManager

    def manager(lookup, config):
        class ReaderManager(KVCacheManager):
            def get_computed_blocks(self, request):
                blocks, num_tokens = lookup(self, request)
                blocks = list(blocks)
                expect(num_tokens == len(blocks) * self.block_size,
                       f"request {request.request_id}: {len(blocks)} blocks but {num_tokens} tokens")
                expect(num_tokens < request.num_tokens, f"request {request.request_id}: all {request.num_tokens} "
                       f"tokens found cached, but its last token must be computed (its logits are needed)")
                return blocks, num_tokens
        return ReaderManager(BlockPool(config.num_kv_blocks), config.block_size, enable_caching=True)

    def case(prompts, blocks, seqs, salts=None, max_tokens=6):
        def test(get_computed_blocks):
            config = EngineConfig(block_size=4, num_kv_blocks=blocks, max_num_seqs=seqs, max_num_batched_tokens=64,
                                  enable_prefix_caching=True)
            engine, outputs = run_engine(prompts, max_tokens, config, kv_manager=manager(get_computed_blocks, config),
                                         salts=salts)
            reference, _ = run_engine(prompts, max_tokens, config, salts=salts)
            for i, prompt in enumerate(prompts):
                where = divergence(outputs[i], greedy_reference(prompt, max_tokens))
                expect(where is None, f"request {i} ({len(prompt)}-token prompt): {where}")
            for i, prompt in enumerate(prompts):
                got, want = engine.output(str(i)).num_cached_tokens, reference.output(str(i)).num_cached_tokens
                expect(got == want, f"request {i} ({len(prompt)}-token prompt): {got} cached tokens, expected {want}")
        return test

    def evicted_in_the_middle(get_computed_blocks):
        from minivllm.core.kv_cache_utils import block_hashes
        from minivllm.engine.llm_engine import LLMEngine
        from minivllm.sampling_params import SamplingParams

        config = EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=1, enable_prefix_caching=True)
        model, tokenizer, _ = tiny_model()
        engine = LLMEngine(model, tokenizer, config)
        engine.kv_manager = engine.scheduler.kv_manager = \
            manager(get_computed_blocks, config)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        first = shared[:24]
        for request_id, prompt in (("a", first), ("b", first + others[0])):
            engine.add_request(request_id, prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
            if request_id == "a":  # block 1 of the prefix is forgotten (as if evicted); blocks 2-5 stay cached
                pool = engine.kv_manager.pool
                pool.evict(pool.cached.get(block_hashes(first, 4)[1]))
        got = engine.output("b").num_cached_tokens
        expect(got == 4, f"block 1 of a cached 6-block prefix evicted: {got} tokens served from cache, expected 4 "
                         f"(block 0 only: the chain breaks at the first missing block)")

    shared = passage_prompts([41])[0]
    others = passage_prompts([9, 14, 5, 11, 20], offset=400)
    with_tail = [shared + tail for tail in others]
    return [
        ("an evicted block in the middle ends the hit", evicted_in_the_middle),
        ("identical block-aligned prompts: the last block is recomputed", case([shared[:40]] * 3, 200, 1)),
        ("a shared 41-token prefix, five tails", case(with_tail, 200, 2)),
        ("a tail that differs inside block 2", case([shared, shared[:9] + others[0] + shared[18:]], 200, 1)),
        ("a tight cache: 24 blocks of 4, one request at a time, LRU eviction",
         case([shared + others[0], others[1] + shared, shared + others[2], others[3] * 4, shared[:30]], 24, 1)),
        ("salted requests share only with their own salt",
         case([shared + t for t in others[:4]], 200, 1, salts=["a", "b", "a", None])),
    ]


@exercise("07.predict_cached")
def _predict_cached():
    """The reader predicts, from two texts, how many of B's tokens the engine serves from cache after A ran;
    the check sends A then B to a real LLMEngine and compares with B's num_cached_tokens."""
    from minivllm.book.mechanism_checks import run_engine, tiny_model
    from minivllm.book.texts import PASSAGES
    from minivllm.config import EngineConfig

    def case(text_a, text_b, block_size, what):
        def test(predict_cached):
            tokenizer = tiny_model()[1]
            a, b = tokenizer(text_a).input_ids, tokenizer(text_b).input_ids
            got = predict_cached(text_a, text_b, tokenizer, block_size)
            config = EngineConfig(block_size=block_size, num_kv_blocks=400, max_num_seqs=1,
                                  enable_prefix_caching=True)
            engine, _ = run_engine([a, b], 1, config)
            actual = engine.output("1").num_cached_tokens
            d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            expect(got == actual, f"{what}: predicted {got}, the engine served {actual} of B's {len(b)} tokens from "
                                  f"cache (A {len(a)} tokens, first differing token {d}, block size {block_size})")
        return test

    hamlet, jaques = PASSAGES["HAMLET"], PASSAGES["JAQUES"]
    return [
        ("a new question after the same text", case(hamlet + "\nQ: who?", hamlet + "\nQ: where?", 16, "new question")),
        ("one character changed inside a word", case(hamlet, hamlet.replace("outrageous", "outrageouz"), 16,
                                                     "'outrageous' -> 'outrageouz'")),
        ("B extends A", case(jaques[:200], jaques, 8, "B = A + more text")),
        ("identical texts", case(jaques, jaques, 4, "the same text twice")),
        ("identical texts, blocks of one token: the last one is computed", case(jaques, jaques, 1, "block size 1")),
        ("B is a prefix of A", case(hamlet, hamlet[:300], 16, "B = the first 300 characters of A")),
        ("a change in the first word", case(hamlet, "So" + hamlet[2:], 16, "'To be' -> 'So be'")),
    ]
