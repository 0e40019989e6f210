"""Generation by recomputation: stop conditions, bad input, equivalence with transformers."""

import pytest
import torch

from minivllm.book.recompute import generate_recompute
from minivllm.core.stop_checker import StopChecker
from minivllm.sampling_params import SamplingParams


class CharTokenizer:
    """One character per token id; enough to test text-level stop conditions."""
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if (i == 0 and skip_special_tokens) else chr(ord("a") + i - 1) for i in ids)


def finish(params, ids, tokenizer=CharTokenizer(), room=None):
    checker = StopChecker(params, tokenizer, max_new_tokens=room)
    for n in range(1, len(ids) + 1):
        reason = checker.finish_reason(ids[:n])
        if reason:
            return reason, n, checker.text(ids[:n])
    return None, len(ids), checker.text(ids)


def test_max_tokens_and_context_room_give_length():
    assert finish(SamplingParams(max_tokens=3), [1, 2, 3, 4, 5]) == ("length", 3, "abc")
    assert finish(SamplingParams(max_tokens=None), [1, 2, 3, 4], room=2) == ("length", 2, "ab")


def test_eos_stops_unless_ignored():
    assert finish(SamplingParams(max_tokens=10), [1, 2, 0, 3]) == ("stop", 3, "ab")
    assert finish(SamplingParams(max_tokens=4, ignore_eos=True), [1, 2, 0, 3]) == ("length", 4, "abc")


def test_stop_token_ids():
    assert finish(SamplingParams(max_tokens=10, stop_token_ids=[3]), [1, 2, 3, 4]) == ("stop", 3, "abc")


def test_stop_strings_cut_the_text_and_can_be_kept():
    ids = [1, 2, 3, 4, 5, 6]  # "abcdef"
    assert finish(SamplingParams(max_tokens=10, stop=["cd", "b"]), ids) == ("stop", 2, "a")
    assert finish(SamplingParams(max_tokens=10, stop="de"), ids) == ("stop", 5, "abc")
    assert finish(SamplingParams(max_tokens=10, stop="de", include_stop_str_in_output=True), ids) == ("stop", 5, "abcde")


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="SamplingParams.stop needs a tokenizer"):
        StopChecker(SamplingParams(stop="x"), tokenizer=None)


@pytest.fixture(scope="module")
def tiny():
    from minivllm import load_model

    return load_model()


def test_bad_input_is_refused_before_any_work(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate_recompute(model, [], SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams.n = 2"):
        generate_recompute(model, [1], SamplingParams(n=2))
    with pytest.raises(ValueError, match="leaves no room in max_len = 2048"):
        generate_recompute(model, [1] * model.config.max_model_len, SamplingParams())


def test_embedded_model_greedy_matches_transformers(tiny):
    from transformers import AutoModelForCausalLM

    from minivllm.model.loader import DEFAULT_MODEL

    model, tokenizer = tiny
    hf_model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    for prompt in ["ROMEO:\n", "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\n"]:
        ids = tokenizer(prompt).input_ids
        ours = generate_recompute(model, ids, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), tokenizer)
        with torch.no_grad():
            theirs = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
        assert ours.token_ids == theirs[0, len(ids):].tolist()
        assert ours.text == tokenizer.decode(ours.token_ids, skip_special_tokens=True)
        assert ours.finish_reason == "length" and len(ours.token_times) == 64


def test_seeded_sampling_is_reproducible(tiny):
    model, tokenizer = tiny
    ids = tokenizer("JULIET:\n").input_ids
    runs = [generate_recompute(model, ids, SamplingParams(temperature=1.0, seed=seed, max_tokens=20), tokenizer).token_ids
            for seed in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2]
