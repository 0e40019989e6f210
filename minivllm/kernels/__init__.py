"""Kernels: Triton's (chapter 8) and chapter 8b's C++ kernels for the CPU, whose sources are csrc/*.cpp, built by
build.py for the instruction set of the CPU that runs them (`python -m minivllm.kernels` builds them all). On a CPU
the Triton kernels run in Triton's interpreter, which has to be switched on before triton is imported:
`minivllm.kernels.interpreter.use_interpreter_without_gpu()`, the one place that does it."""
