"""The book's shape, so that it does not regress: cells a reader can read, figures, and autograded exercises
in every chapter, each with a solution."""

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CHAPTERS = sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb") if p.name[:2] != "00")
CHECK = re.compile(r'check\("(\d\d[a-z]?\.[A-Za-z0-9_]+)"')


def code_lines(cell) -> int:
    return sum(1 for line in cell.source.splitlines() if line.strip())


def test_code_cells_are_at_most_40_lines_with_three_exceptions_none_over_60():
    lengths = [(path.name, index, code_lines(cell)) for path in [NOTEBOOKS / "00_how_to_use.ipynb", *CHAPTERS]
               for index, cell in enumerate(nbformat.read(path, 4).cells) if cell.cell_type == "code"]
    long = [entry for entry in lengths if entry[2] > 40]
    assert len(long) <= 3 and all(n <= 60 for _, _, n in long), f"cells over 40 non-blank lines: {long}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_has_two_figures(path):
    figures = sum("image/png" in output.get("data", {}) for cell in nbformat.read(path, 4).cells
                  if cell.cell_type == "code" for output in cell.outputs)
    assert figures >= 2, f"{path.name}: {figures} figure(s)"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_has_two_autograded_exercises_with_solutions(path):
    asked = {name for cell in nbformat.read(path, 4).cells if cell.cell_type == "code"
             for name in CHECK.findall(cell.source)}
    assert len(asked) >= 2, f"{path.name}: autograded exercises {sorted(asked)}"
    solution = NOTEBOOKS / "solutions" / path.name
    solved = {name for cell in nbformat.read(solution, 4).cells if cell.cell_type == "code"
              for name in CHECK.findall(cell.source)}
    assert asked <= solved, f"{path.name}: no solution for {sorted(asked - solved)}"
