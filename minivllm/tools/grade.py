"""Grade a class: run notebooks and collect their exercise checks.

    python -m minivllm grade NOTEBOOK... [--json FILE] [--timeout S] [--seed N]

Each notebook runs top to bottom in a fresh Jupyter kernel (nbclient), in its own folder, in a process of its
own that is killed with its kernel when the time limit runs out. Every `check("NN.name", ...)` it calls appends
its result to a file the grader names in MINIVLLM_CHECK_RECORD (see minivllm.exercises); an exercise the
notebook's source names but never reached (an earlier cell raised, the time ran out) counts as not passed.
The grader prints a table of notebooks x exercises and, with --json, writes

    {"notebooks": [{"path": "...", "exercises": {"07.chain": {"passed": true, "report": ["..."]}},
                    "passed": 3, "total": 4, "error": null}]}

`error` is null, or what stopped the notebook: the exception of a cell outside any check, or
"timed out after S s". The exit status is 0 whenever grading ran, whatever the scores; 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from minivllm.exercises import RECORD_VARIABLE, SEED_VARIABLE

CHECK_CALL = re.compile(r"""\bcheck\(\s*["'](\d+[a-z]?\.\w+)["']""")
TRUST = ("Student code is run as it is, with your permissions: grade in a container or a throwaway account, "
         "never in your own.")


def exercises_named(path: Path) -> list[str]:
    """The exercise names the notebook's code cells pass to check(...), in order of first appearance."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    names: dict[str, None] = {}
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            source = cell.get("source", "")
            names.update(dict.fromkeys(CHECK_CALL.findall("".join(source) if isinstance(source, list) else source)))
    return list(names)


def _run_in_kernel(path: Path, timeout: float, outcome: Path) -> None:
    """The child process: execute the notebook; write the error that stopped it (or null) to `outcome`."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    error = None
    try:
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}},
                                extra_arguments=["--IPKernelApp.log_level=ERROR"])
        client.execute()
    except CellExecutionError as failure:
        error = _cell_error(failure)
    except Exception as failure:  # an unreadable notebook, a kernel that died: the notebook's error, not ours
        error = f"{type(failure).__name__}: {failure}"
    outcome.write_text(json.dumps(error), encoding="utf-8")


def _cell_error(failure) -> str:
    """'NameError: name 'x' is not defined' from nbclient's long report of a failed cell."""
    ename, evalue = getattr(failure, "ename", None), getattr(failure, "evalue", None)
    if ename:
        return f"{ename}: {evalue}" if evalue else ename
    lines = [line for line in str(failure).splitlines() if line.strip()]
    return lines[-1] if lines else "a cell raised"


def grade_notebook(path: Path, timeout: float, seed: int | None = None) -> dict:
    """Run one notebook under the time limit and collect its checks, in the JSON shape of the module doc."""
    with tempfile.TemporaryDirectory(prefix="minivllm-grade-") as scratch:
        record, outcome = Path(scratch) / "checks.jsonl", Path(scratch) / "outcome.json"
        env = dict(os.environ, **{RECORD_VARIABLE: str(record)})
        env.setdefault("TQDM_DISABLE", "1")
        if seed is not None:
            env[SEED_VARIABLE] = str(seed)
        command = [sys.executable, "-m", "minivllm.tools.grade", "--run-in-kernel", str(path), str(timeout),
                   str(outcome)]
        child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)  # its own process group: the kernel goes with it
        try:
            child.wait(timeout=timeout)
            error = json.loads(outcome.read_text(encoding="utf-8")) if outcome.exists() else \
                f"the grading process ended with status {child.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            error = f"timed out after {timeout:g} s"
        results = _read_records(record)
    exercises = {name: {"passed": False, "report": ["never checked: the notebook stopped before this check"]}
                 for name in exercises_named(path)}
    exercises.update(results)
    return {"path": str(path), "exercises": exercises, "passed": sum(e["passed"] for e in exercises.values()),
            "total": len(exercises), "error": error}


def _read_records(record: Path) -> dict:
    """Each exercise's last check (a notebook may check an exercise again after fixing it)."""
    results = {}
    if record.exists():
        for line in record.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the time limit
                continue
            results[entry["name"]] = {"passed": bool(entry["passed"]), "report": list(entry["report"])}
    return results


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
        description="Execute notebooks in fresh kernels and report their exercise checks.",
        epilog=textwrap.fill(TRUST, 100) + "\n\n" + textwrap.fill(
            "--seed N reruns every randomised case of every check with seed N instead of the default, so an "
            "answer written to the cases the notebook printed fails.", 100))
    parser.add_argument("notebooks", nargs="+", type=Path, metavar="NOTEBOOK", help="the .ipynb files to grade")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument("--timeout", type=float, default=1200.0, metavar="S",
                        help="seconds each notebook may run, kernel start included (default 1200)")
    parser.add_argument("--seed", type=int, default=None, metavar="N",
                        help="the seed of the checks' randomised cases (default: the checks' own, 0)")
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for path in args.notebooks:
        if path.suffix != ".ipynb" or not path.is_file():
            parser.error(f"{path}: not a notebook file (.ipynb)")
    if not args.timeout > 0:
        parser.error(f"argument --timeout: {args.timeout:g} s; it must be positive")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"argument --json: the folder {args.json.parent} does not exist")
    graded = []
    for path in args.notebooks:
        print(f"grading {path} ...", file=sys.stderr, flush=True)
        graded.append(grade_notebook(path, args.timeout, args.seed))
    print(format_table(graded))
    if args.json is not None:
        args.json.write_text(json.dumps({"notebooks": graded}, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run-in-kernel"]:
        _run_in_kernel(Path(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4]))
    else:
        sys.exit(main())
