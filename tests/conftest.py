"""Shared fixtures: random-init checkpoints of each supported family, written with save_pretrained."""

import pytest
import torch

# name: (transformers config class, architecture kwargs)
FAMILIES = {
    "qwen3-gqa2-tied": ("Qwen3Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            tie_word_embeddings=True)),
    "qwen3-headdim-differs-untied": ("Qwen3Config", dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                                         num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                                         tie_word_embeddings=False, rope_theta=1_000_000.0)),
    "qwen3-attention-bias-mha": ("Qwen3Config", dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                                     attention_bias=True, tie_word_embeddings=False)),
    "qwen2-qkv-bias-gqa4": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=8, num_key_value_heads=2,
                                                tie_word_embeddings=True, rope_theta=500_000.0)),
    "llama-untied-gqa8": ("LlamaConfig", dict(hidden_size=128, intermediate_size=160, num_hidden_layers=2,
                                              num_attention_heads=8, num_key_value_heads=1,
                                              tie_word_embeddings=False)),
    "llama-biases-llama3-rope": ("LlamaConfig", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        attention_bias=True, mlp_bias=True, head_dim=32, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama-linear-rope-no-head-dim": ("LlamaConfig", dict(
        hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))),
}


def save_random_checkpoint(folder, family: str, vocab_size: int = 256, seed: int = 0, **overrides):
    """A random-init transformers model of `family`, saved with save_pretrained; returns the HF model."""
    import transformers

    class_name, kwargs = FAMILIES[family]
    kwargs = {**kwargs, **overrides}
    if "rope_theta" in kwargs:
        kwargs["rope_parameters"] = dict(rope_type="default", rope_theta=kwargs.pop("rope_theta"))
    config = getattr(transformers, class_name)(vocab_size=vocab_size, max_position_embeddings=256,
                                               bos_token_id=1, eos_token_id=2, pad_token_id=0, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # random init leaves norms at 1 and biases at 0: perturb them so their code paths are tested
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(folder)
    return model


def transformers_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    """The reference: transformers' greedy continuation of one prompt, exactly max_tokens long."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> (folder, transformers model)."""
    made = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        made[family] = (folder, save_random_checkpoint(folder, family))
    return made


def kernel_missing(load) -> bool:
    """True where a C++ kernel cannot be built here for a reason that is not a bug (no compiler, or
    MINIVLLM_CPU_KERNELS=off): its tests skip. A compile error is not such a reason: the tests then run and fail."""
    from minivllm.kernels.build import KernelBuildError, KernelUnavailable

    try:
        load()
    except KernelBuildError:
        return False
    except KernelUnavailable:
        return True
    return False


def kernel_or_skip(load, *args):
    """`load(*args)`, or a skip where the kernel cannot be built here (see kernel_missing)."""
    from minivllm.kernels.build import KernelBuildError, KernelUnavailable

    try:
        return load(*args)
    except KernelBuildError:
        raise
    except KernelUnavailable as error:
        pytest.skip(f"the C++ kernel cannot be built here: {error}")
