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


# ------------------------------------------------------------------ the batched sampler's penalties and min_tokens

from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

from minivllm.core.request import Request
from minivllm.core.stop_checker import StopChecker
from minivllm.engine.sampler import Sampler, batched_sampling_probs, processed_logits


def request_with(prompt, output, **params):
    p = SamplingParams(temperature=0, max_tokens=64, **params)
    request = Request("r", list(prompt), p, StopChecker(p))
    for token in output:
        request.append_output_token_id(token)
    return request


def batch_logits(rows, vocab=40, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_equals_transformers_processor():
    prompts, outputs = [[1, 5, 5, 9], [2, 3], [7]], [[5, 11, 30], [], [7, 7, 8]]
    penalties = [1.3, 0.7, 1.0]
    requests = [request_with(p, o, repetition_penalty=r) for p, o, r in zip(prompts, outputs, penalties)]
    logits = batch_logits(3)
    ours = processed_logits(logits, requests)
    for i, (prompt, output, penalty) in enumerate(zip(prompts, outputs, penalties)):
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits[i:i + 1].clone())
        torch.testing.assert_close(ours[i], theirs[0])
    assert not torch.equal(ours[0], logits[0])  # it did something


def test_frequency_and_presence_penalties_follow_openais_definition():
    requests = [request_with([4, 4, 6], [6, 6, 9, 2], frequency_penalty=0.5, presence_penalty=1.25),
                request_with([1], [3, 3], presence_penalty=-2.0)]
    logits = batch_logits(2)
    ours = processed_logits(logits, requests)
    expected = logits.clone()
    for i, r in enumerate(requests):  # mu[j] - c[j] * frequency - (c[j] > 0) * presence, output tokens only
        for token in set(r.output_token_ids):
            count = r.output_token_ids.count(token)
            expected[i, token] -= count * r.params.frequency_penalty + r.params.presence_penalty
    torch.testing.assert_close(ours, expected)
    assert ours[0, 4] == logits[0, 4]  # a prompt token is not penalised by them


def test_penalty_counts_follow_new_tokens_without_recounting():
    request = request_with([1, 2], [3], frequency_penalty=1.0)
    logits = batch_logits(1)
    processed_logits(logits, [request])
    counts_before = request.penalty_state[1]
    request.append_output_token_id(3)
    request.append_output_token_id(5)
    ours = processed_logits(logits, [request])
    assert request.penalty_state[1] is counts_before and request.penalty_state[2] == 3  # updated in place
    assert ours[0, 3] == logits[0, 3] - 2 and ours[0, 5] == logits[0, 5] - 1


def test_min_tokens_masks_stop_tokens_as_transformers_processor():
    stops = [4, 9]
    requests = [request_with([1, 2], [3] * n, min_tokens=3, stop_token_ids=stops) for n in (0, 2, 3)]
    logits = batch_logits(3)
    ours = processed_logits(logits, requests)
    for i, r in enumerate(requests):
        processor = MinNewTokensLengthLogitsProcessor(2, 3, stops)
        theirs = processor(torch.tensor([r.all_token_ids]), logits[i:i + 1].clone())
        torch.testing.assert_close(ours[i], theirs[0])
    assert ours[0, 4] == float("-inf") and ours[2, 4] == logits[2, 4]


def test_min_tokens_stop_rule_waits_for_the_stop_string_after_min_tokens():
    class Letters:  # a tokenizer of one character per token
        eos_token_id = 0

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(96 + i) for i in ids)

    params = SamplingParams(max_tokens=10, min_tokens=3, stop="ab")
    checker = StopChecker(params, Letters())
    ids = []
    reasons = []
    for token in [1, 2, 3, 1, 2]:  # "abcab": the first "ab" lies within the first 3 tokens, the second after
        ids.append(token)
        reasons.append(checker.finish_reason(ids))
    assert reasons == [None, None, None, None, "stop"] and checker.text(ids) == "abc"


def test_greedy_rows_use_the_penalised_logits_and_logprobs_the_raw_ones():
    request = request_with([1], [], repetition_penalty=2.0)
    logits = torch.full((1, 10), -1.0)
    logits[0, 1], logits[0, 2] = 4.0, 2.5  # token 1, in the prompt, drops to 2.0: token 2 wins
    tokens = Sampler()(logits, [request], torch.Generator())
    assert tokens == [2]
    entry = Sampler.logprobs(logits, [request_with([1], [], repetition_penalty=2.0, logprobs=1)], tokens)
    [(logprob, [(best, _)])] = next(iter(entry.values()))
    assert best == 1 and abs(logprob - logits[0].log_softmax(-1)[2].item()) < 1e-6


def test_a_top_p_below_float32s_smallest_number_keeps_the_best_token():
    logits = batch_logits(2)
    probs = batched_sampling_probs(logits, [SamplingParams(top_p=1e-46), SamplingParams(top_p=1e-30)])
    assert ((probs > 0).sum(-1) == 1).all()
    assert (probs.argmax(-1) == logits.argmax(-1)).all()  # the race draws it every time: the rest are 0
