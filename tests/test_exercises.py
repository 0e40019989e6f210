"""The exercise mechanism: unknown names, stubs, wrong answers and crashes are reported, never raised."""

import pytest

from minivllm import exercises


def all_exercises():
    exercises._load_chapters()
    return sorted(exercises.EXERCISES)


def test_every_chapter_so_far_has_exercises():
    chapters = {name.split(".")[0] for name in all_exercises()}
    assert {"00", "01", "02"} <= chapters


@pytest.mark.parametrize("name", all_exercises())
def test_a_stub_is_reported_as_not_implemented(name, capsys):
    def stub(*args, **kwargs):
        raise NotImplementedError

    assert exercises.check(name, stub) is False
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("name", all_exercises())
def test_a_wrong_answer_fails_with_reasons(name, capsys):
    assert exercises.check(name, lambda *args, **kwargs: 0) is False
    out = capsys.readouterr().out
    assert "✗" in out and f"{name}: 0 of" in out


def test_a_crash_is_a_failed_check_naming_the_error(capsys):
    def crashes(x, weight, eps):
        return x.undefined_method()

    assert exercises.check("01.rms_norm", crashes) is False
    assert "AttributeError" in capsys.readouterr().out


def test_unknown_exercise_lists_the_known_ones():
    with pytest.raises(KeyError, match="01.rms_norm"):
        exercises.check("99.nothing", print)
