"""The grader's contained child for one notebook: execute it top to bottom in a fresh Jupyter kernel (nbclient)
and write the error that stopped it, or null, as JSON to OUTCOME.

    python minivllm/tools/grade_notebook_runner.py NOTEBOOK TIMEOUT_S OUTCOME

Run as a script, not with -m, so that it imports nbclient and not the minivllm package (torch): it lives
under the grader's CPU and memory limits, and those are the notebook's to spend.
"""

import os
import sys

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # the tools folder is no import root

import json  # noqa: E402
from pathlib import Path  # noqa: E402


def cell_error(failure) -> str:
    """'NameError: name 'x' is not defined' from nbclient's long report of a failed cell."""
    ename, evalue = getattr(failure, "ename", None), getattr(failure, "evalue", None)
    if ename:
        return f"{ename}: {evalue}" if evalue else ename
    lines = [line for line in str(failure).splitlines() if line.strip()]
    return lines[-1] if lines else "a cell raised"


def run(path: Path, timeout: float, outcome: Path) -> None:
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
        error = cell_error(failure)
    except Exception as failure:  # a kernel that died (the memory or CPU limit): the notebook's error, not ours
        error = f"{type(failure).__name__}: {failure}"
    outcome.write_text(json.dumps(error), encoding="utf-8")


if __name__ == "__main__":
    run(Path(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3]))
