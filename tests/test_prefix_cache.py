"""Prefix caching: the hash chain, exact hit counts, salts, LRU eviction, and identical outputs."""

import hashlib
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.config import ModelConfig
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.loader import load_weights
from minivllm.tools.cache_autopsy import explain_cache
from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_utils import SEED_HASH, block_hashes, hash_block
from minivllm.sampling_params import SamplingParams


def test_hash_chain_is_sha256_of_parent_tokens_and_extra_keys():
    tokens = list(range(40))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 2  # the 8 tokens of the partial third block are not hashed
    first = hashlib.sha256(SEED_HASH + json.dumps([tokens[:16], []], separators=(",", ":")).encode()).digest()
    assert hashes[0] == first and hashes[1] == hash_block(first, tokens[16:32])


def test_one_changed_token_changes_its_block_and_every_block_after_it():
    tokens = list(range(100))
    changed = tokens.copy()
    changed[37] = 999  # block 2 of 16
    a, b = block_hashes(tokens, 16), block_hashes(changed, 16)
    assert a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:]))


def test_salt_enters_the_first_block_so_nothing_is_shared():
    tokens = list(range(64))
    plain, salted, other = block_hashes(tokens, 16), block_hashes(tokens, 16, "tenant-a"), block_hashes(tokens, 16, "tenant-b")
    assert all(len({x, y, z}) == 3 for x, y, z in zip(plain, salted, other))
    assert block_hashes(tokens, 16, "tenant-a") == salted


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["allocate", "cache", "free", "revive"]), st.integers(0, 30)), max_size=80))
def test_cache_map_stays_consistent_and_blocks_in_use_are_never_evicted(ops):
    pool = BlockPool(8)
    held: list[int] = []
    for op, arg in ops:
        if op == "allocate" and arg % 3 < pool.num_free:
            in_use = {b for b in held if pool.block_hash[b]}
            held += pool.allocate(arg % 3)
            assert all(pool.block_hash[b] for b in in_use)  # evicting only ever takes free blocks' names
        elif op == "cache" and held and pool.block_hash[held[arg % len(held)]] is None:
            pool.cache(held[arg % len(held)], hash_block(SEED_HASH, [arg % 4]))  # few contents: duplicates
        elif op == "free" and held:
            pool.free([held.pop(arg % len(held))])
        elif op == "revive" and pool.cached:
            block = pool.cached[sorted(pool.cached)[arg % len(pool.cached)]]
            pool.revive([block])
            held.append(block)
        named = [(h, b) for h in pool.cached for b in pool.cached.copies(h)]
        assert all(pool.block_hash[b] == h for h, b in named) and all(pool.cached.copies(h) for h in pool.cached)
        assert sum(h is not None for h in pool.block_hash) == len(named)
        assert pool.num_free + len(set(held)) == 8
        assert all(pool.ref_counts[b] == held.count(b) for b in range(8))
        unnamed_free = [b for b in pool.free_queue if pool.block_hash[b] is None]
        assert list(pool.free_queue)[:len(unnamed_free)] == unnamed_free  # unnamed first, then the cached


def test_blocks_are_evicted_least_recently_freed_first_and_prefixes_last():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    for k, block in enumerate(blocks):
        pool.cache(block, hash_block(SEED_HASH, [k]))
    pool.free(blocks[::-1])  # a request gives its blocks back tail first
    fresh = pool.allocate(3)  # the never-used blocks go first
    assert not set(fresh) & set(blocks) and len(pool.cached) == 3
    evicted = pool.allocate(2)
    assert evicted == [blocks[2], blocks[1]] and list(pool.cached.values()) == [blocks[0]]


def test_a_freed_block_without_a_name_is_reused_before_any_cached_block():
    """vLLM 0.33's free_blocks: unnamed blocks to the front of the free queue, in the order freed; named ones
    to the back."""
    pool = BlockPool(6)
    blocks = pool.allocate(4)  # 0 1 2 3; the queue holds 4 5
    pool.cache(blocks[0], hash_block(SEED_HASH, [0]))
    pool.cache(blocks[2], hash_block(SEED_HASH, [2]))
    pool.free(blocks[::-1])  # 3 (unnamed), 2 (named), 1 (unnamed), 0 (named)
    assert list(pool.free_queue) == [3, 1, 4, 5, 2, 0]
    assert pool.allocate(4) == [3, 1, 4, 5] and pool.cached.get(hash_block(SEED_HASH, [0])) == 0


def test_every_full_block_is_named_even_when_its_contents_are_already_cached():
    """vLLM's BlockHashToBlockMap keeps every block with a hash; a lookup returns the first one named."""
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    contents = hash_block(SEED_HASH, [1, 2, 3])
    pool.cache(first, contents)
    pool.cache(second, contents)
    assert pool.cached.copies(contents) == [first, second] and pool.cached[contents] == first
    pool.evict(first)
    assert pool.cached.get(contents) == second and len(pool.cached) == 1
    pool.evict(second)
    assert contents not in pool.cached and pool.cached.get(contents) is None and not pool.cached
    [block] = pool.allocate(1)
    pool.cache(block, contents)
    with pytest.raises(ValueError, match="already named"):
        pool.cache(block, hash_block(SEED_HASH, [4]))


# ------------------------------------------------------------------ the engine


def load(folder):
    return load_weights(folder, ModelConfig.from_hf(json.loads((folder / "config.json").read_text())),
                        torch.float32, torch.device("cpu"))


def serve(engine, prompts, salts=None, max_tokens=12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(None, p, params, cache_salt=(salts or [None] * len(prompts))[i])
           for i, p in enumerate(prompts)]
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    return [finished[i] for i in ids]


@pytest.fixture(scope="module")
def model(checkpoints):
    return load(checkpoints["qwen3-gqa2-tied"][0])


def random_tokens(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("shared_blocks", [0, 1, 2, 5])
def test_cached_tokens_are_exactly_the_shared_full_blocks(model, shared_blocks):
    engine = LLMEngine(model, None, EngineConfig(block_size=8, num_kv_blocks=64, enable_prefix_caching=True))
    first = random_tokens(50, 1)
    second = first[:shared_blocks * 8] + random_tokens(20, 2)
    serve(engine, [first])
    [out] = serve(engine, [second])
    assert out.num_cached_tokens == shared_blocks * 8


def test_a_fully_cached_prompt_still_computes_its_last_token(model):
    engine = LLMEngine(model, None, EngineConfig(block_size=8, num_kv_blocks=64, enable_prefix_caching=True))
    for length, expected in [(32, 24), (35, 32)]:  # block-aligned: the last block is recomputed
        prompt = random_tokens(length, length)
        first, again = serve(engine, [prompt])[0], serve(engine, [prompt])[0]
        assert again.num_cached_tokens == expected and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_different_salts_never_share_and_equal_salts_do(model):
    engine = LLMEngine(model, None, EngineConfig(block_size=8, num_kv_blocks=64, enable_prefix_caching=True))
    prompt = random_tokens(40, 3)
    serve(engine, [prompt], salts=["tenant-a"])
    other, same, unsalted = (serve(engine, [prompt], salts=[salt])[0] for salt in ["tenant-b", "tenant-a", None])
    assert (other.num_cached_tokens, same.num_cached_tokens, unsalted.num_cached_tokens) == (0, 32, 0)


def test_outputs_identical_with_and_without_caching_through_evictions_and_preemptions(checkpoints, model):
    _, hf_model = checkpoints["qwen3-gqa2-tied"]
    shared = random_tokens(37, 4)
    prompts = [shared + random_tokens(n, 10 + n) for n in (5, 20, 1, 30, 9, 3)] + [shared[:32], shared]

    def run(enable, num_blocks):
        engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=num_blocks, max_num_seqs=3,
                                                     max_num_batched_tokens=32, enable_prefix_caching=enable))
        outputs = serve(engine, prompts, max_tokens=20)
        assert engine.kv_manager.pool.num_free == num_blocks
        return [o.outputs[0].token_ids for o in outputs], engine

    plain, _ = run(False, 60)
    cached, roomy = run(True, 60)
    squeezed, tight = run(True, 22)
    assert plain == cached == squeezed
    assert roomy.kv_manager.prefix_cache_hits > 0 and tight.scheduler.num_preemptions > 0
    assert any(roomy.kv_manager.pool.block_hash) and len(tight.kv_manager.pool.cached) <= 22
    for prompt, tokens in zip(prompts[:3], plain):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20,
                                         do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == expected


def test_stats_count_prompt_tokens_looked_up_and_found(model):
    engine = LLMEngine(model, None, EngineConfig(block_size=8, num_kv_blocks=64, enable_prefix_caching=True))
    prompt = random_tokens(30, 5)
    serve(engine, [prompt])
    serve(engine, [prompt + [7, 8]])
    assert (engine.kv_manager.prefix_cache_queries, engine.kv_manager.prefix_cache_hits) == (30 + 32, 24)


# ------------------------------------------------------------------ the autopsy


class Chars:
    """A tokenizer with one token per character, and a chat template."""

    chat_template = "<role>content, then <assistant> to open the reply"

    def __call__(self, text, add_special_tokens=True):
        return type("Encoding", (), {"input_ids": [ord(c) for c in text]})

    def decode(self, ids):
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>" * add_generation_prompt


def test_autopsy_counts_what_the_engine_would_reuse():
    system = "You are a helpful assistant. " * 3
    end = explain_cache(Chars(), system + "Q1", system + "Q2!", block_size=8)
    start = explain_cache(Chars(), system + "Q1", "y" + system[1:] + "Q1", block_size=8)
    assert end.first_different_token == len(system) + 1 and end.reused_blocks == (len(system) + 1) // 8
    assert start.first_different_token == 0 and start.reused_blocks == 0
    assert end.reused_tokens + end.recomputed_tokens == len(system) + 3
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    assert explain_cache(Chars(), chat, chat[:1] + [{"role": "user", "content": "ho"}], 8).reused_blocks > 0
    assert explain_cache(Chars(), system, system, 8, salt_a="a", salt_b="b").reused_blocks == 0


def test_explain_cache_command_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "a.txt").write_text("ROMEO:\nBut soft, what light through yonder window breaks? " * 4)
    (tmp_path / "b.txt").write_text("ROMEO:\nBut soft, what light through yonder window breaks? " * 4 + "JULIET:")
    result = subprocess.run([sys.executable, "-m", "minivllm", "explain-cache", str(tmp_path / "a.txt"),
                             str(tmp_path / "b.txt"), "--block-size", "8"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "reused" in result.stdout and "B reuses" in result.stdout and "recomputes" in result.stdout


def named(pool, block_id):
    return pool.block_hash[block_id] is not None


def test_issue_case_an_unnamed_block_does_not_push_a_cached_prefix_out(model):
    """Four blocks of 16: A (32-token prompt P), B (5), C (40), then D = P[:16] + 10 tokens, one at a time.
    vLLM 0.33 serves D 16 cached tokens: B's and C's unnamed last blocks are reused before A's first block."""
    engine = LLMEngine(model, None, EngineConfig(block_size=16, num_kv_blocks=4, enable_prefix_caching=True))
    pool, prompt = engine.kv_manager.pool, random_tokens(32, 21)
    serve(engine, [prompt], max_tokens=1)  # A took blocks 0 1, both named, freed tail first to the back
    assert list(pool.free_queue) == [2, 3, 1, 0] and named(pool, 0) and named(pool, 1)
    serve(engine, [random_tokens(5, 22)], max_tokens=1)  # B took block 2, unnamed: back to the front
    assert list(pool.free_queue) == [2, 3, 1, 0] and not named(pool, 2)
    serve(engine, [random_tokens(40, 23)], max_tokens=1)  # C took 2 3 1 (evicting A's block 1)
    assert list(pool.free_queue) == [1, 0, 3, 2] and not named(pool, 1) and named(pool, 0)
    [d] = serve(engine, [prompt[:16] + random_tokens(10, 24)], max_tokens=1)
    assert d.num_cached_tokens == 16


def test_issue_case_duplicate_blocks_are_all_named_so_either_copy_serves_a_hit(model):
    """X and Y, the same 16 tokens, arrive together and each computes its own block; W (40 tokens) evicts
    one copy; Q = X + 5 tokens still hits the other (vLLM names both copies)."""
    engine = LLMEngine(model, None, EngineConfig(block_size=16, num_kv_blocks=4, enable_prefix_caching=True))
    pool, x = engine.kv_manager.pool, random_tokens(16, 31)
    serve(engine, [x, list(x)], max_tokens=1)
    [contents] = pool.cached
    assert len(pool.cached.copies(contents)) == 2
    serve(engine, [random_tokens(40, 32)], max_tokens=1)
    assert len(pool.cached.copies(contents)) == 1
    [q] = serve(engine, [x + random_tokens(5, 33)], max_tokens=1)
    assert q.num_cached_tokens == 16


# ------------------------------------------------------------------ KV events, from the pool (vLLM's BlockPool)


def events_engine(model, num_blocks, block_size=16, **config):
    return LLMEngine(model, None, EngineConfig(block_size=block_size, num_kv_blocks=num_blocks,
                                               enable_prefix_caching=True, enable_kv_cache_events=True, **config))


def test_kv_events_name_every_copy_of_a_duplicate_and_remove_each_copy(model):
    """The issue's duplicate case, as events: X and Y store the same hash twice, W's blocks remove one copy."""
    from minivllm.core.kv_events import BlockRemoved, BlockStored

    engine, x = events_engine(model, 4), random_tokens(16, 31)
    serve(engine, [x, list(x)], max_tokens=1)
    stored = engine.take_events()
    assert stored == [BlockStored([block_hashes(x, 16)[0]], None, x, 16, "GPU")] * 2
    assert engine.take_events() == []  # each event is handed over once
    w = random_tokens(40, 32)
    serve(engine, [w], max_tokens=1)
    events = engine.take_events()
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]
    assert events[0].block_hashes == block_hashes(x, 16) and events[0].medium == "GPU"
    assert events[1] == BlockStored(block_hashes(w, 16), None, w[:32], 16, "GPU")


def test_kv_events_chain_their_parent_and_a_reset_is_one_event(model):
    from minivllm.core.kv_events import AllBlocksCleared

    engine, prompt = events_engine(model, 32, block_size=8), random_tokens(20, 41)
    serve(engine, [prompt], max_tokens=12)  # 32 tokens in all: blocks 0-1 at admission, 2-3 while decoding
    events = engine.take_events()
    chain = block_hashes(prompt, 8)
    assert events[0].block_hashes == chain and events[0].parent_block_hash is None
    assert all(e.parent_block_hash == p.block_hashes[-1] for p, e in zip(events, events[1:]))
    assert sum(len(e.block_hashes) for e in events) == 3  # the 4th block holds the unsampled last token
    engine.kv_manager.reset_prefix_cache()
    assert engine.take_events() == [AllBlocksCleared()] and not engine.kv_manager.pool.cached


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(1, 6)), min_size=1, max_size=8))
def test_replaying_the_events_gives_the_pools_cached_map(model, requests):
    """A consumer that counts copies from the events alone knows exactly what the pool has cached."""
    from collections import Counter

    from minivllm.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    engine, copies = events_engine(model, 12, block_size=4, max_num_seqs=3, max_num_batched_tokens=24), Counter()
    base = random_tokens(40, 51)
    prompts = [base[:shared * 8] + random_tokens(n, shared * 100 + n) for shared, n, _ in requests]
    for batch in (prompts[::2], prompts[1::2]):
        serve(engine, batch, max_tokens=requests[0][2])
        for event in engine.take_events():
            if isinstance(event, BlockStored):
                copies.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                copies.subtract(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                copies.clear()
    pool = engine.kv_manager.pool
    assert +copies == Counter({h: len(pool.cached.copies(h)) for h in pool.cached})


def test_without_the_flag_the_pool_records_nothing(model):
    engine = LLMEngine(model, None, EngineConfig(block_size=8, num_kv_blocks=16, enable_prefix_caching=True))
    serve(engine, [random_tokens(30, 61)])
    assert engine.take_events() == [] and not engine.kv_manager.pool.kv_events
    with pytest.raises(ValueError, match="enable_kv_cache_events: KV events come from the prefix cache"):
        LLMEngine(model, None, EngineConfig(block_size=8, num_kv_blocks=16, enable_kv_cache_events=True))
