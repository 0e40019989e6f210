"""GGUF files: random-init llama, qwen2 and qwen3 checkpoints written as GGUF load into logits equal to
transformers'; SmolLM2-135M-Instruct (a real Q4_1 file) chats with transformers' greedy tokens; bad files
are refused with a message naming what is wrong."""

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from minivllm import LLM, SamplingParams
from minivllm.attention.base import NoCacheAttention
from minivllm.book.real_model import smollm2_gguf
from minivllm.exercises.ch90 import _permute
from minivllm.model.gguf_loader import GLOBAL_TENSORS, LAYER_TENSORS, load_gguf
from tests.conftest import save_random_checkpoint

TO_GGUF = {v: k for k, v in GLOBAL_TENSORS.items()}
LAYER_TO_GGUF = {v: k for k, v in LAYER_TENSORS.items()}


def write_gguf(path, hf_model, arch: str) -> None:
    """hf_model's weights as a float32 GGUF file, named and (for llama) permuted as llama.cpp's converter does."""
    config = hf_model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_vocab_size(config.vocab_size)
    for name, weight in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{LAYER_TO_GGUF[rest]}"
        else:
            gguf_name = TO_GGUF[name]
        if arch == "llama" and rest_is(name, "q_proj.weight"):
            weight = _permute(weight, config.num_attention_heads)
        if arch == "llama" and rest_is(name, "k_proj.weight"):
            weight = _permute(weight, config.num_key_value_heads)
        writer.add_tensor(gguf_name, weight.float().numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def rest_is(name: str, suffix: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(suffix)


@pytest.mark.parametrize("family, arch", [("llama-untied-gqa8", "llama"), ("qwen2-qkv-bias-gqa4", "qwen2"),
                                          ("qwen3-gqa2-tied", "qwen3")])
def test_gguf_of_each_architecture_gives_transformers_logits(tmp_path, family, arch):
    hf_model = save_random_checkpoint(tmp_path / "hf", family)
    write_gguf(tmp_path / "model.gguf", hf_model, arch)
    model, tokenizer = load_gguf(tmp_path / "model.gguf")
    assert tokenizer is None  # the file carries no tokenizer
    tokens = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ours = model.compute_logits(model(*NoCacheAttention.for_sequences([tokens])))
        theirs = hf_model(torch.tensor([tokens])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4


def test_a_truncated_file_and_an_unknown_architecture_are_refused(tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm2_gguf().read_bytes()[:1_000_000])
    with pytest.raises(ValueError, match=r"not a readable GGUF file: .*truncated.gguf: "):
        load_gguf(truncated)
    writer = GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"gpt2.gguf: general.architecture: 'gpt2' is not supported"):
        load_gguf(tmp_path / "gpt2.gguf")


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    path = smollm2_gguf()
    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return LLM(str(path), num_kv_blocks=128, max_model_len=1024), hf_model


def test_smollm2_chats_with_transformers_greedy_tokens_and_knows_paris(smollm2):
    llm, hf_model = smollm2
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?"]
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                       SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for out in outputs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == expected[:len(out.outputs[0].token_ids)]
    assert "Paris" in outputs[0].outputs[0].text
    assert llm.stats()["kv_blocks_free"] == 128


def test_chat_refuses_bad_messages_before_any_work(smollm2):
    llm, _ = smollm2
    for bad, message in [([{"role": "user"}], r"messages\[0\]\[0\]: each message needs"),
                         ([[]], r"messages\[0\]: a conversation is a non-empty list"),
                         ([{"role": "user", "content": 5}], "both strings")]:
        with pytest.raises(ValueError, match=message):
            llm.chat(bad, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_chat_needs_a_chat_template(tmp_path, checkpoints):
    folder, _ = checkpoints["qwen3-gqa2-tied"]  # saved without a tokenizer
    with pytest.raises(ValueError, match="LLM.chat needs a tokenizer with a chat template"):
        LLM(str(folder), num_kv_blocks=16).chat([{"role": "user", "content": "hi"}])
