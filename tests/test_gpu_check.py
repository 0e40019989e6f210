"""`make gpu-check` cannot rot before a GPU is lent: its smoke run goes through every step of the full run
(the kernel tests included) on this CPU, in triton's interpreter, at tiny sizes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.tools import gpu_check, train_tiny

REPO = Path(__file__).resolve().parents[1]


def test_the_harness_points_at_the_repository():
    assert gpu_check.ROOT == REPO and gpu_check.RESULTS == REPO / "bench" / "gpu"
    assert (gpu_check.ROOT / "tests" / "test_triton_attention.py").is_file()
    assert train_tiny.MODELS_DIR == REPO / "minivllm" / "models"
    assert (train_tiny.MODELS_DIR / "tiny-shakespeare" / "config.json").is_file()


def test_results_go_under_out_when_it_is_set(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.results_folder(None, smoke=False) == tmp_path / "gpu"
    monkeypatch.delenv("OUT")
    assert gpu_check.results_folder(None, smoke=False) == REPO / "bench" / "gpu"
    assert gpu_check.results_folder(tmp_path / "x", smoke=True) == tmp_path / "x"


def test_smoke_run_goes_through_every_step(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    env |= {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    done = subprocess.run([sys.executable, "-m", "minivllm.tools.gpu_check", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [results_file] = tmp_path.glob("*.json")  # the partial results saved after each step are gone
    results = json.loads(results_file.read_text())
    assert results["smoke"] and results["date"] in results_file.name
    assert results["torch"] and results["triton"] and results["device"]
    tests = results["tests"]
    assert tests["passed"] and " passed" in tests["summary"] and "failed" not in tests["summary"], tests
    assert len(results["decode"]) == 4 and all(r["kernel_gbs"] > 0 for r in results["decode"])
    assert all(r["kernel_tflops"] > 0 for r in results["prefill"])
    assert results["block_size"] and results["splits"]
    engine = results["engine"]
    assert "error" not in engine, engine
    agreement = engine["agreement_float32"]
    assert agreement["identical_sequences"] == agreement["sequences"] > 0  # float32: the same greedy tokens
    assert all(engine[name]["output_tokens"] > 0
               for name in ("minivllm", "transformers_generate", "transformers_generate_batch"))
    draft = results["draft_sizing"]
    assert "error" not in draft and draft["drafts"] and all(d["draft_cost"] > 0 for d in draft["drafts"])
    figures = sorted(p.name.removeprefix(results_file.stem) for p in tmp_path.glob("*.png"))
    assert figures == ["_block_size_splits.png", "_decode.png", "_prefill.png"]
    assert gpu_check.latest_results(tmp_path) is None  # a smoke run never stands in for measurements
