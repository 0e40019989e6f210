"""`python -m minivllm.tools.bench dtypes`: float32 against bfloat16 decode on SmolLM2-135M, near the machine's limits.

The model is the appendix's real SmolLM2-135M-Instruct (its Q4_1 GGUF file, dequantized to the dtype asked for).
For each dtype and batch size (1 and 32 requests of a 199-token prompt, 128 greedy tokens each) the engine's
decode steps are timed (wall time, torch's threads); configurations alternate round after round and each keeps
its min and median. Two fractions say how near the limits a row is:

- batch 1 against memory bandwidth: a decode step reads every weight once and the cached keys and values of its
  context, so (weight bytes + KV bytes) / step time, over the bandwidth of a large torch copy measured here;
- batch 32 against the matmul rate: the step's FLOPs (2 per weight per token, plus attention) / step time, over
  the rate of square matmuls of that dtype measured here.

llama.cpp is a peer when its binaries are found (`llama-bench`, `llama-batched-bench`, `llama-quantize` on PATH or
in $LLAMA_CPP_BIN): the same model as F32, F16 and its Q4_1 file, one stream at the same context depth and 32
parallel sequences, the same thread count. Never needed by the tests. Plain module: a benchmark, not engine code.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

PROMPT_LEN, OUTPUT_LEN, BATCHES, DTYPES = 199, 128, (1, 32), ("float32", "bfloat16")


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second a torch copy moves (read + write) through a buffer far larger than the caches."""
    src = torch.ones(megabytes * 2 ** 20 // 4)
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * 4 / best


def matmul_rate(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """FLOPs per second of square matmuls in this dtype (oneDNN's bf16 kernels on a CPU that has them)."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    return 2 * size ** 3 / min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_costs(config, batch: int, context: int, dtype_bytes: int) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode step of `batch` sequences at this context: every weight once, and the
    keys and values of every sequence's context."""
    c = config
    weights = c.vocab_size * c.hidden_size + c.num_layers * (
        c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * c.hidden_size * c.intermediate_size)
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim
    bytes_read = (weights + batch * context * kv_per_token) * dtype_bytes
    flops = batch * (2 * weights + 4 * c.num_layers * c.num_heads * c.head_dim * context)
    return bytes_read, flops


class DecodeTimer:
    """One engine, whose decode steps (not the prefill, not the last) are timed by wall clock."""

    def __init__(self, model: str, dtype: str, batch: int):
        from minivllm import LLM, SamplingParams

        self.llm = LLM(model, dtype=dtype, enable_prefix_caching=False, max_num_seqs=batch,
                       max_num_batched_tokens=PROMPT_LEN * batch + batch)
        self.prompts = [{"prompt_token_ids": [100 + i] + list(range(101, 100 + PROMPT_LEN))} for i in range(batch)]
        self.params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
        self.steps, step = [], self.llm.engine.step

        def timed_step():
            start = time.perf_counter()
            outputs = step()
            self.steps.append(time.perf_counter() - start)
            return outputs

        self.llm.engine.step = timed_step

    def run(self) -> float:
        """The median decode step of one generate call, in seconds."""
        self.steps.clear()
        self.llm.generate(self.prompts, self.params, use_tqdm=False)
        return statistics.median(self.steps[1:-1])


def minivllm_rows(model: str, rounds: int) -> list[dict]:
    timers = {(dtype, batch): DecodeTimer(model, dtype, batch) for dtype in DTYPES for batch in BATCHES}
    for timer in timers.values():
        timer.run()  # warm-up: kernels built, oneDNN primitives created
    seconds = {key: [] for key in timers}
    for round_ in range(rounds):  # configurations alternate, round after round
        for key, timer in timers.items():
            seconds[key].append(timer.run())
            print(f"round {round_ + 1}: {key[0]} batch {key[1]}: {1000 * seconds[key][-1]:.1f} ms/step", flush=True)
    bandwidth = copy_bandwidth()
    rows = []
    for (dtype, batch), timer in timers.items():
        best, median = min(seconds[dtype, batch]), statistics.median(seconds[dtype, batch])
        config = timer.llm.engine.model.config
        bytes_read, flops = step_costs(config, batch, PROMPT_LEN + OUTPUT_LEN // 2, 2 if dtype == "bfloat16" else 4)
        row = {"engine": "minivllm", "dtype": dtype, "batch": batch, "step_ms_min": 1000 * best,
               "step_ms_median": 1000 * median, "decode_tokens_per_s": batch / median,
               "attention_backend": timer.llm.engine.model_runner.backend.__name__}
        if batch == 1:
            row |= {"bytes_per_step": bytes_read, "memory_bandwidth_gb_s": bandwidth / 1e9,
                    "bandwidth_fraction": bytes_read / median / bandwidth}
        else:
            rate = matmul_rate(getattr(torch, dtype))
            row |= {"flops_per_step": flops, "matmul_gflops_per_s": rate / 1e9, "matmul_fraction": flops / median / rate}
        rows.append(row)
    return rows


def llama_cpp_tool(name: str) -> str | None:
    folder = os.environ.get("LLAMA_CPP_BIN")
    path = Path(folder) / name if folder else None
    return str(path) if path and path.exists() else shutil.which(name)


def llama_cpp_rows(gguf: Path, threads: int, rounds: int) -> list[dict]:
    """llama.cpp's decode rate on the same model as F32, F16 and Q4_1, one stream and 32 parallel sequences."""
    bench, batched, quantize = (llama_cpp_tool(n) for n in ("llama-bench", "llama-batched-bench", "llama-quantize"))
    if not (bench and batched and quantize):
        return [{"engine": "llama.cpp", "skipped": "llama-bench, llama-batched-bench or llama-quantize not found "
                                                   "(PATH or $LLAMA_CPP_BIN)"}]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-llama-") as folder:
        files = {"Q4_1": gguf}
        for kind in ("F32", "F16"):
            files[kind] = Path(folder) / f"model-{kind}.gguf"
            subprocess.run([quantize, "--allow-requantize", str(gguf), str(files[kind]), kind], check=True,
                           capture_output=True)
        single = {kind: [] for kind in files}
        parallel = {kind: [] for kind in files}
        for _ in range(rounds):
            for kind, path in files.items():
                out = subprocess.run([bench, "-m", str(path), "-p", "0", "-n", str(OUTPUT_LEN), "-d", str(PROMPT_LEN),
                                      "-t", str(threads), "-r", "1", "-o", "json"], check=True, capture_output=True,
                                     text=True).stdout
                single[kind].append(json.loads(out)[0]["avg_ts"])
                out = subprocess.run([batched, "-m", str(path), "-c", str(32 * (PROMPT_LEN + OUTPUT_LEN) + 64),
                                      "-npp", str(PROMPT_LEN), "-ntg", str(OUTPUT_LEN), "-npl", "32", "-t", str(threads),
                                      "--output-format", "jsonl"], check=True, capture_output=True, text=True).stdout
                line = next(json.loads(l) for l in out.splitlines() if l.startswith("{"))
                parallel[kind].append(line["speed_tg"])
        for kind in files:
            rows.append({"engine": "llama.cpp", "dtype": kind, "batch": 1,
                         "decode_tokens_per_s": statistics.median(single[kind]), "all": single[kind]})
            rows.append({"engine": "llama.cpp", "dtype": kind, "batch": 32,
                         "decode_tokens_per_s": statistics.median(parallel[kind]), "all": parallel[kind]})
    return rows


def dtypes(args) -> dict:
    from minivllm.book.real_model import smollm2_gguf

    gguf, rounds = smollm2_gguf(), args.repeats or 3
    rows = minivllm_rows(str(gguf), rounds)
    rows += llama_cpp_rows(gguf, torch.get_num_threads(), rounds)
    by = {(r["engine"], r.get("dtype"), r.get("batch")): r for r in rows}
    ratios = {f"bfloat16 / float32, batch {b}": by["minivllm", "bfloat16", b]["decode_tokens_per_s"]
              / by["minivllm", "float32", b]["decode_tokens_per_s"] for b in BATCHES}
    for row in rows:
        print(json.dumps(row), flush=True)
    return {"model": f"SmolLM2-135M-Instruct ({gguf.name}, dequantized)", "prompt_tokens": PROMPT_LEN,
            "output_tokens": OUTPUT_LEN, "rounds": rounds, "rows": rows, "ratios": ratios}
