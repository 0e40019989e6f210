"""The model: one decoder for Qwen3, Qwen2 and Llama over a flat packed batch, and its loader. It knows
nothing about caches: attention goes through the metadata object the caller passes (minivllm.attention)."""
