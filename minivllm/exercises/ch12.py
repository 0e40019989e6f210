"""Chapter 12 exercises."""

from minivllm.exercises import case_random, exercise, expect


@exercise("12.cached_prefix_tokens")
def _cached_prefix_tokens():
    """The reader's cached_prefix_tokens(token_ids, block_size, cache_salt, held) predicts, from the set of block
    hashes a replica's KV events say it holds, how many of a request's tokens that replica serves from its cache.
    The check builds `held` from a real engine's events, then sends the request to that engine and compares."""
    from minivllm import LLM, SamplingParams
    from minivllm.book.texts import CORPUS
    from minivllm.distributed.router import BlockIndex

    def case(earlier, request, block_size, num_kv_blocks=200, salts=None, what=""):
        def test(cached_prefix_tokens):
            llm = LLM(block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_seqs=1,
                      kv_events_config={"enable_kv_cache_events": True})
            index = BlockIndex(1)
            salts_ = salts or [None] * (len(earlier) + 1)
            for tokens, salt in zip(earlier, salts_):
                llm.generate({"prompt_token_ids": tokens, "cache_salt": salt} if salt else {"prompt_token_ids": tokens},
                             SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
            for event in llm.engine.take_events():
                index.apply(0, event)
            held = frozenset(index.blocks[0])
            got = cached_prefix_tokens(list(request), block_size, salts_[-1], held)
            prompt = {"prompt_token_ids": request} | ({"cache_salt": salts_[-1]} if salts_[-1] else {})
            [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            expect(got == out.num_cached_tokens, f"{what}: predicted {got} cached tokens, the engine served "
                                                 f"{out.num_cached_tokens} of the request's {len(request)} from cache "
                                                 f"(block size {block_size}, {len(held)} blocks held)")
        return test

    def gap(cached_prefix_tokens):
        from minivllm.core.kv_cache_utils import SEED_HASH, hash_block

        tokens, chain = list(range(500, 533)), [SEED_HASH]
        for k in range(8):
            chain.append(hash_block(chain[-1], tokens[4 * k:4 * k + 4]))
        held = frozenset(chain[1:3] + chain[4:])  # block 2 was evicted (a BlockRemoved event), later ones were not
        got = cached_prefix_tokens(tokens, 4, None, held)
        expect(got == 8, f"blocks 0, 1 and 3-7 held, block 2 evicted: predicted {got} cached tokens, expected 8 "
                         f"(the engine's lookup stops at the first block it lacks)")

    from transformers import AutoTokenizer

    from minivllm.model.loader import DEFAULT_MODEL

    ids = AutoTokenizer.from_pretrained(DEFAULT_MODEL)(CORPUS).input_ids
    a, other = ids[:48], ids[300:340]
    return [
        ("a gap in the blocks held ends the prefix", gap),
        ("a new question after the same prefix", case([a + ids[100:110]], a + ids[200:207], 4, what="shared 48 tokens")),
        ("nothing in common", case([a], other, 4, what="different first block")),
        ("the whole request is cached: its last block is recomputed", case([a], a, 8, what="identical, block-aligned")),
        ("a salt changes every hash", case([a], a + [5], 4, salts=["tenant-a", "tenant-b"], what="other salt")),
        ("the same salt matches", case([a], a + [5], 4, salts=["tenant-a", "tenant-a"], what="same salt")),
        ("a cache of 16 blocks of 4 that evicted the first prompt's tail",
         case([a, other + ids[400:410]], a + [7], 4, num_kv_blocks=16, what="after eviction")),
    ]


def reference_choose(block_hashes, loads, index) -> int:
    """Longest cached prefix; then fewest in flight; then the lowest replica number."""
    return min(loads, key=lambda r: (-index.cached_prefix(r, block_hashes), loads[r], r))


@exercise("12.choose")
def _choose():
    """The reader's choose(block_hashes, loads, index) -> replica is installed as a real Router's policy and
    replayed against the rule (longest cached prefix, then fewest in flight, then the lowest number)."""
    from minivllm.distributed.kv_events import BlockRemoved, BlockStored
    from minivllm.distributed.router import BlockIndex, Router

    def chain(*names):
        return [name.encode().ljust(32, b".") for name in names]

    def single(held: dict[int, list[bytes]], loads: dict[int, int], request: list[bytes], what: str):
        def test(choose):
            index = BlockIndex(1 + max(max(held, default=0), max(loads)))
            for replica, hashes in held.items():
                index.apply(replica, BlockStored(hashes, None, [0] * len(hashes), 1))
            got, want = choose(list(request), dict(loads), index), reference_choose(request, loads, index)
            expect(got == want, f"{what}: chose replica {got}, expected {want} (cached prefix "
                                f"{ {r: index.cached_prefix(r, request) for r in loads} }, in flight {loads})")
        return test

    def replay(replicas: int, seed: int, what: str):
        def test(choose):
            rng = case_random(f"12.choose/{seed}")
            routers = [Router(replicas, "prefix-aware", block_size=4) for _ in range(2)]
            routers[0].policy.choose, routers[1].policy.choose = choose, reference_choose
            conversations = [[1000 * t + k for k in range(12)] for t in range(4) for _ in range(2)]
            for step in range(40):
                c = rng.randrange(len(conversations))
                conversations[c] += [rng.randrange(999) for _ in range(rng.choice([3, 5, 9]))]
                salt = "tenant-x" if c == 7 else None
                (got, _), (want, _) = (router.route(conversations[c], salt) for router in routers)
                expect(got == want, f"{what}: request {step} (conversation {c}, {len(conversations[c])} tokens) went "
                                    f"to replica {got}; the rule says {want}")
                if rng.random() < 0.6:  # some requests finish before the next arrives
                    done = rng.randrange(replicas)
                    for router in routers:
                        if router.in_flight[done]:
                            router.finished(done)
                if rng.random() < 0.15:  # a replica evicts a block
                    victim = rng.randrange(replicas)
                    gone = sorted(routers[1].index.blocks[victim])[:1]
                    for router in routers:
                        router.index.apply(victim, BlockRemoved(gone))
        return test

    a, b, c, d = chain("a", "b", "c", "d")
    return [
        ("the longest prefix wins", single({0: [a], 1: [a, b, c]}, {0: 0, 1: 0}, [a, b, c, d], "1 holds 3 blocks")),
        ("... even against load", single({0: [a], 1: [a, b]}, {0: 0, 1: 7}, [a, b, c], "1 is busier")),
        ("a gap ends the prefix", single({0: [a, c, d], 1: [a, b]}, {0: 0, 1: 0}, [a, b, c, d], "0 lacks b")),
        ("a tie goes to the less loaded", single({0: [a, b], 1: [a, b]}, {0: 3, 1: 1}, [a, b, c], "tie on 2 blocks")),
        ("a tie in everything goes to the lowest number", single({}, {2: 0, 1: 0}, [a], "nothing held")),
        ("only live replicas count", single({0: [a, b, c]}, {1: 0, 2: 4}, [a, b, c], "replica 0 is dead")),
        ("replayed in a Router: 2 replicas", replay(2, 0, "2 replicas")),
        ("replayed in a Router: 3 replicas, evictions", replay(3, 1, "3 replicas")),
    ]
