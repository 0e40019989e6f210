#!/usr/bin/env bash
# make test-portable: the C++ kernels' tests, and the chapters that run them, on the paths other readers' machines
# take, forced on this one:
#   - the instruction-set levels below this CPU's own that readers' CPUs stop at (MINIVLLM_CPU_ISA=avx2 / portable):
#     AVX2 only, and no vector instructions asked for (what ARM compiles too);
#   - the kernels off (MINIVLLM_CPU_KERNELS=off): a machine with no C++ compiler;
#   - clang instead of gcc (CXX=clang++); on Debian without libomp it is also a compiler without OpenMP.
# `make test` has run everything on this CPU's own level with gcc just before (.ci/run calls both).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
# the kernels and the engines on them, against the reference and transformers (tests/test_kernel_build.py, the build
# itself, runs in make test, and here again with clang, whose messages and OpenMP differ)
KERNEL_TESTS=(tests/test_cpu_attention.py tests/test_cpu_gemv.py tests/test_cpu_ops.py tests/test_int8.py
              tests/test_bf16.py)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
NBVAL=(--nbval --nbval-sanitize-with tests/nbval_sanitize.cfg)
export TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
summary=()
failed=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

run_path() {  # run_path LABEL ENV... -- PYTEST_ARGS...
  local label=$1 started=$SECONDS
  shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "=== $label: ${envs[*]}"
  env "${envs[@]}" "$PY" -m minivllm.kernels || true
  local status=0
  env "${envs[@]}" "${PYTEST[@]}" "$@" | tee "$log" || status=$?
  [ "$status" = 0 ] || failed=1
  summary+=("$label (${envs[*]}): $(tail -n 1 "$log" | tr -d '=') in $((SECONDS - started)) s")
}

levels=$("$PY" -c "from minivllm.kernels.build import ISA_LEVELS, isa_level
print(' '.join(ISA_LEVELS[:ISA_LEVELS.index(isa_level())]))")
for level in $levels; do
  case $level in
    portable) run_path "portable loops" MINIVLLM_CPU_ISA=portable -- "${KERNEL_TESTS[@]}" \
                notebooks/08b_cpu_kernel.ipynb "${NBVAL[@]}" ;;
    avx2) run_path "avx2" MINIVLLM_CPU_ISA=avx2 -- "${KERNEL_TESTS[@]}" ;;
    *) ;;  # avx512 and avx512_vnni: the same #ifs as the levels around them, which make test and these runs cover
  esac
done

run_path "no C++ kernels" MINIVLLM_CPU_KERNELS=off -- tests/test_kernel_build.py "${KERNEL_TESTS[@]}" tests/test_engine.py \
  notebooks/01_language_model.ipynb notebooks/06_continuous_batching.ipynb "${NBVAL[@]}"

if ! command -v clang++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing clang (apt-get) for the clang path"
  apt-get install -y -q clang >/dev/null 2>&1 || echo "apt-get could not install clang" >&2
fi
if command -v clang++ >/dev/null 2>&1; then
  run_path "clang" CXX=clang++ -- tests/test_kernel_build.py "${KERNEL_TESTS[@]}"
else
  summary+=("clang: NOT RUN (no clang++ on PATH, and it could not be installed here)")
fi
printf '%s\n' "" "make test-portable:" "${summary[@]/#/  }"
exit "$failed"
