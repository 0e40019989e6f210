"""Loading checkpoints: bad configs and weight files are refused by name, before any work."""

import json
import shutil

import pytest
import torch

from minivllm.config import ModelConfig
from minivllm.model.loader import load_model, load_weights, resolve_dtype, weight_files
from tests.conftest import save_random_checkpoint


@pytest.fixture
def qwen3_folder(tmp_path):
    save_random_checkpoint(tmp_path, "qwen3-gqa2-tied")
    return tmp_path


def hf_config(folder):
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("change, field, value", [
    ({"architectures": ["MistralForCausalLM"]}, "architectures", "MistralForCausalLM"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_parameters.rope_type", "yarn"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type", "dynamic"),
    ({"dtype": "float8_e4m3fn"}, "dtype", "float8_e4m3fn"),
    ({"hidden_act": "gelu"}, "hidden_act", "gelu"),
    ({"use_sliding_window": True}, "use_sliding_window", ""),
])
def test_unsupported_config_is_refused_naming_field_and_value(qwen3_folder, change, field, value):
    with pytest.raises(ValueError) as error:
        ModelConfig.from_hf({**hf_config(qwen3_folder), **change})
    assert field in str(error.value) and value in str(error.value)


def test_old_style_rope_fields_are_read(qwen3_folder):
    config = {**hf_config(qwen3_folder), "rope_parameters": None, "rope_theta": 123.0,
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    parsed = ModelConfig.from_hf(config)
    assert parsed.rope_theta == 123.0 and parsed.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}


def test_unsupported_dtype_argument_is_refused():
    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                                  "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})
    with pytest.raises(ValueError, match="dtype='int8'"):
        resolve_dtype("int8", config, torch.device("cpu"))
    assert resolve_dtype(None, config, torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", config, torch.device("cpu")) == torch.bfloat16


def test_corrupt_weight_file_is_named(qwen3_folder):
    weights = qwen3_folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    config = ModelConfig.from_hf(hf_config(qwen3_folder))
    with pytest.raises(ValueError, match=f"weights file {weights} cannot be read"):
        load_weights(qwen3_folder, config, torch.float32, torch.device("cpu"))


def test_missing_shard_is_named(qwen3_folder):
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (qwen3_folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors is missing"):
        weight_files(qwen3_folder)


def test_folder_without_weights_or_config_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        weight_files(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_model(tmp_path)


def test_missing_tensor_is_named(qwen3_folder):
    from safetensors.torch import load_file, save_file

    weights = qwen3_folder / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights)
    config = ModelConfig.from_hf(hf_config(qwen3_folder))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_weights(qwen3_folder, config, torch.float32, torch.device("cpu"))


def test_sharded_checkpoint_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_model = save_random_checkpoint(tmp_path / "one", "llama-untied-gqa8")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    config = ModelConfig.from_hf(hf_config(tmp_path / "sharded"))
    model = load_weights(tmp_path / "sharded", config, torch.float32, torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "one")
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_a_hub_name_that_cannot_be_fetched_is_explained(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="'no-such-org/no-such-model' is neither a local folder"):
        load_model("no-such-org/no-such-model")


def test_bf16_weights_load_in_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_model = save_random_checkpoint(tmp_path / "fp32", "qwen2-qkv-bias-gqa4")
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    config = ModelConfig.from_hf(hf_config(tmp_path / "bf16"))
    assert config.dtype == torch.bfloat16
    model = load_weights(tmp_path / "bf16", config, torch.bfloat16, torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.bias, reference.model.layers[0].self_attn.q_proj.bias)
