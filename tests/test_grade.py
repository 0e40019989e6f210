"""python -m minivllm grade: one real solutions notebook (chapter 2's, the smallest) and small synthetic ones,
each run in a fresh kernel. The JSON shape is the one issue 24 asks for."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from minivllm.tools import grade

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "notebooks" / "solutions" / "02_prefill_decode.ipynb"
CHAPTER = ROOT / "notebooks" / "02_prefill_decode.ipynb"
CHAPTER_2 = ["02.linear_intensity", "02.ttft_tpot"]


def exercise_cells(path: Path) -> list:
    return [cell for cell in nbformat.read(path, as_version=4).cells
            if cell.cell_type == "code" and 'check("' in cell.source]


def write(path: Path, cells) -> Path:
    nbformat.write(new_notebook(cells=[new_markdown_cell("# a submission"), *cells]), path)
    return path


def run_grade(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minivllm", "grade", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Chapter 2's solutions, its stubs, and its solutions with one exercise broken, graded in one call."""
    folder = tmp_path_factory.mktemp("submissions")
    solutions = shutil.copy(SOLUTIONS, folder / "solutions.ipynb")
    stubs = write(folder / "stubs.ipynb", exercise_cells(CHAPTER))
    cells = exercise_cells(SOLUTIONS)
    broken = cells[1].source.replace("(len(token_times) - 1)", "len(token_times)")  # TPOT over n, not n - 1
    assert broken != cells[1].source
    cells[1].source = broken
    one_broken = write(folder / "one_broken.ipynb", cells)
    raises = write(folder / "raises.ipynb", [exercise_cells(SOLUTIONS)[0], new_code_cell("1 / 0"),
                                             exercise_cells(SOLUTIONS)[1]])
    report = folder / "grades.json"
    run = run_grade(solutions, stubs, one_broken, raises, "--json", report, "--timeout", 600)
    assert run.returncode == 0, run.stderr
    return run.stdout, {Path(n["path"]).stem: n for n in json.loads(report.read_text())["notebooks"]}


def test_the_json_has_the_issues_shape(graded):
    _, notebooks = graded
    for notebook in notebooks.values():
        assert set(notebook) == {"path", "exercises", "passed", "total", "error"}
        for result in notebook["exercises"].values():
            assert set(result) == {"passed", "report"} and isinstance(result["passed"], bool)
            assert all(isinstance(line, str) for line in result["report"])
        assert notebook["passed"] == sum(r["passed"] for r in notebook["exercises"].values())
        assert notebook["total"] == len(notebook["exercises"])


def test_a_solutions_notebook_passes_every_exercise(graded):
    solutions = graded[1]["solutions"]
    assert sorted(solutions["exercises"]) == CHAPTER_2
    assert solutions["passed"] == solutions["total"] == 2 and solutions["error"] is None
    assert solutions["exercises"]["02.ttft_tpot"]["report"][-1] == "02.ttft_tpot: all 4 checks passed"


def test_the_chapters_stubs_pass_none(graded):
    stubs = graded[1]["stubs"]
    assert stubs["total"] == 2 and stubs["passed"] == 0 and stubs["error"] is None
    assert all("not implemented yet" in r["report"][0] for r in stubs["exercises"].values())


def test_one_broken_exercise_fails_alone(graded):
    exercises = graded[1]["one_broken"]["exercises"]
    assert exercises["02.linear_intensity"]["passed"] and not exercises["02.ttft_tpot"]["passed"]
    assert any(line.startswith("✗") for line in exercises["02.ttft_tpot"]["report"])


def test_a_cell_that_raises_is_the_notebooks_error_and_later_checks_count_as_failed(graded):
    raises = graded[1]["raises"]
    assert raises["error"] == "ZeroDivisionError: division by zero"
    assert raises["exercises"]["02.linear_intensity"]["passed"]
    assert raises["exercises"]["02.ttft_tpot"] == {
        "passed": False, "report": ["never checked: the notebook stopped before this check"]}
    assert (raises["passed"], raises["total"]) == (1, 2)


def test_the_table_has_a_row_per_notebook_and_a_column_per_exercise(graded):
    lines = graded[0].splitlines()
    assert lines[0].split()[:3] == ["notebook", *CHAPTER_2] and len(lines) == 5
    row = next(line for line in lines if "one_broken" in line)
    assert row.split()[-3:] == ["✓", "✗", "1/2"]


def test_a_cell_that_never_ends_times_out_within_the_limit(tmp_path):
    first, second = exercise_cells(SOLUTIONS)
    cells = [first, new_code_cell("import time\ntime.sleep(3600)"), second]
    sleeper = write(tmp_path / "sleeper.ipynb", cells)
    start = time.monotonic()
    result = grade.grade_notebook(sleeper, timeout=20)
    assert time.monotonic() - start < 20 + 10  # the limit, then killing the process group
    assert result["error"] == "timed out after 20 s"
    assert not result["exercises"]["02.ttft_tpot"]["passed"]


def test_the_seed_reaches_the_checks(tmp_path):
    cell = new_code_cell("import os\nfrom minivllm.exercises import check, check_seed\n"
                         "def plan(running, waiting, budget, seqs):\n"
                         "    assert check_seed() == int(os.environ['EXPECTED_SEED'])\n    raise NotImplementedError\n"
                         "check(\"06.plan\", plan)")
    notebook = write(tmp_path / "seeded.ipynb", [new_code_cell("import os\nos.environ['EXPECTED_SEED'] = '77'"), cell])
    result = grade.grade_notebook(notebook, timeout=300, seed=77)
    assert result["error"] is None and result["exercises"]["06.plan"]["report"][0].endswith("NotImplementedError)")


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: NOTEBOOK"),
    (["missing.ipynb"], "missing.ipynb: not a notebook file"),
    ([str(SOLUTIONS), "--timeout", "0"], "--timeout: 0 s; it must be positive"),
    ([str(SOLUTIONS), "--seed", "x"], "--seed: invalid int value"),
    ([str(SOLUTIONS), "--json", "/no/such/folder/x.json"], "the folder /no/such/folder does not exist"),
])
def test_usage_errors_exit_non_zero_before_running_anything(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        grade.main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_help_says_student_code_runs_as_it_is(capsys):
    with pytest.raises(SystemExit):
        grade.main(["--help"])
    assert "container or a throwaway account" in capsys.readouterr().out.replace("\n", " ")
