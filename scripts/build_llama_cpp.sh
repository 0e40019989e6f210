#!/usr/bin/env bash
# `make llama-cpp`: llama.cpp's benchmark tools, built from source as a peer for `make bench` (never for the tests).
# PyPI's llama-cpp-python sdist carries llama.cpp's source (vendor/llama.cpp); pip only downloads it (--no-deps,
# no build), then cmake builds the three tools bench dtypes runs, for this CPU (GGML_NATIVE), into
# .llama.cpp/build/bin. About 10 minutes on 2 cores. bench dtypes looks in $LLAMA_CPP_BIN, then there, then on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36   # llama-cpp-python's release; the llama.cpp it vendors is what gets built
DEST=.llama.cpp
BIN=$DEST/build/bin
if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-batched-bench" ] && [ -x "$BIN/llama-quantize" ]; then
  echo "llama.cpp's tools are built: $BIN"; exit 0
fi
command -v cmake >/dev/null || { echo "error: building llama.cpp needs cmake (and a C++ compiler)" >&2; exit 1; }
mkdir -p "$DEST"
.venv/bin/pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DEST" >/dev/null
rm -rf "$DEST/src" && mkdir "$DEST/src"
tar xzf "$DEST/llama_cpp_python-$VERSION.tar.gz" -C "$DEST/src" --strip-components=3 \
  "llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$DEST/src" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
cmake --build "$DEST/build" -j "$(nproc)" --target llama-bench llama-batched-bench llama-quantize >/dev/null
echo "llama.cpp's tools: $BIN (llama-cpp-python $VERSION's vendored source)"
