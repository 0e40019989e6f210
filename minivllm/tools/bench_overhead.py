"""`python -m minivllm.tools.bench overhead`: the engine's own time per decode step, apart from the model.

A decode step is scheduling, preparing the batch, the model's forward pass (and its logits), sampling and
bookkeeping. The model's part grows with the context (attention reads every cached token); the rest should
not: a per-step cost that grows with the context is bookkeeping that rebuilds per-request state every step.
This measures, for each (context, batch), the median over decode steps of the step's wall time minus the time
spent inside the model's forward and compute_logits, on a small random-init model (so that the model's time
does not drown the engine's). Plain module: a benchmark, not engine code; `make bench` runs it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

OVERHEAD_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=2048, max_position_embeddings=8192)
CONTEXTS, BATCHES, DECODE_STEPS = (100, 4000), (1, 32), 24


def timed_method(obj, name: str, spent: list[float]) -> None:
    """Replace obj.name (on the instance) by a wrapper that adds its wall time to spent[0]."""
    method = getattr(obj, name)
    cuda = torch.cuda.is_available()

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = method(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        spent[0] += time.perf_counter() - start
        return result

    setattr(obj, name, wrapper)


def measure(folder: str, context: int, batch: int, seed: int = 0) -> dict:
    """Median engine (non-model) and model milliseconds over the decode steps of `batch` requests whose prompts
    are `context` tokens long (distinct prompts, no prefix caching: every request keeps its own blocks). All
    prompts are prefilled in the first step, so every later step decodes the whole batch."""
    from minivllm import LLM, SamplingParams

    llm = LLM(folder, max_model_len=context + DECODE_STEPS + 8, max_num_seqs=batch,
              max_num_batched_tokens=context * batch + batch, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": torch.randint(3, OVERHEAD_SHAPE["vocab_size"], (context,), generator=gen).tolist()}
               for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    engine, model_time, steps = llm.engine, [0.0], []
    timed_method(engine.model, "forward", model_time)
    timed_method(engine.model, "compute_logits", model_time)
    step = engine.step

    def timed_step():
        model_time[0] = 0.0
        start = time.perf_counter()
        outputs = step()
        steps.append((time.perf_counter() - start, model_time[0]))
        return outputs

    engine.step = timed_step
    llm.generate(prompts, params, use_tqdm=False)
    if len(steps) != DECODE_STEPS:
        raise RuntimeError(f"{len(steps)} steps for one prefill step and {DECODE_STEPS - 1} decode steps")
    decode = steps[1:-1]  # not the prefill, nor the last step (where every request finishes and frees its blocks)
    engine_ms = [1000 * (wall - model) for wall, model in decode]
    model_ms = [1000 * model for _, model in decode]
    return {"context": context, "batch": batch, "decode_steps": len(decode),
            "engine_ms_per_step": statistics.median(engine_ms), "model_ms_per_step": statistics.median(model_ms),
            "engine_ms_per_request_step": statistics.median(engine_ms) / batch}


def overhead(args) -> dict:
    from minivllm.tools.bench_baselines import save_random_checkpoint

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as folder:
        save_random_checkpoint(Path(folder), OVERHEAD_SHAPE, torch.float32)
        for batch in BATCHES:
            for context in CONTEXTS:
                rows.append(measure(folder, context, batch, args.seed))
                row = rows[-1]
                print(f"batch {batch:3d} context {context:5d}: engine {row['engine_ms_per_step']:7.2f} ms/step, "
                      f"model {row['model_ms_per_step']:7.2f} ms/step")
    growth = {f"batch {b}": next(r["engine_ms_per_step"] for r in rows if (r["batch"], r["context"]) == (b, CONTEXTS[1]))
              / next(r["engine_ms_per_step"] for r in rows if (r["batch"], r["context"]) == (b, CONTEXTS[0]))
              for b in BATCHES}
    return {"shape": OVERHEAD_SHAPE, "decode_steps": DECODE_STEPS, "rows": rows,
            f"engine_time_ratio_{CONTEXTS[1]}_to_{CONTEXTS[0]}": growth}
