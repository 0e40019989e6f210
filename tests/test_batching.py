"""Static batching equals one-at-a-time generation; the workload generator and the memory accounting behave."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.book.static_batching import generate_static_batch
from minivllm.config import ModelConfig
from minivllm.book.contiguous_cache import generate_cached
from minivllm.model.loader import load_weights
from minivllm.sampling_params import SamplingParams
from minivllm.book.workloads import RESERVATIONS, chat_workload, contiguous_timeline, first_fit, memory_shares, reserve_pow2
from minivllm.book.workloads import WorkloadRequest


def load(folder):
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    return load_weights(folder, config, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("family", ["qwen3-gqa2-tied", "qwen2-qkv-bias-gqa4", "llama-biases-llama3-rope"])
def test_static_batch_equals_each_request_alone(checkpoints, family):
    model = load(checkpoints[family][0])
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 13, 6, 30, 9)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=1, max_tokens=35, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=30, seed=2, max_tokens=28, stop_token_ids=[10, 11, 12, 13]),
              SamplingParams(temperature=0.7, top_p=0.8, seed=3, max_tokens=12, ignore_eos=True)]
    batch = generate_static_batch(model, prompts, params, max_len=80)
    for done, prompt, p in zip(batch, prompts, params):
        alone = generate_cached(model, prompt, p)
        assert (done.token_ids, done.finish_reason) == (alone.token_ids, alone.finish_reason)
        assert done.prompt_token_ids == prompt


def test_static_batch_respects_its_max_len(checkpoints):
    model = load(checkpoints["qwen3-gqa2-tied"][0])
    batch = generate_static_batch(model, [[5] * 10, [6] * 3], SamplingParams(temperature=0, max_tokens=None,
                                                                            ignore_eos=True), max_len=16)
    assert [len(c.token_ids) for c in batch] == [6, 13]
    assert all(c.finish_reason == "length" for c in batch)


def test_static_batch_refuses_bad_input(checkpoints):
    model = load(checkpoints["qwen3-gqa2-tied"][0])
    greedy = SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="prompts is empty"):
        generate_static_batch(model, [], greedy)
    with pytest.raises(ValueError, match="params: 1 SamplingParams for 2 prompts"):
        generate_static_batch(model, [[5], [6]], [greedy])
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        generate_static_batch(model, [[5], []], greedy)
    with pytest.raises(ValueError, match=r"prompts\[0\]: a prompt of 8 tokens"):
        generate_static_batch(model, [[5] * 8], greedy, max_len=8)
    with pytest.raises(ValueError, match="max_len"):
        generate_static_batch(model, [[5]], greedy, max_len=model.config.max_model_len + 1)


def test_workload_is_deterministic_by_seed_and_fits_the_context():
    a, b, c = chat_workload(500, seed=3), chat_workload(500, seed=3), chat_workload(500, seed=4)
    assert a == b and a != c
    small = chat_workload(2000, seed=0, max_model_len=256)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.total_len <= 256 for r in small)
    # unclipped, the means are the ones asked for (log-normal, 2,000 draws: within 15%)
    wide = chat_workload(2000, seed=0, max_model_len=10**9, mean_prompt=100, mean_output=300)
    assert abs(sum(r.prompt_len for r in wide) / 2000 / 100 - 1) < 0.15
    assert abs(sum(r.output_len for r in wide) / 2000 / 300 - 1) < 0.15
    with pytest.raises(ValueError, match="sigma"):
        chat_workload(10, sigma=0)


def test_first_fit_takes_the_lowest_gap_that_holds_the_request():
    assert first_fit([], 10, 10) == 0
    assert first_fit([(0, 5), (8, 20), (30, 40)], 3, 50) == 5
    assert first_fit([(0, 5), (8, 20), (30, 40)], 4, 50) == 20
    assert first_fit([(0, 5), (8, 20), (30, 40)], 11, 50) is None
    assert first_fit([(2, 50)], 3, 60) == 50


requests_strategy = st.lists(st.builds(WorkloadRequest, st.integers(1, 60), st.integers(1, 70)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(requests=requests_strategy, extra_budget=st.integers(0, 300))
def test_every_snapshot_accounts_for_the_whole_budget(requests, extra_budget):
    max_model_len = 130
    budget = max_model_len + extra_budget
    for name, reserve in RESERVATIONS.items():
        snapshots = list(contiguous_timeline(requests, budget, reserve, max_model_len))
        assert snapshots and snapshots[-1].waiting == 0
        for s in snapshots:
            assert min(s.token_states, s.reservation, s.internal, s.free) >= 0
            assert s.token_states + s.reservation + s.internal + s.free == budget  # used <= reserved <= budget
            assert s.running >= 1
            if name == "oracle":
                assert s.internal == 0
        shares = memory_shares(snapshots, budget)
        parts = (shares.token_states, shares.reservation, shares.internal, shares.external)
        assert all(0 <= p <= 1 for p in parts) and abs(sum(parts) - 1) < 1e-9


@settings(max_examples=100, deadline=None)
@given(request=st.builds(WorkloadRequest, st.integers(1, 1000), st.integers(1, 1000)))
def test_pow2_reserves_less_than_twice_the_output(request):
    reserved = reserve_pow2(request, 2048)
    assert request.total_len <= reserved < request.prompt_len + 2 * request.output_len or reserved == 2048


def test_tighter_reservation_runs_more_requests_at_once():
    requests = chat_workload(300, seed=1)
    budget = 16_384
    shares = {name: memory_shares(contiguous_timeline(requests, budget, reserve, 2048), budget)
              for name, reserve in RESERVATIONS.items()}
    assert shares["max"].mean_running == budget // 2048  # max reservation: always exactly 8 rows
    assert shares["max"].mean_running < shares["pow2"].mean_running < shares["oracle"].mean_running
    assert shares["max"].token_states < shares["pow2"].token_states < shares["oracle"].token_states
    assert shares["oracle"].internal == 0


def test_timeline_refuses_what_cannot_be_served():
    with pytest.raises(ValueError, match="budget"):
        list(contiguous_timeline([WorkloadRequest(5, 5)], 0, RESERVATIONS["oracle"], 64))
    with pytest.raises(ValueError, match=r"requests\[1\]: reserves 60 slots"):
        list(contiguous_timeline([WorkloadRequest(5, 5), WorkloadRequest(30, 30)], 32, RESERVATIONS["oracle"], 64))
    with pytest.raises(ValueError, match=r"requests\[0\]"):
        list(contiguous_timeline([WorkloadRequest(60, 10)], 100, RESERVATIONS["oracle"], 64))
    with pytest.raises(ValueError, match="snapshots is empty"):
        memory_shares([], 10)
