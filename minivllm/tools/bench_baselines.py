"""The baselines of `make bench` and `make gpu-check`: transformers' `generate` in static padded batches and its
`generate_batch` (continuous batching with a paged cache), on the same requests as the engine, greedy; and the
random-init checkpoints they run on. Plain module, split from tools/bench.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


def save_random_checkpoint(folder: Path, shape: dict, dtype: torch.dtype, seed: int = 0) -> int:
    """A random-init Qwen3 of `shape`, saved by transformers' save_pretrained (no tokenizer: prompts are token
    ids); returns its parameter count."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(tie_word_embeddings=True, eos_token_id=0, pad_token_id=0, dtype=dtype, **shape)
    model = Qwen3ForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def run_hf_static(model_dir, prompts, output_lens, batch_size: int, dtype=torch.float32, device="cpu") -> dict:
    """transformers' generate in static batches, left-padded, in arrival order: a batch runs until its longest
    output is done; each request keeps (and is credited with) only the tokens it asked for."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = model.config.pad_token_id or 0

    def run(batch, lens):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                                 min_new_tokens=max(lens), do_sample=False, pad_token_id=pad)
        return [row[:n] for row, n in zip(out[:, width:].tolist(), lens)]

    run(prompts[:2], [2, 2])  # warm-up
    start = time.perf_counter()
    token_ids = []
    for i in range(0, len(prompts), batch_size):
        token_ids += run(prompts[i:i + batch_size], output_lens[i:i + batch_size])
    elapsed = time.perf_counter() - start
    tokens = sum(len(t) for t in token_ids)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "batch_size": batch_size, "token_ids": token_ids}


def run_hf_continuous(model_dir, prompts, output_lens, dtype=torch.float32, device="cpu") -> dict:
    """transformers' continuous batching with a paged cache (what `generate_batch` runs), each request with its
    own max_new_tokens."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    config = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=-1,
                              pad_token_id=model.config.pad_token_id or 0)
    model.generate_batch(prompts[:2], generation_config=config, max_new_tokens=2)  # warm-up
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max(output_lens),
                          num_requests=len(prompts))
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5,
                                                   workload_hints=hints) as manager:
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
               for i, (p, n) in enumerate(zip(prompts, output_lens))]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing")
    elapsed = time.perf_counter() - start
    token_ids = [list(results[i].generated_tokens) for i in ids]
    tokens = sum(len(t) for t in token_ids)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "token_ids": token_ids}
