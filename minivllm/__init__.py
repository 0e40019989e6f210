"""minivllm: a small but real LLM inference engine, built step by step in the book's notebooks."""

from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.llm import LLM
from minivllm.model.loader import load_model
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams", "load_model"]
