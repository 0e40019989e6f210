"""Chapter 11's input checks: plumbing, not taught. They run before any worker process starts."""

import torch


def check_tensor_parallel_size(size, model_config, speculative_config=None, device=None) -> None:
    """Refuse a tensor_parallel_size this model cannot be split into, naming the option."""
    if isinstance(size, bool) or not isinstance(size, int):
        raise ValueError(f"tensor_parallel_size = {size!r}: must be an integer >= 1")
    if size < 1:
        raise ValueError(f"tensor_parallel_size = {size}: must be >= 1")
    if size == 1:
        return
    heads, kv_heads = model_config.num_heads, model_config.num_kv_heads
    for name, value in (("num_heads", heads), ("num_kv_heads", kv_heads),
                        ("intermediate_size", model_config.intermediate_size)):
        if value % size:
            raise ValueError(f"tensor_parallel_size = {size} does not divide the model's {name} = {value}: "
                             f"every rank must hold the same number of whole heads (try a divisor of {value})")
    if speculative_config is not None:
        raise ValueError("speculative_config and tensor_parallel_size > 1 together are not supported: "
                         "choose one (speculative decoding runs on one process)")
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size = {size}: needs {size} CUDA devices, "
                         f"{torch.cuda.device_count()} visible")
