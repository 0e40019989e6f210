"""What the grader takes from a notebook without running it: the exercises its chapter has, and each answer.

An answer is the function (or class) a notebook passes to `check("NN.name", answer)`, with the definitions it
needs: every top-level import, `def`, `class` and inert assignment (`BLOCK = 16`, no call in it) of the code
cells before the check call, in order. Nothing else of the notebook is kept: no statement that only runs
(`minivllm.exercises.run_checks = ...`, `print(...)`, a write to a file, `llm = LLM()`), so the grader can run the
answer's check again in a fresh process, where the notebook's own top-level code never ran.

Flags are what a teacher should see: an answer that imports the package's own implementation of the exercise
(issue 39), or that reaches into the check machinery. Both score zero.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

EXERCISES_FOLDER = Path(__file__).resolve().parents[1] / "exercises"
REGISTERED = re.compile(r"""exercise\(\s*["'](\d+[a-z]?\.\w+)["']""")
CHAPTER_OF_FILE = re.compile(r"^(\d+[a-z]?)_")
# what an answer may import from minivllm.exercises; the rest decides verdicts
HARMLESS_FROM_EXERCISES = {"check", "check_seed", "verdict", "case_random"}
# names only the check machinery uses (not `expect`: engine code has methods of that name)
MACHINERY = {"run_checks", "EXERCISES", "RESULTS", "CheckFailed", "RECORD_VARIABLE", "SEED_VARIABLE", "_NOTES",
             "_load_chapters"}
INERT = (ast.Constant, ast.Name, ast.Attribute, ast.Subscript, ast.Slice, ast.Tuple, ast.List, ast.Set, ast.Dict,
         ast.BinOp, ast.UnaryOp, ast.expr_context, ast.operator, ast.unaryop, ast.Lambda, ast.arguments, ast.arg)


@dataclass
class Answer:
    name: str
    definitions: list[str]  # the statements run, one by one, before the answer is evaluated
    answer: str  # the expression passed to check(...), e.g. "chain"
    flags: list[str] = field(default_factory=list)


def chapter_exercises(chapter: str) -> list[str]:
    """The exercises minivllm.exercises registers for `chapter` ("07", "08b"), read from chNN.py's source."""
    module = EXERCISES_FOLDER / f"ch{chapter}.py"
    return list(dict.fromkeys(REGISTERED.findall(module.read_text(encoding="utf-8")))) if module.is_file() else []


def chapters_of(path: Path, answers: dict[str, Answer]) -> list[str]:
    """The chapter a notebook belongs to: its file name's prefix ("07_prefix_caching.ipynb"), else the chapters
    of the exercises it checks."""
    named = CHAPTER_OF_FILE.match(path.name)
    if named and chapter_exercises(named.group(1)):
        return [named.group(1)]
    return list(dict.fromkeys(name.split(".")[0] for name in answers))


def _parse(source: str) -> ast.Module | None:
    """A cell's statements; IPython's `%magic` and `!shell` lines are dropped first (they are not Python)."""
    for text in (source, "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                                   for line in source.splitlines())):
        try:
            return ast.parse(text)
        except SyntaxError:
            continue
    return None


def _check_call(statement: ast.stmt) -> tuple[str, ast.expr | None] | None:
    """('07.chain', the answer expression) for a statement `check("07.chain", chain)`, else None."""
    if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)):
        return None
    call = statement.value
    called = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
    if called != "check" or not call.args or not isinstance(call.args[0], ast.Constant):
        return None
    name = call.args[0].value
    if not isinstance(name, str) or not re.fullmatch(r"\d+[a-z]?\.\w+", name):
        return None
    return name, call.args[1] if len(call.args) > 1 else None


def _kept(statement: ast.stmt) -> bool:
    """A statement that defines something and runs nothing: imports, def, class, assignment of an inert value."""
    if isinstance(statement, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        return (all(isinstance(t, ast.Name) for t in targets)
                and all(isinstance(node, INERT) for node in ast.walk(statement.value)))
    return False


def extract_answers(code_cells: list[str]) -> dict[str, Answer]:
    """Each exercise's answer at its last check(...) call, from a notebook's code cells in order."""
    answers: dict[str, Answer] = {}
    kept: list[ast.stmt] = []
    for source in code_cells:
        module = _parse(source)
        if module is None:
            continue
        for statement in module.body:
            found = _check_call(statement)
            if found is None:
                if _kept(statement):
                    kept.append(statement)
                continue
            name, expression = found
            usable = isinstance(expression, (ast.Name, ast.Attribute, ast.Lambda))
            answers[name] = Answer(name, [ast.unparse(statement) for statement in kept],
                                   ast.unparse(expression) if usable else "",
                                   _flags(name, module, kept, expression))
            if not usable:
                answers[name].flags.append("the answer passed to check() is not a name, an attribute or a lambda")
    return answers


def _flags(name: str, answer_cell: ast.Module, kept: list[ast.stmt], expression) -> list[str]:
    flags = []
    short = name.split(".", 1)[1]
    answer_name = expression.id if isinstance(expression, ast.Name) else None
    for node in ast.walk(answer_cell):  # the reference itself, imported in the answer's cell (issue 39)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minivllm"):
            for alias in node.names:
                if alias.name in {short, answer_name} or (alias.asname or alias.name) == answer_name:
                    flags.append(f"imports {node.module}.{alias.name}, the package's own implementation of "
                                 f"what {name} asks you to write")
    for node in ast.walk(ast.Module(body=kept, type_ignores=[])):  # the check machinery, anywhere it is kept
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minivllm.exercises"):
            touched = [f"{node.module}.{a.name}" for a in node.names
                       if node.module != "minivllm.exercises" or a.name not in HARMLESS_FROM_EXERCISES]
        elif isinstance(node, ast.Import):
            touched = [a.name for a in node.names if a.name.startswith("minivllm.exercises")]
        elif isinstance(node, ast.Attribute):  # `ex.run_checks`, `minivllm.exercises.ch08.expect`
            dotted = ast.unparse(node)
            touched = [dotted] if node.attr in MACHINERY or (
                "exercises." in dotted and node.attr not in HARMLESS_FROM_EXERCISES) else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # os.environ[...], sys.modules[...]
            touched = [repr(node.value)[:40]] if "MINIVLLM_CHECK" in node.value or "minivllm.exercises" in node.value \
                else []
        else:
            touched = []
        flags += [f"reaches into the check machinery ({t})" for t in touched]
    return list(dict.fromkeys(flags))
