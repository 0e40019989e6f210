"""Chapter 13: the second tier of KV blocks. Greedy outputs equal transformers' with the tier (under preemption,
chunked prefill and salts); the tiers stay within their size and every pool block comes back; a salted tenant's
blocks are served to nobody else, from memory or from disk; a corrupt, truncated or foreign block file is refused
(said once) and its tokens recomputed; a full disk fails no request; a second process serves a returning prompt
from the file tier; speculative decoding (n-gram and draft model) runs with a tier, and tensor parallelism is
refused."""

import errno
import json
import subprocess
import sys
import textwrap
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from minivllm.book.mechanism_checks import greedy_reference, passage_prompts, tiny_model
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.kv_offload import file_tier
from minivllm.kv_offload.file_tier import FileTier, encode_block, kv_identity
from minivllm.kv_offload.tier import CPUTier
from minivllm.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 6
BLOCK_BYTES = 4 * 2 * 4 * 4 * 32 * 4  # the tiny model: layers x (k, v) x block of 4 x kv heads x head dim x fp32


def config(blocks=24, seqs=2, budget=32, reserve_full_isl=True):
    return EngineConfig(block_size=4, num_kv_blocks=blocks, max_num_seqs=seqs, max_num_batched_tokens=budget,
                        enable_prefix_caching=True, scheduler_reserve_full_isl=reserve_full_isl)


def offloading(cfg, cpu_blocks=64, root=None, file_blocks=64, loaded=None):
    """An engine whose CPU tier holds cpu_blocks blocks (a GiB size, as vLLM's; a tier of 0 holds none)."""
    model, tokenizer = loaded or tiny_model()[:2]
    files = None if root is None else {"root_dir": root, "size": file_blocks * (BLOCK_BYTES + 400) / 2**30}
    cfg = replace(cfg, kv_offloading_size=max(cpu_blocks, 1e-6) * BLOCK_BYTES / 2**30, kv_offloading_file_tier=files,
                  model_name="tiny-shakespeare")
    return LLMEngine(model, tokenizer, cfg)


def run(engine, prompts, tag, salts=None, each_step=lambda: None):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(f"{tag}{i}", p, params, cache_salt=salts[i] if salts else None)
           for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
        each_step()
    outs = [engine.output(i) for i in ids]
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def shared_prefix_prompts():
    shared = passage_prompts([40])[0]
    tails = passage_prompts([9, 14, 5, 11, 7], offset=400)
    return [shared + t for t in tails] + passage_prompts([45, 33], offset=900)


def assert_matches_transformers(prompts, outputs):
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs)):
        assert tokens == greedy_reference(prompt, MAX_TOKENS), f"request {i} differs from transformers"


def test_outputs_equal_transformers_and_the_tier_serves_what_the_pool_lost():
    """Chunked prefill (8 tokens a step) and preemption (admission without the full-prompt reservation,
    vLLM's scheduler_reserve_full_isl=False), with salts; two rounds, the second served from the tier."""
    prompts = shared_prefix_prompts()
    salts = ["a", "b", "a", None, "b", None, "a"]
    model, tokenizer, _ = tiny_model()
    plain = LLMEngine(model, tokenizer, config(20, 3, 8, reserve_full_isl=False))
    tiered = offloading(config(20, 3, 8, reserve_full_isl=False))
    for round_ in range(2):
        plain_out, plain_cached = run(plain, prompts, f"r{round_}-", salts)
        tier_out, tier_cached = run(tiered, prompts, f"r{round_}-", salts)
        assert_matches_transformers(prompts, tier_out)
        assert tier_out == plain_out
    assert sum(tier_cached) > sum(plain_cached), "the second round should be served from the tier"
    assert tiered.model_runner.connector.blocks_loaded > 0
    assert tiered.scheduler.num_preemptions > 0, "the case is meant to preempt"
    for request_id, cached in zip(range(len(prompts)), tier_cached):
        assert cached % 4 == 0 and cached < len(prompts[request_id])


def test_without_the_prefix_cache_the_pool_names_nothing_and_only_the_tier_serves_hits():
    """enable_prefix_caching=False with a tier (the architecture review's silent bug: the pool cached anyway).
    As in vLLM, the connector is asked whether or not the local cache is on: a repeated prompt is served from
    the tier, copied into fresh pool blocks; the pool finds nothing, names nothing, and hits count only there."""
    prompts = shared_prefix_prompts()[:3]
    tiered = offloading(replace(config(), enable_prefix_caching=False))
    first, cached_first = run(tiered, prompts, "a")
    again, cached_again = run(tiered, prompts, "b")
    assert_matches_transformers(prompts, again)
    assert first == again and cached_first[0] == 0  # the others share its 40-token prefix: from the tier
    manager = tiered.kv_manager
    assert not manager.enable_caching and len(manager.pool.cached) == 0 and manager.prefix_cache_hits == 0
    assert min(cached_again) > 0 and tiered.stats()["kv_offload_hit_tokens"] == sum(cached_first + cached_again)
    assert manager.pool.num_free == manager.pool.num_blocks, "every pool block comes back"
    plain = LLMEngine(*tiny_model()[:2], replace(config(), enable_prefix_caching=False))
    run(plain, prompts, "a")
    assert run(plain, prompts, "b")[1] == [0, 0, 0], "no tier, no cache: nothing is served"


def test_the_tiers_stay_within_their_size_and_every_pool_block_comes_back(tmp_path):
    engine = offloading(config(20, 2, 16), cpu_blocks=7, root=tmp_path, file_blocks=11)
    file = engine.kv_manager.store.tiers[1]
    sizes = []

    def measure():
        on_disk = sum(p.stat().st_size for p in file.folder.glob("*.kv"))
        sizes.append((engine.kv_manager.store.cpu.used_bytes, file.used_bytes, on_disk))

    prompts = shared_prefix_prompts()
    for round_ in range(2):
        outputs, _ = run(engine, prompts, f"r{round_}-", each_step=measure)
        assert_matches_transformers(prompts, outputs)
    assert max(cpu for cpu, _, _ in sizes) == 7 * BLOCK_BYTES, "the CPU tier should fill up exactly"
    assert all(cpu <= 7 * BLOCK_BYTES and used <= file.capacity_bytes and disk == used for cpu, used, disk in sizes)
    assert len(file.files) > 0 and not list(file.folder.glob("*.tmp"))
    manager = engine.kv_manager
    assert manager.pool.num_free == manager.pool.num_blocks
    assert not (manager.block_tables or manager.tier_hits or manager.num_offered or manager.loads or manager.stores)


def test_the_cpu_tier_is_lru_and_refuses_a_block_of_another_size():
    tier = CPUTier(2 * 8, 8)
    a, b, c = (torch.full((2,), float(i)) for i in range(3))
    tier.put(b"a", a)
    tier.put(b"b", b)
    tier.get(b"a")  # a use: b is now the oldest
    tier.put(b"c", c)
    assert list(tier.blocks) == [b"a", b"c"] and tier.used_bytes == 16
    assert ("removed", b"b", "CPU") in tier.events
    with pytest.raises(ValueError, match="bytes"):
        tier.put(b"d", torch.zeros(3))
    empty = CPUTier(7, 8)
    empty.put(b"a", a)
    assert b"a" not in empty and empty.used_bytes == 0


def test_a_salted_tenants_blocks_are_served_to_nobody_else_from_memory_or_disk(tmp_path):
    secret = passage_prompts([44])[0]
    flood = passage_prompts([60, 60, 60], offset=250)
    engine = offloading(config(20, 1, 64), cpu_blocks=200, root=tmp_path, file_blocks=200)
    run(engine, [secret], "victim", ["tenant-a"])
    run(engine, flood, "flood")  # the pool forgets the victim's blocks; the tiers keep them
    _, [other] = run(engine, [secret], "other", ["tenant-b"])
    _, [unsalted] = run(engine, [secret], "unsalted")
    outputs, [same] = run(engine, [secret], "again", ["tenant-a"])
    assert (other, unsalted) == (0, 0), "another tenant, or no salt, must find none of tenant-a's blocks"
    assert same == 40 and engine.kv_manager.store.hits["CPU"] > 0
    assert_matches_transformers([secret], outputs)

    restarted = offloading(config(20, 1, 64), cpu_blocks=0, root=tmp_path, file_blocks=200)  # disk only
    _, [other_disk] = run(restarted, [secret], "other", ["tenant-c"])
    assert other_disk == 0 and restarted.kv_manager.store.hits["STORAGE"] == 0
    outputs, [same_disk] = run(restarted, [secret], "again", ["tenant-a"])
    assert same_disk == 40 and restarted.kv_manager.store.hits["STORAGE"] == 10
    assert_matches_transformers([secret], outputs)


def damage(kind, path, identity, block_hash, key):
    data = path.read_bytes()
    if kind == "a flipped payload byte":
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    elif kind == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif kind == "another model's block":
        foreign = dict(identity, model="another-model")
        kv = file_tier.decode_block(identity, block_hash, data, key)
        path.write_bytes(encode_block(foreign, block_hash, kv + 1, key))
    elif kind == "another block's contents":
        other = next(p for p in path.parent.glob("*.kv") if p != path)
        path.write_bytes(other.read_bytes())
    elif kind == "not a block file":
        path.write_bytes(b"hello" * 100)


@pytest.mark.parametrize("kind", ["a flipped payload byte", "truncated", "another model's block",
                                  "another block's contents", "not a block file"])
def test_a_damaged_or_foreign_block_file_is_refused_once_and_recomputed(tmp_path, kind):
    from minivllm.core.kv_cache_utils import block_hashes

    prompt = passage_prompts([44])[0]
    run(offloading(config(20, 1, 64), cpu_blocks=0, root=tmp_path), [prompt], "writer")
    engine = offloading(config(20, 1, 64), cpu_blocks=0, root=tmp_path)
    file = engine.kv_manager.store.tiers[1]
    hashes = block_hashes(prompt, 4)
    for index in (3, 6):  # two bad files: the engine says so once
        damage(kind, file.path(hashes[index]), file.identity, hashes[index], file.key)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs, [cached] = run(engine, [prompt], "reader")
        _, [second] = run(offloading(config(20, 1, 64), cpu_blocks=0, root=tmp_path), [prompt], "second")
        _, [third] = run(offloading(config(20, 1, 64), cpu_blocks=0, root=tmp_path), [prompt], "third")
    refusals = [str(w.message) for w in caught if "refused" in str(w.message)]
    assert cached == 12, "the hit ends at the first refused block (block 3)"
    assert_matches_transformers([prompt], outputs)
    assert second == 24, "block 3 was recomputed and stored again; block 6, never read, is refused now"
    assert third == 40, "every damaged file has been replaced by a recomputed block"
    assert len(refusals) == 2, f"one warning per engine that found a bad file: {refusals}"


def test_a_full_disk_fails_no_request(tmp_path, monkeypatch):
    engine = offloading(config(20, 1, 64), root=tmp_path)  # its folder and key are made before the disk fills

    def no_space(folder, name, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / name))

    monkeypatch.setattr(file_tier, "write_file", no_space)
    prompt = passage_prompts([44])[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, _ = run(engine, [prompt], "a")
        run(engine, passage_prompts([60, 60], offset=250), "flood")
        second, [cached] = run(engine, [prompt], "b")
    file = engine.kv_manager.store.tiers[1]
    assert sum("cannot write" in str(w.message) for w in caught) == 1
    assert file.write_failures > 1 and not file.files and not list(file.folder.glob("*.kv*"))
    assert cached == 40, "the CPU tier still serves"
    assert_matches_transformers([prompt, prompt], [first[0], second[0]])


RESTART_SCRIPT = """
import json, sys
from tests.test_kv_offload import config, offloading, run
from minivllm.book.texts import CORPUS
from minivllm.model.loader import load_model
model, tokenizer = load_model(None, device="cpu")
engine = offloading(config(20, 1, 64), root=sys.argv[1], loaded=(model, tokenizer))
outputs, cached = run(engine, [tokenizer.encode(CORPUS)[:44]], "turn")
print(json.dumps({"tokens": outputs[0], "cached": cached[0], "from_disk": engine.kv_manager.store.hits["STORAGE"]}))
"""


def test_a_second_process_serves_the_prefix_from_the_file_tier(tmp_path):
    def process():
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(RESTART_SCRIPT), str(tmp_path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = process(), process()
    assert (first["cached"], first["from_disk"]) == (0, 0)
    assert (second["cached"], second["from_disk"]) == (40, 10)
    assert first["tokens"] == second["tokens"] == greedy_reference(passage_prompts([44])[0], MAX_TOKENS)


def test_the_file_tier_evicts_its_oldest_files_and_rescans_them_at_start(tmp_path):
    identity = kv_identity("m", (2,), torch.float32)
    size = len(encode_block(identity, b"\x00" * 32, torch.zeros(2), b"k" * 32))
    tier = FileTier(tmp_path, 3 * size, identity)
    for i in range(5):
        tier.put(bytes([i]) * 32, torch.full((2,), float(i)))
    assert list(tier.files) == [bytes([i]) * 32 for i in (2, 3, 4)] and tier.used_bytes == 3 * size
    again = FileTier(tmp_path, 3 * size, identity)
    assert set(again.files) == set(tier.files)
    assert torch.equal(again.get(bytes([3]) * 32), torch.full((2,), 3.0))


def test_llm_kv_offloading_size_has_vllms_meaning(tmp_path):
    from minivllm import LLM

    llm = LLM(num_kv_blocks=16, kv_offloading_size=0.001)
    block = llm.engine.kv_cache.bytes_per_block
    assert llm.engine.kv_manager.store.cpu.capacity_blocks == round(0.001 * 2**30) // block and len(llm.engine.kv_manager.store.tiers) == 1
    with_files = LLM(num_kv_blocks=16, kv_offloading_size=0.001,
                     kv_offloading_file_tier={"root_dir": str(tmp_path), "size": 0.01})
    assert with_files.engine.kv_manager.store.tiers[1].capacity_bytes == round(0.01 * 2**30)
    for bad in (0, -1, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="kv_offloading_size"):
            LLM(num_kv_blocks=16, kv_offloading_size=bad)
    with pytest.raises(ValueError, match="kv_offloading_backend"):
        LLM(num_kv_blocks=16, kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="kv_offloading_file_tier"):
        LLM(num_kv_blocks=16, kv_offloading_file_tier={"root_dir": str(tmp_path), "size": 1})
    assert type(LLM(num_kv_blocks=16).engine) is LLMEngine, "no size, no tier"
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(num_kv_blocks=16, kv_offloading_size=1, tensor_parallel_size=2)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_with_a_tier_equals_transformers_and_loads_from_it(method):
    """LLM(kv_offloading_size=..., speculative_config=...): chapter 9's verification with chapter 13's copies.
    Two rounds with a flood between them that the pool cannot hold (and preemption: admission without the
    full-prompt reservation); the second round's prefixes come from the tier; drafts are made and accepted;
    every token is transformers'; every pool block comes back. The n-gram case also records KV events."""
    from minivllm import LLM
    from minivllm.core.kv_events import BlockStored
    from minivllm.kv_offload.manager import OffloadingConnector, OffloadingKVCacheManager
    from minivllm.spec_decode.engine import SpecDecodeEngine

    spec = {"method": method, "num_speculative_tokens": 3}
    events = {"kv_events_config": {"enable_kv_cache_events": True}} if method == "ngram" else {}
    llm = LLM(block_size=4, num_kv_blocks=20, max_num_seqs=3, max_num_batched_tokens=16,
              scheduler_reserve_full_isl=False, kv_offloading_size=200 * BLOCK_BYTES / 2**30,
              speculative_config=spec | ({"prompt_lookup_max": 3, "prompt_lookup_min": 1} if method == "ngram" else {}),
              **events)
    engine = llm.engine
    assert isinstance(engine, SpecDecodeEngine) and isinstance(engine.kv_manager, OffloadingKVCacheManager)
    assert isinstance(engine.model_runner.connector, OffloadingConnector)  # parts of one engine, not pair classes
    prompts, max_tokens = shared_prefix_prompts(), 12
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rounds = []
    for round_ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rounds.append(outs)
        if round_ == 0:
            loaded_before = engine.model_runner.connector.blocks_loaded
            llm.generate([{"prompt_token_ids": p} for p in passage_prompts([60, 60, 60], offset=250)], params,
                         use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert list(out.outputs[0].token_ids) == greedy_reference(prompt, max_tokens), f"round {round_}"
    stats = llm.stats()
    assert engine.model_runner.connector.blocks_loaded > loaded_before, "the second round should load from the tier"
    assert sum(o.num_cached_tokens for o in rounds[1]) > sum(o.num_cached_tokens for o in rounds[0])
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert engine.scheduler.num_preemptions > 0, "the case is meant to preempt"
    manager = engine.kv_manager
    assert manager.pool.num_free == manager.pool.num_blocks
    assert not (manager.block_tables or manager.tier_hits or manager.num_offered or manager.loads or manager.stores)
    if events:
        assert any(isinstance(e, BlockStored) and e.medium == "CPU" for e in engine.take_events())


def test_kv_events_report_the_medium_of_every_tier(tmp_path):
    from minivllm import LLM
    from minivllm.core.kv_events import BlockRemoved, BlockStored

    llm = LLM(num_kv_blocks=8, kv_offloading_size=4 * 64 / 2**20, kv_events_config={"enable_kv_cache_events": True},
              kv_offloading_file_tier={"root_dir": str(tmp_path), "size": 0.01})
    prompt = passage_prompts([100])[0]
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2), use_tqdm=False)
    events = llm.engine.take_events()  # what the pool and the tiers recorded
    stored = {(e.medium, h) for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    removed = {(e.medium, h) for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    from minivllm.core.kv_cache_utils import block_hashes

    chain = block_hashes(prompt, 16)
    assert {h for m, h in stored if m == "CPU"} == set(chain) == {h for m, h in stored if m == "STORAGE"}
    assert {h for m, h in removed if m == "CPU"} == set(chain[:2]), "a CPU tier of 4 blocks drops the 2 oldest"
    assert any(m == "GPU" for m, _ in stored)
    assert llm.engine.take_events() == [], "each event once"
