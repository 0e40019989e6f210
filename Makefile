# Every target sets itself up: .venv is created or reused by scripts/setup_venv.sh.
PY := .venv/bin/python
NBVAL := --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg

.PHONY: install book test test-portable lab export clean-notebooks notebooks gpu-check bench llama-cpp

install:
	@bash scripts/setup_venv.sh

## make book: execute every notebook in book order, then render the HTML book into book/_build/html
book: install
	$(PY) minivllm/tools/notebooks.py book

## make test: package tests, strict nbval on every notebook and solution, and the export-sync check
test: install
	$(PY) minivllm/tools/notebooks.py check-export
	TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 $(PY) -m pytest -p no:cacheprovider tests notebooks $(NBVAL)

## make test-portable: the C++ kernels' tests and the chapters that run them (8b; 1 and 6 without kernels) on the
## paths other CPUs take, forced here: each instruction-set level below this CPU's (MINIVLLM_CPU_ISA), no kernels
## (MINIVLLM_CPU_KERNELS=off, as without a compiler) and clang (installed with apt-get where it can be), which on
## Debian without libomp is also a compiler without OpenMP
test-portable: install
	@bash scripts/test_portable.sh

## make lab: JupyterLab on the notebooks
lab: install
	.venv/bin/jupyter lab notebooks

## make export: notebooks -> package (the `# export: minivllm/<module>.py` cells)
export: install
	$(PY) minivllm/tools/notebooks.py export

## make clean-notebooks: strip execution counts and volatile metadata, keep outputs
clean-notebooks: install
	$(PY) minivllm/tools/notebooks.py clean

## make notebooks: re-execute every notebook in place (after changing engine code), then clean them
notebooks: install
	$(PY) minivllm/tools/notebooks.py execute --inplace

## make bench: minivllm against transformers (generate, generate_batch) on the same requests, three workloads
## (a 32M Qwen3, SmolLM2-135M's shape, nano-vllm's benchmark scaled to a CPU) with ratios and roofline fractions,
## speculative decoding (chapter 9), the server under Poisson load (chapter 10) and the engine's non-model time per
## decode step at 100 and 4,000 tokens of context (batch 1 and 32), and float32 against bfloat16 decode on SmolLM2-135M
## at batch 1 and 32 with the fractions of measured memory bandwidth and matmul rate (llama.cpp beside them when
## its binaries are in $$LLAMA_CPP_BIN, in .llama.cpp/build/bin (make llama-cpp) or on PATH) and chapter 13's second
## KV tier on a workload 4x the pool (hit rate, TTFT p50/p90, the cost of copy-outs); JSON in bench/results
bench: install
	$(PY) -m minivllm.tools.bench compare --workload all --out bench/results
	$(PY) -m minivllm.tools.bench spec --num-prompts 16 --output-len 256 --out bench/results
	$(PY) -m minivllm.tools.bench serve --num-prompts 32 --output-len 128 --out bench/results
	$(PY) -m minivllm.tools.bench overhead --out bench/results
	$(PY) -m minivllm.tools.bench dtypes --out bench/results
	$(PY) -m minivllm.tools.bench_offload --out bench/results

## make llama-cpp: llama.cpp's llama-bench, llama-batched-bench and llama-quantize built from source (the sdist
## of PyPI's llama-cpp-python, cmake, this CPU's instructions) into .llama.cpp/build/bin, where bench dtypes finds them
llama-cpp: install
	@bash scripts/build_llama_cpp.sh

## make vllm-cites: every vllm/... path and name the book cites exists in the pinned vLLM release (pip downloads
## its wheel, --no-deps: needs the network, so not part of make test; VLLM_CITES_ARGS="--source DIR" reads a tree)
vllm-cites: install
	$(PY) -m minivllm.tools.vllm_cites $(VLLM_CITES_ARGS)

## make gpu-check: on a CUDA machine, chapter 8's kernel tests compiled, their benchmarks, the engine against
## transformers and chapter 9's draft sizing -> bench/gpu/ ($OUT/gpu when $OUT is set); --smoke runs in `make test`
gpu-check: install
	$(PY) -m minivllm.tools.gpu_check
