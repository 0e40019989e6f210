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


TOKENIZER_TEXT = "ROMEO: But soft, what light through yonder window breaks?\n<|endoftext|> Juliet é ✓"
TOKENIZER_IDS = [861, 28, 1524, 368, 1045, 14, 437, 1254, 1779, 285, 1642, 1567, 300, 1644, 85, 33, 201, 0, 1867,
                 223, 130, 105, 223, 161, 253, 244]  # what the shipped tokenizer gave when it was trained


@pytest.mark.parametrize("folder", [DEFAULT_MODEL, DRAFT_MODEL])
def test_the_tokenizer_config_loads_in_transformers_4_and_5(folder):
    """transformers 4.x (pinned by guidellm and older tools) knows no `TokenizersBackend`, transformers 5's name for
    the class; both know `PreTrainedTokenizerFast`. 4.x before 4.50 reads the chat template from the config only.
    (Checked by hand with transformers 4.57.6 in a separate venv: the same ids and the same rendered chat.)"""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == (folder / "chat_template.jinja").read_text()
    assert config["eos_token"] == config["pad_token"] == "<|endoftext|>" and config["model_max_length"] == 2048
    auto, fast = AutoTokenizer.from_pretrained(folder), PreTrainedTokenizerFast.from_pretrained(folder)
    assert auto(TOKENIZER_TEXT).input_ids == fast(TOKENIZER_TEXT).input_ids == TOKENIZER_IDS
    assert auto.eos_token_id == auto.pad_token_id == 0 and auto.decode(TOKENIZER_IDS) == TOKENIZER_TEXT
    assert auto.chat_template == config["chat_template"]


def test_the_training_script_writes_the_portable_config(tmp_path):
    """train_tiny rewrites what transformers 5's save_pretrained wrote, as it did for the shipped folders."""
    from minivllm.book.texts import CORPUS
    from minivllm.tools.train_tiny import make_tokenizer_config_portable, train_tokenizer

    train_tokenizer(CORPUS[:2000], vocab_size=300).save_pretrained(tmp_path)  # as train_tiny saves it
    make_tokenizer_config_portable(tmp_path)
    assert (tmp_path / "tokenizer_config.json").read_text() == (DEFAULT_MODEL / "tokenizer_config.json").read_text()
