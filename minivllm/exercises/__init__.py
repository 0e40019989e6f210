"""Checks for the book's implementation exercises.

    from minivllm.exercises import check
    check("01.rms_norm", rms_norm)

runs behaviour tests against a reader's function and prints, for each, whether it passed and why
not (`run_checks` returns the same as a value). Each chapter's exercises live in `chNN.py` beside this file,
registered with `@exercise("<NN>.<name>")`; `EXERCISES` lists them all.

Randomised cases draw from `case_random(...)`, seeded by the environment variable MINIVLLM_CHECK_SEED (0 when
unset): a grader reruns them with another seed (`python -m minivllm grade --seed N`), so an answer that
hard-codes the cases a notebook printed fails. When MINIVLLM_CHECK_RECORD names a file, `check` also appends
one JSON line per call to it ({"name", "passed", "report"}). The grader does not read it (a notebook can write
that file too): it runs each answer's check again itself, in a fresh process (minivllm.tools.grade).

A test may also `note(...)` a line that is a report, not a verdict (the speed of the reader's kernel against
the engine's): it follows the test's own line, marked ⏱. `verdict(name)` is the last call's summary line without
those notes, for a cell whose check prints timings that move from run to run.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import pkgutil
import random
import sys
import traceback
from importlib import import_module
from typing import Callable

import torch

EXERCISES: dict[str, Callable] = {}
RESULTS: dict[str, tuple[bool, list[str]]] = {}  # the last check of each exercise in this process
_NOTES: list[str] = []
SEED_VARIABLE = "MINIVLLM_CHECK_SEED"
RECORD_VARIABLE = "MINIVLLM_CHECK_RECORD"


def check_seed() -> int:
    """The seed of every randomised case: MINIVLLM_CHECK_SEED, or 0."""
    value = os.environ.get(SEED_VARIABLE, "0")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{SEED_VARIABLE}={value!r}: the check seed must be an integer") from None


def case_seed(base: int) -> int:
    """A torch seed for a randomised case: `base` itself under the default check seed, another under any other."""
    return base + 1_000_003 * check_seed()


def case_random(stream: str) -> random.Random:
    """A random generator for one exercise's randomised cases (`stream` keeps exercises independent)."""
    return random.Random(f"{check_seed()}/{stream}")


def exercise(name: str):
    def register(suite):
        EXERCISES[name] = suite
        return suite

    return register


class CheckFailed(AssertionError):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def close(actual, expected, what: str, atol=1e-5, rtol=1e-5) -> None:
    actual = torch.as_tensor(actual)
    expect(actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    error = (actual.double() - expected.double()).abs().max().item()
    expect(torch.allclose(actual.double(), expected.double(), atol=atol, rtol=rtol),
           f"{what}: max abs difference {error:.2e} from the reference")


@contextlib.contextmanager
def forbidden_calls(functions, rule: str):
    """Inside, the reader's code may not call any of `functions` (however it imported them: calls are
    watched by code object); a call fails the check with `rule` once the block ends."""
    codes = {inspect.unwrap(f).__code__: f"{f.__module__}.{f.__qualname__}" for f in functions}
    called: list[str] = []
    previous = sys.getprofile()

    def watch(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            called.append(codes[frame.f_code])

    sys.setprofile(watch)
    try:
        yield
    finally:
        sys.setprofile(previous)
    if called:
        raise CheckFailed(f"{called[0]} was called: {rule}")


def note(line: str) -> None:
    """Add a report line to the test that is running (a measurement, not a pass or a fail)."""
    _NOTES.append(line)


def verdict(name: str) -> str:
    """The summary line of the last check(name, ...) in this process, e.g. '03.cache_attend: all 6 checks passed'."""
    if name not in RESULTS:
        return f"{name}: never checked"
    return RESULTS[name][1][-1]


def _load_chapters() -> None:
    for module in pkgutil.iter_modules(__path__):
        if module.name.startswith("ch"):
            import_module(f"{__name__}.{module.name}")


def run_checks(name: str, candidate, stop_at_failure: bool = False) -> tuple[bool, list[str]]:
    """Run exercise `name`'s behaviour tests against `candidate`: (all passed, one report line per test).
    With stop_at_failure, the tests after the first failed one are not run (a quick verdict)."""
    _load_chapters()
    if name not in EXERCISES:
        raise KeyError(f"no exercise {name!r}; known: {', '.join(sorted(EXERCISES))}")
    cases = list(EXERCISES[name]())
    report, passed = [], 0
    for description, test in cases:
        _NOTES.clear()
        try:
            test(candidate)
        except NotImplementedError:
            return False, [f"✗ {name}: not implemented yet (the function raises NotImplementedError)"]
        except CheckFailed as failure:
            report.append(f"✗ {description}: {failure}")
        except Exception as error:  # a crash in the reader's code is a failed check, shown where it happened
            frame = traceback.extract_tb(error.__traceback__)[-1]
            report.append(f"✗ {description}: {type(error).__name__}: {error} (line {frame.lineno} of {frame.name})")
        else:
            passed += 1
            report.append(f"✓ {description}")
            report.extend(f"  ⏱ {line}" for line in _NOTES)
            continue
        if stop_at_failure:
            return False, report + [f"{name}: stopped at the first failed check"]
    summary = f"all {len(cases)} checks passed" if passed == len(cases) else f"{passed} of {len(cases)} checks passed"
    return passed == len(cases), report + [f"{name}: {summary}"]


def check(name: str, candidate) -> None:
    """Run exercise `name`'s behaviour tests against `candidate` and print what passed, what failed and why."""
    passed, report = run_checks(name, candidate)
    RESULTS[name] = passed, report
    record = os.environ.get(RECORD_VARIABLE)
    if record:
        with open(record, "a", encoding="utf-8") as file:
            file.write(json.dumps({"name": name, "passed": passed, "report": report}) + "\n")
    print("\n".join(report))
