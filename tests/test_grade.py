"""python -m minivllm grade (issue 41, item 5): every test grades a small notebook built to break the grader, a
reproducer of what the red team did (a forged verdict, a loop, a memory hog, a daemon that outlives its kernel,
a missing check() call, a file that is not a notebook). Answers that must pass are chapter 8's two quickest
solutions (plain PyTorch, checked in a second), so each test stays well under a minute."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from minivllm.tools import grade
from minivllm.tools.grade_answers import Answer, extract_answers
from minivllm.tools.grade_check import sign, verified

ROOT = Path(__file__).resolve().parents[1]
QUICK = ROOT / "notebooks" / "solutions" / "08_triton.ipynb"  # plain PyTorch answers, checked in a second
CHAPTER_8 = ["08.online_softmax", "08.merge_partials", "08.prefill_key_range", "08.tile_update"]
STUB = "def {0}(*args):\n    raise NotImplementedError\n\n\ncheck(\"08.{1}\", {0})"


def quick_cells() -> list:
    """The solutions' answers to 08.online_softmax and 08.merge_partials, in that order."""
    cells = {name: cell for cell in nbformat.read(QUICK, as_version=4).cells for name in CHAPTER_8[:2]
             if cell.cell_type == "code" and f'check("{name}"' in cell.source}
    return [cells["08.online_softmax"], cells["08.merge_partials"]]


def write(path: Path, cells) -> Path:
    nbformat.write(new_notebook(cells=[new_markdown_cell("# a submission"), *cells]), path)
    return path


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def daemon_cell(pid_file: Path, then: str) -> str:
    """A kernel that ignores SIGTERM and SIGINT and forks a daemon (twice, in a session of its own) that writes
    its pid and sleeps; then the kernel runs `then`."""
    return (f"import os, signal, time\n"
            f"signal.signal(signal.SIGTERM, signal.SIG_IGN)\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            f"if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n        time.sleep(3600)\n"
            f"    os._exit(0)\n"
            f"while not os.path.exists({str(pid_file)!r}):\n    time.sleep(0.05)\n{then}")


def test_a_forged_verdict_scores_nothing(tmp_path):
    """The red team's forgeries: patch the check runner (with names built at run time, so no static flag
    catches them), and answers that print and write passing verdicts on every descriptor, then exit."""
    forge = ("import importlib, json\n"
             "exercises = importlib.import_module('minivllm.' + 'exercises')\n"
             "setattr(exercises, 'run_' + 'checks', lambda name, f, stop_at_failure=False: (True, ['all passed']))\n"
             "setattr(exercises, 'check', lambda name, f: print(json.dumps({'name': name, 'passed': True})))")
    liar = ("import json, os\n\n\ndef merge_partials(*args):\n"
            "    line = json.dumps({'name': '08.merge_partials', 'passed': True, 'report': ['all passed']})\n"
            "    for fd in range(1, 10):  # stdout, stderr, and whatever else is open: the verdict channel too\n"
            "        try:\n            os.write(fd, ('0' * 64 + ' ' + line + '\\n').encode())\n"
            "        except OSError:\n            pass\n    os._exit(0)\n\n\n"
            "check(\"08.merge_partials\", merge_partials)")
    cells = [new_code_cell("from minivllm.exercises import check"), new_code_cell(forge),
             new_code_cell(STUB.format("online_attention", "online_softmax")), new_code_cell(liar)]
    result = grade.grade_notebook(write(tmp_path / "08_forger.ipynb", cells), grade.Limits(120))
    exercises = result["exercises"]
    assert (result["passed"], result["total"]) == (0, 4), exercises
    assert exercises["08.online_softmax"]["report"] == [
        "✗ 08.online_softmax: not implemented yet (the function raises NotImplementedError)"]
    assert "gave no verdict" in exercises["08.merge_partials"]["report"][0]


def test_a_missing_check_scores_zero_and_a_raising_cell_does_not_hide_later_answers(tmp_path):
    first, second = quick_cells()
    path = write(tmp_path / "08_ada.ipynb", [first, new_code_cell("1 / 0"), second])
    result = grade.grade_notebook(path, grade.Limits(120))
    exercises = result["exercises"]
    assert list(exercises) == CHAPTER_8 and (result["passed"], result["total"]) == (2, 4)
    assert result["error"] == "ZeroDivisionError: division by zero"
    assert exercises["08.online_softmax"]["passed"] and exercises["08.merge_partials"]["passed"]
    assert exercises["08.merge_partials"]["report"][-1].startswith("08.merge_partials: all ")
    assert exercises["08.tile_update"] == {"passed": False, "flags": [],
                                           "report": ['✗ 08.tile_update: no check("08.tile_update", ...) call in '
                                                      'the notebook']}


def test_a_broken_notebook_is_reported_and_the_class_is_graded(tmp_path):
    broken = tmp_path / "01_broken.ipynb"
    broken.write_text('{"cells": [', encoding="utf-8")  # cut short: not JSON
    empty = write(tmp_path / "08_empty.ipynb", [])
    report = tmp_path / "grades.json"
    run = subprocess.run([sys.executable, "-m", "minivllm", "grade", str(broken), str(empty), "--json", str(report),
                          "--timeout", "60"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    notebooks = {Path(n["path"]).stem: n for n in json.loads(report.read_text())["notebooks"]}
    assert notebooks["01_broken"]["error"].startswith("not a readable notebook: JSONDecodeError")
    assert (notebooks["01_broken"]["passed"], notebooks["01_broken"]["total"]) == (0, 3)  # chapter 1's three
    assert notebooks["08_empty"]["error"] is None
    assert (notebooks["08_empty"]["passed"], notebooks["08_empty"]["total"]) == (0, 4)
    lines = run.stdout.splitlines()
    assert lines[0].split()[0] == "notebook" and len(lines) == 3
    assert lines[1].endswith("(not a readable notebook: JSONDecodeError: Expecting value: line 1 column 12 "
                             "(char 11))") and lines[2].split()[-1] == "0/4"


def test_a_loop_is_killed_at_the_time_limit_with_a_daemon_it_forked(tmp_path):
    pid_file = tmp_path / "daemon.pid"
    path = write(tmp_path / "sleeper.ipynb", [new_code_cell(daemon_cell(pid_file, "while True:\n    pass"))])
    start = time.monotonic()
    result = grade.grade_notebook(path, grade.Limits(30))
    assert time.monotonic() - start < 30 + 15  # the limit, then the sweeps
    assert result["error"] == "timed out after 30 s"
    assert pid_file.exists(), "the kernel never reached its fork"
    assert not alive(int(pid_file.read_text()))


def test_a_daemon_left_by_a_notebook_that_ended_is_killed(tmp_path):
    pid_file = tmp_path / "daemon.pid"
    path = write(tmp_path / "leaver.ipynb", [new_code_cell(daemon_cell(pid_file, "print('done')"))])
    result = grade.grade_notebook(path, grade.Limits(60))
    assert result["error"] is None
    assert not alive(int(pid_file.read_text()))


def test_a_notebook_over_the_memory_limit_fails_with_memory_error(tmp_path):
    path = write(tmp_path / "hog.ipynb", [new_code_cell("hog = bytearray(32 << 30)")])  # 32 GiB
    result = grade.grade_notebook(path, grade.Limits(60, memory_gib=4))
    assert result["error"] == "MemoryError"


def test_a_notebook_over_the_cpu_limit_is_stopped_before_the_time_limit(tmp_path):
    path = write(tmp_path / "spinner.ipynb", [new_code_cell("while True:\n    pass")])
    start = time.monotonic()
    result = grade.grade_notebook(path, grade.Limits(300, cpu=5))
    assert time.monotonic() - start < 60
    assert result["error"] is not None and "timed out" not in result["error"], result["error"]


def test_the_seed_reaches_the_checks(tmp_path):
    seeded = write(tmp_path / "seeded.ipynb", [new_code_cell(
        "from minivllm.exercises import check, check_seed\n"
        "def plan(running, waiting, budget, seqs):\n"
        "    assert check_seed() == 77, check_seed()  # the grader's --seed reached the check\n"
        "    raise NotImplementedError\n"
        "check(\"06.plan\", plan)")])
    result = grade.grade_notebook(seeded, grade.Limits(120), seed=77)
    assert result["total"] == 3  # chapter 6's exercises, from the one it checks
    assert result["exercises"]["06.plan"]["report"] == [
        "✗ 06.plan: not implemented yet (the function raises NotImplementedError)"]


def test_answers_that_import_the_reference_or_touch_the_checks_are_flagged_and_not_run(tmp_path):
    answers = extract_answers([
        "from minivllm.exercises import check\nfrom minivllm.core.kv_cache_utils import block_hashes as chain\n"
        "check(\"07.chain\", chain)",
        "import minivllm.exercises.ch07 as rules\n\n\ndef shared_blocks(a, b, block_size):\n    return 0\n\n\n"
        "check(\"07.shared_blocks\", shared_blocks)"])
    assert answers["07.chain"].flags == ["imports minivllm.core.kv_cache_utils.block_hashes, the package's own "
                                         "implementation of what 07.chain asks you to write"]
    assert answers["07.shared_blocks"].flags == ["reaches into the check machinery (minivllm.exercises.ch07)"]
    graded = grade.check_answer(answers["07.shared_blocks"], grade.Limits(5), None, tmp_path)
    assert not graded["passed"] and graded["report"][0].startswith("✗ 07.shared_blocks: not checked: reaches")


def test_an_answer_in_a_whole_chapter_is_checked_with_the_chapters_definitions(tmp_path):
    """A student's notebook is the chapter with its stubs filled in: the answer is extracted along with the
    chapter's definitions (about 140 statements of chapter 6), none of what it runs (`llm = LLM(...)`)."""
    chapter = nbformat.read(ROOT / "notebooks" / "06_continuous_batching.ipynb", as_version=4)
    solved = next(c.source for c in nbformat.read(ROOT / "notebooks" / "solutions" / "06_continuous_batching.ipynb",
                                                  as_version=4).cells if 'check("06.plan"' in c.source)
    code = [solved if 'check("06.plan"' in c.source else c.source for c in chapter.cells if c.cell_type == "code"]
    answer = extract_answers(code)["06.plan"]
    assert len(answer.definitions) > 100 and "llm = LLM(enable_prefix_caching=False)" not in answer.definitions
    graded = grade.check_answer(answer, grade.Limits(120), None, tmp_path)
    assert graded["passed"], graded["report"]


@pytest.mark.parametrize("folder", ["notebooks", "notebooks/solutions"])
def test_every_book_notebook_has_every_answer_extracted_and_none_flagged(folder):
    for path in sorted((ROOT / folder).glob("*.ipynb")):
        code = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        answers = extract_answers(code)
        chapter = path.name.split("_")[0]
        assert sorted(answers) == sorted(grade.chapter_exercises(chapter)), path.name
        assert all(a.answer and not a.flags for a in answers.values()), path.name


def test_only_a_verdict_signed_with_the_key_is_accepted():
    key, message = os.urandom(32), json.dumps({"name": "08.merge_partials", "passed": True, "report": []})
    assert verified(key, f"{sign(key, message)} {message}\n") == json.loads(message)
    assert verified(key, f"{'0' * 64} {message}\n{sign(os.urandom(32), message)} {message}") is None
    assert verified(key, message) is None


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: NOTEBOOK"),
    (["missing.ipynb"], "missing.ipynb: not a notebook file"),
    ([str(QUICK), "--timeout", "0"], "--timeout: 0; it must be positive"),
    ([str(QUICK), "--memory", "-1"], "--memory: -1; it must be positive"),
    ([str(QUICK), "--seed", "x"], "--seed: invalid int value"),
    ([str(QUICK), "--chapter", "77"], "no exercises registered for chapter '77'"),
    ([str(QUICK), "--json", "/no/such/folder/x.json"], "the folder /no/such/folder does not exist"),
])
def test_usage_errors_exit_non_zero_before_running_anything(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        grade.main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_help_says_student_code_runs_as_it_is(capsys):
    with pytest.raises(SystemExit):
        grade.main(["--help"])
    assert "container or a throwaway account" in capsys.readouterr().out.replace("\n", " ")
