"""SamplingParams validation and the sampler's behaviour."""

import pytest
import torch

from minivllm.engine.sampler import sample_token, sampling_probs
from minivllm.sampling_params import SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("max_tokens", 0), ("max_tokens", -3), ("n", 0), ("stop", ""), ("stop", ["ok", ""]), ("stop_token_ids", [-1]),
    # the upper bounds: what the engine's tensors hold, and no unbounded work for one request
    ("n", 4097), ("top_k", 2**31), ("max_tokens", 2**31), ("seed", 2**63), ("temperature", float("inf")),
    ("temperature", float("nan")), ("stop", ["x"] * 33), ("stop", ["x" * 1025]), ("stop_token_ids", list(range(1025))),
    ("stop_token_ids", [2**31]), ("n", True), ("temperature", "0.5"), ("stop", {"a"}),
])
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} = "):
        SamplingParams(**{field: value})


def test_integers_beyond_any_float_or_repr_are_refused_by_name():
    for field in ["n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens"]:
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field} = an integer of 66439 bits: must be"):
            SamplingParams(**{field: 10**20000})  # more than 4,300 digits: even repr() of it raises
    assert SamplingParams(temperature=2**64).temperature == 2.0**64  # large but finite: a float


def test_defaults_are_vllms():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p, params.max_tokens,
            params.seed, params.ignore_eos) == (1, 1.0, 1.0, 0, 0.0, 16, None, False)
    assert SamplingParams(stop="x").stop_strings == ["x"]


def logits_row(seed=0, vocab=50):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2


def draws(logits, params, count=4000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.bincount(torch.tensor([sample_token(logits, params, gen) for _ in range(count)]),
                          minlength=logits.numel()).float() / count


def test_greedy_is_argmax():
    logits = logits_row()
    assert sample_token(logits, SamplingParams(temperature=0)) == int(logits.argmax())
    assert sample_token(logits, SamplingParams(temperature=1e-6)) == int(logits.argmax())


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = logits_row(vocab=1000) * 0.1
    params = SamplingParams(temperature=1.0)

    def run(seed):
        gen = torch.Generator().manual_seed(seed)
        return [sample_token(logits, params, gen) for _ in range(20)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_unfiltered_sampling_follows_the_softmax():
    logits = logits_row()
    frequencies = draws(logits, SamplingParams(temperature=1.0))
    assert (frequencies - logits.softmax(-1)).abs().max() < 0.03


def test_temperature_sharpens():
    logits = logits_row()
    cold = draws(logits, SamplingParams(temperature=0.3))
    hot = draws(logits, SamplingParams(temperature=3.0))
    top = int(logits.argmax())
    assert cold[top] > logits.softmax(-1)[top] > hot[top]


def test_top_k_keeps_only_the_k_best():
    logits = logits_row()
    frequencies = draws(logits, SamplingParams(top_k=3), count=1000)
    assert set(frequencies.nonzero().flatten().tolist()) <= set(logits.topk(3).indices.tolist())
    assert sample_token(logits, SamplingParams(top_k=1), torch.Generator().manual_seed(0)) == int(logits.argmax())


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    frequencies = draws(logits, SamplingParams(top_p=0.75), count=2000)
    assert frequencies[0] == 0 and frequencies[3] == 0  # 0.5 + 0.3 reaches 0.75: tokens 1 and 2 only
    assert abs(frequencies[1] - 0.5 / 0.8) < 0.04


def test_min_p_drops_tokens_far_below_the_best():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.07, 0.03]))
    frequencies = draws(logits, SamplingParams(min_p=0.1), count=2000)  # threshold 0.06
    assert frequencies[3] == 0 and frequencies[2] > 0


def test_top_p_counts_what_min_p_left_as_vllm_does():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    probs = sampling_probs(logits, SamplingParams(temperature=1.0, min_p=0.2, top_p=0.82))
    # min_p drops 0.05; renormalised, 0.5 and 0.3 already hold 0.84 >= 0.82, so 0.15 goes too
    assert (probs > 0).tolist() == [True, True, False, False]
