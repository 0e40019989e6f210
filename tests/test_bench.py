"""`make bench` at toy sizes: every benchmark command still runs end to end and writes its JSON.
(Benchmarks measure; these tests only keep them from rotting. No timing is asserted.)"""

import json
from pathlib import Path

import pytest
import torch

from minivllm.tools import bench


def run(tmp_path, *argv) -> dict:
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{argv[0]}-*.json")
    return json.loads(path.read_text())


def test_engine_and_compare(tmp_path):
    small = ["--num-prompts", "3", "--min-prompt", "4", "--max-prompt", "12", "--output-len", "4"]
    engine = run(tmp_path / "engine", "engine", *small)
    assert engine["minivllm"]["output_tokens"] == 12
    compare = run(tmp_path / "compare", "compare", *small, "--min-output", "2", "--hf-batch-size", "2", "--repeats", "2")
    runs = compare["workloads"]["custom"]["runs"]
    for name, result in runs.items():  # outputs of 2-4 tokens: static batches must cut each to its own length
        assert "error" not in result and result["greedy_tokens_match_minivllm"], name
        assert 0 < result["roofline_fraction"] < 1 and result["seconds"] == min(result["all_seconds"]), name
        assert len(result["all_seconds"]) == 2, name
    assert runs["minivllm"]["output_tokens"] == runs["transformers_generate_static"]["output_tokens"] < 12


def test_spec(tmp_path):
    result = run(tmp_path, "spec", "--num-prompts", "2", "--output-len", "12", "--ks", "2", "--batch-sizes", "2")
    rows = result["results"]["batch_2"]
    assert [(r["method"], r["k"]) for r in rows] == [(None, 0), ("draft_model", 2), ("ngram", 2)]
    assert all(r["outputs_identical"] and 1 <= r["mean_acceptance_length"] <= 3 for r in rows[1:])


def test_serve(tmp_path):
    result = run(tmp_path, "serve", "--num-prompts", "3", "--min-prompt", "4", "--max-prompt", "12",
                 "--output-len", "4", "--request-rates", "inf")
    summary = result["by_request_rate"]["inf"]
    assert summary["output_tokens_per_s"] > 0 and summary["ttft_p50_ms"] <= summary["ttft_p99_ms"]


def test_overhead_measures_decode_steps_apart_from_the_model(tmp_path):
    import torch

    from minivllm.tools.bench_overhead import DECODE_STEPS, OVERHEAD_SHAPE, measure
    from minivllm.tools.bench_baselines import save_random_checkpoint

    save_random_checkpoint(tmp_path, {**OVERHEAD_SHAPE, "num_hidden_layers": 1}, torch.float32)
    row = measure(str(tmp_path), context=20, batch=3)
    assert (row["context"], row["batch"], row["decode_steps"]) == (20, 3, DECODE_STEPS - 2)
    assert row["engine_ms_per_step"] > 0 and row["model_ms_per_step"] > 0


def test_dtypes_counts_a_decode_steps_bytes_and_flops_and_skips_a_missing_llama_cpp(monkeypatch):
    from types import SimpleNamespace

    from minivllm.tools import bench_dtypes

    smollm2 = SimpleNamespace(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                              num_kv_heads=3, head_dim=64)
    bytes_1, flops_1 = bench_dtypes.step_costs(smollm2, 1, 0, 4)
    assert 134_000_000 < bytes_1 / 4 < 135_000_000  # SmolLM2-135M: its weights, read once per step
    assert flops_1 == 2 * bytes_1 / 4
    bytes_int8, _ = bench_dtypes.step_costs(smollm2, 1, 100, 1, 4)
    assert bytes_int8 == bytes_1 / 4 + 100 * 2 * 30 * 3 * 64 * 4  # int8 weights, fp32 keys and values
    bytes_32, flops_32 = bench_dtypes.step_costs(smollm2, 32, 100, 2)
    assert bytes_32 == bytes_1 / 2 + 32 * 100 * 2 * 30 * 3 * 64 * 2  # bf16: half the weight bytes, plus 32 contexts' KV
    assert flops_32 == 32 * (flops_1 + 4 * 30 * 9 * 64 * 100)
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    monkeypatch.setattr(bench_dtypes, "LLAMA_CPP_BUILT", Path("/nonexistent/.llama.cpp/build/bin"))
    assert bench_dtypes.llama_cpp_timers(Path("none.gguf"), "unused", 2) == {}  # no binaries: llama.cpp is skipped


def test_llama_cpp_tools_come_from_llama_cpp_bin_then_make_llama_cpps_build_then_path(monkeypatch, tmp_path):
    from minivllm.tools import bench_dtypes

    named, built, on_path = (tmp_path / folder for folder in ("named", "built", "path"))
    for folder in (named, built, on_path):
        folder.mkdir()
        (folder / "llama-bench").touch()
    monkeypatch.setenv("PATH", str(on_path))
    monkeypatch.setattr(bench_dtypes, "LLAMA_CPP_BUILT", built)
    monkeypatch.setenv("LLAMA_CPP_BIN", str(named))
    assert bench_dtypes.llama_cpp_tool("llama-bench") == str(named / "llama-bench")
    monkeypatch.delenv("LLAMA_CPP_BIN")
    assert bench_dtypes.llama_cpp_tool("llama-bench") == str(built / "llama-bench")
    monkeypatch.setattr(bench_dtypes, "LLAMA_CPP_BUILT", tmp_path / "missing")
    (on_path / "llama-bench").chmod(0o755)
    assert bench_dtypes.llama_cpp_tool("llama-bench") == str(on_path / "llama-bench")


def test_the_dtypes_matmul_rate_is_measured_on_the_models_own_products():
    from types import SimpleNamespace

    from minivllm.tools import bench_dtypes

    shape = SimpleNamespace(hidden_size=64, intermediate_size=128)
    timed = []
    real = torch.nn.functional.linear

    def recording(x, w, bias=None):
        timed.append((tuple(x.shape), tuple(w.shape), x.dtype))
        return real(x, w, bias)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "linear", recording)
        assert bench_dtypes.matmul_rate(torch.bfloat16, shape, 32, repeats=2) > 0
    assert set(timed) == {((32, 64), (128, 64), torch.bfloat16), ((32, 128), (64, 128), torch.bfloat16)}
