"""`python -m minivllm.kernels`: build every C++ kernel for this CPU (make install runs it) and say which built."""

import sys

from minivllm.kernels.build import compiler, isa_level, kernel_problem
from minivllm.kernels.cpu_attention import load_cpu_attention
from minivllm.kernels.cpu_gemv import load_cpu_gemv
from minivllm.kernels.cpu_int8 import load_cpu_int8
from minivllm.kernels.cpu_ops import load_cpu_ops


def build_all() -> bool:
    """Builds (or finds built) every kernel the engine uses, for this CPU; prints one line each. True if all did."""
    print(f"minivllm: C++ kernels for this CPU's level {isa_level()!r} with {compiler()} "
          f"(MINIVLLM_CPU_ISA caps it, MINIVLLM_CPU_KERNELS=off turns them off)")
    problems = {load.__name__: kernel_problem(load)
                for load in (load_cpu_attention, load_cpu_gemv, load_cpu_int8, load_cpu_ops)}
    for name, problem in problems.items():
        print(f"  {name}: {'built' if problem is None else 'NOT BUILT: ' + problem}")
    return all(problem is None for problem in problems.values())


sys.exit(0 if build_all() else 1)
