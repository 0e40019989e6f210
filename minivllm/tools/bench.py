"""Benchmarks (not tests): throughput and latency of the engine, and the engine against transformers.

    python -m minivllm bench [--num-prompts 64 --output-len 128 ...]   # the engine alone, JSON to stdout
    python -m minivllm.tools.bench compare --workload all --out bench/results  # `make bench`: minivllm vs transformers
    python -m minivllm.tools.bench spec --out bench/results                  # speculative decoding (chapter 9)
    python -m minivllm.tools.bench serve --out bench/results                 # the server under Poisson load (chapter 10)
    python -m minivllm.tools.bench overhead --out bench/results              # the engine's non-model time per step
    python -m minivllm.tools.bench dtypes --out bench/results                # fp32 vs bf16 (and llama.cpp) on SmolLM2

Every command takes vLLM's engine arguments (--max-num-seqs, --block-size, ...: minivllm/engine/arg_utils.py).

`compare` runs the same requests (greedy, ignore_eos) on the same random-init checkpoint through minivllm,
transformers' `generate` in static padded batches, and transformers' `generate_batch` (its continuous batching
with paged attention), in one process, one after the other, and reports output tokens per second, the ratios
side by side, and the fraction of the compute roofline each reached: the workload's FLOPs divided by the
machine's fp32 matmul rate, measured in the same run. Named workloads (`--workload`): `qwen3-32m` (32 requests,
prompts 32-256, outputs 32-96, on a 32M Qwen3), `smollm2-135m` (24 chat requests on a random-init model of
SmolLM2-135M's shape: Llama, 30 layers, GQA 9/3, vocabulary 49,152), `nanovllm-cpu` (nano-vllm's benchmark scaled
to a CPU: 64 requests, random input and output lengths of 32-512 tokens), `all` (the three); `custom` takes the
lengths from the flags. `spec` sweeps chapter 9's proposers and k on the embedded
model and its draft (a random-init checkpoint would accept nothing), at batch 1 and batch 8. `serve` runs
chapter 10's server on the benchmark checkpoint and sends it Poisson load at several rates. Results are
written with the date and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from minivllm.engine.arg_utils import EngineArgs
from minivllm.tools.bench_baselines import run_hf_continuous, run_hf_static
from minivllm.tools.bench_dtypes import dtypes
from minivllm.tools.bench_overhead import overhead

BENCH_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=10, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, vocab_size=2048, max_position_embeddings=2048)
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=2048,
                     rope_theta=100000.0, rms_norm_eps=1e-5)
# name: (architecture, requests, prompt lengths, output lengths, transformers' static batch size, rounds); chat:
# prompts are chat-templated conversations of SmolLM2's tokenizer. A shared machine's speed drifts by 10-30% from
# minute to minute: the short workloads run three rounds, engines alternating, and each engine keeps its best
WORKLOADS = {
    "qwen3-32m": ("qwen3", 32, (32, 256), (32, 96), 8, 3),
    "smollm2-135m": ("smollm2-chat", 24, None, (32, 128), 8, 3),
    "nanovllm-cpu": ("qwen3", 64, (32, 512), (32, 512), 8, 1),
}


def make_bench_checkpoint(folder: Path, seed: int = 0, architecture: str = "qwen3") -> int:
    """A random-init Qwen3 of about 32M parameters with the tiny model's tokenizer ("qwen3"), or a Llama of
    SmolLM2-135M's shape with SmolLM2's tokenizer ("smollm2-chat"); returns its parameter count."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if architecture == "qwen3":
        from minivllm.model.loader import DEFAULT_MODEL

        config = Qwen3Config(tie_word_embeddings=True, eos_token_id=0, pad_token_id=0, **BENCH_SHAPE)
        model, tokenizer = Qwen3ForCausalLM(config), AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    else:
        config = LlamaConfig(tie_word_embeddings=True, eos_token_id=2, pad_token_id=2, **SMOLLM2_SHAPE)
        model, tokenizer = LlamaForCausalLM(config), smollm2_tokenizer()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def smollm2_tokenizer():
    """SmolLM2's tokenizer (with its chat template), read from the appendix's GGUF file."""
    from transformers import AutoTokenizer

    from minivllm.book.real_model import smollm2_gguf

    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def workload(num_prompts: int, min_prompt: int, max_prompt: int, seed: int = 0,
             vocab_size: int = BENCH_SHAPE["vocab_size"]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size - 1) for _ in range(rng.randint(min_prompt, max_prompt))]
            for _ in range(num_prompts)]


def output_lengths(num_prompts: int, min_output: int, max_output: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed + 1)
    return [rng.randint(min_output, max_output) for _ in range(num_prompts)]


def chat_workload(tokenizer, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """Chat requests: a system prompt, one to three turns of Shakespeare's lines, the chat template applied."""
    from minivllm.book.texts import CORPUS
    from minivllm.entrypoints.chat import chat_token_ids

    lines = [line for line in CORPUS.splitlines() if len(line) > 20]
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        messages = [{"role": "system", "content": "You are a helpful assistant who answers in verse."}]
        for turn in range(rng.randint(1, 3)):
            start = rng.randrange(len(lines) - 8)
            messages.append({"role": "user", "content": " ".join(lines[start:start + rng.randint(2, 8)])})
            if turn:
                messages.insert(-1, {"role": "assistant", "content": lines[rng.randrange(len(lines))]})
        prompts.append(chat_token_ids(tokenizer, messages))
    return prompts


def percentiles(values: list[float]) -> dict:
    from minivllm.tools.loadgen import percentile

    return {"mean": statistics.fmean(values), **{f"p{q}": percentile(values, q) for q in (50, 90, 99)}}


def run_minivllm(model_dir, prompts, output_lens, **engine_args) -> dict:
    from minivllm import LLM, SamplingParams

    llm = LLM(str(model_dir), **engine_args)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    warmup = [[t + 1 for t in p] for p in prompts[:2]]  # other tokens: a warm-up must not fill the prefix cache
    llm.generate([{"prompt_token_ids": p} for p in warmup], params[:2], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = [o.metrics.first_token_time - start for o in outputs]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outputs if len(o.outputs[0].token_ids) > 1]
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "attention_backend": llm.engine.model_runner.backend.__name__,
            "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot), "stats": llm.stats(),
            "token_ids": [o.outputs[0].token_ids for o in outputs]}


def machine() -> dict:
    return {"date": datetime.date.today().isoformat(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


def matmul_flops_per_s(size: int = 1024, repeats: int = 5) -> float:
    """The machine's fp32 matmul rate: the best of a few timed square matmuls, on torch's threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - start) / 4)
    return 2 * size ** 3 / best


def workload_flops(config: dict, prompts: list[list[int]], output_lens: list[int]) -> float:
    """The FLOPs the workload needs, whoever runs it: every prompt token and every generated token but the last
    goes through the decoder (2 per weight, plus attention over its context), and every generated token needs
    the logits of one position. Padding and recomputation are not counted: they are waste, not work."""
    h, layers, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads, head_dim, inter = config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]
    per_layer_weights = h * head_dim * (2 * heads + 2 * kv_heads) + 3 * h * inter
    flops = 0.0
    for prompt, n in zip(prompts, output_lens):
        tokens = len(prompt) + n - 1
        context = tokens * (tokens + 1) / 2  # token i attends over i + 1 keys
        flops += layers * (2 * per_layer_weights * tokens + 4 * heads * head_dim * context)
        flops += 2 * h * config["vocab_size"] * n
    return flops


def compare_one(name: str, architecture: str, prompts, output_lens, hf_batch_size: int, repeats: int, args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        params = make_bench_checkpoint(Path(folder), architecture=architecture)
        model_config = json.loads((Path(folder) / "config.json").read_text())
        print(f"{name}: random-init {architecture}, {params / 1e6:.1f}M parameters; {len(prompts)} prompts of "
              f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, outputs of {min(output_lens)}-"
              f"{max(output_lens)} tokens", flush=True)
        runs, rate = {}, 0.0
        for round_ in range(repeats):  # engines alternate, round after round; each keeps its fastest run
            for run_name, run in [
                ("minivllm", lambda: run_minivllm(folder, prompts, output_lens, **args.engine_kwargs)),
                ("transformers_generate_static", lambda: run_hf_static(folder, prompts, output_lens, hf_batch_size)),
                ("transformers_generate_batch", lambda: run_hf_continuous(folder, prompts, output_lens)),
            ]:
                if run_name in args.skip or "error" in runs.get(run_name, {}):
                    continue
                print(f"running {run_name} (round {round_ + 1} of {repeats}) ...", flush=True)
                try:
                    result = run()
                except Exception as error:  # a baseline that cannot run here is reported, not fatal
                    result = {"error": f"{type(error).__name__}: {error}"}
                best = runs.get(run_name)
                seconds = (best or {}).get("all_seconds", []) + ([result["seconds"]] if "seconds" in result else [])
                if best is None or result.get("seconds", float("inf")) < best["seconds"]:
                    runs[run_name] = result
                runs[run_name]["all_seconds"] = seconds
                print(f"  {json.dumps({k: v for k, v in result.items() if k != 'token_ids'})[:300]}", flush=True)
            rate = max(rate, matmul_flops_per_s())
    flops = workload_flops(model_config, prompts, output_lens)
    reference = runs.get("minivllm", {}).get("token_ids")
    for result in runs.values():
        if "token_ids" in result:
            result["greedy_tokens_match_minivllm"] = result.pop("token_ids") == reference
        if "seconds" in result:
            result["roofline_fraction"] = flops / rate / result["seconds"]
    ours = runs.get("minivllm", {}).get("output_tokens_per_s")
    ratios = {f"minivllm / {n}": ours / r["output_tokens_per_s"]
              for n, r in runs.items() if n != "minivllm" and "output_tokens_per_s" in r and ours}
    return {"checkpoint": architecture, "checkpoint_parameters": params, "requests": len(prompts),
            "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
            "output_tokens": [min(output_lens), max(output_lens)], "transformers_static_batch_size": hf_batch_size,
            "rounds": repeats,
            "workload_gflops": flops / 1e9, "matmul_gflops_per_s": rate / 1e9, "runs": runs,
            "throughput_ratios": ratios}


def compare(args) -> dict:
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    results = {}
    for name in names:
        if name == "custom":
            prompts = workload(args.num_prompts, args.min_prompt, args.max_prompt, args.seed)
            lens = output_lengths(args.num_prompts, args.min_output or args.output_len,
                                  args.max_output or args.output_len, args.seed)
            results[name] = compare_one(name, "qwen3", prompts, lens, args.hf_batch_size, args.repeats or 1, args)
            continue
        architecture, count, prompt_range, output_range, batch, repeats = WORKLOADS[name]
        if architecture == "qwen3":
            prompts = workload(count, *prompt_range, args.seed)
        else:
            prompts = chat_workload(smollm2_tokenizer(), count, args.seed)
        lens = output_lengths(count, *output_range, args.seed)
        results[name] = compare_one(name, architecture, prompts, lens, batch, args.repeats or repeats, args)
    return {"machine": machine(), "engine_settings": args.engine_kwargs,
            "workloads": results}


def spec(args) -> dict:
    from minivllm import LLM, SamplingParams
    from minivllm.book.texts import CORPUS

    prompts = [CORPUS[i * 150:i * 150 + 300] for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def run(config, batch):
        llm = LLM(speculative_config=config)
        llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = [o for i in range(0, len(prompts), batch)
                   for o in llm.generate(prompts[i:i + batch], params, use_tqdm=False)]
        return time.perf_counter() - start, llm.stats(), [o.outputs[0].token_ids for o in outputs]

    results = {}
    for batch in args.batch_sizes:
        base_seconds, _, base_tokens = run(None, batch)
        rows = [{"method": None, "k": 0, "seconds": base_seconds, "speedup": 1.0}]
        print(f"batch {batch}: plain decoding {base_seconds:.1f} s", flush=True)
        for method in ["draft_model", "ngram"]:
            for k in args.ks:
                config = {"method": method, "num_speculative_tokens": k}
                if method == "ngram":
                    config |= {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
                seconds, stats, tokens = run(config, batch)
                drafts = max(1, stats["spec_decode_num_drafts"])
                rows.append({"method": method, "k": k, "seconds": seconds, "speedup": base_seconds / seconds,
                             "acceptance_rate": stats["spec_decode_num_accepted_tokens"]
                             / max(1, stats["spec_decode_num_draft_tokens"]),
                             "mean_acceptance_length": 1 + stats["spec_decode_num_accepted_tokens"] / drafts,
                             "per_position": [n / drafts for n in stats["spec_decode_num_accepted_tokens_per_pos"]],
                             "outputs_identical": tokens == base_tokens})
                print(f"  {method} k={k}: speed-up {rows[-1]['speedup']:.2f}, tokens per round "
                      f"{rows[-1]['mean_acceptance_length']:.2f}", flush=True)
        results[f"batch_{batch}"] = rows
    return {"machine": machine(), "model": "embedded tiny-shakespeare + tiny-shakespeare-draft",
            "workload": {"prompts": len(prompts), "prompt_chars": 300, "output_len": args.output_len},
            "results": results}


def serve(args) -> dict:
    from minivllm import LLM
    from minivllm.tools.loadgen import run_load, summarize
    from minivllm.entrypoints.openai.launcher import BackgroundServer

    prompts = workload(args.num_prompts, args.min_prompt, args.max_prompt, args.seed)
    warmup = [[t + 1 for t in p] for p in prompts[:4]]  # other tokens: a warm-up must not fill the prefix cache
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        params = make_bench_checkpoint(Path(folder))
        llm = LLM(folder, **args.engine_kwargs)
        with BackgroundServer(llm) as server:
            asyncio.run(run_load(server.url, warmup, float("inf"), 8))
            for rate in args.request_rates:
                timings, seconds = asyncio.run(run_load(server.url, prompts, rate, args.output_len, args.seed))
                results[str(rate)] = summarize(timings, seconds)
                print(f"rate {rate}: {json.dumps(results[str(rate)])}", flush=True)
    return {"machine": machine(), "checkpoint_parameters": params, "workload": {
        "num_prompts": args.num_prompts, "prompt_tokens": [args.min_prompt, args.max_prompt],
        "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens}, "by_request_rate": results}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["engine", "compare", "spec", "serve", "overhead", "dtypes"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-output", type=int, default=None, help="compare custom: output lengths drawn from "
                        "[min, max] (default: --output-len)")
    parser.add_argument("--max-output", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None,
                        help="compare: rounds, engines alternating, each keeping its fastest (default: the workload's)")
    parser.add_argument("--workload", default="custom", choices=["custom", *WORKLOADS, "all"],
                        help="compare: a named workload, all of them, or custom (the length flags)")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip", nargs="*", default=[])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 6], help="spec: draft lengths")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="spec: requests at a time")
    parser.add_argument("--request-rates", type=float, nargs="+", default=[0.5, 1, 2, 4, float("inf")],
                        help="serve: Poisson request rates per second (inf: all at once)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every run (default: torch's own choice, one per core)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    EngineArgs.add_cli_args(parser, model_help="checkpoint for `engine` (default: a random-init 32M Qwen3)")
    args = parser.parse_args(argv)
    EngineArgs.from_cli_args(args).check(parser)
    args.engine_kwargs = EngineArgs.from_cli_args(args).llm_kwargs()  # --seed also seeds the workloads
    del args.engine_kwargs["model"]
    for name in ("num_prompts", "min_prompt", "output_len", "hf_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_prompt < args.min_prompt:
        parser.error("--max-prompt must be >= --min-prompt")
    low, high = args.min_output or args.output_len, args.max_output or args.output_len
    if low < 1 or high < low:
        parser.error("--min-output must be >= 1 and --max-output >= --min-output")

    if min(args.ks) < 1 or min(args.batch_sizes) < 1 or min(args.request_rates) <= 0:
        parser.error("--ks and --batch-sizes must be >= 1, --request-rates > 0")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if args.command in ("compare", "spec", "serve", "overhead", "dtypes"):
        result = {"compare": compare, "spec": spec, "serve": serve,
                  "dtypes": lambda args: {"machine": machine(), **dtypes(args)},
                  "overhead": lambda args: {"machine": machine(), **overhead(args)}}[args.command](args)
    else:
        prompts = workload(args.num_prompts, args.min_prompt, args.max_prompt, args.seed)
        with tempfile.TemporaryDirectory() as folder:
            model = args.model or (make_bench_checkpoint(Path(folder)) and folder)
            run = run_minivllm(model, prompts, [args.output_len] * len(prompts), **args.engine_kwargs)
        run.pop("token_ids")
        result = {"machine": machine(), "workload": vars(args) | {"out": str(args.out)}, "minivllm": run}
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"compare-{args.workload}" if args.command == "compare" else args.command
        path = args.out / f"{name}-{result['machine']['date']}.json"
        path.write_text(text + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
