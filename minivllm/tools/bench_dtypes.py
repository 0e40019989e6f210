"""`python -m minivllm.tools.bench dtypes`: float32 against bfloat16 decode on SmolLM2-135M, near the machine's limits.

The model is the appendix's real SmolLM2-135M-Instruct (its Q4_1 GGUF file, dequantized to the dtype asked for).
For each dtype and batch size (1 and 32 requests of a 199-token prompt, 128 greedy tokens each) the engine's
decode steps are timed (wall time, torch's threads); configurations alternate round after round and each keeps
its min and median. The engine runs as `LLM(dtype=...)` builds it: chapter 8b's GEMV takes the products of few
rows where this CPU has AVX2 with FMA (or, in bfloat16, AVX-512 BF16; each row counts its
`gemv_linear_layers`); one more row, "float32 torch matmul" at batch 1, is float32 with `cpu_gemv="off"`: every
product in torch's linear, the engine before the GEMV; and "int8 weights" is float32 with
`quantization="int8_per_channel_weight_only"` (chapter 8b's last section: int8 rows, fp32 activations
rounded per row to int16 for VNNI products), at both batch sizes.
Two fractions say how near the limits a row is:

- batch 1 against memory bandwidth: a decode step reads every weight once and the cached keys and values of its
  context, so (weight bytes + KV bytes) / step time, over the bandwidth of a large torch copy measured here;
- batch 32 against the matmul rate: the step's FLOPs (2 per weight per token, plus attention) / step time, over
  the rate torch's linear reaches here in that dtype on the model's MLP products at that batch (`matmul_rate`).

llama.cpp is a peer when its binaries are found (`llama-bench`, `llama-batched-bench`, `llama-quantize` in
$LLAMA_CPP_BIN, in .llama.cpp/build/bin where `make llama-cpp` builds them, or on PATH): the same model as F32,
F16 and its Q4_1 file, one stream at the same context depth and 32 parallel sequences, the same thread count.
Never needed by the tests. Plain module: a benchmark, not engine code.
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

PROMPT_LEN, OUTPUT_LEN, BATCHES = 199, 128, (1, 32)
# minivllm's configurations: name -> LLM's arguments; "float32 torch matmul" keeps chapter 8b's GEMV out (batch 1 only)
CONFIGURATIONS = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
                  "float32 torch matmul": dict(dtype="float32", cpu_gemv="off"),
                  "int8 weights": dict(dtype="float32", quantization="int8_per_channel_weight_only")}


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second a torch copy moves (read + write) through a buffer far larger than the caches."""
    src = torch.ones(megabytes * 2 ** 20 // 4)
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * 4 / best


def matmul_rate(dtype: torch.dtype, config, batch: int, repeats: int = 5) -> float:
    """FLOPs per second that torch's linear reaches in this dtype on the model's own MLP products at this batch
    ([batch, hidden] by gate/up, [batch, intermediate] by down): the peak a decode step's products can reach here.
    Square 1024 x 1024 matmuls are no peak for bf16 on a CPU without AVX-512 (PyTorch's generic loops: about
    1 GFLOP/s on the AMD EPYC of 2026-12-03, far below what its linear layers reach at these shapes)."""
    h, i = config.hidden_size, config.intermediate_size
    x, up, xi, down = (torch.randn(*shape).to(dtype) for shape in ((batch, h), (i, h), (batch, i), (h, i)))

    def products():
        torch.nn.functional.linear(x, up)
        torch.nn.functional.linear(xi, down)

    products()
    return 2 * 2 * batch * h * i / min(_timed(products) for _ in range(repeats))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_costs(config, batch: int, context: int, weight_bytes: int,
               kv_bytes: int | None = None) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode step of `batch` sequences at this context: every weight once, and the
    keys and values of every sequence's context (kv_bytes per number: weight_bytes unless given)."""
    c = config
    weights = c.vocab_size * c.hidden_size + c.num_layers * (
        c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * c.hidden_size * c.intermediate_size)
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim
    bytes_read = weights * weight_bytes + batch * context * kv_per_token * (kv_bytes or weight_bytes)
    flops = batch * (2 * weights + 4 * c.num_layers * c.num_heads * c.head_dim * context)
    return bytes_read, flops


class DecodeTimer:
    """One engine, whose decode steps (not the prefill, not the last) are timed by wall clock."""

    def __init__(self, model: str, batch: int, **llm_args):
        from minivllm import LLM, SamplingParams

        self.llm = LLM(model, **llm_args, enable_prefix_caching=False, max_num_seqs=batch,
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


class LlamaCppTimer:
    """One llama.cpp configuration (a GGUF file of one kind, one stream or 32 parallel sequences): one run of
    `llama-bench` (one stream at the same context depth) or `llama-batched-bench`, its decode tokens per second."""

    def __init__(self, tools: dict, path: Path, batch: int, threads: int):
        self.tools, self.path, self.batch, self.threads = tools, path, batch, threads

    def run(self) -> float:
        if self.batch == 1:  # -fa off: llama.cpp's faster setting on this CPU at this depth (issue 28's runs)
            out = subprocess.run([self.tools["llama-bench"], "-m", str(self.path), "-p", "0", "-n", str(OUTPUT_LEN),
                                  "-d", str(PROMPT_LEN), "-t", str(self.threads), "-fa", "off", "-r", "1",
                                  "-o", "json"],
                                 check=True, capture_output=True, text=True).stdout
            return json.loads(out)[0]["avg_ts"]
        out = subprocess.run([self.tools["llama-batched-bench"], "-m", str(self.path),
                              "-c", str(self.batch * (PROMPT_LEN + OUTPUT_LEN) + 64), "-npp", str(PROMPT_LEN),
                              "-ntg", str(OUTPUT_LEN), "-npl", str(self.batch), "-t", str(self.threads),
                              "--output-format", "jsonl"], check=True, capture_output=True, text=True).stdout
        return next(json.loads(line) for line in out.splitlines() if line.startswith("{"))["speed_tg"]


LLAMA_CPP_BUILT = Path(__file__).resolve().parents[2] / ".llama.cpp" / "build" / "bin"  # where `make llama-cpp` builds them


def llama_cpp_tool(name: str) -> str | None:
    """A llama.cpp tool from $LLAMA_CPP_BIN, else `make llama-cpp`'s build, else PATH."""
    for folder in (os.environ.get("LLAMA_CPP_BIN"), LLAMA_CPP_BUILT):
        if folder and (Path(folder) / name).exists():
            return str(Path(folder) / name)
    return shutil.which(name)


def llama_cpp_timers(gguf: Path, folder: str, threads: int) -> dict:
    """llama.cpp on the same model as F32, F16 and its Q4_1 file, one stream and 32 parallel sequences; {} when
    its binaries are not found."""
    tools = {name: llama_cpp_tool(name) for name in ("llama-bench", "llama-batched-bench", "llama-quantize")}
    if not all(tools.values()):
        return {}
    files = {"F32": Path(folder) / "model-F32.gguf", "F16": Path(folder) / "model-F16.gguf", "Q4_1": gguf}
    for kind in ("F32", "F16"):
        subprocess.run([tools["llama-quantize"], "--allow-requantize", str(gguf), str(files[kind]), kind], check=True,
                       capture_output=True)
    return {("llama.cpp", kind, batch): LlamaCppTimer(tools, path, batch, threads)
            for batch in BATCHES for kind, path in files.items()}


def measure(model: str, gguf: Path, rounds: int) -> tuple[dict, dict]:
    """Every configuration of both engines, alternating round after round (the machine's load drifts alike for
    all): {(engine, dtype, batch): per-round results} and the timers. minivllm's results are seconds per decode
    step, llama.cpp's decode tokens per second (what its tools print)."""
    with tempfile.TemporaryDirectory(prefix="bench-llama-") as folder:
        timers = {("minivllm", name, batch): DecodeTimer(model, batch, **args) for batch in BATCHES
                  for name, args in CONFIGURATIONS.items() if batch == 1 or args.get("cpu_gemv") != "off"}
        timers |= llama_cpp_timers(gguf, folder, torch.get_num_threads())
        timers = dict(sorted(timers.items(), key=lambda item: item[0][2]))  # batch 1 first, engines side by side
        for timer in timers.values():
            if isinstance(timer, DecodeTimer):
                timer.run()  # warm-up: kernels built, oneDNN primitives created
        results = {key: [] for key in timers}
        for round_ in range(rounds):
            for key, timer in timers.items():
                results[key].append(timer.run())
                print(f"round {round_ + 1}: {key}: {results[key][-1]:.4g}", flush=True)
    return results, timers


def minivllm_row(name: str, batch: int, seconds: list[float], timer: DecodeTimer, bandwidth: float) -> dict:
    from minivllm.kernels.cpu_gemv import GemvLinear  # cpu_gemv="auto": the GEMV where it is selectable
    from minivllm.kernels.cpu_int8 import Int8Linear

    dtype, best, median = CONFIGURATIONS[name]["dtype"], min(seconds), statistics.median(seconds)
    element = 2 if dtype == "bfloat16" else 4
    bytes_read, flops = step_costs(timer.llm.engine.model.config, batch, PROMPT_LEN + OUTPUT_LEN // 2,
                                   1 if "quantization" in CONFIGURATIONS[name] else element, element)
    row = {"engine": "minivllm", "dtype": name, "batch": batch, "step_ms_min": 1000 * best,
           "step_ms_median": 1000 * median, "decode_tokens_per_s": batch / median,
           "decode_tokens_per_s_best": batch / best, "all_step_ms": [1000 * s for s in seconds],
           "attention_backend": timer.llm.engine.model_runner.backend.__name__,
           "gemv_linear_layers": sum(isinstance(m, GemvLinear) for m in timer.llm.engine.model.modules()),
           "int8_linear_layers": sum(isinstance(m, Int8Linear) for m in timer.llm.engine.model.modules())}
    if batch == 1:
        return row | {"bytes_per_step": bytes_read, "memory_bandwidth_gb_s": bandwidth / 1e9,
                      "bandwidth_fraction": bytes_read / median / bandwidth}
    rate = matmul_rate(getattr(torch, dtype), timer.llm.engine.model.config, batch)
    return row | {"flops_per_step": flops, "matmul_gflops_per_s": rate / 1e9, "matmul_fraction": flops / median / rate}


def dtypes(args) -> dict:
    from minivllm.book.real_model import smollm2_gguf

    gguf, rounds, load_before = smollm2_gguf(), args.repeats or 3, os.getloadavg()
    results, timers = measure(str(gguf), gguf, rounds)
    bandwidth = copy_bandwidth()
    rows = []
    for (engine, dtype, batch), values in results.items():
        if engine == "minivllm":
            rows.append(minivllm_row(dtype, batch, values, timers[engine, dtype, batch], bandwidth))
        else:
            rows.append({"engine": engine, "dtype": dtype, "batch": batch,
                         "decode_tokens_per_s": statistics.median(values), "decode_tokens_per_s_best": max(values),
                         "all": values})
    if not any(engine == "llama.cpp" for engine, _, _ in results):
        rows.append({"engine": "llama.cpp", "skipped": "llama-bench, llama-batched-bench or llama-quantize not "
                                                       "found ($LLAMA_CPP_BIN, .llama.cpp/build/bin: make llama-cpp, PATH)"})
    by = {(r["engine"], r.get("dtype"), r.get("batch")): r for r in rows}
    ratios = {f"bfloat16 / float32, batch {b}": by["minivllm", "bfloat16", b]["decode_tokens_per_s"]
              / by["minivllm", "float32", b]["decode_tokens_per_s"] for b in BATCHES}
    ratios |= {f"int8 weights / float32, batch {b}": by["minivllm", "int8 weights", b]["decode_tokens_per_s"]
               / by["minivllm", "float32", b]["decode_tokens_per_s"] for b in BATCHES}
    ratios["float32 / float32 torch matmul, batch 1"] = by["minivllm", "float32", 1]["decode_tokens_per_s"] \
        / by["minivllm", "float32 torch matmul", 1]["decode_tokens_per_s"]
    for row in rows:
        print(json.dumps(row), flush=True)
    return {"model": f"SmolLM2-135M-Instruct ({gguf.name}, dequantized)", "prompt_tokens": PROMPT_LEN,
            "output_tokens": OUTPUT_LEN, "rounds": rounds, "threads": torch.get_num_threads(),
            "alternation": "every configuration of both engines once per round, round after round",
            "load_average_before": load_before, "load_average_after": os.getloadavg(), "rows": rows, "ratios": ratios}
