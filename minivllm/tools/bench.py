"""Benchmarks (not tests): throughput and latency of the engine, and the engine against transformers.

    python -m minivllm bench [--num-prompts 64 --output-len 128 ...]   # the engine alone, JSON to stdout
    python -m minivllm.tools.bench compare --out bench/results               # `make bench`: minivllm vs transformers
    python -m minivllm.tools.bench spec --out bench/results                  # speculative decoding (chapter 9)
    python -m minivllm.tools.bench serve --out bench/results                 # the server under Poisson load (chapter 10)

`compare` runs the same requests (greedy, ignore_eos) on the same random-init Qwen3-shaped checkpoint
through minivllm, transformers' `generate` in static padded batches, and transformers' `generate_batch`
(its continuous batching with paged attention), in one process, one after the other, and reports output
tokens per second and the ratios side by side. `spec` sweeps chapter 9's proposers and k on the embedded
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

BENCH_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=10, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, vocab_size=2048, max_position_embeddings=2048)


def make_bench_checkpoint(folder: Path, seed: int = 0) -> int:
    """A random-init Qwen3 of about 32M parameters, with the tiny model's tokenizer; returns its parameter count."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from minivllm.model.loader import DEFAULT_MODEL

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=True, eos_token_id=0, pad_token_id=0, **BENCH_SHAPE))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEFAULT_MODEL).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def workload(num_prompts: int, min_prompt: int, max_prompt: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, BENCH_SHAPE["vocab_size"] - 1) for _ in range(rng.randint(min_prompt, max_prompt))]
            for _ in range(num_prompts)]


def percentiles(values: list[float]) -> dict:
    from minivllm.tools.loadgen import percentile

    return {"mean": statistics.fmean(values), **{f"p{q}": percentile(values, q) for q in (50, 90, 99)}}


def run_minivllm(model_dir, prompts, output_len, **engine_args) -> dict:
    from minivllm import LLM, SamplingParams

    llm = LLM(str(model_dir), **engine_args)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    warmup = [[t + 1 for t in p] for p in prompts[:2]]  # other tokens: a warm-up must not fill the prefix cache
    llm.generate([{"prompt_token_ids": p} for p in warmup], params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = [o.metrics.first_token_time - start for o in outputs]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outputs if len(o.outputs[0].token_ids) > 1]
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot), "stats": llm.stats(),
            "token_ids": [o.outputs[0].token_ids for o in outputs]}


def run_hf_static(model_dir, prompts, output_len, batch_size: int) -> dict:
    """transformers' generate in static batches, left-padded, in arrival order."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(batch):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        return out[:, width:].tolist()

    run(prompts[:2])  # warm-up
    start = time.perf_counter()
    token_ids = []
    for i in range(0, len(prompts), batch_size):
        token_ids += run(prompts[i:i + batch_size])
    elapsed = time.perf_counter() - start
    tokens = sum(len(t) for t in token_ids)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "batch_size": batch_size, "token_ids": token_ids}


def run_hf_continuous(model_dir, prompts, output_len) -> dict:
    """transformers' generate_batch: continuous batching with a paged cache."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                              eos_token_id=-1, pad_token_id=0)
    model.generate_batch(prompts[:2], generation_config=config)  # warm-up
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=config, progress_bar=True)
    elapsed = time.perf_counter() - start
    by_prompt = sorted(results.values(), key=lambda r: int(r.request_id.split("_")[-1]))
    tokens = sum(len(r.generated_tokens) for r in by_prompt)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "token_ids": [r.generated_tokens for r in by_prompt]}


def machine() -> dict:
    return {"date": datetime.date.today().isoformat(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


def compare(args) -> dict:
    prompts = workload(args.num_prompts, args.min_prompt, args.max_prompt, args.seed)
    with tempfile.TemporaryDirectory() as folder:
        params = make_bench_checkpoint(Path(folder))
        print(f"checkpoint: random-init Qwen3, {params / 1e6:.1f}M parameters; {len(prompts)} prompts of "
              f"{args.min_prompt}-{args.max_prompt} tokens, {args.output_len} output tokens each", flush=True)
        runs = {}
        for name, run in [
            ("minivllm", lambda: run_minivllm(folder, prompts, args.output_len, max_num_seqs=args.max_num_seqs,
                                              max_num_batched_tokens=args.max_num_batched_tokens)),
            ("transformers_generate_static", lambda: run_hf_static(folder, prompts, args.output_len, args.hf_batch_size)),
            ("transformers_generate_batch", lambda: run_hf_continuous(folder, prompts, args.output_len)),
        ]:
            if name in args.skip:
                continue
            print(f"running {name} ...", flush=True)
            try:
                runs[name] = run()
            except Exception as error:  # a baseline that cannot run here is reported, not fatal
                runs[name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"  {json.dumps({k: v for k, v in runs[name].items() if k != 'token_ids'})[:300]}", flush=True)
    reference = runs.get("minivllm", {}).get("token_ids")
    for name, result in runs.items():
        if "token_ids" in result:
            result["greedy_tokens_match_minivllm"] = result.pop("token_ids") == reference
    ours = runs.get("minivllm", {}).get("output_tokens_per_s")
    ratios = {f"minivllm / {name}": ours / r["output_tokens_per_s"]
              for name, r in runs.items() if name != "minivllm" and "output_tokens_per_s" in r and ours}
    return {"machine": machine(), "checkpoint_parameters": params, "workload": vars(args) | {"skip": list(args.skip)},
            "runs": runs, "throughput_ratios": ratios}


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
        llm = LLM(folder, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
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
    parser.add_argument("command", choices=["engine", "compare", "spec", "serve"])
    parser.add_argument("--model", default=None, help="checkpoint for `engine` (default: a random-init 32M Qwen3)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="*", default=[])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 6], help="spec: draft lengths")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="spec: requests at a time")
    parser.add_argument("--request-rates", type=float, nargs="+", default=[0.5, 1, 2, 4, float("inf")],
                        help="serve: Poisson request rates per second (inf: all at once)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    args = parser.parse_args(argv)
    for name in ("num_prompts", "min_prompt", "output_len", "max_num_seqs", "max_num_batched_tokens", "hf_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_prompt < args.min_prompt:
        parser.error("--max-prompt must be >= --min-prompt")

    if min(args.ks) < 1 or min(args.batch_sizes) < 1 or min(args.request_rates) <= 0:
        parser.error("--ks and --batch-sizes must be >= 1, --request-rates > 0")
    if args.command in ("compare", "spec", "serve"):
        result = {"compare": compare, "spec": spec, "serve": serve}[args.command](args)
    else:
        prompts = workload(args.num_prompts, args.min_prompt, args.max_prompt, args.seed)
        with tempfile.TemporaryDirectory() as folder:
            model = args.model or (make_bench_checkpoint(Path(folder)) and folder)
            run = run_minivllm(model, prompts, args.output_len, max_num_seqs=args.max_num_seqs,
                               max_num_batched_tokens=args.max_num_batched_tokens)
        run.pop("token_ids")
        result = {"machine": machine(), "workload": vars(args) | {"out": str(args.out)}, "minivllm": run}
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{args.command}-{result['machine']['date']}.json"
        path.write_text(text + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
