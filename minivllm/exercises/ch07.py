"""Chapter 7 exercises."""

import random

from minivllm.exercises import exercise, expect


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

    rng = random.Random(0)
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


@exercise("07.chain")
def _chain():
    from minivllm.core.kv_cache_utils import block_hashes

    def case(length, size, salt):
        def test(chain):
            tokens = list(range(1000, 1000 + length))
            got, want = list(chain(tokens, size, salt)), block_hashes(tokens, size, salt)
            expect(len(got) == len(want), f"{length} tokens, block size {size}: {len(got)} hashes, expected {len(want)}")
            expect(got == want, f"{length} tokens, block size {size}, salt {salt!r}: hashes differ from block_hashes")
        return test

    return [
        ("fewer tokens than a block", case(10, 16, None)),
        ("three full blocks and a partial one", case(55, 16, None)),
        ("block size 4", case(17, 4, None)),
        ("a salt enters the first block", case(48, 16, "tenant-a")),
    ]
