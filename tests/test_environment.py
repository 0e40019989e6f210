"""environment.yml (conda) and pyproject.toml (pip) ask for the same packages with the same lower bounds."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"torch": "pytorch"}  # pip name -> conda-forge name where they differ


def pyproject_requirements():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    parsed = {}
    for dep in deps:
        if ";" in dep:  # platform-specific (triton): pip installs it through the package itself
            continue
        name, bound = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", dep.replace(" ", "")).groups()
        parsed[CONDA_NAMES.get(name, name)] = bound
    return parsed


def conda_environment():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda, pip = {}, []
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            pip += dep["pip"]
        elif ">=" in dep:
            name, bound = dep.split(">=")
            conda[name] = bound
    return env, conda, pip


def test_every_dependency_has_the_same_lower_bound_in_both():
    _, conda, _ = conda_environment()
    conda.pop("python")
    assert conda == pyproject_requirements()


def test_python_bound_and_channel_agree():
    env, conda, pip = conda_environment()
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == f">={conda['python']}"
    assert env["channels"] == ["conda-forge"]
    assert pip == ["-e .[dev,book]"]


def test_no_hard_pins():
    text = (ROOT / "environment.yml").read_text() + (ROOT / "pyproject.toml").read_text()
    assert not re.search(r"^\s*-\s*[a-z_-]+==", text, re.M)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"[A-Za-z0-9_.-]+\s*==", d)]
