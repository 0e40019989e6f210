"""The answer to an exercise, taken from the cell of notebooks/solutions/ that checks it: the notebook's exercise
cells up to that one run in a fresh namespace, each without its check(...) lines, with the cells before it that
only define things (imports, functions, classes: helpers an answer calls). Cells that compute run no more."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

SOLUTIONS = Path(__file__).resolve().parents[2] / "notebooks" / "solutions"
CHECK_CALL = re.compile(r'^check\("(?P<name>[0-9a-z]+\.[a-z0-9_]+)",\s*(?P<function>\w+)\)\s*$', re.M)


def _exercise_cells(chapter: str) -> list[str]:
    [path] = SOLUTIONS.glob(f"{chapter}_*.ipynb")
    cells = json.loads(path.read_text())["cells"]
    sources = ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]
    return [source for source in sources if CHECK_CALL.search(source) or _only_defines(source)]


def _only_defines(source: str) -> bool:
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    return bool(body) and all(isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))
                              for node in body)


def solution(name: str):
    """The function the solutions notebook passes to check(name, ...)."""
    namespace: dict = {}
    for source in _exercise_cells(name.split(".")[0]):
        calls = {m["name"]: m["function"] for m in CHECK_CALL.finditer(source)}
        exec(compile(CHECK_CALL.sub("", source), f"<solution of {name}>", "exec"), namespace)
        if name in calls:
            return namespace[calls[name]]
    raise KeyError(f"no cell of notebooks/solutions/ checks {name!r}")
