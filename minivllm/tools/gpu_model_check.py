"""`make gpu-check`'s model-level steps: the engine end to end against transformers, and chapter 9's draft sizing.

Plain module beside tools/gpu_check.py (the kernel-level steps and the figures): a benchmark harness, not engine
code. Both steps take a `Sizes` object from gpu_check: a real model's shape in bfloat16 on a GPU, a toy shape
in float32 on a CPU for `--smoke`.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch

# Qwen3-0.6B's shape: 28 layers, 16 query heads sharing 8 kv heads of 128, a vocabulary of 151,936
REAL_SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=8192,
                  rope_theta=1e6, rms_norm_eps=1e-6)
TOY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
                 rope_theta=1e4, rms_norm_eps=1e-6)
ACCEPTANCE_RATES = (0.5, 0.7, 0.9)


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far greedy outputs agree: sequences identical, and the tokens before each first divergence."""
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(ours, theirs)]
    return {"identical_sequences": sum(x == y for x, y in zip(ours, theirs)), "sequences": len(ours),
            "agreeing_prefix_tokens": sum(prefix), "tokens": sum(map(len, theirs))}


def hf_one_by_one(model_dir, prompts, max_tokens: int, dtype, device) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding to move the numbers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    del model
    return outputs


def engine_check(sizes, device: torch.device, backend: str) -> dict:
    """The engine on `device` against transformers on the same checkpoint: greedy token agreement in float32
    and in the run's dtype (bf16 rounds ties differently in two implementations, so there it is a fraction),
    then output tokens/s of the engine, of `generate` in static batches and of `generate_batch`."""
    from minivllm.tools.bench import output_lengths, run_minivllm, workload
    from minivllm.tools.bench_baselines import run_hf_continuous, run_hf_static

    shape, (num_prompts, prompt_lens, output_len), agree_prompts = sizes.engine
    vocab = shape["vocab_size"]
    prompts = workload(num_prompts, *prompt_lens, seed=0, vocab_size=vocab)
    output_lens = output_lengths(num_prompts, output_len, output_len)
    rng = random.Random(1)
    short = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))] for _ in range(agree_prompts)]
    result = {"shape": shape, "num_prompts": num_prompts, "prompt_lens": list(prompt_lens), "output_len": output_len,
              "dtype": str(sizes.dtype).removeprefix("torch.")}
    engine_args = dict(device=device, attention_backend=backend, max_num_seqs=sizes.max_num_seqs)
    from minivllm.tools.bench_baselines import save_random_checkpoint

    with tempfile.TemporaryDirectory(prefix="gpu-check-model-") as folder:
        dtypes = {"float32": torch.float32} | ({} if sizes.dtype == torch.float32 else {"run_dtype": sizes.dtype})
        for name, dtype in dtypes.items():  # the last one saved is the run's dtype, which the throughput uses
            result["parameters"] = save_random_checkpoint(Path(folder), shape, dtype)
            ours = run_minivllm(folder, short, [output_len] * len(short), dtype=dtype, **engine_args)["token_ids"]
            result[f"agreement_{name}"] = agreement(ours, hf_one_by_one(folder, short, output_len, dtype, device))
            print(f"  greedy agreement in {dtype}: {result[f'agreement_{name}']}")
        runs = {"minivllm": lambda: run_minivllm(folder, prompts, output_lens, dtype=sizes.dtype, **engine_args),
                "transformers_generate": lambda: run_hf_static(folder, prompts, output_lens, sizes.hf_batch_size,
                                                               dtype=sizes.dtype, device=device),
                "transformers_generate_batch": lambda: run_hf_continuous(folder, prompts, output_lens,
                                                                         dtype=sizes.dtype, device=device)}
        for name, run in runs.items():
            measured = run()
            result[name] = {k: v for k, v in measured.items() if k in ("seconds", "output_tokens",
                                                                        "output_tokens_per_s")}
            print(f"  {name:28} {measured['output_tokens_per_s']:9.1f} output tokens/s")
    return result


def time_ms(fn, device: torch.device) -> float:
    """Median milliseconds of fn(): triton's do_bench on a GPU (it flushes the L2 cache between runs, so
    nothing is served from cache that a real step would read from memory), a few plain runs on a CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return 1000 * sorted(runs)[1]


def forward_ms(model, num_tokens: int, device: torch.device) -> float:
    """Milliseconds of one forward pass over `num_tokens` new tokens of one sequence (batch 1)."""
    from minivllm.attention.base import NoCacheAttention

    ids = [1 + i % 7 for i in range(num_tokens)]
    inputs = NoCacheAttention.for_sequences([ids], device=device)
    with torch.inference_mode():
        return time_ms(lambda: model(*inputs), device)


def expected_speedup(acceptance: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """Chapter 9's cost model: a round makes (1 - a^(k+1)) / (1 - a) tokens and costs k draft passes plus one
    target pass over k + 1 tokens, in units of one target pass over a single token."""
    return (1 - acceptance ** (k + 1)) / (1 - acceptance) / (k * draft_cost + verify_cost)


def draft_sizing(sizes, device: torch.device) -> dict:
    """Chapter 9's draft sizing on this device: c, the cost of a draft pass against a target pass, for drafts
    with fewer layers, the target's cost over k + 1 tokens against one, and the speed-up they predict."""
    from minivllm.config import ModelConfig
    from minivllm.model.decoder import CausalLM

    shape, _, _ = sizes.engine
    hf = {"architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True, **shape}
    torch.manual_seed(0)
    target = CausalLM(ModelConfig.from_hf(hf)).to(device=device, dtype=sizes.dtype).eval()
    one = forward_ms(target, 1, device)
    verify = {k: forward_ms(target, k + 1, device) / one for k in sizes.draft_ks}
    result = {"target_layers": shape["num_hidden_layers"], "target_ms": one, "verify_cost": verify, "drafts": []}
    del target
    for layers in sizes.draft_layers:
        draft = CausalLM(ModelConfig.from_hf({**hf, "num_hidden_layers": layers})).to(device=device,
                                                                                      dtype=sizes.dtype).eval()
        cost = forward_ms(draft, 1, device) / one
        del draft
        speedups = {f"{a}": {k: expected_speedup(a, k, cost, verify[k]) for k in sizes.draft_ks}
                    for a in ACCEPTANCE_RATES}
        result["drafts"].append({"layers": layers, "draft_cost": cost, "expected_speedup": speedups})
        best = {a: max(s, key=s.get) for a, s in speedups.items()}
        print(f"  draft of {layers:2d} layers: c = {cost:.3f}; best k by acceptance rate {best}")
    return result


def timed(step, *args) -> dict:
    """Run one model-level step; a failure is recorded with its cause, so the kernel results still get written."""
    start = time.time()
    try:
        return {**step(*args), "seconds": round(time.time() - start, 1)}
    except Exception as error:  # noqa: BLE001 -- the harness reports what failed and carries on
        print(f"  FAILED: {type(error).__name__}: {error}")
        return {"error": f"{type(error).__name__}: {str(error)[:500]}", "seconds": round(time.time() - start, 1)}
