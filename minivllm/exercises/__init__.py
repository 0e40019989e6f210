"""Checks for the book's implementation exercises.

    from minivllm.exercises import check
    check("01.rms_norm", rms_norm)

runs behaviour tests against a reader's function and prints, for each, whether it passed and why
not (`run_checks` returns the same as a value). Each chapter's exercises live in `chNN.py` beside this file,
registered with `@exercise("<NN>.<name>")`; `EXERCISES` lists them all.
"""

from __future__ import annotations

import pkgutil
import traceback
from importlib import import_module
from typing import Callable

import torch

EXERCISES: dict[str, Callable] = {}


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


def _load_chapters() -> None:
    for module in pkgutil.iter_modules(__path__):
        if module.name.startswith("ch"):
            import_module(f"{__name__}.{module.name}")


def run_checks(name: str, candidate) -> tuple[bool, list[str]]:
    """Run exercise `name`'s behaviour tests against `candidate`: (all passed, one report line per test)."""
    _load_chapters()
    if name not in EXERCISES:
        raise KeyError(f"no exercise {name!r}; known: {', '.join(sorted(EXERCISES))}")
    cases = list(EXERCISES[name]())
    report, passed = [], 0
    for description, test in cases:
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
    summary = f"all {len(cases)} checks passed" if passed == len(cases) else f"{passed} of {len(cases)} checks passed"
    return passed == len(cases), report + [f"{name}: {summary}"]


def check(name: str, candidate) -> None:
    """Run exercise `name`'s behaviour tests against `candidate` and print what passed, what failed and why."""
    print("\n".join(run_checks(name, candidate)[1]))
