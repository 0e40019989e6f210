"""Every pair of `LLM(...)`'s features (issue 37, goal 5). A pair the compatibility table refuses raises the
table's reason before any weight is read. Every other pair, in two rounds of the same prompts (the second served
from the caches), gives fp32 transformers' greedy tokens in fp32, and in bf16 or int8 follows them up to a near
tie (their accuracy definition: tests/test_bf16.py), with every KV block back after each round."""

import itertools
import warnings

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.book.mechanism_checks import passage_prompts, tiny_model
from minivllm.entrypoints import compatibility
from tests.test_bf16 import LOGIT_BOUND, first_divergence, greedy_with_margins

INT8 = "int8_per_channel_weight_only"
FEATURES = {  # a feature, and the keywords that turn it on (tmp: a folder of its own)
    "no prefix cache": lambda tmp: dict(enable_prefix_caching=False),
    "n-gram speculation": lambda tmp: dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                               "prompt_lookup_max": 2}),
    "draft speculation": lambda tmp: dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 2}),
    "tensor parallelism": lambda tmp: dict(tensor_parallel_size=2),
    "CPU tier": lambda tmp: dict(kv_offloading_size=0.002),
    "file tier": lambda tmp: dict(kv_offloading_size=0.002, kv_offloading_file_tier={"root_dir": str(tmp / "kv"),
                                                                                      "size": 0.01}),
    "KV events": lambda tmp: dict(kv_events_config={"enable_kv_cache_events": True}),
    "int8": lambda tmp: dict(quantization=INT8),
    "bf16": lambda tmp: dict(dtype="bfloat16"),
    "chunked prefill": lambda tmp: dict(max_num_batched_tokens=12),
    "preemption": lambda tmp: dict(num_kv_blocks=14, scheduler_reserve_full_isl=False),
}
SAME_KEYWORD = {("n-gram speculation", "draft speculation")}  # one speculative_config: not a pair
BASE = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, seed=0)
MAX_TOKENS = 6


def prompts() -> list[dict]:
    shared = passage_prompts([21])[0]
    tails = passage_prompts([5, 9, 3], offset=400)
    return [{"prompt_token_ids": shared + tail} for tail in tails] + \
        [{"prompt_token_ids": passage_prompts([17], offset=900)[0]}]


def run(keywords: dict) -> list[list[list[int]]]:
    """The tokens of two rounds of the prompts; every block back after each."""
    llm = LLM(**{**BASE, **keywords})
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        rounds = []
        for _ in range(2):
            rounds.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts(), params, use_tqdm=False)])
            pool = llm.engine.kv_manager.pool
            assert pool.num_free == pool.num_blocks, f"{pool.num_blocks - pool.num_free} KV blocks not back"
        return rounds
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def fp32_greedy() -> list[tuple[list[int], list[float], float]]:
    """fp32 transformers, per prompt: greedy tokens, the top-two gap at each, the near-tie threshold."""
    hf = tiny_model()[2]
    runs = []
    for prompt in prompts():
        tokens, margins, scale = greedy_with_margins(hf, prompt["prompt_token_ids"], MAX_TOKENS)
        runs.append((tokens, margins, 2 * LOGIT_BOUND * scale))
    return runs


def assert_follows(rounds, fp32_greedy, exact: bool, what: str) -> None:
    for number, tokens in enumerate(rounds):
        for i, (got, (want, margins, tie)) in enumerate(zip(tokens, fp32_greedy)):
            diverged = first_divergence(got, want)
            if diverged is not None:
                assert not exact and margins[diverged] < tie, (
                    f"{what}, round {number + 1}, prompt {i}: differs from fp32 transformers at token {diverged} "
                    f"(top-two gap {margins[diverged]:.3f}; near-tie threshold {tie:.3f}, fp32 must not differ)")


PAIRS = [pair for pair in itertools.combinations(FEATURES, 2) if pair not in SAME_KEYWORD]


@pytest.mark.parametrize("first, second", PAIRS, ids=[f"{a} + {b}" for a, b in PAIRS])
def test_a_pair_composes_or_is_refused_by_the_table_before_any_weight_is_read(first, second, fp32_greedy, tmp_path,
                                                                              monkeypatch):
    keywords = {**FEATURES[first](tmp_path), **FEATURES[second](tmp_path)}
    dtype = {"bfloat16": torch.bfloat16}.get(keywords.get("dtype"), torch.float32)
    try:
        compatibility.check_compatible(keywords, dtype)
    except ValueError as refusal:
        import minivllm.entrypoints.llm as entry

        read = entry.load_model

        def planned_only(*args, **kwargs):
            assert kwargs.get("weights") is False, "weights read before the refusal"
            return read(*args, **kwargs)

        monkeypatch.setattr(entry, "load_model", planned_only)
        with pytest.raises(ValueError) as error:
            LLM(**{**BASE, **keywords})
        assert str(error.value) == str(refusal)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a kernel that does not build here falls back, and says so
        rounds = run(keywords)
    exact = not keywords.get("quantization") and dtype == torch.float32
    assert_follows(rounds, fp32_greedy, exact, f"{first} with {second}")


def test_the_table_names_only_features_and_every_refusal_has_a_reason():
    names = set(compatibility.FEATURES)
    for (a, b), reason in compatibility.INCOMPATIBLE.items():
        assert {a, b} <= names and a != b and len(reason) > 20
    for feature, (needed, reason) in compatibility.NEEDS.items():
        assert {feature, needed} <= names and len(reason) > 20
    table = compatibility.composition_table()
    assert table.count("refused") == len(compatibility.INCOMPATIBLE) + 1  # + the file tier's, through the CPU tier's
    assert compatibility.refused("tensor parallelism", "file tier") and not compatibility.refused("KV tier", "file tier")
    with pytest.raises(ValueError, match="kv_offloading_file_tier .file tier. needs kv_offloading_size"):
        LLM(kv_offloading_file_tier={"root_dir": "/nonexistent", "size": 1})
