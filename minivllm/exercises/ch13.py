"""Chapter 13 exercises: the reader's tier lookup and copy-out hook run inside a real engine with a tier."""

import types
from dataclasses import replace

from minivllm.exercises import expect


def _engine(config, tier_blocks: int, override: dict):
    """An engine with a tier on the embedded model whose manager's methods in `override` are the reader's."""
    from minivllm.book.mechanism_checks import tiny_model
    from minivllm.core.block_pool import BlockPool
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.kv_offload.manager import OffloadingKVCacheManager

    model, tokenizer, _ = tiny_model()
    c = model.config
    block_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * config.block_size
    size = tier_blocks * block_bytes / 2**30
    engine = LLMEngine(model, tokenizer, replace(config, kv_offloading_size=size))
    manager = OffloadingKVCacheManager(BlockPool(config.num_kv_blocks), config.block_size,
                                       config.enable_prefix_caching, engine.kv_manager.store)
    for name, method in override.items():  # the reader's, bound to this manager
        setattr(manager, name, types.MethodType(method, manager))
    engine.kv_manager = engine.scheduler.kv_manager = manager  # the scheduler's, which sends the copies
    return engine


def _rounds(engine, prompts, salts, rounds: int, max_steps: int = 200, between=None):
    """Greedy requests, all at once, round after round: {(round, i): (tokens, num_cached_tokens)}.
    `between(engine)` runs after each round but the last."""
    from minivllm.exercises import CheckFailed
    from minivllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    results = {}
    for round_ in range(rounds):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{round_}-{i}", prompt, params, cache_salt=salts[i])
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        else:
            raise CheckFailed(f"round {round_}: no end after {max_steps} steps (a lookup that claims the last token?)")
        for i in range(len(prompts)):
            out = engine.output(f"{round_}-{i}")
            results[round_, i] = (list(out.outputs[0].token_ids), out.num_cached_tokens)
        if between is not None and round_ < rounds - 1:
            between(engine)
    return results


def _gap_in_the_tier(prompt, salt, index):
    """After a round: the pool forgets everything, and the tier loses block `index` of the prompt's chain."""
    from minivllm.core.kv_cache_utils import block_hashes

    def between(engine):
        engine.kv_manager.reset_prefix_cache()
        engine.kv_manager.store.cpu.blocks.pop(block_hashes(prompt, 4, salt)[index], None)
    return between


def _workloads():
    from minivllm.book.mechanism_checks import passage_prompts

    shared = passage_prompts([40])[0]
    tails = passage_prompts([9, 14, 5, 11], offset=400)
    return [
        ("a shared prefix, tails, salts; a 20-block pool that evicts", [shared + t for t in tails],
         ["a", "a", None, "b"], 20, None),
        ("prompts of exactly whole blocks, and one of 3 tokens", [shared[:32], shared[:32], shared[:3], shared[:16]],
         [None, None, None, None], 20, None),
        ("a pool too small for two: preemption", [shared + t for t in tails[:3]], ["x", None, "x"], 17, None),
        ("a block missing in the middle of the tier's run ends the hit", [shared + tails[0]], ["g"], 40,
         _gap_in_the_tier(shared + tails[0], "g", 3)),
    ]


def _run_case(method, reader, prompts, salts, pool, between=None):
    """The same two rounds on an engine whose manager's `method` is the reader's and on one with the engine's
    own; tokens are checked against transformers, cached counts against the engine's own. Returns both
    engines and how many items each one's `method` returned in all."""
    from minivllm.book.mechanism_checks import divergence, greedy_reference
    from minivllm.config import EngineConfig
    from minivllm.kv_offload.manager import OffloadingKVCacheManager

    config = EngineConfig(block_size=4, num_kv_blocks=pool, max_num_seqs=2, max_num_batched_tokens=16,
                          enable_prefix_caching=True, scheduler_reserve_full_isl=False)
    counts = {"reader": 0, "engine": 0}

    def counted(who, function):
        def method_(self, *args):
            result = function(self, *args)
            counts[who] += len(result)
            return result
        return method_

    engine = _engine(config, 40, {method: counted("reader", reader)})
    reference = _engine(config, 40, {method: counted("engine", getattr(OffloadingKVCacheManager, method))})
    got = _rounds(engine, prompts, salts, 2, between=between)
    want = _rounds(reference, prompts, salts, 2, between=between)
    for (round_, i), (tokens, cached) in got.items():
        where = divergence(tokens, greedy_reference(prompts[i], 5))
        expect(where is None, f"round {round_}, request {i} ({len(prompts[i])} tokens): {where}")
        expected = want[round_, i][1]
        expect(cached == expected, f"round {round_}, request {i} ({len(prompts[i])} tokens): {cached} cached "
                                   f"tokens, the engine's own manager gets {expected}")
    return engine, reference, counts


def _exercise(name, method, counted_what):
    from minivllm.exercises import exercise

    @exercise(name)
    def suite():
        def case(prompts, salts, pool, between):
            def test(reader):
                engine, reference, counts = _run_case(method, reader, prompts, salts, pool, between)
                got, want = set(engine.kv_manager.store.cpu.blocks), set(reference.kv_manager.store.cpu.blocks)
                expect(got == want, f"the tier holds {len(got)} blocks, the engine's own hook stores {len(want)} "
                                    f"({len(got - want)} it would not store, {len(want - got)} missing)")
                expect(counts["reader"] == counts["engine"], f"{counts['reader']} {counted_what} in all, "
                                                             f"the engine's own: {counts['engine']}")
                loaded = engine.model_runner.connector.blocks_loaded
                expected = reference.model_runner.connector.blocks_loaded
                expect(loaded == expected, f"{loaded} blocks loaded from the tier, expected {expected}")
            return test

        return [(what, case(*rest)) for what, *rest in _workloads()]
    return suite


_tier_lookup = _exercise("13.tier_lookup", "tier_lookup", "blocks found in the tier")
_blocks_to_offer = _exercise("13.blocks_to_offer", "blocks_to_offer", "blocks offered")
