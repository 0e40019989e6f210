"""Chapter 1's single-request sampler and loader registry: the contracts later chapters rely on."""

import pytest
import torch

from minivllm.engine.sampler import sample_token, sampling_probs
from minivllm.model import loader
from minivllm.sampling_params import SamplingParams


@pytest.mark.parametrize("top_p", [1e-46, 1e-30, 1e-9])
def test_tiny_top_p_keeps_the_top_token(top_p):
    # 1e-46 is 0.0 in float32: "the tokens above reach top_p" then holds for every token, the top one too
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=0)
    probs = sampling_probs(logits, params)
    assert probs.nonzero().flatten().tolist() == [1]
    for seed in range(5):
        assert sample_token(logits, params, torch.Generator().manual_seed(seed)) == 1


def test_top_p_keeps_the_smallest_set_reaching_it():
    logits = torch.tensor([0.6, 0.3, 0.1]).log()
    probs = sampling_probs(logits, SamplingParams(top_p=0.8))
    assert probs.nonzero().flatten().tolist() == [0, 1]


def test_penalty_fields_have_vllms_defaults():
    params = SamplingParams()
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_tokens) == (
        0.0, 0.0, 1.0, 0)


def test_load_model_hands_a_file_to_the_loader_registered_for_its_suffix(tmp_path, monkeypatch):
    calls = []

    def fake_loader(path, dtype, device, weights, tokenizer):
        calls.append((str(path), dtype, device.type, weights, tokenizer))
        return "model", "tokenizer"

    monkeypatch.setattr(loader, "FILE_LOADERS", {".fake": fake_loader})
    (tmp_path / "m.fake").write_bytes(b"")
    assert loader.load_model(tmp_path / "m.fake", device="cpu") == ("model", "tokenizer")
    loader.load_model(tmp_path / "m.fake", device="cpu", weights=False, tokenizer=False)
    assert calls == [(str(tmp_path / "m.fake"), torch.float32, "cpu", True, True),
                     (str(tmp_path / "m.fake"), torch.float32, "cpu", False, False)]


def test_file_without_a_loader_is_refused_naming_its_suffix(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "FILE_LOADERS", {})
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match=r"no loader for '\.bin' files"):
        loader.load_model(tmp_path / "weights.bin", device="cpu")


@pytest.mark.parametrize("field, value", [("presence_penalty", 0.5), ("frequency_penalty", -0.2),
                                          ("repetition_penalty", 1.3), ("min_tokens", 4)])
def test_the_books_one_request_generators_refuse_what_they_cannot_apply(field, value):
    from minivllm.book.contiguous_cache import generate_cached
    from minivllm.book.recompute import generate_recompute

    model, _ = loader.load_model(device="cpu")
    params = SamplingParams(temperature=0, max_tokens=4, **{field: value})
    for generate in (generate_recompute, generate_cached):
        with pytest.raises(ValueError, match=f"{field} = {value!r}"):
            generate(model, [1, 2, 3], params)
