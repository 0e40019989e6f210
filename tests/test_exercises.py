"""The exercise mechanism: unknown names, stubs, wrong answers and crashes are reported, never raised."""

import pytest

from minivllm import exercises


def all_exercises():
    exercises._load_chapters()
    return sorted(exercises.EXERCISES)


def test_every_chapter_so_far_has_exercises():
    chapters = {name.split(".")[0] for name in all_exercises()}
    assert {"00", "01", "02", "05", "06", "07", "09", "10"} <= chapters


@pytest.mark.parametrize("name", all_exercises())
def test_a_stub_is_reported_as_not_implemented(name):
    def stub(*args, **kwargs):
        raise NotImplementedError

    passed, report = exercises.run_checks(name, stub)
    assert not passed and report == [f"✗ {name}: not implemented yet (the function raises NotImplementedError)"]


@pytest.mark.parametrize("name", all_exercises())
def test_a_constant_answer_fails_with_reasons(name):
    passed, report = exercises.run_checks(name, lambda *args, **kwargs: 0)
    assert not passed
    assert any(line.startswith("✗") and ": " in line for line in report)
    assert report[-1].startswith(f"{name}: ") and "of" in report[-1]


def test_a_crash_is_a_failed_check_naming_the_error():
    def crashes(x, weight, eps):
        return x.undefined_method()

    passed, report = exercises.run_checks("01.rms_norm", crashes)
    assert not passed and "AttributeError" in report[0] and "line" in report[0]


def test_check_prints_the_report(capsys):
    exercises.check("06.preemption_order", lambda running: max(running, key=lambda request: request.admitted_at))
    assert capsys.readouterr().out.splitlines()[-1] == "06.preemption_order: all 4 checks passed"


def test_unknown_exercise_lists_the_known_ones():
    with pytest.raises(KeyError, match="01.rms_norm"):
        exercises.run_checks("99.nothing", print)
