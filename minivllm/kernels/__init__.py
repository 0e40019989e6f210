"""Triton kernels (chapter 8). On a CPU they run in Triton's interpreter, which has to be switched on before
triton is imported: `minivllm.kernels.interpreter.use_interpreter_without_gpu()`, the one place that does it."""
