"""The embedded models: loadable with no argument, by transformers too, small enough to ship."""

import json

import pytest
import torch

from minivllm.model.loader import DEFAULT_MODEL

DRAFT_MODEL = DEFAULT_MODEL.parent / "tiny-shakespeare-draft"


def test_assets_fit_in_20_mb():
    size = sum(f.stat().st_size for f in DEFAULT_MODEL.parent.rglob("*") if f.is_file())
    assert size <= 20 * 2**20, f"{size / 2**20:.1f} MB"


@pytest.mark.parametrize("folder", [DEFAULT_MODEL, DRAFT_MODEL])
def test_transformers_loads_the_same_folder_with_the_same_logits(folder):
    from transformers import AutoModelForCausalLM

    from minivllm import load_model
    from minivllm.attention.base import NoCacheAttention

    model, tokenizer = load_model(folder)
    ids = tokenizer("KING RICHARD III:\nNow is the winter of our discontent").input_ids
    logits = model.compute_logits(model(*NoCacheAttention.for_sequences([ids])))
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    assert (logits - expected).abs().max().item() < 1e-4


def test_default_is_the_tiny_model_and_the_draft_shares_its_tokenizer():
    from minivllm import load_model

    model, tokenizer = load_model()
    draft, draft_tokenizer = load_model(DRAFT_MODEL)
    assert model.config.architecture == "Qwen3ForCausalLM"
    assert 3_000_000 <= sum(p.numel() for p in model.parameters()) <= 8_000_000
    assert sum(p.numel() for p in draft.parameters()) <= 1_000_000
    assert draft_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert (DEFAULT_MODEL / "tokenizer.json").read_text() == (DRAFT_MODEL / "tokenizer.json").read_text()


@pytest.mark.parametrize("folder", [DEFAULT_MODEL, DRAFT_MODEL])
def test_model_card_reports_training(folder):
    card = (folder / "README.md").read_text()
    stats = json.loads((folder / "training.json").read_text())
    assert f"{stats['parameters']:,}" in card and str(stats["val_loss"]) in card
    assert "ROMEO:" in card and "char-rnn" in card
