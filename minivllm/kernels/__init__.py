"""Attention kernels: Triton's (chapter 8) and a C++ decode kernel for the CPU (chapter 8b, `cpu_attention.py`,
compiled per install on first use). On a CPU the Triton kernels run in Triton's interpreter, which has to be
switched on before triton is imported: `minivllm.kernels.interpreter.use_interpreter_without_gpu()`, the one
place that does it."""
