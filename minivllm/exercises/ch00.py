"""Chapter 0 exercises."""


from minivllm.exercises import exercise, expect

@exercise("00.parameter_count")
def _parameter_count():
    from minivllm.config import ModelConfig
    from minivllm.model.decoder import CausalLM

    base = dict(architectures=["Qwen3ForCausalLM"], vocab_size=100, hidden_size=32, intermediate_size=48,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                tie_word_embeddings=True)
    variants = {
        "tiny Qwen3, tied embeddings": base,
        "untied embeddings": {**base, "tie_word_embeddings": False},
        "head_dim * heads != hidden_size": {**base, "head_dim": 16},
        "Qwen2 (q/k/v biases, no q/k norms)": {**base, "architectures": ["Qwen2ForCausalLM"], "head_dim": None},
        "Llama with attention and MLP biases": {**base, "architectures": ["LlamaForCausalLM"],
                                                "attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1},
    }

    def case(hf):
        def test(parameter_count):
            cfg = {k: v for k, v in hf.items() if v is not None}
            want = sum(p.numel() for p in CausalLM(ModelConfig.from_hf(cfg)).parameters())
            got = parameter_count(dict(cfg))
            expect(got == want, f"returned {got:,}, the model has {want:,}")
        return test

    return [(f"parameter_count: {what}", case(hf)) for what, hf in variants.items()]
