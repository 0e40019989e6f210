"""The model: one decoder for Qwen3, Qwen2 and Llama over a flat packed batch, and its loader. It knows
nothing about caches: attention goes through the metadata object the caller passes (minivllm.attention)."""

# the appendix's GGUF loader registers ".gguf" in the loader's FILE_LOADERS: the package always reads GGUF files
import minivllm.model.gguf_loader  # noqa: E402,F401
