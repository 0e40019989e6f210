"""Grade a class: run each notebook contained, then check each of its answers again in a fresh process.

    python -m minivllm grade NOTEBOOK... [--json FILE] [--timeout S] [--cpu S] [--memory GIB] [--seed N]
                                         [--chapter NN]

For every notebook, in order, one at a time:

1. **It runs, contained.** Top to bottom in a fresh Jupyter kernel (minivllm.tools.grade_notebook_runner), from a
   copy in a scratch folder, under a supervisor (minivllm.tools.containment) that puts the runner and its kernel
   in a session of their own with a memory limit (RLIMIT_DATA, --memory) and a CPU limit (RLIMIT_CPU, --cpu, per
   process), and at the wall limit (--timeout), or when the notebook ends, SIGKILLs every process the notebook
   started: daemons that forked twice and left the session included. What stopped the notebook is its `error`.
2. **Its answers are checked again, by the grader.** The exercises are the chapter's (from the file name,
   "07_*.ipynb", or --chapter; else the chapters of the exercises it checks), not the ones the notebook
   happens to call `check` on: one with no `check("NN.name", answer)` call scores zero and still counts in the
   total. For each call, the grader takes the answer and the definitions before it from the notebook's
   source (minivllm.tools.grade_answers) and runs the exercise's check in a fresh process under the same limits
   (minivllm.tools.grade_check), which sends its verdict signed with a key the notebook never saw. Nothing the
   notebook printed, wrote or patched decides a score.

A notebook that is not valid JSON, or a grader failure on one notebook, is that notebook's `error`; the
rest of the class is graded. The grader prints a table of notebooks x exercises and, with --json, writes

    {"notebooks": [{"path": "...", "exercises": {"07.chain": {"passed": true, "report": ["..."], "flags": []}},
                    "passed": 3, "total": 4, "error": null}]}

`flags` says why an answer scored zero without being checked: it imports the package's own implementation,
or reaches into the check machinery. The exit status is 0 whenever grading ran, whatever the scores; 2 on a
usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

from minivllm.exercises import SEED_VARIABLE
from minivllm.tools.containment import contained
from minivllm.tools.grade_answers import Answer, chapter_exercises, chapters_of, extract_answers
from minivllm.tools.grade_check import verified

TRUST = ("Student code is run as it is, with your permissions, under limits of time, CPU and memory: grade in a "
         "container or a throwaway account, never in your own.")
RUNNER = Path(__file__).with_name("grade_notebook_runner.py")
OUTPUT_READ_LIMIT = 4 << 20  # the verdict is the check process's last line; a flood of prints before it is cut


class Limits:
    def __init__(self, timeout: float, cpu: float | None = None, memory_gib: float = 16.0):
        self.timeout, self.cpu = timeout, cpu if cpu is not None else 2 * timeout
        self.memory_bytes = int(memory_gib * (1 << 30))


def _environment(seed: int | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINIVLLM_CHECK_")}
    env.setdefault("TQDM_DISABLE", "1")
    if seed is not None:
        env[SEED_VARIABLE] = str(seed)
    return env


def run_notebook(path: Path, limits: Limits, seed: int | None, scratch: Path) -> str | None:
    """Execute a copy of the notebook, contained; None, or what stopped it."""
    folder, private = scratch / "notebook", scratch / "grader"
    folder.mkdir()
    private.mkdir()
    copy, outcome = folder / path.name, private / "outcome.json"
    shutil.copyfile(path, copy)
    command = [sys.executable, str(RUNNER), str(copy), str(limits.timeout), str(outcome)]
    result = contained(command, limits.timeout, limits.cpu, limits.memory_bytes, private / "output.txt",
                       env=_environment(seed), cwd=folder)
    if result["timed_out"]:
        return f"timed out after {limits.timeout:g} s"
    try:
        error = json.loads(outcome.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"the notebook's runner ended with status {result['returncode']} (a limit, or the notebook " \
               "killed it)"
    return error if error is None or isinstance(error, str) else str(error)


def check_answer(answer: Answer, limits: Limits, seed: int | None, scratch: Path) -> dict:
    """Run the exercise's check on `answer` in a fresh contained process; the verdict only if it is signed."""
    if answer.flags or not answer.answer:
        return {"passed": False, "report": [f"✗ {answer.name}: not checked: {'; '.join(answer.flags)}"],
                "flags": answer.flags}
    key = secrets.token_bytes(32)
    request = json.dumps({"name": answer.name, "definitions": answer.definitions, "answer": answer.answer})
    # a folder made now, under a random name, when nothing the notebook started is alive: no module the notebook
    # planted (a json.py) can sit on the check process's import path
    folder = Path(tempfile.mkdtemp(prefix="check-", dir=scratch))
    output = folder / "output.txt"
    result = contained([sys.executable, "-m", "minivllm.tools.grade_check"], limits.timeout, limits.cpu,
                       limits.memory_bytes, output, stdin_data=(key.hex() + "\n" + request + "\n").encode(),
                       env=_environment(seed), cwd=folder)
    verdict = None
    if output.is_file():  # absent only if the supervisor itself failed
        with open(output, "rb") as file:
            file.seek(max(0, output.stat().st_size - OUTPUT_READ_LIMIT))
            verdict = verified(key, file.read().decode("utf-8", "replace"))
    if verdict is None or verdict.get("name") != answer.name:
        why = (f"timed out after {limits.timeout:g} s" if result["timed_out"]
               else f"it ended with status {result['returncode']} before a verdict")
        return {"passed": False, "report": [f"✗ {answer.name}: the check process gave no verdict: {why}"],
                "flags": []}
    return {"passed": bool(verdict["passed"]), "report": [str(line) for line in verdict["report"]], "flags": []}


def grade_notebook(path: Path, limits: Limits | float, seed: int | None = None, chapter: str | None = None) -> dict:
    """Grade one notebook (see the module doc); never raises for what is in the notebook."""
    limits = limits if isinstance(limits, Limits) else Limits(limits)
    error, answers = None, {}
    try:
        notebook = json.loads(path.read_text(encoding="utf-8"))
        cells = [cell for cell in notebook.get("cells", []) if isinstance(cell, dict)]
        code = [cell.get("source", "") for cell in cells if cell.get("cell_type") == "code"]
        answers = extract_answers(["".join(s) if isinstance(s, list) else str(s) for s in code])
    except (OSError, ValueError, AttributeError, TypeError) as failure:
        error = f"not a readable notebook: {type(failure).__name__}: {failure}"
    chapters = [chapter] if chapter else chapters_of(path, answers)
    expected = [name for c in chapters for name in chapter_exercises(c)] or list(answers)
    exercises = {name: {"passed": False, "report": [f"✗ {name}: no check(\"{name}\", ...) call in the notebook"],
                        "flags": []} for name in expected}
    # ignore_cleanup_errors: a notebook may leave files it made unremovable; that is no reason to stop the class
    with tempfile.TemporaryDirectory(prefix="minivllm-grade-", ignore_cleanup_errors=True) as scratch:
        if error is None:
            error = run_notebook(path, limits, seed, Path(scratch))
        for name, answer in answers.items():
            if name in exercises:
                exercises[name] = check_answer(answer, limits, seed, Path(scratch))
    return {"path": str(path), "exercises": exercises, "passed": sum(e["passed"] for e in exercises.values()),
            "total": len(exercises), "error": error}


def format_table(graded: list[dict]) -> str:
    """Notebooks down, exercises across: ✓ passed, ✗ failed, blank where a notebook has no such exercise."""
    names = sorted({name for g in graded for name in g["exercises"]})
    paths = [g["path"] for g in graded]
    width = max([len(p) for p in paths] + [8])
    header = "notebook".ljust(width) + "  " + "  ".join(names) + "  score"
    rows = [header]
    for g in graded:
        marks = [" " if n not in g["exercises"] else "✓" if g["exercises"][n]["passed"] else "✗" for n in names]
        cells = "  ".join(mark.center(len(n)) for mark, n in zip(marks, names))
        rows.append(f"{g['path'].ljust(width)}  {cells}  {g['passed']}/{g['total']}"
                    + (f"  ({g['error']})" if g["error"] else ""))
    return "\n".join(rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m minivllm grade", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run notebooks contained, then check each answer again in a fresh process.",
        epilog=textwrap.fill(TRUST, 100) + "\n\n" + textwrap.fill(
            "--seed N reruns every randomised case of every check with seed N instead of the default, so an "
            "answer written to the cases the notebook printed fails.", 100))
    parser.add_argument("notebooks", nargs="+", type=Path, metavar="NOTEBOOK", help="the .ipynb files to grade")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument("--timeout", type=float, default=1200.0, metavar="S",
                        help="wall seconds for each notebook, and for each answer's check (default 1200)")
    parser.add_argument("--cpu", type=float, default=None, metavar="S",
                        help="CPU seconds each process may use (default: twice --timeout)")
    parser.add_argument("--memory", type=float, default=16.0, metavar="GIB",
                        help="memory each process may map, in GiB (default 16)")
    parser.add_argument("--seed", type=int, default=None, metavar="N",
                        help="the seed of the checks' randomised cases (default: the checks' own, 0)")
    parser.add_argument("--chapter", default=None, metavar="NN",
                        help="the chapter every notebook answers (default: from each file name, NN_*.ipynb)")
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for path in args.notebooks:
        if path.suffix != ".ipynb" or not path.is_file():
            parser.error(f"{path}: not a notebook file (.ipynb)")
    for option, value in (("--timeout", args.timeout), ("--cpu", args.cpu), ("--memory", args.memory)):
        if value is not None and not value > 0:
            parser.error(f"argument {option}: {value:g}; it must be positive")
    if args.chapter is not None and not chapter_exercises(args.chapter):
        parser.error(f"argument --chapter: no exercises registered for chapter {args.chapter!r}")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"argument --json: the folder {args.json.parent} does not exist")
    limits, graded = Limits(args.timeout, args.cpu, args.memory), []
    for path in args.notebooks:
        print(f"grading {path} ...", file=sys.stderr, flush=True)
        try:
            graded.append(grade_notebook(path, limits, args.seed, args.chapter))
        except Exception as failure:  # noqa: BLE001  one notebook the grader could not handle; the class goes on
            graded.append({"path": str(path), "exercises": {}, "passed": 0, "total": 0,
                           "error": f"the grader failed on this notebook: {type(failure).__name__}: {failure}"})
    print(format_table(graded))
    if args.json is not None:
        args.json.write_text(json.dumps({"notebooks": graded}, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
