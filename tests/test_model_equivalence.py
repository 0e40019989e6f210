"""The decoder equals transformers: logits (fp32, 1e-4) and 64-token greedy continuations, every family."""

import json

import pytest
import torch

from minivllm.attention.base import NoCacheAttention
from minivllm.config import ModelConfig
from minivllm.model.loader import load_weights
from tests.conftest import FAMILIES


def minivllm_logits(model, sequences):
    input_ids, positions, metadata = NoCacheAttention.for_sequences(sequences)
    return model.compute_logits(model(input_ids, positions, metadata))


def load(folder):
    """Random checkpoints have no tokenizer: load_model's steps, minus the tokenizer."""
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    return load_weights(folder, config, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(checkpoints, family):
    folder, hf_model = checkpoints[family]
    model = load(folder)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 256, (40,), generator=gen).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    got = minivllm_logits(model, [prompt])
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_batch_matches_each_sequence_alone(checkpoints, family):
    folder, hf_model = checkpoints[family]
    model = load(folder)
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 17, 5, 33)]
    packed = minivllm_logits(model, sequences)
    start = 0
    for seq in sequences:
        with torch.no_grad():
            expected = hf_model(torch.tensor([seq])).logits[0]
        assert (packed[start:start + len(seq)] - expected).abs().max().item() < 1e-4
        start += len(seq)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_64_tokens_identical(checkpoints, family):
    from minivllm.book.recompute import generate_recompute
    from minivllm.sampling_params import SamplingParams

    folder, hf_model = checkpoints[family]
    model = load(folder)
    prompt = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                     pad_token_id=0)[0, len(prompt):].tolist()
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    assert generate_recompute(model, prompt, params).token_ids == expected
