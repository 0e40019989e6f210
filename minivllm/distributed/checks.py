"""Chapter 11's input checks: plumbing, not taught. They run before any worker process starts."""

import ast
import multiprocessing
import os
import sys

import torch


def check_tensor_parallel_size(size, model_config, device=None) -> None:
    """Refuse a tensor_parallel_size this model cannot be split into, naming the option."""
    if isinstance(size, bool) or not isinstance(size, int):
        raise ValueError(f"tensor_parallel_size = {size!r}: must be an integer >= 1")
    if size < 1:
        raise ValueError(f"tensor_parallel_size = {size}: must be >= 1")
    if size == 1:
        return
    heads, kv_heads = model_config.num_heads, model_config.num_kv_heads
    for name, value in (("num_heads", heads), ("num_kv_heads", kv_heads),
                        ("intermediate_size", model_config.intermediate_size)):
        if value % size:
            raise ValueError(f"tensor_parallel_size = {size} does not divide the model's {name} = {value}: "
                             f"every rank must hold the same number of whole heads (try a divisor of {value})")
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size = {size}: needs {size} CUDA devices, "
                         f"{torch.cuda.device_count()} visible")


START_METHOD_VARIABLES = ("VLLM_WORKER_MULTIPROC_METHOD", "MINIVLLM_WORKER_MULTIPROC_METHOD")  # vLLM's name first


def requested_start_method() -> tuple[str, str] | None:
    """(method, 'NAME=value') from the environment, or None when neither variable is set. vLLM's name is the
    documented one; minivllm's is accepted too. A value other than fork or spawn, or two that disagree, is
    refused, naming the variable."""
    found = {name: os.environ[name].strip() for name in START_METHOD_VARIABLES if os.environ.get(name, "").strip()}
    for name, value in found.items():
        if value not in ("fork", "spawn"):
            raise ValueError(f"{name}={value!r}: the worker start method must be 'fork' or 'spawn'")
    if len(set(found.values())) > 1:
        raise ValueError(" and ".join(f"{n}={v}" for n, v in found.items()) + " disagree: set one of them")
    return next(((value, f"{name}={value}") for name, value in found.items()), None)


def script_spawn_reruns(main) -> str | None:
    """The file a spawned child runs again before it runs its target, as multiprocessing.spawn decides it
    (get_preparation_data): the main module by name (`python -m mod`; a package's __main__ excepted) or by
    path (`python script.py`). None for an interactive main (Jupyter, the REPL, `python -c`): nothing reruns."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return None
    path = getattr(main, "__file__", None)
    if path is None:
        return None
    return path if os.path.isabs(path) else os.path.join(multiprocessing.process.ORIGINAL_DIR or "", path)


def is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {type(side).__name__: getattr(side, "id", getattr(side, "value", None)) for side in
             (test.left, test.comparators[0])}
    return sides == {"Name": "__name__", "Constant": "__main__"}


def check_main_guard(why_spawn: str) -> None:
    """Refuse, before any worker starts, to spawn workers from a script's unguarded top level.

    Every spawned child runs the main script again (as `__mp_main__`) before it runs its target, so a script
    that builds the LLM at its top level would build it again in every worker, which would try to start
    workers of its own and die in multiprocessing's bootstrap check. The reliable test is the caller's own
    stack: the outermost frame of this thread that runs the main module's top-level code is the line the
    script is at. If that line is not inside an `if __name__ == "__main__":` block, the child would rerun it.
    (Checking only whether the file contains a guard would miss a script that guards something else.)"""
    main = sys.modules.get("__main__")
    path = script_spawn_reruns(main)
    frame, line = sys._getframe(1), None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            line = frame.f_lineno
        frame = frame.f_back
    if path is None or line is None:  # nothing reruns, or not called from the script's top level
        return
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return  # a script we cannot read: a worker that dies reports its own traceback
    if any(isinstance(node, ast.If) and is_main_test(node.test)
           and node.body[0].lineno <= line <= node.body[-1].end_lineno for node in ast.walk(tree)):
        return
    raise RuntimeError(
        f"tensor-parallel workers start with spawn here ({why_spawn}), and a spawned worker first runs the main "
        f"script again: line {line} of {path} would build the LLM in every worker, and each would try to start "
        "workers of its own. Put the script's work under\n\n    if __name__ == \"__main__\":\n\n"
        "as vLLM's documentation asks of scripts (chapter 11), or, on Linux with CUDA not initialised, start "
        "workers with fork (VLLM_WORKER_MULTIPROC_METHOD=fork, the default there).")
