"""Chapter 13's workload, measured: many tenants in multi-turn conversations whose working set overflows the KV
pool, served with and without a second tier. Hit rate, TTFT p50/p90, and the throughput cost of the copy-outs.

    python -m minivllm.tools.bench_offload --out bench/results

Plain module (benchmark harness): chapter 13 runs the same workload at a small size; `make bench` at this one.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from minivllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    """`tenants` conversations, each salted with its own tenant's salt, `turns` turns each; every turn sends
    all conversations at once; a turn's prompt is the previous prompt, its answer, and a new message."""

    tenants: int = 6
    turns: int = 4
    system_tokens: int = 160
    message_tokens: int = 24
    answer_tokens: int = 8
    block_size: int = 16

    def working_set_blocks(self) -> int:
        """Full blocks of every conversation's last prompt: what a cache must hold to miss nothing."""
        last = self.system_tokens + self.turns * self.message_tokens + (self.turns - 1) * self.answer_tokens
        return self.tenants * (last // self.block_size)


def corpus_ids(tokenizer, length: int = 20_000) -> list[int]:
    """Token ids of the book's corpus, repeated to `length`: prompts are cut from it."""
    from minivllm.book.texts import CORPUS

    ids = tokenizer(CORPUS).input_ids
    return (ids * (length // len(ids) + 1))[:length]


def run_conversations(llm, workload: Workload, ids: list[int]) -> list[dict]:
    """Every request's prompt length, cached tokens and TTFT (wall seconds), turn by turn."""
    w = workload
    histories = [ids[997 * t:997 * t + w.system_tokens] for t in range(w.tenants)]
    params = SamplingParams(temperature=0, max_tokens=w.answer_tokens, ignore_eos=True)
    rows = []
    for turn in range(w.turns):
        prompts = []
        for t, history in enumerate(histories):
            start = 5000 + 131 * (turn * w.tenants + t)
            history += ids[start:start + w.message_tokens]
            prompts.append({"prompt_token_ids": list(history), "cache_salt": f"tenant-{t}"})
        for t, out in enumerate(llm.generate(prompts, params, use_tqdm=False)):
            histories[t] += list(out.outputs[0].token_ids)
            rows.append({"turn": turn, "tenant": t, "prompt_tokens": len(out.prompt_token_ids),
                         "cached_tokens": out.num_cached_tokens,
                         "ttft_s": out.metrics.first_token_time - out.metrics.arrival_time})
    return rows


def hit_rate(rows: list[dict]) -> float:
    return sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows)


def block_bytes(llm) -> int:
    return llm.engine.kv_cache.bytes_per_block


def measure(workload: Workload, tier_fractions=(0, 0.25, 0.5, 1, 2), pool_fraction: float = 0.25) -> dict:
    """Hit rate and TTFT for each tier size (a fraction of the working set; 0: no tier), the pool a quarter of it."""
    from minivllm import LLM

    pool = max(1, int(workload.working_set_blocks() * pool_fraction))
    results = []
    for fraction in tier_fractions:
        llm = LLM(num_kv_blocks=pool, block_size=workload.block_size, max_num_batched_tokens=512)
        size = fraction * workload.working_set_blocks() * block_bytes(llm) / 2**30
        if fraction:
            llm = LLM(num_kv_blocks=pool, block_size=workload.block_size, max_num_batched_tokens=512,
                      kv_offloading_size=size)
        ids = corpus_ids(llm.get_tokenizer())
        started = time.perf_counter()
        rows = run_conversations(llm, workload, ids)
        elapsed = time.perf_counter() - started
        ttfts = sorted(r["ttft_s"] for r in rows)
        tokens = sum(r["prompt_tokens"] for r in rows) + len(rows) * workload.answer_tokens
        by_turn = [hit_rate([r for r in rows if r["turn"] == turn]) for turn in range(workload.turns)]
        results.append({"tier_fraction_of_working_set": fraction, "tier_gib": size, "hit_rate": hit_rate(rows),
                        "hit_rate_by_turn": by_turn,
                        "ttft_p50_ms": 1000 * statistics.median(ttfts),
                        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
                        "tokens_per_s": tokens / elapsed, **{k: v for k, v in llm.stats().items() if "offload" in k}})
    return {"pool_blocks": pool, "working_set_blocks": workload.working_set_blocks(), "runs": results}


def copy_out_cost(rounds: int = 3) -> dict:
    """Throughput on prompts that never repeat (no hit to gain), with and without the tier: what copying every
    prompt block out costs. Alternating rounds; the best of each."""
    from minivllm import LLM

    plain = LLM(num_kv_blocks=256, max_num_batched_tokens=512)
    tiered = LLM(num_kv_blocks=256, max_num_batched_tokens=512, kv_offloading_size=0.25)
    ids = corpus_ids(plain.get_tokenizer())
    best = {"without tier": float("inf"), "with tier": float("inf")}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for r in range(rounds):
        for name, llm in (("without tier", plain), ("with tier", tiered)):
            prompts = [{"prompt_token_ids": ids[(r * 16 + i) * 300:(r * 16 + i) * 300 + 256]} for i in range(16)]
            started = time.process_time()
            llm.generate(prompts, params, use_tqdm=False)
            best[name] = min(best[name], time.process_time() - started)
    return {"cpu_seconds_best_of_rounds": best, "copy_out_overhead": best["with tier"] / best["without tier"] - 1,
            "blocks_stored": tiered.stats()["kv_offload_blocks_stored"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args(argv)
    workload = Workload(tenants=args.tenants, turns=args.turns)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "processor": platform.processor(),
              "workload": workload.__dict__, "hit_rate_vs_tier": measure(workload), "copy_out": copy_out_cost()}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"offload-{report['date']}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    for run in report["hit_rate_vs_tier"]["runs"]:
        print(f"tier {run['tier_fraction_of_working_set']:4} x working set: hit rate {run['hit_rate']:.0%}, "
              f"TTFT p50 {run['ttft_p50_ms']:.0f} ms, p90 {run['ttft_p90_ms']:.0f} ms")
    print(f"copy-out overhead on prompts that never repeat: {report['copy_out']['copy_out_overhead']:+.1%}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
