"""Scripts work as they do with vLLM (chapter 11): the README's snippet run from a file, as a new user runs
it; workers forked by default on Linux (computing correctly with several OpenMP threads), spawned on request;
under spawn an unguarded script is refused before any worker starts, with an error naming the guard; a
worker that dies before it is ready is explained by the parent. No finaliser errors, no hangs."""

import os
import subprocess
import sys
import textwrap

import pytest

README_SNIPPET = """\
from minivllm import LLM, SamplingParams
llm = LLM(); print(llm.generate(["ROMEO:\\n"])[0].outputs[0].text)
tp = LLM(tensor_parallel_size=2); tp.generate(["ROMEO:\\n"]); tp.shutdown()
"""

GUARDED = """\
from minivllm import LLM, SamplingParams


def main():
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = LLM(device="cpu", num_kv_blocks=16)
    expected = one.generate(["ROMEO:\\n"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    tp = LLM(device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    got = tp.generate(["ROMEO:\\n"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    print("method", tp.engine.workers.start_method, "equal", list(got) == list(expected), flush=True)
    tp.shutdown()


if __name__ == "__main__":
    main()
"""

FINALISER_TROUBLE = ("can only join a started process", "Exception ignored", "AssertionError")


def run_script(tmp_path, source: str, method: str | None = None, timeout_s: float = 240.0):
    """python <file> in a fresh folder, as a user runs a script; the start method from the environment."""
    script = tmp_path / "first_try.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.endswith("WORKER_MULTIPROC_METHOD")}
    env.update(TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    if method is not None:
        env["VLLM_WORKER_MULTIPROC_METHOD"] = method
    return subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def test_the_readme_snippet_runs_from_a_file(tmp_path):
    done = run_script(tmp_path, README_SNIPPET)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the first LLM printed no text"
    assert not any(words in done.stderr for words in FINALISER_TROUBLE), done.stderr[-3000:]


def test_under_spawn_an_unguarded_script_is_refused_naming_the_guard_before_any_worker_starts(tmp_path):
    done = run_script(tmp_path, README_SNIPPET, method="spawn")
    assert done.returncode == 1
    assert 'if __name__ == "__main__":' in done.stderr and "line 3 of" in done.stderr
    assert "VLLM_WORKER_MULTIPROC_METHOD=spawn" in done.stderr  # it says why the workers would be spawned
    assert done.stderr.count("Traceback") == 1 and "died" not in done.stderr  # no worker ever started
    assert not any(words in done.stderr for words in FINALISER_TROUBLE), done.stderr[-3000:]


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_guarded_script_works_with_either_start_method(tmp_path, method):
    done = run_script(tmp_path, GUARDED, method=method)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"method {method} equal True" in done.stdout
    assert not any(words in done.stderr for words in FINALISER_TROUBLE), done.stderr[-3000:]


def test_a_forked_worker_with_several_openmp_threads_computes_and_does_not_hang(tmp_path):
    """The driver has run multi-threaded operations before it forks (OpenMP's pool is up), and the worker
    runs with 2 threads of its own: without pausing OpenMP first, the worker would wait forever."""
    source = textwrap.dedent("""\
        import torch
        from minivllm import LLM, SamplingParams
        torch.set_num_threads(4)
        x = torch.randn(512, 512)
        print(float((x @ x).sum()) != 0.0, float(x.exp().sum()) > 0)  # parallel regions in the driver
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompts = ["ROMEO:\\n", "First Citizen:\\nBefore we proceed"]
        one = LLM(device="cpu", num_kv_blocks=32)
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
        tp = LLM(device="cpu", num_kv_blocks=32, tensor_parallel_size=2)
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, greedy, use_tqdm=False)]
        print("method", tp.engine.workers.start_method, "equal", got == expected, flush=True)
        tp.shutdown()
        """)
    done = run_script(tmp_path, source, timeout_s=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "method fork equal True" in done.stdout


def test_a_worker_that_dies_in_spawns_rerun_of_the_script_is_explained_by_the_parent(tmp_path):
    """The script is guarded, but fails when a spawned worker reruns it: before worker_main runs, so only the
    worker's stderr can tell why. The parent's error carries its last lines."""
    source = 'if __name__ == "__mp_main__":\n    raise RuntimeError("this script cannot run in a worker")\n' + GUARDED
    done = run_script(tmp_path, source, method="spawn")
    assert done.returncode == 1
    assert "tensor-parallel worker rank 1 died (exit code 1)" in done.stderr
    assert "this script cannot run in a worker" in done.stderr.split("rank 1 died", 1)[1]
    assert not any(words in done.stderr for words in FINALISER_TROUBLE), done.stderr[-3000:]
