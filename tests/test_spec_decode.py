"""Speculative decoding (chapter 9): verification is exact, greedy outputs are the target's token for token,
sampled outputs follow the target's distribution, and every block comes back."""

import pytest
import torch

from minivllm import LLM
from minivllm.config import EngineConfig
from minivllm.exercises.ch09 import chi_square_p_value
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.engine import SpecDecodeEngine
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.spec_decode.rejection_sampler import verify_greedy, verify_sampled
from tests.conftest import save_random_checkpoint, transformers_greedy
from tests.test_engine import load, prompts_of, run


def test_verify_greedy_keeps_the_agreeing_run_and_adds_one():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted: a bonus token
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the target's token replaces the first miss
    assert verify_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert verify_greedy([3], []) == [3]


@pytest.mark.parametrize("draft", ["sampled", "one-hot"])
def test_rejection_sampling_reproduces_the_target_distribution(draft):
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.4, 0.3, 0.1, 0.1, 0.1]])
    first, second_after_accept, trials = torch.zeros(5), torch.zeros(5), 20_000
    for _ in range(trials):
        if draft == "sampled":
            tokens = [int(torch.multinomial(row, 1, generator=gen)) for row in q]
            out = verify_sampled(p, tokens, q, gen)
        else:
            tokens = [1, 3]  # a fixed guess, as an n-gram lookup makes
            out = verify_sampled(p, tokens, None, gen)
        assert 1 <= len(out) <= 3 and out[:-1] == tokens[:len(out) - 1]
        first[out[0]] += 1
        if len(out) >= 2:
            second_after_accept[out[1]] += 1
    assert chi_square_p_value(first, p[0]) > 1e-4, first / trials
    # given that the first draft token was accepted, the second token follows the target's second row
    assert chi_square_p_value(second_after_accept, p[1]) > 1e-4, second_after_accept / second_after_accept.sum()


def test_rejection_sampling_with_a_perfect_draft_accepts_everything():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 7, generator=gen), -1)
    for _ in range(200):
        tokens = [int(torch.multinomial(row, 1, generator=gen)) for row in p[:3]]
        assert verify_sampled(p, tokens, p[:3], gen)[:3] == tokens


def test_ngram_lookup():
    proposer = NgramProposer(prompt_lookup_max=3, prompt_lookup_min=1)
    assert proposer.lookup([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]  # the 2-gram [2, 3] was followed by 4, 9
    assert proposer.lookup([1, 2, 3, 1, 2, 7, 1, 2], 3) == [7, 1, 2]  # the latest earlier match wins
    assert proposer.lookup([5, 6, 7, 8], 2) == []  # nothing repeats
    assert proposer.lookup([4, 4], 3) == [4]  # the match's continuation is cut at the end of the text
    assert NgramProposer(3, 3).lookup([1, 2, 1, 2], 4) == []  # shorter n-grams are not tried below the minimum
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(prompt_lookup_max=2, prompt_lookup_min=3)


def repetitive_prompts(seed=0):
    """Some prompts repeat a phrase, so an n-gram lookup has something to find; others are random."""
    phrases = prompts_of([6, 9, 4], seed)
    return [phrases[0] * 4, prompts_of([50], seed + 1)[0], phrases[1] * 3 + phrases[2], prompts_of([3], seed + 2)[0],
            phrases[2] * 10, prompts_of([37], seed + 3)[0]]


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("spec", ["ngram", "draft=target", "draft=other family"])
def test_greedy_under_pressure_equals_transformers(checkpoints, tmp_path, spec, prefix_caching):
    folder, hf_model = checkpoints["qwen3-gqa2-tied"]
    if spec == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    elif spec == "draft=target":  # every guess is right: full acceptance, bonus tokens, a two-token catch-up
        config = {"model": str(folder), "num_speculative_tokens": 4}
    else:  # another architecture, other weights: nearly always wrong, so verification keeps rejecting
        save_random_checkpoint(tmp_path, "llama-untied-gqa8", seed=1)
        config = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2}
    engine = SpecDecodeEngine(load(folder), None, EngineConfig(block_size=4, num_kv_blocks=32, max_num_seqs=4,
                                                               max_num_batched_tokens=20,
                                                               enable_prefix_caching=prefix_caching), _backend(),
                              config)
    prompts = repetitive_prompts() + [repetitive_prompts()[0] + [7]]  # the last one shares a cached prefix
    lengths = [30, 17, 25, 1, 30, 22, 12]
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    finished = run(engine)
    assert engine.scheduler.num_preemptions > 0, "the test should preempt"
    assert engine.stats()["spec_decode_num_draft_tokens"] > 0
    if spec == "draft=target":
        assert engine.stats()["spec_decode_num_accepted_tokens"] == engine.stats()["spec_decode_num_draft_tokens"]
    elif spec == "ngram":  # the random model loops on the repeated phrases, and the lookup finds them
        assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    else:
        assert engine.stats()["spec_decode_num_accepted_tokens"] < engine.stats()["spec_decode_num_draft_tokens"]
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        assert finished[str(i)].outputs[0].token_ids == transformers_greedy(hf_model, prompt, n), f"request {i}"
        assert finished[str(i)].outputs[0].finish_reason == "length"
    assert engine.kv_manager.pool.num_free == 32 and no_speculation_left(engine)


def no_speculation_left(engine) -> bool:
    """Every request the engine still knows, finished or aborted, holds no drafts, draft distributions or draft
    cache entries."""
    requests = [r for children in engine.output_processor.parents.values() for r in children]
    assert requests, "the engine should still hold the finished requests"
    return all(not r.spec_token_ids and r.draft_probs is None and r.num_draft_computed_tokens == 0 for r in requests)


def _backend():
    from minivllm.attention.paged import PagedAttention

    return PagedAttention


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampling_with_top_k_1_is_greedy(checkpoints, method):
    """top_k=1 makes every distribution one-hot: the rejection-sampling path must give the greedy tokens."""
    folder, hf_model = checkpoints["qwen3-gqa2-tied"]
    config = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1} \
        if method == "ngram" else {"model": str(folder), "num_speculative_tokens": 3}
    engine = SpecDecodeEngine(load(folder), None, EngineConfig(block_size=4, num_kv_blocks=64), _backend(), config)
    prompts = repetitive_prompts(seed=5)[:4]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=1.0, top_k=1, seed=i, max_tokens=20,
                                                          ignore_eos=True))
    finished = run(engine)
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    for i, prompt in enumerate(prompts):
        assert finished[str(i)].outputs[0].token_ids == transformers_greedy(hf_model, prompt, 20)


@pytest.mark.parametrize("method, seed", [("ngram", 0), ("draft_model", 0), ("draft_model", None)])
def test_sampled_tokens_follow_the_target_distribution(tmp_path, method, seed):
    """The 4th token of 3,000 samples against its exact marginal under the target alone; the 2nd to 4th come
    from rounds of two drafts, so acceptance, rejection and the bonus token all take part. Seeded requests are
    verified by races with noise of (seed, position), unseeded ones by rejection sampling: both must be exact."""
    vocab = 8
    target = save_random_checkpoint(tmp_path / "target", "qwen3-gqa2-tied", vocab_size=vocab, seed=3)
    save_random_checkpoint(tmp_path / "draft", "llama-untied-gqa8", vocab_size=vocab, seed=4)
    config = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1, "prompt_lookup_min": 1} \
        if method == "ngram" else {"model": str(tmp_path / "draft"), "num_speculative_tokens": 2}
    engine = SpecDecodeEngine(load(tmp_path / "target"), None,
                              EngineConfig(block_size=4, num_kv_blocks=4096, max_num_seqs=256,
                                           max_num_batched_tokens=2048), _backend(), config)
    prompt, samples = [3, 5, 3, 6], 3000
    engine.add_request("r", prompt, SamplingParams(n=samples, temperature=1.0, seed=seed, max_tokens=4,
                                                   ignore_eos=True))
    fourth = torch.zeros(vocab)
    for completion in run(engine)["r"].outputs:
        fourth[completion.token_ids[3]] += 1
    assert engine.stats()["spec_decode_num_draft_tokens"] > engine.stats()["spec_decode_num_drafts"] > 0  # rounds of two drafts
    assert engine.stats()["spec_decode_num_accepted_tokens_per_pos"][1] > 0  # some rounds accepted both
    with torch.no_grad():  # P(t4) = sum over t1, t2, t3 of p(t1) p(t2 | t1) p(t3 | t1, t2) p(t4 | t1, t2, t3)
        exact = torch.zeros(vocab)
        prefixes, weights = [list(prompt)], torch.ones(1)
        for _ in range(4):
            probs = target(torch.tensor(prefixes)).logits[:, -1].softmax(-1)  # [prefixes, vocab]
            joint = weights[:, None] * probs
            if len(prefixes[0]) == len(prompt) + 3:
                exact = joint.sum(0)
                break
            prefixes = [p + [t] for p in prefixes for t in range(vocab)]
            weights = joint.flatten()
    assert chi_square_p_value(fourth, exact) > 1e-4, (fourth / samples, exact)
    assert engine.kv_manager.pool.num_free == 4096


def test_abort_and_max_model_len_with_drafts_in_flight(checkpoints):
    folder, hf_model = checkpoints["qwen3-gqa2-tied"]
    engine = SpecDecodeEngine(load(folder), None, EngineConfig(block_size=4, num_kv_blocks=32, max_model_len=40),
                              _backend(), {"model": str(folder), "num_speculative_tokens": 5})
    prompt = prompts_of([30])[0]
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    engine.add_request("aborted", prompts_of([9])[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert any(r.spec_token_ids for r in engine.scheduler.running), "drafts should be in flight"
    engine.abort_request("aborted")
    finished = run(engine)
    out = finished["long"].outputs[0]
    assert len(prompt) + len(out.token_ids) == 40 and out.finish_reason == "length"  # drafts never pass the limit
    assert out.token_ids == transformers_greedy(hf_model, prompt, 10)
    assert engine.kv_manager.pool.num_free == 32
    assert no_speculation_left(engine)


def test_bad_speculative_config_is_refused_naming_the_field(checkpoints, tmp_path):
    folder, _ = checkpoints["qwen3-gqa2-tied"]
    model, config = load(folder), EngineConfig(num_kv_blocks=16)
    for spec, field in [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                        ({"num_speculative_tokens": 2}, "method"),
                        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens.*True"),
                        ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
                        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": True},
                         "prompt_lookup_max"),
                        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "2"},
                         "prompt_lookup_min"),
                        ({"method": "ngram"}, "num_speculative_tokens"),
                        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
                        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                          "prompt_lookup_max": 2}, "prompt_lookup_min")]:
        with pytest.raises(ValueError, match=field):
            SpecDecodeEngine(model, None, config, _backend(), spec)
    save_random_checkpoint(tmp_path, "llama-untied-gqa8", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        SpecDecodeEngine(model, None, config, _backend(), {"model": str(tmp_path), "num_speculative_tokens": 2})


def test_llm_refuses_a_bad_speculative_config_before_reading_any_weight(tmp_path, monkeypatch):
    """The architecture review found speculative_config checked after the target's weights were read."""
    import minivllm.entrypoints.llm as entry

    read = entry.load_model

    def planned_only(*args, **kwargs):
        assert kwargs.get("weights") is False, "weights read before the refusal"
        return read(*args, **kwargs)

    monkeypatch.setattr(entry, "load_model", planned_only)
    for spec, message in [({"method": "eagle", "num_speculative_tokens": 2}, "method"), ("ngram", "a dict"),
                          ({"method": "draft_model", "model": str(tmp_path / "none"), "num_speculative_tokens": 2},
                           "none")]:
        with pytest.raises((ValueError, OSError), match=message):
            LLM(speculative_config=spec)
    save_random_checkpoint(tmp_path / "small", "llama-untied-gqa8", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        LLM(speculative_config={"model": str(tmp_path / "small"), "num_speculative_tokens": 2})


def test_penalties_and_min_tokens_are_refused_with_speculation(checkpoints):
    """Verification samples from the raw logits, so chapter 6's penalties would be skipped: refused, and the
    engine goes on serving."""
    folder, _ = checkpoints["qwen3-gqa2-tied"]
    engine = SpecDecodeEngine(load(folder), None, EngineConfig(num_kv_blocks=16), _backend(),
                              {"method": "ngram", "num_speculative_tokens": 2})
    for field, value in [("presence_penalty", 0.5), ("frequency_penalty", -0.5), ("repetition_penalty", 1.2),
                         ("min_tokens", 2)]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}: not available with speculative decoding"):
            engine.add_request(field, [5, 6, 7], SamplingParams(max_tokens=4, **{field: value}))
    engine.add_request("plain", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.output("plain").outputs[0].token_ids) == 4
    assert engine.kv_manager.pool.num_free == 16


def test_llm_api_with_the_embedded_draft_model():
    from minivllm.book.texts import CORPUS

    prompts = [CORPUS[:200], CORPUS[1000:1100], "ROMEO:"]
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = LLM(num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    for spec in [{"model": None, "num_speculative_tokens": 3},
                 {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}]:
        llm = LLM(num_kv_blocks=256, speculative_config=spec)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in plain]
        stats = llm.stats()
        assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_command_line_speculative_config():
    import subprocess
    import sys

    def run_cli(*extra):
        return subprocess.run([sys.executable, "-m", "minivllm", "generate", "ROMEO:", "--max-tokens", "12", *extra],
                              capture_output=True, text=True, timeout=300)

    plain, spec = run_cli(), run_cli("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    bad = run_cli("--speculative-config", '{"method": "ngram"')
    assert bad.returncode != 0 and "--speculative-config" in bad.stderr and "not JSON" in bad.stderr


def test_a_draft_models_cache_shares_the_kv_memory_budget():
    from minivllm import LLM

    budget = 64 * 2**20
    plain = LLM(kv_cache_memory_bytes=budget)
    spec = LLM(kv_cache_memory_bytes=budget, speculative_config={"model": None, "num_speculative_tokens": 2})
    engine = spec.engine
    used = engine.kv_cache.kv.numel() * engine.kv_cache.kv.element_size() \
        + engine.proposer.kv_cache.kv.numel() * engine.proposer.kv_cache.kv.element_size()
    assert plain.engine.kv_cache.kv.numel() * 4 <= budget and used <= budget
    assert engine.kv_cache.num_blocks < plain.engine.kv_cache.num_blocks
    explicit = LLM(num_kv_blocks=100, speculative_config={"model": None, "num_speculative_tokens": 2})
    assert explicit.engine.kv_cache.num_blocks == 100  # a number given by the caller is kept


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_seeded_outputs_do_not_depend_on_kv_pressure(tmp_path, method):
    """A seeded request's tokens are a function of its seed and prompt: a cache so tight that requests are
    preempted and get fewer draft slots than asked for gives the same tokens as a roomy one (issue 41)."""
    vocab = 12
    save_random_checkpoint(tmp_path / "target", "qwen3-gqa2-tied", vocab_size=vocab, seed=3)
    save_random_checkpoint(tmp_path / "draft", "llama-untied-gqa8", vocab_size=vocab, seed=4)
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1} \
        if method == "ngram" else {"model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in torch.randint(3, 12, (16,))]
    outputs, stats = {}, {}
    for blocks in (4096, 14):
        engine = SpecDecodeEngine(load(tmp_path / "target"), None,
                                  EngineConfig(block_size=4, num_kv_blocks=blocks, max_num_seqs=16), _backend(), config)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24,
                                                              ignore_eos=True))
        finished = run(engine)
        outputs[blocks] = [finished[str(i)].outputs[0].token_ids for i in range(len(prompts))]
        stats[blocks] = engine.stats()
        assert engine.kv_manager.pool.num_free == blocks
    assert stats[14]["num_preemptions"] > 0 and stats[4096]["num_preemptions"] == 0
    assert stats[14]["spec_decode_num_accepted_tokens"] > 0 and stats[4096]["spec_decode_num_accepted_tokens"] > 0
    differing = [i for i in range(len(prompts)) if outputs[14][i] != outputs[4096][i]]
    assert not differing, f"requests {differing} changed under KV pressure"
    assert len({tuple(o) for o in outputs[4096]}) > 8  # and the seeds do matter
