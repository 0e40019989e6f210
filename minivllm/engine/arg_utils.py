"""vLLM's engine arguments on the command line: one definition for `serve`, `generate` and `bench`.

vLLM 0.33.0 declares them in `vllm/engine/arg_utils.py` (`EngineArgs.add_cli_args`, one argument group per
config class: ModelConfig, ParallelConfig, CacheConfig, SchedulerConfig, AttentionConfig). The flags here have
vLLM's names and meanings, and map onto `LLM(...)`'s keyword arguments (`EngineArgs.llm_kwargs`). Every value
is range-checked by argparse, before anything is loaded, with an error naming the flag. Plain module: command
line plumbing, not a chapter's code.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, fields

# vLLM's --dtype choices (ModelDType in vllm/config/model.py) -> the loader's names; "auto": the checkpoint's
# dtype on a GPU, float32 on a CPU
DTYPES = {"auto": None, "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
          "float32": "float32"}
# minivllm's attention backends, and vLLM's AttentionBackendEnum names for the same kernels
ATTENTION_BACKENDS = {"auto": "auto", "triton": "triton", "cpu": "cpu", "torch": "torch",
                      "TRITON_ATTN": "triton", "CPU_ATTN": "cpu"}
MAX_SEED = 2**63 - 1


def human_readable_int(text: str) -> int:
    """vLLM's human_readable_int (vllm/utils/argparse_utils.py): '1k' is 1,000, '1K' 1,024, '25.6k' 25,600."""
    value = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        if suffix.islower():
            return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
        if not number.isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: no decimals with a binary suffix ({suffix}); "
                                             f"did you mean {number}{suffix.lower()}?")
        return int(number) * 2 ** (10 * "KMGT".index(suffix) + 10)
    if not re.fullmatch(r"-?\d+", value):
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer (a number, optionally with k, m, g, K, M, G)")
    return int(value)


def bounded_int(low: int, high: int | None = None, readable: bool = False):
    """An argparse type: an integer in [low, high]; argparse names the flag in its error."""

    def parse(text: str) -> int:
        value = human_readable_int(text) if readable else None
        if value is None:
            if not re.fullmatch(r"\s*-?\d+\s*", text):
                raise argparse.ArgumentTypeError(f"{text!r}: not an integer")
            value = int(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value}: must be " + (f"from {low} to {high}" if high is not None
                                                                     else f">= {low}"))
        return value

    parse.__name__ = "integer"  # argparse's "invalid integer value" message
    return parse


def max_model_len(text: str) -> int | None:
    """vLLM's human_readable_int_or_auto: -1 or 'auto' derive it from the model (None here), else >= 2."""
    if text.strip() in ("-1", "auto"):
        return None
    return bounded_int(2, readable=True)(text)


def positive_gib(text: str) -> float:
    """vLLM's --kv-offloading-size: a number of GiB above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number of GiB") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value}: must be a number of GiB above 0")
    return value


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def parallel_capacity() -> int:
    """How many ranks this machine can run: its GPUs, or on a CPU its cores (gloo, one process per rank)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count() or 1


@dataclass
class EngineArgs:
    """The engine's settings, named as vLLM names them; the defaults are LLM(...)'s."""

    model: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    speculative_config: dict | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_help: str | None = None) -> argparse.ArgumentParser:
        d = EngineArgs()
        model = parser.add_argument_group("ModelConfig")
        model.add_argument("--model", default=d.model,
                           help=model_help or "checkpoint folder, .gguf file or hub name (default: the embedded tiny model)")
        model.add_argument("--dtype", choices=list(DTYPES), default=d.dtype,
                           help="weights and activations; auto: the checkpoint's on a GPU, float32 on a CPU")
        model.add_argument("--quantization", "-q", choices=["int8_per_channel_weight_only"], default=d.quantization,
                           help="int8_per_channel_weight_only: int8 weight rows, fp32 activations rounded to int16 "
                                "per row in the products, on a CPU "
                                "(chapter 8b); default: the checkpoint's weights")
        model.add_argument("--seed", type=bounded_int(0, MAX_SEED), default=d.seed,
                           help="the engine's random seed (requests without a seed of their own)")
        model.add_argument("--max-model-len", type=max_model_len, default=d.max_model_len,
                           help="prompt plus output tokens per request; -1 or auto: the model's and the KV cache's "
                                "limit. Accepts 1k (1,000), 1K (1,024)")
        parallel = parser.add_argument_group("ParallelConfig")
        parallel.add_argument("--tensor-parallel-size", "-tp", type=bounded_int(1), default=d.tensor_parallel_size,
                              help="ranks that shard every layer (chapter 11)")
        cache = parser.add_argument_group("CacheConfig")
        cache.add_argument("--block-size", type=bounded_int(1, 1024), default=d.block_size,
                           help="tokens per KV block (chapter 5)")
        cache.add_argument("--kv-cache-memory-bytes", type=bounded_int(1, readable=True),
                           default=d.kv_cache_memory_bytes,
                           help="bytes of KV cache (default: 512 MiB on a CPU, 90%% of free memory on a GPU); "
                                "accepts 512M, 2G")
        cache.add_argument("--num-gpu-blocks-override", type=bounded_int(1), default=d.num_gpu_blocks_override,
                           help="this many KV blocks, whatever the memory (for tests)")
        cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                           default=d.enable_prefix_caching, help="reuse the KV blocks of shared prefixes (chapter 7)")
        cache.add_argument("--kv-offloading-size", type=positive_gib, default=d.kv_offloading_size,
                           help="GiB of CPU memory for KV blocks behind the pool (chapter 13); default: no tier")
        cache.add_argument("--kv-offloading-backend", choices=["native"], default=d.kv_offloading_backend,
                           help="native: the engine's own CPU tier (vLLM also has lmcache, an LMCache server)")
        scheduler = parser.add_argument_group("SchedulerConfig")
        scheduler.add_argument("--max-num-batched-tokens", type=bounded_int(1, readable=True),
                               default=d.max_num_batched_tokens, help="tokens per engine step (chapter 6)")
        scheduler.add_argument("--max-num-seqs", type=bounded_int(1), default=d.max_num_seqs,
                               help="requests running at once (chapter 6)")
        scheduler.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                               default=d.enable_chunked_prefill, help="split long prompts over steps (chapter 6)")
        attention = parser.add_argument_group("AttentionConfig")
        attention.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS), default=d.attention_backend,
                               help="auto: Triton on a GPU, the C++ kernel on a CPU; TRITON_ATTN and CPU_ATTN are "
                                    "vLLM's names for triton and cpu")
        parser.add_argument("--speculative-config", "-sc", type=json_object, default=d.speculative_config,
                            help='speculative decoding (chapter 9), as JSON: {"method": "ngram" or "draft_model", '
                                 '"num_speculative_tokens": k, ...}')
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def check(self, parser: argparse.ArgumentParser) -> None:
        """What a type cannot check alone: against this machine. parser.error exits, naming the flag."""
        capacity = parallel_capacity()
        if self.tensor_parallel_size > capacity:
            parser.error(f"argument --tensor-parallel-size: {self.tensor_parallel_size}: this machine runs at most "
                         f"{capacity} ranks (its GPUs, or its CPU cores)")
        if self.kv_cache_memory_bytes is not None:
            import psutil

            available = psutil.virtual_memory().available
            if self.kv_cache_memory_bytes > available:
                parser.error(f"argument --kv-cache-memory-bytes: {self.kv_cache_memory_bytes:,} bytes: more than "
                             f"this machine has available ({available:,})")

    def llm_kwargs(self) -> dict:
        """LLM(...)'s keyword arguments."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)}
        kwargs["dtype"] = DTYPES[kwargs["dtype"]]
        kwargs["attention_backend"] = ATTENTION_BACKENDS[kwargs["attention_backend"]]
        kwargs["num_kv_blocks"] = kwargs.pop("num_gpu_blocks_override")
        return kwargs
