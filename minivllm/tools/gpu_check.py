"""`make gpu-check`: chapter 8's Triton kernels and the engine on a CUDA GPU.

    python -m minivllm.tools.gpu_check            # a CUDA machine: sized for under 7 minutes on one H200 (estimate)
    python -m minivllm.tools.gpu_check --smoke    # anywhere with triton: every step below at tiny sizes, on a
                                                  # CPU in triton's interpreter; checks this harness, measures nothing

1. runs tests/test_triton_attention.py with the kernels compiled (with --smoke: its kernel tests, interpreted);
2. sweeps the kernels' tile sizes on one large shape and keeps the fastest;
3. decode attention: achieved GB/s, and its fraction of the GPU's spec bandwidth, over batch 1-128 and context
   1k-16k, against torch SDPA over K/V gathered beforehand into contiguous tensors; then KV block sizes 16-128,
   and split-K;
4. prefill attention: TFLOP/s against torch SDPA (causal FlashAttention) on contiguous tensors;
5. the engine end to end on a random-init checkpoint of Qwen3-0.6B's shape in bfloat16 (save_pretrained):
   greedy token agreement with transformers on the same device, output tokens/s against transformers'
   `generate` (static batches) and `generate_batch` (continuous batching);
6. chapter 9's draft sizing: the cost c of a draft pass against a target pass, for drafts of fewer layers, and
   the speed-up chapter 9's cost model predicts from it.

Results go to bench/gpu/<date>_<gpu>.json (to $OUT when that variable is set, to a temporary folder with
--smoke, or to --out) with a PNG per figure beside it, named alike; chapter 8 reads the newest. The date, the
GPU's name, the torch and triton versions and the spec-sheet peaks are recorded. Plain module, not exported
from a notebook: a benchmark harness, not engine code.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# chapter 8 draws the figures through this module's names
from minivllm.tools.gpu_plots import plot_block_size_and_splits, plot_decode, plot_prefill, write  # noqa: F401
from minivllm.tools.gpu_model_check import time_ms

ROOT = Path(__file__).resolve().parents[2]  # the repository: minivllm/tools/gpu_check.py -> .
RESULTS = ROOT / "bench" / "gpu"
# spec-sheet HBM bandwidth (bytes/s) and dense bf16 tensor throughput (FLOP/s); matched on the device name
SPEC_SHEETS = {
    "H200": (4.8e12, 989e12),
    "H100 SXM": (3.35e12, 989e12),
    "H100 80GB HBM3": (3.35e12, 989e12),
    "A100-SXM4-80GB": (2.039e12, 312e12),
    "A100-SXM4-40GB": (1.555e12, 312e12),
}
# the shape of one attention layer of a Llama-3-8B-sized model: 32 query heads sharing 8 kv heads of 128
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
TESTS_TIMEOUT_S = 240  # compiling every kernel variant the tests ask for takes a minute or two
# with --smoke, the kernel tests that compare the kernels with the reference, interpreted (minutes for all)
SMOKE_TESTS = ("test_decode_kernel_matches_reference and 16-2-64 or test_prefill_kernel_matches_reference and 16-2-64"
               " or test_backend_writes_the_cache_and_matches_reference")


class Sizes:
    """What to measure. The full sizes fit an H200's 141 GB with room to spare; the smoke sizes run in seconds
    in the interpreter."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.dtype = torch.float32 if smoke else torch.bfloat16  # the interpreter has no bf16
        self.heads = (4, 2, 32) if smoke else (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
        self.batches = [1, 2] if smoke else [1, 8, 32, 128]
        self.contexts = [16, 48] if smoke else [1024, 4096, 16384]
        self.block_size = 16
        self.big = (2, 48) if smoke else (64, 8192)  # (batch, context) for the sweeps
        self.block_sizes = [4, 16] if smoke else [16, 32, 64, 128]
        self.splits = [1, 2] if smoke else [1, 2, 4, 8, 16]
        self.split_shapes = [(1, 48)] if smoke else [(1, 16384), (4, 16384), (32, 16384)]
        self.decode_tiles = [dict(block_n=16)] if smoke else [
            dict(block_n=n, num_warps=w, num_stages=s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
        self.prefill_tiles = [dict(block_m=16, block_n=16)] if smoke else [
            dict(block_m=m, block_n=n, num_warps=w) for m in (64, 128) for n in (32, 64) for w in (4, 8)]
        self.prefill_shape = (1, 32) if smoke else (4, 2048)  # (batch, prompt length) for the prefill sweep
        # (batch, cached context, new tokens): fresh prompts of 8k tokens in all, then chunks over a long prefix
        self.prefills = [(2, 0, 16), (1, 16, 16)] if smoke else [
            (16, 0, 512), (8, 0, 1024), (4, 0, 2048), (2, 0, 4096), (1, 0, 8192), (4, 4096, 512), (1, 16384, 2048)]
        self.copy_bytes = 2**20 if smoke else 2**32
        # the engine end to end: (model shape, (requests, (shortest, longest prompt), output tokens), prompts
        # compared token by token with transformers); chapter 9's draft sizing: draft depths and k
        from minivllm.tools.gpu_model_check import REAL_SHAPE, TOY_SHAPE

        self.engine = (TOY_SHAPE, (3, (4, 12), 4), 2) if smoke else (REAL_SHAPE, (128, (128, 1024), 128), 8)
        self.max_num_seqs = 4 if smoke else 128
        self.hf_batch_size = 2 if smoke else 32
        self.draft_layers = [1] if smoke else [1, 2, 4, 7]
        self.draft_ks = [1, 2] if smoke else [1, 2, 4, 8]


# ------------------------------------------------------------------ measuring


def copy_bandwidth(num_bytes: int, device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write): what this memory delivers in practice."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / (time_ms(lambda: dst.copy_(src), device) / 1000)


def decode_problem(batch: int, context: int, block_size: int, sizes: Sizes, device: torch.device):
    """A decode step: `batch` sequences of `context` cached tokens each, their blocks scattered through the cache
    the way a long-running engine leaves them. Returns q, k_cache, v_cache, block_tables, seq_lens."""
    heads, kv_heads, head_dim = sizes.heads
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device).manual_seed(0)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=sizes.dtype, generator=gen)
    order = torch.randperm(num_blocks, device=device, generator=gen)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.long, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=sizes.dtype, generator=gen)
    return q, kv[0], kv[1], block_tables, seq_lens


def decode_bytes(batch: int, context: int, sizes: Sizes) -> int:
    """What decode attention must move at least: every cached key and value once, q in, the output out."""
    heads, kv_heads, head_dim = sizes.heads
    element = torch.finfo(sizes.dtype).bits // 8
    return element * head_dim * (2 * batch * context * kv_heads + 2 * batch * heads)


def measure_decode(batch, context, sizes, device, block_size=None, **kernel_options) -> float:
    from minivllm.kernels.paged_attention import paged_decode_attention

    q, k_cache, v_cache, block_tables, seq_lens = decode_problem(batch, context, block_size or sizes.block_size,
                                                                 sizes, device)
    ms = time_ms(lambda: paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, context,
                                                **kernel_options), device)
    return decode_bytes(batch, context, sizes) / (ms / 1000) / 1e9


def measure_decode_sdpa(batch, context, sizes, device) -> float | None:
    """torch SDPA on K/V already gathered into [batch, kv_heads, context, head_dim]: no paging at all. None if
    this torch has no SDPA kernel for the case."""
    heads, kv_heads, head_dim = sizes.heads
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(batch, heads, 1, head_dim, device=device, dtype=sizes.dtype, generator=gen)
    k, v = torch.randn(2, batch, kv_heads, context, head_dim, device=device, dtype=sizes.dtype, generator=gen)
    attention = torch.nn.functional.scaled_dot_product_attention
    try:
        ms = time_ms(lambda: attention(q, k, v, enable_gqa=True), device)
    except RuntimeError:
        return None
    return decode_bytes(batch, context, sizes) / (ms / 1000) / 1e9


def prefill_problem(batch: int, context: int, new: int, sizes: Sizes, device: torch.device):
    heads, kv_heads, head_dim = sizes.heads
    seq_len = context + new
    block_size = sizes.block_size
    blocks_per_seq = math.ceil(seq_len / block_size)
    gen = torch.Generator(device).manual_seed(0)
    kv = torch.randn(2, batch * blocks_per_seq, block_size, kv_heads, head_dim, device=device, dtype=sizes.dtype,
                     generator=gen)
    order = torch.randperm(batch * blocks_per_seq, device=device, generator=gen)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.long, device=device)
    query_start_loc = torch.arange(batch + 1, device=device) * new
    q = torch.randn(batch * new, heads, head_dim, device=device, dtype=sizes.dtype, generator=gen)
    return q, kv[0], kv[1], block_tables, seq_lens, query_start_loc


def prefill_flops(batch: int, context: int, new: int, sizes: Sizes) -> int:
    """Causal attention FLOPs: query i (at position context + i) meets context + i + 1 keys, 4 FLOPs per
    key and dimension (q.k and p.v, a multiply and an add each)."""
    heads, _, head_dim = sizes.heads
    keys = new * context + new * (new + 1) // 2
    return 4 * batch * heads * head_dim * keys


def measure_prefill(batch, context, new, sizes, device, **kernel_options) -> float:
    from minivllm.kernels.paged_attention import paged_prefill_attention

    q, k_cache, v_cache, block_tables, seq_lens, starts = prefill_problem(batch, context, new, sizes, device)
    ms = time_ms(lambda: paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, starts, new,
                                                 **kernel_options), device)
    return prefill_flops(batch, context, new, sizes) / (ms / 1000) / 1e12


def measure_prefill_sdpa(batch, new, sizes, device) -> float | None:
    """torch SDPA, causal, on contiguous [batch, heads, new, head_dim] (FlashAttention on a recent GPU). None if
    this torch has no SDPA kernel for the case."""
    heads, kv_heads, head_dim = sizes.heads
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(batch, heads, new, head_dim, device=device, dtype=sizes.dtype, generator=gen)
    k, v = torch.randn(2, batch, kv_heads, new, head_dim, device=device, dtype=sizes.dtype, generator=gen)
    attention = torch.nn.functional.scaled_dot_product_attention
    try:
        ms = time_ms(lambda: attention(q, k, v, is_causal=True, enable_gqa=True), device)
    except RuntimeError:
        return None
    return prefill_flops(batch, 0, new, sizes) / (ms / 1000) / 1e12


def best_of(configs: list[dict], measure) -> tuple[dict, list[dict]]:
    """Run measure(**config) for each; a config the compiler refuses (too much shared memory) is recorded."""
    rows = []
    for config in configs:
        try:
            rows.append({**config, "value": measure(**config)})
        except Exception as error:  # noqa: BLE001 -- an out-of-resources config is a result, not a failure
            rows.append({**config, "value": None, "error": f"{type(error).__name__}: {str(error)[:200]}"})
    measured = [r for r in rows if r["value"] is not None]
    if not measured:
        raise RuntimeError(f"every tile configuration failed: {rows}")
    best = max(measured, key=lambda r: r["value"])
    return {k: v for k, v in best.items() if k != "value"}, rows


def run_tests(sizes: Sizes) -> dict:
    """tests/test_triton_attention.py in a subprocess: all of it compiled on a GPU, its kernel tests in the
    interpreter with --smoke. Never its own gpu_check tests, which would run this harness again."""
    start = time.time()
    env = dict(os.environ)
    if sizes.smoke:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    selection = f"({SMOKE_TESTS}) and not gpu_check" if sizes.smoke else "not gpu_check"
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection,
                               "tests/test_triton_attention.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"  the tests took over {TESTS_TIMEOUT_S} s: stopped")
        return {"passed": False, "summary": f"stopped after {TESTS_TIMEOUT_S} s", "seconds": TESTS_TIMEOUT_S}
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    print(f"  {summary}")
    if done.returncode:
        print(done.stdout[-4000:], done.stderr[-2000:])
    return {"passed": done.returncode == 0, "summary": summary, "seconds": round(time.time() - start, 1)}


def run(sizes: Sizes, device: torch.device, save=lambda results: None) -> dict:
    """Every step in turn; save(results) after each, so a run stopped by a lease's time limit keeps what it
    measured."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu {platform.machine()}"
    peak_bandwidth, peak_flops = next((spec for key, spec in SPEC_SHEETS.items() if key in name), (None, None))
    heads, kv_heads, head_dim = sizes.heads
    results = {
        "date": datetime.date.today().isoformat(), "device": name, "smoke": sizes.smoke,
        "torch": torch.__version__, "triton": __import__("triton").__version__,
        "dtype": str(sizes.dtype).removeprefix("torch."),
        "shape": {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "block_size": sizes.block_size},
        "peak_bandwidth_gbs": peak_bandwidth and peak_bandwidth / 1e9, "peak_tflops": peak_flops and peak_flops / 1e12,
    }
    print(f"{name}: tests with the kernels compiled")
    results["tests"] = run_tests(sizes)
    save(results)
    results["copy_bandwidth_gbs"] = copy_bandwidth(sizes.copy_bytes, device) / 1e9
    print(f"  device-to-device copy: {results['copy_bandwidth_gbs']:.0f} GB/s")

    batch, context = sizes.big
    print(f"decode tile sweep at batch {batch} x context {context}")
    decode_tile, results["decode_tile_sweep"] = best_of(
        sizes.decode_tiles, lambda **tile: measure_decode(batch, context, sizes, device, num_splits=1, **tile))
    results["decode_tile"] = decode_tile
    print(f"  best {decode_tile}")
    save(results)

    print("decode bandwidth")
    results["decode"] = []
    for batch in sizes.batches:
        for context in sizes.contexts:
            row = {"batch": batch, "context": context,
                   "kernel_gbs": measure_decode(batch, context, sizes, device, **decode_tile),
                   "sdpa_gbs": measure_decode_sdpa(batch, context, sizes, device)}
            row["kernel_fraction_of_peak"] = peak_bandwidth and row["kernel_gbs"] * 1e9 / peak_bandwidth
            results["decode"].append(row)
            print(f"  batch {batch:4d} context {context:6d}: triton {row['kernel_gbs']:8.1f} GB/s, "
                  f"sdpa {row['sdpa_gbs'] or float('nan'):8.1f} GB/s")
            save(results)

    batch, context = sizes.big
    print(f"KV block size at batch {batch} x context {context}")
    results["block_size"] = [{"block_size": b, "kernel_gbs": measure_decode(batch, context, sizes, device,
                                                                           block_size=b, **decode_tile)}
                             for b in sizes.block_sizes]

    print("split-K")
    results["splits"] = [{"batch": batch, "context": context, "num_splits": s,
                          "kernel_gbs": measure_decode(batch, context, sizes, device, num_splits=s, **decode_tile)}
                         for batch, context in sizes.split_shapes for s in sizes.splits]
    save(results)

    batch, new = sizes.prefill_shape
    print(f"prefill tile sweep at batch {batch} x {new} tokens")
    prefill_tile, results["prefill_tile_sweep"] = best_of(
        sizes.prefill_tiles, lambda **tile: measure_prefill(batch, 0, new, sizes, device, **tile))
    results["prefill_tile"] = prefill_tile
    print(f"  best {prefill_tile}")
    results["prefill"] = []
    for batch, context, new in sizes.prefills:
        row = {"batch": batch, "context": context, "new": new,
               "kernel_tflops": measure_prefill(batch, context, new, sizes, device, **prefill_tile),
               "sdpa_tflops": measure_prefill_sdpa(batch, new, sizes, device) if context == 0 else None}
        results["prefill"].append(row)
        print(f"  batch {batch:3d} context {context:6d} new {new:5d}: triton {row['kernel_tflops']:7.1f} TFLOP/s"
              + (f", sdpa {row['sdpa_tflops']:7.1f}" if row["sdpa_tflops"] else ""))
        save(results)

    from minivllm.tools.gpu_model_check import draft_sizing, engine_check, timed

    print(f"the engine against transformers, {results['dtype']}")
    results["engine"] = timed(engine_check, sizes, device, "auto" if device.type == "cuda" else "triton")
    save(results)
    print("chapter 9's draft sizing")
    results["draft_sizing"] = timed(draft_sizing, sizes, device)
    return results


# ------------------------------------------------------------------ reading results back (the figures: gpu_plots)


def latest_results(folder: Path = RESULTS) -> dict | None:
    """The newest measured (not smoke) results in bench/gpu/, or None."""
    found = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    measured = [r for r in found if not r.get("smoke")]
    return max(measured, key=lambda r: r["date"]) if measured else None


def results_folder(out: Path | None, smoke: bool) -> Path:
    """--out, else $OUT (a lent machine hands back what is written there), else bench/gpu (a temporary folder
    for a smoke run, which must not stand in for measurements)."""
    if out is not None:
        return out
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu"
    return Path(tempfile.mkdtemp(prefix="gpu-check-smoke-")) if smoke else RESULTS


PARTIAL = "partial.json"  # what a run has measured so far; removed once the results are written


def save_partial(results: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PARTIAL).write_text(json.dumps(results, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any machine with triton; measures nothing")
    parser.add_argument("--out", type=Path, help=f"results folder (default $OUT/gpu when $OUT is set, else "
                                                 f"{RESULTS.relative_to(ROOT)}, or a temporary folder with --smoke)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu-check needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False).\n"
              "On this machine the kernels run in triton's interpreter: `make test` checks them there, and\n"
              "`python -m minivllm.tools.gpu_check --smoke` exercises this harness at tiny sizes.", file=sys.stderr)
        return 2
    if not args.smoke and os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: unset it, gpu-check measures the compiled kernels.", file=sys.stderr)
        return 2
    from minivllm.kernels.interpreter import triton_available, use_interpreter_without_gpu

    if not triton_available():
        print("gpu-check needs the triton package (pip install triton).", file=sys.stderr)
        return 2
    if args.smoke and not use_interpreter_without_gpu():  # must happen before anything imports triton
        print("--smoke on a CPU needs triton's interpreter, and triton was imported before it could be turned on: "
              "run it in a fresh process, or set TRITON_INTERPRET=1.", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.time()
    folder = results_folder(args.out, args.smoke)
    results = run(Sizes(args.smoke), device, save=lambda partial: save_partial(partial, folder))
    results["seconds"] = round(time.time() - started, 1)
    for path in write(results, folder):
        print(f"wrote {path}")
    (folder / PARTIAL).unlink(missing_ok=True)
    failed = [step for step in ("engine", "draft_sizing") if "error" in results[step]]
    if not results["tests"]["passed"] or failed:
        print(f"FAILED: {'the tests' if not results['tests']['passed'] else ''} {' '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
