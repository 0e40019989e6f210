"""minivllm: a small but real LLM inference engine, built step by step in the book's notebooks.

The public names are imported lazily, so that the tooling in this package (`notebook_tools`, which
writes the generated modules) runs even while a generated module is missing or broken.
"""

from importlib import import_module

__version__ = "0.1.0"

_PUBLIC = {
    "LLM": "minivllm.llm",
    "LLMEngine": "minivllm.engine",
    "RequestOutput": "minivllm.engine",
    "SamplingParams": "minivllm.sampling",
    "load_model": "minivllm.loader",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
