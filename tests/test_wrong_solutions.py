"""Every exercise's check rejects the mistakes students make and accepts the answer in notebooks/solutions/.

The wrong answers live in tests/wrong_solutions/: every module there (but solutions.py) is picked up, whatever
its name, and gives `WRONG = {"NN.name": [wrong_answer, ...]}` (at least two per exercise), and, optionally,
`RUN_THE_MODEL = {"NN.name", ...}`: the exercises whose checks run the model (in the engine, on tensor-parallel
ranks, on SmolLM2). Those take minutes for a right answer, which must pass every case: it is checked where the
solutions notebooks are, by strict nbval in `make test` (their cells print "all N checks passed"), not twice.
The right answers to the others are taken from the solutions notebooks' cells. A wrong answer stops at its
first failed case. 08.tile_update runs the Triton interpreter, which must be switched on before anything imports
triton, so its wrong answers are tried in a fresh Python process."""

import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from importlib import import_module
from pathlib import Path

import pytest

from minivllm import exercises
from tests import wrong_solutions
from tests.wrong_solutions import ch08
from tests.wrong_solutions.solutions import solution

ROOT = Path(__file__).resolve().parents[1]
IN_A_FRESH_PROCESS = {"08.tile_update"}
MODULES = [import_module(f"{wrong_solutions.__name__}.{module.name}")
           for module in pkgutil.iter_modules(wrong_solutions.__path__) if module.name != "solutions"]
RUN_THE_MODEL = set().union(*(getattr(module, "RUN_THE_MODEL", set()) for module in MODULES)) | {
    "05.allocate", "06.schedule", "07.computed_blocks", "07.predict_cached", "08b.paged_decode",
    "09.verify_greedy", "09.verify_sampled", "11.vocab_parallel_embedding", "11.shard_qkv",
    "12.cached_prefix_tokens", "90.dequantize_q4_1", "90.unpermute"}


def all_exercises():
    exercises._load_chapters()
    return sorted(exercises.EXERCISES)


def _merged() -> dict:
    merged: dict = {}
    for module in MODULES:
        for name, wrong in module.WRONG.items():
            merged.setdefault(name, []).extend(wrong)
    return merged


WRONG = _merged()


def test_every_exercise_has_wrong_solutions():
    missing = set(all_exercises()) - set(WRONG) - IN_A_FRESH_PROCESS
    assert not missing, f"exercises without wrong solutions in tests/wrong_solutions/: {sorted(missing)}"
    assert all(len(WRONG[name]) >= 2 for name in WRONG)


def test_every_wrong_solution_names_an_exercise_that_exists():
    unknown = set(WRONG) - set(all_exercises())
    assert not unknown, f"tests/wrong_solutions/ has answers to exercises no check knows: {sorted(unknown)}"


@pytest.mark.parametrize("name", sorted(set(all_exercises()) - IN_A_FRESH_PROCESS - RUN_THE_MODEL))
def test_the_solution_notebooks_answer_passes(name):
    passed, report = exercises.run_checks(name, solution(name))
    assert passed, "\n".join(report)


@pytest.mark.parametrize("name, wrong", [(name, wrong) for name in sorted(set(WRONG) & set(all_exercises()))
                                         for wrong in WRONG[name]],
                         ids=lambda value: getattr(value, "__name__", value))
def test_a_wrong_answer_fails(name, wrong):
    passed, report = exercises.run_checks(name, wrong, stop_at_failure=True)
    assert not passed, f"{wrong.__name__} passed {name}"
    assert any(line.startswith("✗ ") for line in report)


def test_a_check_reports_a_measurement_beside_its_verdict():
    """A note is printed under the test that made it, marked ⏱, and is no verdict: verdict() leaves it out."""
    exercises.EXERCISES["00.noted"] = lambda: [("measured", lambda f: exercises.note(f"took {f()} s"))]
    try:
        exercises.check("00.noted", lambda: 3)
        assert exercises.RESULTS["00.noted"] == (True, ["✓ measured", "  ⏱ took 3 s",
                                                        "00.noted: all 1 checks passed"])
        assert exercises.verdict("00.noted") == "00.noted: all 1 checks passed"
    finally:
        del exercises.EXERCISES["00.noted"]


def test_a_hard_coded_answer_fails_under_another_seed(monkeypatch):
    """An answer that replays what the default seed's randomised cases expect fails once the seed changes."""
    seen = {}

    def recording(token_ids, k, prompt_lookup_max, prompt_lookup_min):
        key = (tuple(token_ids), k, prompt_lookup_max, prompt_lookup_min)
        seen[key] = solution("09.ngram_lookup")(token_ids, k, prompt_lookup_max, prompt_lookup_min)
        return seen[key]

    assert exercises.run_checks("09.ngram_lookup", recording)[0]

    def replay(token_ids, k, prompt_lookup_max, prompt_lookup_min):
        return seen.get((tuple(token_ids), k, prompt_lookup_max, prompt_lookup_min), [])

    assert exercises.run_checks("09.ngram_lookup", replay)[0]
    monkeypatch.setenv(exercises.SEED_VARIABLE, "12345")
    assert not exercises.run_checks("09.ngram_lookup", replay)[0]


def test_a_seed_that_is_not_a_number_is_refused(monkeypatch):
    monkeypatch.setenv(exercises.SEED_VARIABLE, "twelve")
    with pytest.raises(ValueError, match="MINIVLLM_CHECK_SEED='twelve'"):
        exercises.run_checks("06.plan", lambda *args: 0)


TILE_UPDATE_SCRIPT = textwrap.dedent("""
    import json, sys
    from minivllm.kernels.interpreter import use_interpreter_without_gpu
    use_interpreter_without_gpu()
    import triton.language as tl
    from minivllm import exercises
    from tests.wrong_solutions.ch08 import TILE_UPDATE_WRONG

    results = {}
    for what, source in TILE_UPDATE_WRONG.items():
        namespace = {"tl": tl}
        exec(source, namespace)
        results[what] = exercises.run_checks("08.tile_update", namespace["tile_update"], stop_at_failure=True)
    print(json.dumps(results))
""")


def test_tile_update_rejects_wrong_updates():
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TQDM_DISABLE="1")
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", TILE_UPDATE_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(results) == set(ch08.TILE_UPDATE_WRONG)
    for what, (passed, report) in results.items():
        assert not passed, f"a tile update with {what} passed 08.tile_update"
